"""Compressed all-reduce, reduce-scatter and all-gather (DESIGN section 4).

This is the only module that holds a codec and a communicator at once.

All-reduce of ``count`` values on ``N`` ranks, two quantizations:

1. (stateful codecs) ``plan = codec.begin(...)``; ``y = plan.forward(x)``;
2. the flat buffer is cut into the ``N`` shards of ``np.array_split``; each
   shard into pieces of ``layout.piece`` values, one piece per shard per
   pipeline stage;
3. stage ``s``: every rank encodes piece ``s`` of every other rank's shard
   (each piece is encoded on its own, so no header travels) and an
   all-to-all sends shard ``j``'s piece to rank ``j``;
4. rank ``j`` takes its own piece as it is (it never travels, so it is never
   quantized), adds the ``N - 1`` decoded pieces in rank order in fp32
   (deterministic, and independent of whether ``out`` aliases ``x``),
   re-encodes the sum, and an all-gather sends it to everyone, itself
   included; every rank decodes all pieces from the same bytes, so every rank
   ends with bitwise identical values;
5. ``plan.inverse``, ``op="avg"`` divides by ``N``, cast to the caller's dtype.

The pipeline keeps three stages in flight: while stage ``s`` is encoded,
stage ``s-1``'s all-to-all and stage ``s-2``'s all-gather move, and every
codec call is followed by a ``test()`` of the open requests so MPI makes
progress without a progress thread. Reduce-scatter is steps 1-4 without the
all-gather; the owner keeps its fp32 sum.

Before each collective the ranks compare a small fingerprint (collective,
count, dtype, op, codec config, key, and for stateful codecs a checksum of
the key's state) with one tiny all-gather, so mismatched calls or diverged
GeoFP8 state fail with :class:`CollectiveMismatchError` on every rank instead
of hanging or producing garbage. ``check=False`` (or ``GEOCOMM_CHECK=0``)
skips it.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from geocomm._layout import shard_bounds
from geocomm.codecs import Codec, get_codec
from geocomm.codecs.base import DTYPE_CODES
from geocomm.comm.base import Communicator, Request, wait

#: Values of the whole buffer per pipeline stage (all shards together); see
#: perf/results/chunk_sweep.md for the measurement behind the default.
DEFAULT_CHUNK_ELEMS = 1 << 20
#: Pieces start at multiples of this many values, so fp8 blocks of 128 and
#: NVFP4 blocks of 16 are never split.
PIECE_ALIGN = 256
OPS = ("sum", "avg")


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with different arguments."""


# ---------------------------------------------------------------------------
# default communicator and codec instances


_default_comm: Communicator | None = None
_codec_cache: dict[str, Codec] = {}


def init(comm: Any = None, backend: str = "mpi") -> Communicator:
    """Set (and return) the default communicator.

    ``comm`` may be a geocomm Communicator, an mpi4py communicator, or None
    for ``MPI.COMM_WORLD``. ``backend="nccl"`` builds the NCCL communicator
    (CuPy arrays on GPUs).
    """
    global _default_comm
    if comm is not None and isinstance(comm, Communicator):
        _default_comm = comm
    elif backend == "mpi":
        from geocomm.comm.mpi import MPICommunicator

        _default_comm = MPICommunicator(comm)
    elif backend == "nccl":
        from geocomm.comm.nccl import NCCLCommunicator

        _default_comm = NCCLCommunicator(comm)
    else:
        raise ValueError(f"unknown backend {backend!r} (expected 'mpi' or 'nccl')")
    return _default_comm


def get_comm(comm: Communicator | None = None) -> Communicator:
    """``comm`` if given, else the default communicator (initialised on first use)."""
    if comm is not None:
        return comm
    return _default_comm if _default_comm is not None else init()


def resolve_codec(codec: Any) -> Codec:
    """A codec instance for an id, config or Codec; ids and configs map to one
    cached instance each, so stateful codecs keep their per-key state."""
    if isinstance(codec, Codec):
        return codec
    config = get_codec(codec).get_config()
    name = json.dumps(config, sort_keys=True)
    if name not in _codec_cache:
        _codec_cache[name] = get_codec(config)
    return _codec_cache[name]


# ---------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class Layout:
    """Where every piece of every stage lies; identical on every rank."""

    count: int
    size: int
    bounds: np.ndarray
    piece: int
    stages: int

    @classmethod
    def plan(cls, count: int, size: int, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> Layout:
        if chunk_elems <= 0:
            raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
        bounds = shard_bounds(count, size)
        per_shard = -(-chunk_elems // size)
        piece = max(PIECE_ALIGN, -(-per_shard // PIECE_ALIGN) * PIECE_ALIGN)
        longest = int(np.max(np.diff(bounds))) if count else 0
        return cls(count, size, bounds, piece, -(-longest // piece))

    def piece_range(self, shard: int, stage: int) -> tuple[int, int]:
        """Absolute [lo, hi) of shard ``shard``'s piece in stage ``stage`` (may be empty)."""
        start, end = int(self.bounds[shard]), int(self.bounds[shard + 1])
        lo = min(start + stage * self.piece, end)
        return lo, min(lo + self.piece, end)


def wire_bytes(codec: Codec, layout: Layout, rank: int, gather: bool = True) -> int:
    """Bytes ``rank`` sends in one compressed all-reduce (``gather=False``:
    reduce-scatter): its pieces for the other shards, plus its re-encoded
    reduced pieces, which N - 1 ranks receive. Side channels of stateful
    codecs are not included (their plans report ``side_bytes``)."""
    total = 0
    for s in range(layout.stages):
        for j in range(layout.size):
            lo, hi = layout.piece_range(j, s)
            if j != rank:
                total += codec.wire_size(hi - lo)
            elif gather:
                total += (layout.size - 1) * codec.wire_size(hi - lo)
    return total


def array_module(array: Any) -> Any:
    """numpy, or cupy for CuPy arrays (the NCCL backend works on the device)."""
    if type(array).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _check_array(x: Any, name: str = "x") -> Any:
    """x if it is a NumPy or CuPy array of a supported float dtype, else TypeError."""
    if not isinstance(x, np.ndarray) and array_module(x) is np:
        raise TypeError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"{name} has dtype {x.dtype}; geocomm collectives take float32, "
                        "float16, bfloat16 or (codec 'none') float64")
    return x


def _segments(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    counts = np.asarray(sizes, dtype=np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return counts, displs


class _ScratchPool:
    """Wire buffers kept between calls, per thread, for NumPy pipelines.

    Megabyte-sized buffers freed after every call go back to the kernel
    (glibc trims the heap), and the next call pays for zeroed pages again: a
    profile of a 64 MiB fp8 all-reduce showed that page clearing cost as much
    as encoding. CuPy has its own memory pool, so device buffers skip this.
    """

    KEEP = 16  # buffers kept per thread (a pipeline uses 8) ...
    KEEP_BYTES = 64 << 20  # ... and at most this many bytes of them

    def __init__(self) -> None:
        self.local = threading.local()

    def _free(self) -> list[np.ndarray]:
        if not hasattr(self.local, "free"):
            self.local.free = []
        return self.local.free

    def take(self, xp: Any, nbytes: int) -> Any:
        """An uninitialized uint8 buffer of ``nbytes`` (a pooled one when it fits)."""
        if xp is not np:
            return xp.empty(nbytes, np.uint8)
        free = self._free()
        fits = [i for i, b in enumerate(free) if b.size >= nbytes]
        if not fits:
            return np.empty(nbytes, np.uint8)
        best = min(fits, key=lambda i: free[i].size)
        return free.pop(best)[:nbytes]

    def give_back(self, buffers: list[Any]) -> None:
        free = self._free()
        for b in buffers:
            if isinstance(b, np.ndarray):
                free.append(b.base if b.base is not None else b)
        free.sort(key=lambda b: b.size)
        kept, total = 0, 0
        while kept < min(len(free), self.KEEP) and total + free[kept].size <= self.KEEP_BYTES:
            total += free[kept].size
            kept += 1
        del free[kept:]


_SCRATCH = _ScratchPool()


class Pipeline:
    """The staged algorithm for one call; phases are separate methods so the
    perf tools can time encode, communication and decode on their own."""

    def __init__(self, comm: Communicator, codec: Codec, layout: Layout,
                 source: np.ndarray, result: np.ndarray, result_offset: int, gather: bool):
        self.comm, self.codec, self.layout = comm, codec, layout
        self.source, self.result = source, result
        self.result_offset = result_offset  # absolute index of result[0]
        self.gather = gather
        self.open: list[Request] = []
        n, me = comm.size, comm.rank
        xp = array_module(source)
        wire = codec.wire_size
        mine = wire(layout.piece)
        every = [wire(min(layout.piece, int(b - a))) for a, b in
                 zip(layout.bounds[:-1], layout.bounds[1:], strict=True)]
        # two stages in flight at most per phase: double buffers
        self.a2a_send = [_SCRATCH.take(xp, sum(every)) for _ in range(2)]
        self.a2a_recv = [_SCRATCH.take(xp, n * mine) for _ in range(2)]
        self.ag_send = [_SCRATCH.take(xp, mine) for _ in range(2)]
        self.ag_recv = [_SCRATCH.take(xp, sum(every)) for _ in range(2)]
        self.me = me
        self.a2a_req: dict[int, Request] = {}
        self.ag_req: dict[int, Request] = {}

    # -- helpers ------------------------------------------------------------
    def _progress(self) -> None:
        self.open = [r for r in self.open if not r.test()]

    def _stage_sizes(self, stage: int) -> list[int]:
        """Wire bytes of every shard's piece in ``stage``."""
        ranges = (self.layout.piece_range(j, stage) for j in range(self.comm.size))
        return [self.codec.wire_size(hi - lo) for lo, hi in ranges]

    def _local(self, lo: int, hi: int) -> np.ndarray:
        return self.result[lo - self.result_offset: hi - self.result_offset]

    # -- phases ---------------------------------------------------------------
    def _a2a_sizes(self, s: int) -> tuple[list[int], list[int]]:
        """Wire bytes this rank sends to and receives from each rank in stage
        ``s``'s all-to-all: its piece of every other shard, and every other
        rank's piece of its own shard; nothing to itself (its own piece enters
        the sum unquantized)."""
        sizes = self._stage_sizes(s)
        mine = sizes[self.me]
        sizes[self.me] = 0
        return sizes, [0 if i == self.me else mine for i in range(self.comm.size)]

    def encode_stage(self, s: int) -> None:
        counts, displs = _segments(self._a2a_sizes(s)[0])
        buf = self.a2a_send[s % 2]
        for j in range(self.comm.size):
            if j != self.me:
                lo, hi = self.layout.piece_range(j, s)
                self.codec.encode_wire(self.source[lo:hi],
                                       buf[displs[j]: displs[j] + counts[j]])
                self._progress()

    def start_alltoall(self, s: int) -> None:
        send_sizes, recv_sizes = self._a2a_sizes(s)
        send_counts, send_displs = _segments(send_sizes)
        recv_counts, recv_displs = _segments(recv_sizes)
        req = self.comm.alltoallv(self.a2a_send[s % 2], send_counts, send_displs,
                                  self.a2a_recv[s % 2], recv_counts, recv_displs)
        self.a2a_req[s] = req
        self.open.append(req)

    def reduce_stage(self, s: int) -> None:
        """My piece of my shard (exact), then the other ranks' decoded pieces in
        rank order, summed in fp32 into result. Own piece first: out may alias
        the source, and the order must not depend on that."""
        wait(self.a2a_req.pop(s), f"the all-to-all of stage {s}", self.me)
        lo, hi = self.layout.piece_range(self.me, s)
        acc = self._local(lo, hi)
        acc[...] = self.source[lo:hi]
        seg = self.codec.wire_size(hi - lo)
        buf = self.a2a_recv[s % 2]
        offset = 0
        for i in range(self.comm.size):
            if i != self.me:
                self.codec.decode_wire(buf[offset: offset + seg], acc, accumulate=True)
                offset += seg
                self._progress()

    def reencode_stage(self, s: int) -> None:
        """Encode my reduced piece for the all-gather (the second quantization)."""
        lo, hi = self.layout.piece_range(self.me, s)
        self.codec.encode_wire(self._local(lo, hi), self.ag_send[s % 2])
        self._progress()

    def start_allgather(self, s: int) -> None:
        sizes = self._stage_sizes(s)
        counts, displs = _segments(sizes)
        send = self.ag_send[s % 2][: sizes[self.me]]
        req = self.comm.allgatherv(send, self.ag_recv[s % 2], counts, displs)
        self.ag_req[s] = req
        self.open.append(req)

    def decode_stage(self, s: int) -> None:
        wait(self.ag_req.pop(s), f"the all-gather of stage {s}", self.me)
        counts, displs = _segments(self._stage_sizes(s))
        buf = self.ag_recv[s % 2]
        for j in range(self.comm.size):
            lo, hi = self.layout.piece_range(j, s)
            self.codec.decode_wire(buf[displs[j]: displs[j] + counts[j]], self._local(lo, hi))
            self._progress()

    def run(self) -> None:
        stages = self.layout.stages
        for s in range(stages + 2):
            if s < stages:
                self.encode_stage(s)
                self.start_alltoall(s)
            if 1 <= s <= stages:
                self.reduce_stage(s - 1)
                if self.gather:
                    self.reencode_stage(s - 1)
                    self.start_allgather(s - 1)
            if self.gather and s >= 2:
                self.decode_stage(s - 2)
        # every request has completed (each phase waited on its own)
        _SCRATCH.give_back(self.a2a_send + self.a2a_recv + self.ag_send + self.ag_recv)


# ---------------------------------------------------------------------------
# argument handling


def _as_float32(x: Any) -> Any:
    """Flat contiguous float32 values of x (a copy unless x already is one)."""
    return array_module(x).ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _check_out(out: Any, x: Any) -> None:
    if out is None:
        return
    shape, dtype = x.shape, x.dtype
    if type(out) is not type(x):
        raise TypeError(f"out must be an array like x ({type(x).__name__}), "
                        f"got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out is {out.dtype}{list(out.shape)}, expected {dtype}{list(shape)}")
    if not getattr(out.flags, "writeable", True):
        raise ValueError("out is read-only")


def _fingerprint(kind: str, count: int, dtype: np.dtype, op: str, codec: Codec,
                 key: str | None) -> np.ndarray:
    config = json.dumps(codec.get_config(), sort_keys=True).encode()
    state = getattr(codec, "state_checksum", None)  # stateful codecs: per-key geometry
    return np.array([
        zlib.crc32(kind.encode()), count, DTYPE_CODES[dtype], OPS.index(op),
        zlib.crc32(config), zlib.crc32((key or "").encode()),
        state(key) if state is not None and key is not None else 0,
    ], dtype=np.int64)


_FIELDS = ("collective", "count", "dtype", "op", "codec config", "key", "codec state")


def check_consistent(comm: Communicator, kind: str, count: int, dtype: np.dtype, op: str,
                     codec: Codec, key: str | None) -> None:
    """Raise CollectiveMismatchError on every rank if the ranks' calls differ."""
    rows = comm.allgather_int64(_fingerprint(kind, count, dtype, op, codec, key))
    bad = np.nonzero((rows != rows[0]).any(axis=1))[0]
    if bad.size:
        diffs = [_FIELDS[f] for f in np.nonzero(rows[bad[0]] != rows[0])[0]]
        detail = ", ".join(f"rank {r}: count={rows[r, 1]}" for r in range(comm.size))
        raise CollectiveMismatchError(
            f"geocomm.{kind}: ranks {bad.tolist()} differ from rank 0 in {', '.join(diffs)} "
            f"({detail}); every rank must pass the same count, dtype, op, codec and key, and "
            "stateful codecs must hold the same state"
        )


def _check_enabled(check: bool | None) -> bool:
    if check is not None:
        return check
    return os.environ.get("GEOCOMM_CHECK", "1") not in ("0", "false", "no")


def _prepare(x: Any, op: str, codec: Any, comm: Communicator | None) -> tuple[
        np.ndarray, Codec, Communicator]:
    x = _check_array(x)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    codec = resolve_codec(codec)
    if x.dtype == np.float64 and not codec.lossless:
        raise TypeError(
            "float64 arrays are not compressed (the formats start from float32); cast to "
            "float32 first or use codec='none' for an exact float64 reduction"
        )
    select = getattr(codec, "select", None)  # codec="auto": by message size
    if select is not None:
        codec = select(x.size)
    return x, codec, get_comm(comm)


def _host_only(codec: Codec, source: Any) -> None:
    if array_module(source) is not np:
        raise TypeError(f"codec {codec.codec_id!r} transforms on the host (NumPy); on CuPy "
                        "arrays use fp8/nvfp4/bf16, or the MPI backend, which stages through "
                        "host memory")


def _begin(codec: Codec, source: Any, key: str | None, comm: Communicator) -> Any:
    """The codec's transform plan (None for stateless codecs)."""
    if type(codec).begin is Codec.begin:
        return None
    _host_only(codec, source)
    return codec.begin(source, key, lambda v: ordered_sum(comm, v))


def ordered_sum(comm: Communicator, values: np.ndarray) -> np.ndarray:
    """Elementwise float32 sum over ranks, added in rank order: bitwise identical
    on every rank (unlike MPI_Allreduce, whose order may differ per rank)."""
    flat = np.ascontiguousarray(values, np.float32).reshape(-1)
    nbytes = flat.nbytes
    gathered = np.empty(comm.size * nbytes, np.uint8)
    counts, displs = _segments([nbytes] * comm.size)
    wait(comm.allgatherv(flat.view(np.uint8), gathered, counts, displs),
         "a geometry all-reduce", comm.rank)
    rows = gathered.view(np.float32).reshape(comm.size, -1)
    total = rows[0].copy()
    for row in rows[1:]:
        total += row
    return total.reshape(np.shape(values))


# ---------------------------------------------------------------------------
# public collectives


def allreduce(x: np.ndarray, codec: Any = None, op: str = "sum", out: np.ndarray | None = None,
              *, key: str | None = None, comm: Communicator | None = None,
              chunk_elems: int | None = None, check: bool | None = None) -> np.ndarray:
    """All-reduce ``x`` over the ranks of ``comm`` through ``codec``.

    x: float32, float16, bfloat16 (ml_dtypes) or, with ``codec="none"``,
    float64 numpy array; any shape and strides. Returns an array of x's dtype
    and shape (``out`` if given, which may be x itself). ``op``: "sum" or
    "avg". ``key`` names the tensor for stateful codecs (GeoFP8). Results are
    bitwise identical on every rank.
    """
    x, codec, comm = _prepare(x, op, codec, comm)
    _check_out(out, x)
    xp = array_module(x)
    if _check_enabled(check):
        check_consistent(comm, "allreduce", x.size, x.dtype, op, codec, key)
    if codec.lossless:
        work = xp.ascontiguousarray(x, np.float64 if x.dtype == np.float64 else np.float32)
        # MPI/NCCL need distinct send and receive buffers
        total = _direct_result(out, work.dtype, work, same_ok=False)
        if total is None:
            total = xp.empty_like(work)
        comm.allreduce(work, total, "sum")
    else:
        source = _as_float32(x)
        plan = _begin(codec, source.reshape(x.shape), key, comm)
        if plan is not None:
            source = np.ascontiguousarray(plan.forward(source), np.float32)
        # the pipeline only writes ranges it has already encoded, so out may be x
        total = _direct_result(out, np.float32, source, same_ok=True) if plan is None else None
        if total is None:
            total = xp.empty(x.size, np.float32)
        layout = Layout.plan(x.size, comm.size, chunk_elems or DEFAULT_CHUNK_ELEMS)
        Pipeline(comm, codec, layout, source, total, 0, gather=True).run()
        if plan is not None:
            total = np.ascontiguousarray(plan.inverse(total), np.float32)
        codec.end(key, plan, total)
    if op == "avg":
        total /= total.dtype.type(comm.size)
    result = total.reshape(x.shape)
    if out is None:
        return result.astype(x.dtype, copy=False)
    if not _same_memory(out, result):
        out[...] = result
    return out


def _direct_result(out: Any, dtype: Any, source: Any, same_ok: bool) -> Any:
    """A flat view of ``out`` to reduce into, when out is C-contiguous, of
    ``dtype``, and either apart from ``source`` or (``same_ok``) exactly the
    same memory; else None (reduce into scratch and copy)."""
    if out is None or out.dtype != dtype or not out.flags.c_contiguous or out.size == 0:
        return None
    if array_module(out).may_share_memory(out, source) and not (
            same_ok and _same_memory(out, source)):
        return None
    return out.reshape(-1)


def _same_memory(a: Any, b: Any) -> bool:
    """Whether a and b view the same contiguous memory (nothing to copy)."""
    if a.size == 0:
        return True
    ptr = (lambda v: v.data.ptr) if type(a).__module__.startswith("cupy") else \
        (lambda v: v.__array_interface__["data"][0])
    return ptr(a) == ptr(b) and a.nbytes == b.nbytes and b.flags.c_contiguous \
        and a.flags.c_contiguous


def reduce_scatter(x: np.ndarray, codec: Any = None, op: str = "sum", *,
                   key: str | None = None, comm: Communicator | None = None,
                   chunk_elems: int | None = None, check: bool | None = None) -> np.ndarray:
    """This rank's shard of the reduced flat ``x`` (``np.array_split`` convention).

    Each rank's pieces are quantized once on the way to the owner, who sums
    them in fp32 and returns that sum (no second quantization). Returns a 1-D
    array of x's dtype.
    """
    x, codec, comm = _prepare(x, op, codec, comm)
    if _check_enabled(check):
        check_consistent(comm, "reduce_scatter", x.size, x.dtype, op, codec, key)
    bounds = shard_bounds(x.size, comm.size)
    lo, hi = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
    xp = array_module(x)
    if codec.lossless:
        work = xp.ascontiguousarray(x, np.float64 if x.dtype == np.float64 else np.float32)
        total = xp.empty_like(work)
        comm.allreduce(work.reshape(-1), total.reshape(-1), "sum")
        shard = total.reshape(-1)[lo:hi].copy()
    else:
        source = _as_float32(x)
        begin_shards = getattr(codec, "begin_shards", None)
        plan = None
        if begin_shards is not None:
            _host_only(codec, source)
            plan = begin_shards(source.reshape(x.shape), key, lambda v: ordered_sum(comm, v),
                                bounds)
        if plan is not None:
            source = np.ascontiguousarray(plan.forward(source), np.float32)
        shard = xp.empty(hi - lo, np.float32)
        layout = Layout.plan(x.size, comm.size, chunk_elems or DEFAULT_CHUNK_ELEMS)
        Pipeline(comm, codec, layout, source, shard, lo, gather=False).run()
        if plan is not None:
            shard = np.ascontiguousarray(plan.inverse_range(shard, lo, hi), np.float32)
    if op == "avg":
        shard /= shard.dtype.type(comm.size)
    return shard.astype(x.dtype, copy=False)


def allgather(x: np.ndarray, codec: Any = None, *, comm: Communicator | None = None,
              check: bool | None = None) -> np.ndarray:
    """Stack every rank's ``x`` (same shape on all ranks): shape ``(size, *x.shape)``.

    Each rank encodes its own array once; every rank decodes all of them from
    the same bytes, so the result is identical everywhere.
    """
    x, codec, comm = _prepare(x, "sum", codec, comm)
    if _check_enabled(check):
        check_consistent(comm, "allgather", x.size, x.dtype, "sum", codec, None)
    xp = array_module(x)
    if x.dtype == np.float64:  # lossless codec only (checked in _prepare)
        send = xp.ascontiguousarray(x, np.float64).reshape(-1).view(np.uint8)
        recv = xp.empty(comm.size * send.size, np.uint8)
        counts, displs = _segments([send.size] * comm.size)
        wait(comm.allgatherv(send, recv, counts, displs), "an all-gather", comm.rank)
        return recv.view(np.float64).reshape((comm.size, *x.shape))
    seg = codec.wire_size(x.size)
    send = xp.empty(seg, np.uint8)
    codec.encode_wire(_as_float32(x), send)
    recv = xp.empty(comm.size * seg, np.uint8)
    counts, displs = _segments([seg] * comm.size)
    wait(comm.allgatherv(send, recv, counts, displs), "an all-gather", comm.rank)
    values = xp.empty((comm.size, x.size), np.float32)
    for j in range(comm.size):
        codec.decode_wire(recv[j * seg: (j + 1) * seg], values[j])
    return values.reshape((comm.size, *x.shape)).astype(x.dtype, copy=False)
