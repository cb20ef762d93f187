"""The calls the torch.distributed backend (adapters/torch/backend/group.py) passes on exact,
through the wrapped gloo or NCCL backend: integer and MAX/MIN reductions, small
tensors, broadcast, all-gather, all-to-all, point to point, barriers. Averages on
the CPU run as a sum and a division, since gloo has no AVG."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from geocomm.adapters.torch.backend.work import all_of, first_tensor, then_work


class ExactCalls:
    """The exact half of :class:`~geocomm.adapters.torch.backend.GeocommProcessGroup`:
    every call goes to ``self._exact(call, args)``, the inner backend for the
    tensors' device."""

    _size: int
    timeout: Any

    def _exact(self, call: str, args: Sequence[Any]) -> Any:
        raise NotImplementedError  # the process group's

    def _exact_reduce(self, call: str, args: Sequence[Any], opts: Any, results: list) -> Any:
        inner = self._exact(call, args)
        tensor = first_tensor(args)
        emulate = (
            opts.reduceOp == dist.ReduceOp.AVG
            and tensor is not None
            and tensor.device.type == "cpu"
            and tensor.is_floating_point()
        )
        if not emulate:
            return getattr(inner, call)(*args, opts)
        summed = type(opts)()
        for name in ("timeout", "asyncOp"):
            if hasattr(opts, name):
                setattr(summed, name, getattr(opts, name))
        summed.reduceOp = dist.ReduceOp.SUM
        work = getattr(inner, call)(*args, summed)
        size = self._size

        def divide() -> list:
            for t in results:
                t.div_(size)
            return results

        return then_work(work, divide)

    # -- everything else: exact, through the wrapped backend --------------------

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._exact_reduce("allreduce_coalesced", (tensors,), opts, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._exact("reduce", (tensors,)).reduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._exact("broadcast", (tensors,)).broadcast(tensors, opts)

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.distributed_c10d.AllgatherOptions()
        inner = self._exact("allgather", (input_tensors,))
        return inner.allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None):
        opts = opts if opts is not None else dist.distributed_c10d.AllgatherOptions()
        return self._exact("_allgather_base", (input,))._allgather_base(output, input, opts)

    all_gather_single = _allgather_base  # the name torch >= 2.13 calls

    def allgather_coalesced(self, output_lists: list, input_list: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.distributed_c10d.AllgatherOptions()
        inner = self._exact("allgather_coalesced", (input_list,))
        return inner.allgather_coalesced(output_lists, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None):
        opts = opts if opts is not None else dist.distributed_c10d.AllgatherOptions()
        inner = self._exact("allgather_into_tensor_coalesced", (inputs,))
        works = [inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        works = [
            self._exact_reduce("_reduce_scatter_base", (o, i), opts, [o])
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return all_of(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def gather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        inner = self._exact("gather", (input_tensors,))
        return inner.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        inner = self._exact("scatter", (output_tensors,))
        return inner.scatter(output_tensors, input_tensors, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        inner = self._exact("alltoall_base", (input,))
        return inner.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    all_to_all_single = alltoall_base  # the name torch >= 2.13 calls

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        inner = self._exact("alltoall", (input_tensors,))
        return inner.alltoall(output_tensors, input_tensors, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._exact("send", (tensors,)).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._exact("recv", (tensors,)).recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return self._exact("recv_anysource", (tensors,)).recv_anysource(tensors, tag)

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._exact("barrier", ()).barrier(opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        inner = self._exact("monitored_barrier", ())
        return inner.monitored_barrier(timeout or self.timeout, wait_all_ranks)
