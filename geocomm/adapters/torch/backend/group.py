"""A compressed torch.distributed backend: ``dist.init_process_group("geocomm")``.

    import geocomm.adapters.torch                # registers the backend "geocomm"
    dist.init_process_group("geocomm")           # or "cpu:geocomm,cuda:geocomm"
    model = DDP(net)                             # no hook: the backend compresses
    geocomm.adapters.torch.backend.configure(codec="geofp8", min_numel=65536)
    geocomm.adapters.torch.backend.stats()       # bytes sent, compressed and exact calls

The process group wraps an exact backend (gloo for CPU tensors, NCCL for CUDA
ones, made from the group's store under a prefix of their own). ``all_reduce``
and ``reduce_scatter_tensor`` (and the list form of ``reduce_scatter``) of one
contiguous fp32, fp16 or bf16 tensor of at least ``min_numel`` values with SUM
or AVG go through geocomm's compressed collectives; every other call (integer
and bool tensors, MAX, MIN, PRODUCT, PREMUL_SUM, small tensors, broadcast,
all-gather, all-to-all, barrier, send and recv, object collectives, coalesced
calls) goes to the exact backend unchanged and returns its work. gloo has no
AVG: an exact floating AVG there is a SUM divided afterwards.

Compressed calls run on one worker thread per group, in submission order (the
same on every rank), so DDP's backward goes on while a bucket is encoded and
sent; the call returns a work at once. Their bytes travel over a second exact
backend of their own (another store prefix) through a
:class:`~geocomm.comm.torchdist.TorchDistCommunicator` wrapped in a
:class:`~geocomm.comm.metered.MeteredComm` (``backend.stats``), so they never
interleave with the exact calls, whose order gloo pairs by.

Keys (the codec state of GeoFP8 and error feedback, the rounding streams): a
compressed call's key is ``(kind, numel, dtype, j)``, decided from the
sequence of compressed calls' (kind, numel, dtype) alone, which every rank
shares. By default a step begins at any call whose (kind, numel, dtype) the
current step has seen already, so ``j`` is 0 and each size keeps one key:
DDP's buckets (fixed sizes, the same order every step) and FSDP2's
reduce-scatters keep their keys from step to step, but tensors of one size
share a key (and a GeoFP8 basis or error-feedback residual). Calling
``backend.step()`` once per step (after ``optimizer.step()``) ends steps there only,
and ``j`` then counts the calls of a size within the step: every call site
keeps a key of its own. The counts never depend on memory addresses, so the
keys agree across ranks whenever the calls do. Ranks compare each call's
count, dtype, op, codec and key before it moves (``check``, on by default;
started when the call is made, adapters/torch/backend/checks.py);
calls that differ raise :class:`~geocomm.CollectiveMismatchError`
on every rank. What the check cannot see: one rank compressing a call
another sends exact (different ``min_numel``, dtype or op) waits on two
different inner backends until the group's timeout.

See docs/design.md, "The torch.distributed backend".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from geocomm import api
from geocomm.adapters.torch import checkpoints
from geocomm.adapters.torch.backend.checks import TOPOLOGY, EarlyChecks
from geocomm.adapters.torch.backend.config import (
    FLOATS,
    BackendConfig,
    BackendStats,
    Keys,
    configured,
    new_config,
)
from geocomm.adapters.torch.backend.exact import ExactCalls
from geocomm.adapters.torch.backend.work import FutureWork, ProcessGroupBase, first_tensor, op_name
from geocomm.adapters.torch.worker import Worker
from geocomm.codecs import get_codec
from geocomm.codecs.base import Codec, StatefulCodec
from geocomm.comm.metered import MeteredComm
from geocomm.comm.torchdist import TorchDistCommunicator
from geocomm.engine import costs
from geocomm.engine.call import CollectiveMismatchError

__all__ = ["NAME", "GeocommProcessGroup"]

#: the backend's name for ``init_process_group`` and ``new_group``
NAME = "geocomm"


def _detached_group(backend: Any, store: Any, rank: int, size: int, cuda: bool) -> Any:
    """A ``ProcessGroup`` over ``backend`` outside torch.distributed's registry (what
    :class:`TorchDistCommunicator` sends through)."""
    kind = dist.ProcessGroup.BackendType.NCCL if cuda else dist.ProcessGroup.BackendType.GLOO
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cuda" if cuda else "cpu"), kind, backend)
    group._set_default_backend(kind)
    return group


def _gloo(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout=timeout)


def _nccl(store: Any, rank: int, size: int, timeout: timedelta, ranks: Sequence[int]) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.global_ranks_in_group = list(ranks)
    return dist.ProcessGroupNCCL(store, rank, size, options)


class _Device:
    """What one device type needs: the exact backend and the compressed communicator."""

    def __init__(self, exact: Any, comm: MeteredComm):
        self.exact, self.comm = exact, comm


class GeocommProcessGroup(ExactCalls, ProcessGroupBase):
    """The process group ``init_process_group("geocomm")`` and ``new_group(backend=
    "geocomm")`` return (see the module docstring). Made by torch.distributed on
    every rank of the group, from its store."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        group_id: str = "",
        ranks: Sequence[int] = (),
    ):
        super().__init__(rank, size)
        self.group_id, self.timeout = group_id, timeout
        self.ranks = list(ranks) or list(range(size))
        self.config = new_config(configured)
        self.codec: Codec = _codec_of_group(self.config.codec)
        self._keys = Keys()
        self._stats = BackendStats()
        self._lock = threading.Lock()  # the counters: exact calls may come from any thread
        self._worker = Worker(f"geocomm-backend-{group_id}")
        self._aborted: RuntimeError | None = None  # what every call raises once aborted
        self._streams: dict[int, Any] = {}
        self._devices: dict[str, _Device] = {}
        self._store, self._rank, self._size = store, rank, size
        # gloo connects every rank when it is made: both CPU backends are made now, on
        # every rank alike; NCCL connects at its first collective
        self._devices["cpu"] = self._make_device("cpu")
        checks_store = dist.PrefixStore("geocomm/checks/", store)
        self._checks = EarlyChecks(_gloo(checks_store, rank, size, timeout), size)
        if torch.cuda.is_available() and dist.is_nccl_available():
            self._devices["cuda"] = self._make_device("cuda")
        # the exact backends are this group's backends too: torch reads the group's name
        # from them, and finds them for what it asks a backend (set_timeout, allocation)
        kinds = {"cpu": self.GLOO, "cuda": self.NCCL}
        for name, device in self._devices.items():
            self._register_backend(torch.device(name), kinds[name], device.exact)
        self._set_default_backend(kinds["cuda" if "cuda" in self._devices else "cpu"])

    def _make_device(self, device: str) -> _Device:
        cuda = device == "cuda"
        stores = [dist.PrefixStore(f"geocomm/{device}/{p}/", self._store) for p in ("x", "c")]
        args = (self._rank, self._size, self.timeout)
        if cuda:
            exact, inner = (_nccl(s, *args, self.ranks) for s in stores)
        else:
            exact, inner = (_gloo(s, *args) for s in stores)
        group = _detached_group(inner, stores[1], self._rank, self._size, cuda)
        comm = TorchDistCommunicator(group, device_arrays=cuda, ranks=self.ranks)
        return _Device(exact, MeteredComm(comm))

    # -- what the backend is ----------------------------------------------------

    def getBackendName(self) -> str:  # the C++ name torch calls
        return NAME

    def _device(self, tensor: torch.Tensor | None) -> _Device:
        kind = "cpu" if tensor is None else tensor.device.type
        found = self._devices.get(kind)
        if found is None:
            raise RuntimeError(
                f"the geocomm backend moves CPU tensors (gloo) and CUDA tensors (NCCL, "
                f"when torch has it), not {kind} tensors"
            )
        return found

    def _exact(self, call: str, args: Sequence[Any]) -> Any:
        with self._lock:
            self._stats.exact += 1
            self._stats.exact_by_call[call] = self._stats.exact_by_call.get(call, 0) + 1
        return self._device(first_tensor(args)).exact

    # -- the compressed calls ---------------------------------------------------

    def _compressible(
        self, kind: str, tensor: torch.Tensor, op: Any, numel: int | None = None
    ) -> str | None:
        """ "sum"/"avg" when this call of ``tensor`` (``numel`` values in all, default
        the tensor's) is compressed, else None."""
        config = self.config
        name = op_name(op)
        if (
            name is None
            or kind not in config.compress
            or tensor.dtype not in FLOATS
            or (tensor.numel() if numel is None else numel) < config.min_numel
            or not tensor.is_contiguous()
            or tensor.device.type not in self._devices
        ):
            return None
        return name

    def _key(self, kind: str, tensor: torch.Tensor) -> tuple:
        signature = (kind, tensor.numel(), str(tensor.dtype).removeprefix("torch."))
        with self._lock:
            key = self._keys.key(signature)
            self._stats.steps = self._keys.steps
        return key

    def _stream_context(self, device: torch.device, ready: Any) -> Any:
        """CPU: nothing. CUDA: the worker's stream of ``device``, after ``ready``."""
        if ready is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(device))
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device)
        stack.enter_context(torch.cuda.stream(stream))
        stream.wait_event(ready)
        return stack

    def _submit(
        self, kind: str, tensor: torch.Tensor, op: str, run: Callable[..., None], result: list
    ) -> FutureWork:
        """Queue ``run(options)`` (the collective's keywords codec, key, comm, check,
        topology, stage_size) for the worker; the work's value is ``result`` once it ran. Key,
        codec and settings are fixed now, in call order; so is the metadata check
        started (adapters/torch/backend/checks.py). RuntimeError once aborted."""
        if self._aborted is not None:
            raise self._aborted
        key = self._key(kind, tensor)
        config, codec, comm = self.config, self.codec, self._device(tensor).comm
        resolved = costs.codec_for(codec, tensor.numel(), comm.backend, comm.size)
        wait_check = None
        if config.check:
            wait_check = self._checks.start(kind, tensor, op, resolved, key, config.stage_size)
        state_check = config.check and not EarlyChecks.complete(resolved)
        itemsize = tensor.element_size()
        factor = 2 if kind == "all_reduce" else 1
        with self._lock:
            self._stats.compressed += 1
            self._stats.values += tensor.numel()
            self._stats.baseline += (
                factor * (self._size - 1) * tensor.numel() * itemsize // self._size
            )
        if tensor.is_cuda:
            ready = torch.cuda.current_stream(tensor.device).record_event()
            future: torch.futures.Future = torch.futures.Future(devices=[tensor.device])
        else:
            ready, future = None, torch.futures.Future()
        what = f"geocomm backend, group {self.group_id!r}: {kind} of key {key}"

        def job() -> None:
            with self._stream_context(tensor.device, ready):
                try:
                    if wait_check is not None:
                        wait_check()
                    run({"codec": codec, "key": key, "comm": comm,
                         "check": state_check, "topology": TOPOLOGY,
                         "stage_size": config.stage_size})  # fmt: skip
                except CollectiveMismatchError as exc:
                    raise CollectiveMismatchError(f"{what}: {exc}") from exc
                # inside the stream context: a CUDA future records the worker's stream
                future.set_result(result)

        self._worker.submit(job, future)
        return FutureWork(future)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = self._compressible("all_reduce", tensors[0], opts.reduceOp) if tensors else None
        if op is None or len(tensors) != 1:
            return self._exact_reduce("allreduce", (tensors,), opts, tensors)
        tensor = tensors[0]

        def run(options: dict[str, Any]) -> None:
            api.allreduce(tensor, op=op, out=tensor, **options)

        return self._submit("all_reduce", tensor, op, run, tensors)

    def _reduce_scatter_flat(
        self, output: torch.Tensor, flat: torch.Tensor, op: str, keep: list
    ) -> FutureWork:
        def run(options: dict[str, Any]) -> None:
            api.reduce_scatter(flat.view(-1), op=op, out=output.view(-1), **options)

        return self._submit("reduce_scatter", flat, op, run, keep)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._compressible("reduce_scatter", input, opts.reduceOp)
        if (
            op is None
            or output.dtype != input.dtype
            or not output.is_contiguous()
            or input.numel() != output.numel() * self._size
        ):
            return self._exact_reduce("_reduce_scatter_base", (output, input), opts, [output])
        return self._reduce_scatter_flat(output, input, op, [output])

    reduce_scatter_single = _reduce_scatter_base  # the name torch >= 2.13 calls

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts=None
    ) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = None
        if len(output_tensors) == 1 and len(input_tensors) == 1:
            output, pieces = output_tensors[0], input_tensors[0]
            like = all(
                p.dtype == output.dtype
                and p.numel() == output.numel()
                and p.device == output.device
                for p in pieces
            )
            if like and len(pieces) == self._size:
                total = output.numel() * self._size
                op = self._compressible("reduce_scatter", output, opts.reduceOp, total)
        if op is None:
            return self._exact_reduce(
                "reduce_scatter", (output_tensors, input_tensors), opts, output_tensors
            )
        flat = torch.cat([p.reshape(-1) for p in pieces])
        return self._reduce_scatter_flat(output, flat, op, output_tensors)

    def barrier(self, opts: Any = None) -> Any:
        """gloo's and NCCL's barrier complete after the group's earlier calls: so does
        this one, the queued compressed calls first (they run on the worker, outside
        the exact backend that runs the barrier)."""
        self.flush()
        return super().barrier(opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        """As :meth:`barrier`: after the queued compressed calls."""
        self.flush()
        return super().monitored_barrier(timeout, wait_all_ranks)

    # -- life cycle ---------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued compressed call ran (the worker stays available)."""
        future: torch.futures.Future = torch.futures.Future()
        self._worker.submit(lambda: future.set_result(None), future)
        future.wait()

    def shutdown(self) -> None:
        """Let queued compressed calls finish and stop the worker thread."""
        self._worker.close()
        for exact in [d.exact for d in self._devices.values()] + [self._checks.group]:
            with contextlib.suppress(Exception):
                exact.shutdown()

    def abort(self) -> None:
        """torch.distributed's abort (``_abort_process_group``): returns at once. Queued
        compressed calls fail (their works raise), as does every later one; the
        backends' transfers are aborted where torch can (NCCL; gloo where its release
        can), and the worker thread stops once its running call returns."""
        self._aborted = RuntimeError(f"the geocomm process group {self.group_id!r} was aborted")
        self._worker.abort(self._aborted)
        groups = [d.exact for d in self._devices.values()] + [self._checks.group]
        groups += [d.comm.comm.group for d in self._devices.values()]
        for group in groups:
            with contextlib.suppress(Exception):
                group.abort()

    # -- configuration, statistics, state -----------------------------------------

    def configure(self, **fields: Any) -> BackendConfig:
        """Replace fields of this group's :class:`BackendConfig` (after :meth:`flush`); a
        new codec starts with fresh state. Every rank must call it at the same point."""
        self.flush()
        config = replace(self.config, **fields)
        if "codec" in fields:
            self.codec = _codec_of_group(config.codec)
            with self._lock:
                self._keys.new_step()
        self.config = config
        return config

    def stats(self) -> BackendStats:
        """A copy of the counters, with the compressed communicators' bytes."""
        with self._lock:
            out = replace(self._stats, exact_by_call=dict(self._stats.exact_by_call))
        out.sent = sum(d.comm.sent for d in self._devices.values()) + self._checks.sent
        out.transfers = sum(d.comm.calls for d in self._devices.values())
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = BackendStats(steps=self._keys.steps)
        for d in self._devices.values():
            d.comm.reset()
        self._checks.sent = 0

    def new_step(self) -> None:
        """Begin a step of the keys now; from then on steps end only here."""
        with self._lock:
            self._keys.new_step(manual=True)

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (GeoFP8 bases and call counts, error-feedback
        residuals, stochastic rounding's call counts: torch tensors and plain values,
        adapters/torch/checkpoints.py) with the group's size, rank and key counters. Flushes
        queued compressed calls first."""
        self.flush()
        with self._lock:
            steps = self._keys.steps
        state = checkpoints.codec_state(self.codec, self._size, [])
        return {**state, "backend": NAME, "rank": self._rank, "steps": steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output of this rank; the next compressed call begins
        a step (save between steps). Raises ValueError for another world size, rank
        or codec."""
        if state.get("backend") != NAME:
            raise ValueError(f"not a geocomm backend state (backend {state.get('backend')!r})")
        checkpoints.check_world_size(state.get("world_size"), self._size, "the geocomm backend")
        if state["rank"] != self._rank:
            raise ValueError(
                f"the state was saved by rank {state['rank']}, this is rank {self._rank} "
                "(each rank loads its own)"
            )
        self.flush()
        checkpoints.load_codec_state(self.codec, state, [], "the geocomm backend")
        with self._lock:
            manual = self._keys.manual
            self._keys = Keys()
            self._keys.steps, self._keys.manual = int(state["steps"]), manual


def _codec_of_group(codec: Any) -> Codec:
    """A group's codec for a configured id, config or Codec: an instance of its own for
    a stateful one (a state serves one group of ranks: ``StatefulCodec.hold_for``), so
    that the groups torch makes (a DeviceMesh's shard and replica groups) never share
    one; a stateless Codec as it is."""
    codec = get_codec(codec)
    return get_codec(codec.get_config()) if isinstance(codec, StatefulCodec) else codec


def _create(options: Any, backend_options: Any = None) -> GeocommProcessGroup:
    return GeocommProcessGroup(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        str(options.group_id),
        list(options.global_ranks_in_group),
    )


if not hasattr(dist.Backend, NAME.upper()):
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
