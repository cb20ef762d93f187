"""A compressed torch.distributed backend: ``dist.init_process_group("geocomm")``.

    import geocomm.adapters.torch                # registers the backend "geocomm"
    dist.init_process_group("geocomm")           # or "cpu:geocomm,cuda:geocomm"
    model = DDP(net)                             # no hook: the backend compresses
    geocomm.adapters.torch_backend.configure(codec="geofp8", min_numel=65536)
    geocomm.adapters.torch_backend.stats()       # bytes sent, compressed and exact calls

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
:class:`~geocomm.comm.metered.MeteredComm` (:func:`stats`), so they never
interleave with the exact calls, whose order gloo pairs by.

Keys (the codec state of GeoFP8 and error feedback, the rounding streams): a
compressed call's key is ``(kind, numel, dtype, j)``, decided from the
sequence of compressed calls' (kind, numel, dtype) alone, which every rank
shares. By default a step begins at any call whose (kind, numel, dtype) the
current step has seen already, so ``j`` is 0 and each size keeps one key:
DDP's buckets (fixed sizes, the same order every step) and FSDP2's
reduce-scatters keep their keys from step to step, but tensors of one size
share a key (and a GeoFP8 basis or error-feedback residual). Calling
:func:`step` once per step (after ``optimizer.step()``) ends steps there only,
and ``j`` then counts the calls of a size within the step: every call site
keeps a key of its own. The counts never depend on memory addresses, so the
keys agree across ranks whenever the calls do. Ranks compare each call's
count, dtype, op, codec and key before it moves (``check``, on by default);
calls that differ raise :class:`~geocomm.collectives.CollectiveMismatchError`
on every rank. What the check cannot see: one rank compressing a call
another sends exact (different ``min_numel``, dtype or op) waits on two
different inner backends until the group's timeout.

See docs/design.md, "The torch.distributed backend".
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from geocomm.adapters import arrays, checkpoint
from geocomm.adapters.worker import Worker
from geocomm.codecs.base import Codec
from geocomm.collectives import CollectiveMismatchError, resolve_codec
from geocomm.comm.metered import MeteredComm
from geocomm.comm.torchdist import TorchDistCommunicator

__all__ = [
    "NAME",
    "BackendConfig",
    "BackendStats",
    "GeocommProcessGroup",
    "configure",
    "load_state_dict",
    "state_dict",
    "stats",
    "step",
]

#: the backend's name for ``init_process_group`` and ``new_group``
NAME = "geocomm"
#: the calls that may be compressed (names for :func:`configure`'s ``compress``)
KINDS = ("all_reduce", "reduce_scatter")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BackendConfig:
    """What a geocomm process group compresses, and how.

    ``codec``: codec id, config dict or Codec (a Codec instance is shared by
    the groups made while it is configured); ``min_numel``: smaller tensors
    go exact; ``compress``: which of ``"all_reduce"``, ``"reduce_scatter"``
    are compressed; ``check``: compare every compressed call's metadata across
    ranks first (one small all-gather); ``stage_size``: the pipeline's stage
    size (None: the collectives' default).
    """

    codec: Any = "fp8"
    min_numel: int = 16384
    compress: tuple[str, ...] = KINDS
    check: bool = True
    stage_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_numel, int) or self.min_numel < 1:
            raise ValueError(f"min_numel must be a positive integer, got {self.min_numel!r}")
        bad = [k for k in self.compress if k not in KINDS]
        if isinstance(self.compress, str) or bad:
            raise ValueError(f"compress takes names from {KINDS}, got {self.compress!r}")


def _env_config() -> dict[str, Any]:
    """``GEOCOMM_CODEC`` (an id, or a JSON config) and ``GEOCOMM_MIN_NUMEL``."""
    fields: dict[str, Any] = {}
    codec = os.environ.get("GEOCOMM_CODEC", "").strip()
    if codec:
        fields["codec"] = json.loads(codec) if codec.startswith("{") else codec
    numel = os.environ.get("GEOCOMM_MIN_NUMEL", "").strip()
    if numel:
        fields["min_numel"] = int(numel)
    return fields


_configured: dict[str, Any] = {}  # what configure() set without a group


def _new_config() -> BackendConfig:
    """A new group's configuration: configure()'s, over the environment's, over the defaults."""
    return BackendConfig(**{**_env_config(), **_configured})


@dataclass
class BackendStats:
    """What one group did: ``sent`` bytes and ``transfers`` counted at the compressed
    communicator (this rank's own segments, metadata checks included), ``baseline``
    bytes the uncompressed ring would have sent for the same calls, the number of
    ``compressed`` and ``exact`` calls, ``values`` compressed, ``steps`` begun."""

    sent: int = 0
    transfers: int = 0
    baseline: int = 0
    compressed: int = 0
    exact: int = 0
    values: int = 0
    steps: int = 0
    exact_by_call: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Baseline bytes over sent bytes (0 before any compressed call)."""
        return self.baseline / self.sent if self.sent else 0.0


class _Keys:
    """The keys of one group's compressed calls (see the module docstring): decided from
    the sequence of the calls' (kind, numel, dtype) alone, which every rank shares."""

    def __init__(self) -> None:
        self.counts: dict[tuple, int] = {}
        self.steps = 0
        self.manual = False  # step() was called: steps end there only

    def new_step(self, manual: bool = False) -> None:
        self.counts.clear()
        self.steps += 1
        self.manual = self.manual or manual

    def key(self, signature: tuple) -> tuple:
        if not self.manual and signature in self.counts:  # a repeat: a new step begins
            self.new_step()
        j = self.counts.get(signature, 0)
        self.counts[signature] = j + 1
        return (*signature, j)


# torch's stubs overload the collectives' signatures (the Python conveniences beside the
# C++ ones this class overrides): typed as Any, the bases leave the overrides unchecked
_ProcessGroup: Any = dist.ProcessGroup
_Work: Any = dist.Work


class _FutureWork(_Work):
    """A ``Work`` whose result is ``future``'s: ``wait()`` raises the job's own exception
    (a :class:`CollectiveMismatchError` stays one); C++ callers (DDP) use the future."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def result(self) -> list[torch.Tensor]:
        return self._future.value()


def _done_work(value: Any) -> _FutureWork:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return _FutureWork(future)


def _op_name(op: Any) -> str | None:
    """ "sum" or "avg" for the reduce ops geocomm compresses, else None."""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None


def _first_tensor(args: Iterable[Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            found = _first_tensor(a)
            if found is not None:
                return found
    return None


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


class GeocommProcessGroup(_ProcessGroup):
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
        self.config = _new_config()
        self.codec: Codec = resolve_codec(self.config.codec)
        self._keys = _Keys()
        self._stats = BackendStats()
        self._lock = threading.Lock()  # the counters: exact calls may come from any thread
        self._worker = Worker(f"geocomm-backend-{group_id}")
        self._streams: dict[int, Any] = {}
        self._devices: dict[str, _Device] = {}
        self._store, self._rank, self._size = store, rank, size
        # gloo connects every rank when it is made: both CPU backends are made now, on
        # every rank alike; NCCL connects at its first collective
        self._devices["cpu"] = self._make_device("cpu")
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
        comm = TorchDistCommunicator(group, device_arrays=cuda)
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
        return self._device(_first_tensor(args)).exact

    # -- the compressed calls ---------------------------------------------------

    def _compressible(
        self, kind: str, tensor: torch.Tensor, op: Any, numel: int | None = None
    ) -> str | None:
        """ "sum"/"avg" when this call of ``tensor`` (``numel`` values in all, default
        the tensor's) is compressed, else None."""
        config = self.config
        name = _op_name(op)
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
        self, kind: str, tensor: torch.Tensor, run: Callable[..., None], result: list
    ) -> _FutureWork:
        """Queue ``run(options)`` for the worker (``options``: the collective's keywords
        codec, key, comm, check, stage_size); the work's
        value is ``result`` once it ran. Key, codec and settings are fixed now, in
        call order."""
        key = self._key(kind, tensor)
        config, codec, comm = self.config, self.codec, self._device(tensor).comm
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
                    run({"codec": codec, "key": key, "comm": comm, "check": config.check,
                         "stage_size": config.stage_size})  # fmt: skip
                except CollectiveMismatchError as exc:
                    raise CollectiveMismatchError(f"{what}: {exc}") from exc
                # inside the stream context: a CUDA future records the worker's stream
                future.set_result(result)

        self._worker.submit(job, future)
        return _FutureWork(future)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = self._compressible("all_reduce", tensors[0], opts.reduceOp) if tensors else None
        if op is None or len(tensors) != 1:
            return self._exact_reduce("allreduce", (tensors,), opts, tensors)
        tensor = tensors[0]

        def run(options: dict[str, Any]) -> None:
            arrays.allreduce(tensor, op=op, out=tensor, **options)

        return self._submit("all_reduce", tensor, run, tensors)

    def _reduce_scatter_flat(
        self, output: torch.Tensor, flat: torch.Tensor, op: str, keep: list
    ) -> _FutureWork:
        def run(options: dict[str, Any]) -> None:
            shard = arrays.reduce_scatter(flat.view(-1), op=op, **options)
            output.view(-1).copy_(shard)

        return self._submit("reduce_scatter", flat, run, keep)

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

    # -- exact reductions (gloo has no AVG: a SUM, divided afterwards) ----------

    def _exact_reduce(self, call: str, args: Sequence[Any], opts: Any, results: list) -> Any:
        inner = self._exact(call, args)
        tensor = _first_tensor(args)
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

        return _then(work, divide)

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
        return _all_of(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        works = [
            self._exact_reduce("_reduce_scatter_base", (o, i), opts, [o])
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return _all_of(works, outputs)

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

    # -- life cycle ---------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued compressed call ran (the worker stays available)."""
        future: torch.futures.Future = torch.futures.Future()
        self._worker.submit(lambda: future.set_result(None), future)
        future.wait()

    def shutdown(self) -> None:
        """Let queued compressed calls finish and stop the worker thread."""
        self._worker.close()
        for device in self._devices.values():
            with contextlib.suppress(Exception):
                device.exact.shutdown()

    def abort(self) -> None:
        self.shutdown()

    # -- configuration, statistics, state -----------------------------------------

    def configure(self, **fields: Any) -> BackendConfig:
        """Replace fields of this group's :class:`BackendConfig` (after :meth:`flush`); a
        new codec starts with fresh state. Every rank must call it at the same point."""
        self.flush()
        config = replace(self.config, **fields)
        if "codec" in fields:
            self.codec = resolve_codec(config.codec)
            with self._lock:
                self._keys.new_step()
        self.config = config
        return config

    def stats(self) -> BackendStats:
        """A copy of the counters, with the compressed communicators' bytes."""
        with self._lock:
            out = replace(self._stats, exact_by_call=dict(self._stats.exact_by_call))
        out.sent = sum(d.comm.sent for d in self._devices.values())
        out.transfers = sum(d.comm.calls for d in self._devices.values())
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = BackendStats(steps=self._keys.steps)
        for d in self._devices.values():
            d.comm.reset()

    def new_step(self) -> None:
        """Begin a step of the keys now; from then on steps end only here."""
        with self._lock:
            self._keys.new_step(manual=True)

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (GeoFP8 bases and call counts, error-feedback
        residuals, stochastic rounding's call counts: torch tensors and plain values,
        adapters/checkpoint.py) with the group's size, rank and key counters. Flushes
        queued compressed calls first."""
        self.flush()
        with self._lock:
            steps = self._keys.steps
        state = checkpoint.codec_state(self.codec, self._size, [])
        return {**state, "backend": NAME, "rank": self._rank, "steps": steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output of this rank; the next compressed call begins
        a step (save between steps). Raises ValueError for another world size, rank
        or codec."""
        if state.get("backend") != NAME:
            raise ValueError(f"not a geocomm backend state (backend {state.get('backend')!r})")
        checkpoint.check_world_size(state.get("world_size"), self._size, "the geocomm backend")
        if state["rank"] != self._rank:
            raise ValueError(
                f"the state was saved by rank {state['rank']}, this is rank {self._rank} "
                "(each rank loads its own)"
            )
        self.flush()
        checkpoint.load_codec_state(self.codec, state, [], "the geocomm backend")
        with self._lock:
            manual = self._keys.manual
            self._keys = _Keys()
            self._keys.steps, self._keys.manual = int(state["steps"]), manual


def _future_of(work: Any) -> torch.futures.Future:
    """``work``'s future; for a work without one (gloo's reduce-scatter), a completed
    future after waiting for it here."""
    try:
        return work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        work.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _then(work: Any, finish: Callable[[], list]) -> _FutureWork:
    """A work that completes with ``finish()`` once ``work`` did."""

    def done(f: torch.futures.Future) -> list:
        f.value()  # raises the work's exception
        return finish()

    return _FutureWork(_future_of(work).then(done))


def _all_of(works: list, value: list) -> _FutureWork:
    """One work that completes when every one of ``works`` did, with ``value``."""
    if not works:
        return _done_work(value)

    def done(f: torch.futures.Future) -> list:
        for each in f.value():
            each.value()  # raises a failed one's exception
        return value

    return _FutureWork(torch.futures.collect_all([_future_of(w) for w in works]).then(done))


# ---------------------------------------------------------------------------
# module-level access


def _group(group: Any = None) -> GeocommProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, GeocommProcessGroup):
        raise TypeError(
            f"not a geocomm process group: {type(group).__name__} (make it with "
            f'init_process_group("{NAME}") or new_group(backend="{NAME}"))'
        )
    return group


def configure(group: Any = None, **fields: Any) -> BackendConfig:
    """Set :class:`BackendConfig` fields (``codec``, ``min_numel``, ``compress``,
    ``check``, ``stage_size``).

    Without ``group``: for the geocomm groups made afterwards (over
    ``GEOCOMM_CODEC`` and ``GEOCOMM_MIN_NUMEL``); returns the configuration a
    new group would get. With ``group`` (a geocomm process group): that group's,
    now; every rank must call it at the same point.
    """
    if group is not None:
        return _group(group).configure(**fields)
    trial = BackendConfig(**{**_env_config(), **_configured, **fields})
    resolve_codec(trial.codec)  # a bad codec fails here
    _configured.update(fields)
    return trial


def reset_configuration() -> None:
    """Forget what :func:`configure` set for new groups (the environment and defaults again)."""
    _configured.clear()


def stats(group: Any = None) -> BackendStats:
    """The counters of ``group`` (default: the default group)."""
    return _group(group).stats()


def step(group: Any = None) -> None:
    """Begin a new step of ``group``'s keys now (see the module docstring); every rank
    must call it at the same point."""
    _group(group).new_step()


def state_dict(group: Any = None) -> dict[str, Any]:
    """``group``'s codec state on this rank (:meth:`GeocommProcessGroup.state_dict`)."""
    return _group(group).state_dict()


def load_state_dict(state: dict[str, Any], group: Any = None) -> None:
    """Restore :func:`state_dict` output into ``group`` (the same world size and rank)."""
    _group(group).load_state_dict(state)


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
