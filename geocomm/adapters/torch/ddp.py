"""The DDP communication hook: asynchronous, bucketed, compressed.

    import geocomm.adapters.torch as gt
    model = DDP(net)
    state = gt.GeocommHookState(net, codec="geofp8")
    model.register_comm_hook(state, gt.geocomm_hook)
    ...
    state.last_step                              # bytes, ratio, error estimate of the last step

DDP hands the hook one bucket (a flat buffer of several gradients) at a time,
while backward goes on computing the others. :func:`geocomm_hook` queues the
bucket for the state's worker thread and returns a future at once; the worker
reduces the whole bucket in ONE compressed collective (``parts=`` names every
parameter, so GeoFP8 keeps each one's key and 2-D map) plus, when some of its
parameters are excluded from compression, ONE exact collective for those.
The future completes when the bucket holds the average.

Why a thread: the C codec, NumPy and gloo release the GIL, so encoding and
sending overlap the autograd engine's backward. One worker with a FIFO queue
keeps the collective order the same on every rank (DDP launches buckets in
index order). geocomm's traffic uses a process group of its own
(``dist.new_group``) so it never interleaves with DDP's own collectives.

CUDA gradients: the hook records an event on the gradients' stream (torch's
current stream); the worker runs on a stream of its own that waits for that
event, geocomm's CuPy kernels run on it (CuPy's wrapper of torch's stream) and
the bytes move through geocomm's NCCL communicator, bootstrapped over a gloo
group of its own (:func:`~geocomm.adapters.torch.distributed.dedicated_comm`; or
a communicator passed as ``comm=``). A bucket's buffer is the same every step,
so from its third step on a bucket's collective replays as one CUDA graph. The
future is device-aware, so DDP's stream waits for the worker's stream before
it reads the result. fp32, fp16 and bf16 gradients.
"""

# No "from __future__ import annotations": DDP compares the hook's bucket
# annotation with dist.GradBucket itself, not with a string.
import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from geocomm.adapters.torch import checkpoints
from geocomm.adapters.torch.distributed import dedicated_comm
from geocomm.adapters.torch.grads import BufferLayout, Entry, GradReducer, Selection, check_dtype
from geocomm.adapters.torch.telemetry import BucketStats, StepStats, Telemetry
from geocomm.adapters.torch.worker import Worker
from geocomm.codecs import get_codec

__all__ = ["GeocommHookState", "geocomm_hook"]


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


#: the integer view of each floating-point dtype DDP buckets geocomm reduces hold
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _parameters_digest(module: torch.nn.Module, chunk: int = 1 << 24) -> np.ndarray:
    """(the sum of every fp32/fp16/bf16 parameter's values read as integers, modulo
    2^63; how many): what replicas share, exact whatever the order of the sums. Each
    chunk sums on the parameters' device in int64 (under 2^31 a value, 2^24 values: no
    overflow), and the chunks' sums come to the host at once."""
    sums: list[torch.Tensor] = []
    count = 0
    for p in module.parameters():
        bits = _BITS.get(p.dtype)
        if bits is None:
            continue
        flat = p.detach().reshape(-1).view(bits)
        for at in range(0, flat.numel(), chunk):
            sums.append(flat[at : at + chunk].sum(dtype=torch.int64))
        count += flat.numel()
    total = sum(int(v) for v in torch.stack(sums).cpu()) if sums else 0
    return np.array([total % (1 << 63), count], np.int64)


def _group_size(group: Any) -> int | None:
    """The size of ``group`` (None: the world), or None before torch.distributed is set up."""
    return dist.get_world_size(group) if dist.is_initialized() else None


class GeocommHookState:
    """The state of :func:`geocomm_hook`: codec, communicator, parameter policy, telemetry.

    geocomm talks over a process group of its own over ``group``'s ranks (gloo,
    or NCCL for CUDA gradients), made at the first bucket on the thread that
    calls the hook, so the state may be built before the default process group
    exists and before DDP wraps the module (as Lightning's
    ``DDPStrategy(ddp_comm_state=...)`` does).

    Args:
        module: the module DDP wraps; its parameter names are GeoFP8's keys and what
            ``exclude`` matches.
        codec: codec id, config or Codec (default "fp8"): an id or config makes
            this model's own codec, with state of its own (GeoFP8's bases, error feedback's
            residuals); a Codec is used as it is, so one shared by two models shares its
            state between them.
        group: the process group whose ranks take part (default: the world): DDP's
            ``process_group`` when it has one (the first bucket raises ValueError when
            the ranks hold different parameters, as other DDP groups' do).
        check: compare the bucket's metadata across ranks: None (default) on the
            first call of each bucket layout, every call under ``GEOCOMM_CHECK=1``;
            True every call; False never (nor the parameters, at the first bucket).
        comm: a geocomm communicator to use instead of the state's own group.
        exclude: name patterns (:func:`fnmatch.fnmatchcase`) of parameters that
            travel exact (:class:`~geocomm.adapters.torch.Selection`); a bucket's
            excluded parameters share one exact collective.
        min_numel: parameters with fewer values travel exact too.
        error_sample: values per bucket for the error estimate (0: none); default
            4096 for CPU gradients and none for CUDA ones, whose estimate would make
            the host wait for the device twice per bucket.
        stage_size: values per pipeline stage (default: the collectives' choice for
            the backend; docs/design.md, "Training integration").
        history: steps :attr:`telemetry` keeps.
        log_every: log every n-th step to the ``geocomm.torch`` logger (0: never).

    Attributes:
        last_step: the last finished step's :class:`~geocomm.adapters.torch.StepStats`
            (bytes sent, ratio, collectives, estimated error), None before one.
        telemetry: every kept step (:class:`~geocomm.adapters.torch.Telemetry`).

    Bucket layouts are the same on every rank whenever DDP calls the hook (DDP
    verifies parameter shapes at construction and broadcasts rebuilt buckets
    from rank 0), so every rank decides alike when to check.

    Example::

        state = GeocommHookState(net, codec="geofp8", exclude=("*norm*",))
        model.register_comm_hook(state, geocomm_hook)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        codec: Any = "fp8",
        group: Any = None,
        check: bool | None = None,
        *,
        comm: Any = None,
        exclude: Sequence[str] = (),
        min_numel: int = 0,
        error_sample: int | None = None,
        stage_size: int | None = None,
        history: int = 100,
        log_every: int = 0,
    ):
        codec = get_codec(codec)  # a bad codec fails here, before any collective
        self.module = module
        self.group = group
        self.selection = Selection.of(exclude, min_numel)
        self.device: torch.device | None = None  # the gradients', at the first bucket
        self.reducer = GradReducer(
            codec, comm, check, error_sample, stage_size, Telemetry(history, log_every),
            connect=None if comm is not None else self._connect,
        )  # fmt: skip
        self._names: dict[int, str] | None = None
        self._rank_of: dict[str, int] = {}  # a parameter's place in the module
        self._layouts: dict[Any, BufferLayout] = {}
        self._worker = Worker("geocomm-ddp")
        self._stream: Any = None
        self._expected_size: int | None = None

    def _connect(self) -> Any:
        """The communicator over a process group of its own, made at the first bucket."""
        if not dist.is_initialized():
            raise RuntimeError(
                "GeocommHookState makes its process group at the first bucket, and the "
                "default process group is not initialized yet (dist.init_process_group)"
            )
        device = self.device if self.device is not None else _module_device(self.module)
        comm = dedicated_comm(self.group, device)
        checkpoints.check_world_size(self._expected_size, comm.size, "GeocommHookState")
        return comm

    def _start(self, device: torch.device) -> None:
        """Set up on the first bucket: device, stream and communicator, on the thread
        that calls the hook, at the same point on every rank (the first bucket); then
        :meth:`_check_replicas` (unless ``check=False``)."""
        if self.device is not None:
            return
        self.device = device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
        comm = self.reducer.comm  # made now, in bucket order, not on the worker
        if self.reducer.policy != "never":
            self._check_replicas(comm)

    def _check_replicas(self, comm: Any) -> None:
        """ValueError on every rank unless the communicator's ranks hold the same
        parameters (DDP's replicas do: it broadcasts them when it wraps the module).
        Ranks that hold others belong to other DDP groups: DDP runs over a subgroup
        and the state was not given it, and a tensor-parallel model's shards, alike
        in shape, would otherwise be averaged together without a word."""
        digest = _parameters_digest(self.module)
        rows = comm.allgather_int64(digest)
        differ = [r for r in range(len(rows)) if not np.array_equal(rows[r], rows[0])]
        if differ:
            raise ValueError(
                f"GeocommHookState: ranks {differ} of the hook's {len(rows)} hold other "
                "parameters than rank 0, so they are not replicas of one DDP model; for DDP "
                "over a process group, pass that group as GeocommHookState(..., group=...)"
            )

    @property
    def codec(self) -> Any:
        return self.reducer.codec

    @property
    def comm(self) -> Any:
        """The (metered) communicator: ``comm.sent`` bytes, ``comm.calls`` transfers."""
        return self.reducer.comm

    @property
    def telemetry(self) -> Telemetry:
        return self.reducer.telemetry

    @property
    def last_step(self) -> StepStats | None:
        """Bytes, compression ratio and error estimate of the last finished step."""
        return self.telemetry.last_step

    @property
    def names(self) -> dict[int, str]:
        """Parameter name by ``id``, read at the first bucket (after DDP and any move)."""
        if self._names is None:
            named = list(self.module.named_parameters())
            self._names = {id(p): name for name, p in named}
            self._rank_of = {name: i for i, (name, _) in enumerate(named)}
        return self._names

    def layout(self, params: Sequence[torch.Tensor], index: int = 0) -> BufferLayout:
        """The layout of a bucket of ``params`` (in bucket order), cached. Its tensors
        travel in reverse module order, whatever the bucket's order: DDP rebuilds its
        buckets after the first step (in the order gradients become ready, which is
        usually that one), so a resumed job's first step sends a bucket of the same
        parameters in the same order, and with the same bits, as the same step of a
        straight run (the buckets themselves may differ: docs/torch.md, "Checkpoints")."""
        cache_key = (index, tuple(id(p) for p in params))
        layout = self._layouts.get(cache_key)
        if layout is None:
            entries, offset = [], 0
            for p in params:
                name = self.names.get(id(p))
                if name is None:
                    raise ValueError(
                        f"bucket {index}: a parameter of shape {tuple(p.shape)} is not a "
                        "parameter of the module given to GeocommHookState (pass the module "
                        "that DDP wraps)"
                    )
                entries.append(Entry(offset, tuple(p.shape), name, name))
                offset += p.numel()
            layout = self._layouts[cache_key] = BufferLayout(
                entries, self.selection, order=lambda e: -self._rank_of[e.name]
            )
        return layout

    def reduce_bucket(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], index: int = 0
    ) -> BucketStats:
        """Average the flat ``buffer`` of ``params``' gradients over the ranks, in
        place, now (what the worker runs for each bucket; also usable to time
        the communication alone). Returns the bucket's statistics."""
        self._start(buffer.device)
        layout = self.layout(params, index)
        return self.reducer.allreduce(
            layout, buffer, index, "avg", what=f"DDP bucket {index} ({len(params)} parameters)"
        )

    def _stream_context(self, ready: Any) -> contextlib.AbstractContextManager:
        """CPU: nothing. CUDA: the worker's stream, after the gradients' stream's ``ready``."""
        if ready is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stream = self._stream
        assert stream is not None  # made with the state whenever the module is on CUDA
        stack.enter_context(torch.cuda.stream(stream))
        stream.wait_event(ready)
        return stack

    def submit(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], index: int, last: bool
    ) -> torch.futures.Future:
        """Queue the bucket; the future's value is ``buffer`` once it holds the average.
        TypeError at once for a bucket of a dtype geocomm does not reduce."""
        check_dtype(buffer.dtype, "a DDP bucket")
        self._start(buffer.device)
        if buffer.is_cuda:
            ready = torch.cuda.current_stream(buffer.device).record_event()
            future: torch.futures.Future = torch.futures.Future(devices=[buffer.device])
        else:
            ready, future = None, torch.futures.Future()

        def job() -> None:
            with self._stream_context(ready):
                self.reduce_bucket(buffer, params, index)
                if last:
                    self.telemetry.end_step()
                # inside the stream context: a CUDA future records the worker's stream
                future.set_result(buffer)

        self._worker.submit(job, future)
        return future

    def state_dict(self) -> dict[str, Any]:
        """The codec's state for a checkpoint (torch tensors and plain values: save it
        with ``torch.save`` beside the model's and the optimizer's): GeoFP8 bases and
        call counts, error-feedback residuals, stochastic rounding's call counts, and
        the world size and parameters it belongs to. Call between steps."""
        size = self.reducer.comm.size if self.reducer.connected else _group_size(self.group)
        return checkpoints.codec_state(self.codec, size, checkpoints.parameter_layout(self.module))

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output before the first step of a resumed job;
        ValueError if it was saved for another codec, parameter layout or world size."""
        saved_size = checkpoints.load_codec_state(
            self.codec, data, checkpoints.parameter_layout(self.module), "GeocommHookState",
            checkpoints.namespace(_module_device(self.module)),
        )  # fmt: skip
        size = self.reducer.comm.size if self.reducer.connected else _group_size(self.group)
        if size is not None:
            checkpoints.check_world_size(saved_size, size, "GeocommHookState")
        self._expected_size = saved_size

    def close(self) -> None:
        """Let queued buckets finish and stop the worker thread (a later bucket restarts it)."""
        self._worker.close()


def geocomm_hook(
    state: GeocommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the compressed average of ``bucket``, asynchronous.

    The bucket is queued to the state's worker thread, which reduces it with one
    compressed all-reduce (plus one exact one for excluded parameters) while
    backward goes on. Register with ``model.register_comm_hook(state, geocomm_hook)``.

    Args:
        state: the hook's :class:`GeocommHookState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future, at once, that completes with the bucket's buffer once it holds
        the average over the ranks, bitwise identical on every rank (device-aware
        on CUDA: DDP's stream waits for it without blocking the host).
    """
    return state.submit(bucket.buffer(), bucket.parameters(), bucket.index(), bucket.is_last())
