"""Communicator over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs).

It lets the DDP and FSDP2 integrations (:mod:`geocomm.adapters.torch`) send
geocomm's encoded bytes through a torch process group, whether the job came
from ``torchrun`` or ``mpirun``. Gloo moves data on its own threads, so
nonblocking calls overlap with the codec without help. Uneven all-gathers are
padded to the largest segment (gloo has no all-gather-v).

Over a NCCL group the communicator moves CuPy arrays (``backend == "nccl"``,
so the collectives keep them on the device): they travel as CUDA tensors
through DLPack, ProcessGroupNCCL orders each transfer after the work queued
on torch's current stream, and ``wait()`` makes the current stream wait for
it. The metadata all-gather goes through the device and back (NCCL has no
host tensors). With more than one rank, an uncaught
exception ends the job (:mod:`geocomm.comm.abort`): ``MPI_Abort`` when MPI
runs the ranks (mpirun), else this process exits at once with status 1, which
torchrun answers by stopping the other ranks.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from geocomm.comm import abort


def _array_module(array: Any) -> Any:
    """numpy for NumPy arrays, else cupy (the only device arrays the collectives pass)."""
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy


class _Work:
    """A torch ``Work`` plus an optional step to run once it has completed.

    ``wait_for`` sleeps until the work's future completes (the backend's own
    thread sets an event), so :func:`geocomm.comm.base.wait` does not poll.
    """

    __slots__ = ("_done", "_finish", "_work")

    def __init__(self, work: Any, finish: Any = None):
        self._work, self._finish = work, finish
        self._done = threading.Event()
        work.get_future().add_done_callback(lambda _: self._done.set())

    def wait_for(self, seconds: float) -> bool:
        """Block at most ``seconds`` (GIL released) for completion; True when done."""
        return self._done.wait(seconds)

    def _complete(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None

    def test(self) -> bool:
        # the future completes before gloo marks its work completed: trust either
        if self._done.is_set() or self._work.is_completed():
            self._work.wait()
            self._complete()
            return True
        return False

    def wait(self) -> None:
        self._work.wait()
        self._complete()


class TorchDistCommunicator:
    """:class:`geocomm.comm.Communicator` over a torch.distributed group."""

    backend = "torch"

    def __init__(self, group: Any = None):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (init_process_group first, "
                               "or geocomm.adapters.torch.init_distributed_from_mpi())")
        self._torch, self._dist, self.group = torch, dist, group
        # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        # "nccl" tells the collectives to keep CuPy arrays on the device
        self.backend = "nccl" if dist.get_backend(group) == "nccl" else "torch"
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else torch.device("cpu")
        abort.register(self)

    def _t(self, array: Any) -> Any:
        """The array as a torch tensor sharing its memory (CuPy through DLPack)."""
        if isinstance(array, np.ndarray):
            return self._torch.from_numpy(array)
        return self._torch.from_dlpack(array)

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        # segments are packed in rank order (displacements are running sums)
        work = self._dist.all_to_all_single(
            self._t(recv[: int(np.sum(recv_counts))]), self._t(send[: int(np.sum(send_counts))]),
            output_split_sizes=[int(c) for c in recv_counts],
            input_split_sizes=[int(c) for c in send_counts],
            group=self.group, async_op=True)
        return _Work(work)

    def allgatherv(self, send, recv, counts, displs):
        xp = _array_module(send)
        width = int(np.max(counts)) if len(counts) else 0
        mine = int(counts[self.rank])
        if np.all(counts == width) and np.array_equal(displs, np.arange(self.size) * width) \
                and recv.flags.c_contiguous and send.flags.c_contiguous:
            # equal segments packed in rank order (the pipeline's usual stage): no padding
            work = self._all_gather(
                self._t(recv[: self.size * width]), self._t(send[:width]), group=self.group,
                async_op=True)
            return _Work(work)
        padded = xp.zeros(width, np.uint8)
        padded[:mine] = send[:mine]
        gathered = xp.empty(self.size * width, np.uint8)
        work = self._all_gather(self._t(gathered), self._t(padded),
                                                 group=self.group, async_op=True)

        def unpad() -> None:
            for j in range(self.size):
                c, d = int(counts[j]), int(displs[j])
                recv[d: d + c] = gathered[j * width: j * width + c]

        return _Work(work, unpad)

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        recv[...] = send
        reduce_op = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}[op]
        self._dist.all_reduce(self._t(recv.reshape(-1)), op=reduce_op, group=self.group)

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, np.int64)
        rows = np.empty((self.size, values.size), np.int64)
        send = self._t(values).to(self.device)
        gathered = self._t(rows.reshape(-1)).to(self.device)
        self._all_gather(gathered, send, group=self.group)
        if self.device.type != "cpu":
            rows.reshape(-1)[...] = gathered.cpu().numpy()
        return rows

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def abort_local(self) -> None:
        """Nothing to release: ending the process frees gloo's sockets."""

    def abort(self, code: int = 1) -> None:
        """MPI_Abort when MPI runs the job, else exit this process now (does not return)."""
        if not abort.mpi_world_abort(code):
            os._exit(code)
