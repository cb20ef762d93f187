"""The device pipeline: CuPy arrays over NCCL: batched kernels, waits ordered on
streams (docs/design.md, "The collective").

The host-driven :class:`~geocomm.engine.host.Pipeline` launches a few kernels per
piece and waits for every transfer from Python. :class:`BatchedPipeline` runs
the same algorithm, with the same bits, as one launch per phase and stage:

* **segment tables** (:mod:`geocomm.engine.device_tables`): every launch covers
  the pieces of one table, a row of ``len(FIELDS)`` uint64 per piece (where
  its values and wire body lie, its stochastic-rounding index, its scale
  layout; ``native/gc_pipeline.cu`` documents the fields). :func:`call_tables`
  builds the rows of every stage of a call on the host, a pure function of the
  pieces, the rank and the format; one upload per call.
* **per stage**: one launch encodes this rank's pieces of the other ``N - 1``
  shards (two for fp8 walked by tiles, block 0 or above TEAM_MAX: amax, then
  codes); one grouped all-to-all; one launch adds the owner's piece and the
  ``N - 1`` received bodies in rank order (own piece first) and encodes the
  sum, without storing it (``gc_pipe_reduce`` stores it instead for
  reduce-scatter and for calls with a map, which needs the sum); one grouped
  all-gather (an all-to-all whose rank sends its own body, encoded in place
  in the receive buffer, to every other rank); one launch decodes every
  piece. Stochastic rounding draws as the host path does: this rank's rounding
  stream 1 for its pieces of other shards, stream 2 for its own sum, at each value's
  global index.
* **streams**: kernels run on the caller's current stream, NCCL on the
  communicator's. A grouped NCCL call first makes its stream wait for an
  event recorded on the current stream (the encode that filled what it sends,
  and every read of what it will overwrite: stages double-buffer, so stage
  ``s + 2`` reuses stage ``s``'s buffers after the current stream finished with
  them); the phase that reads what arrived makes the current stream wait for
  the event recorded after the transfer (``cudaStreamWaitEvent``). The host
  never waits: the call returns with its work queued on the current stream,
  like any CuPy operation, and the scratch goes back to CuPy's pool, which
  hands it out again only on the current stream, after those waits.
  What a ``GEOCOMM_TIMEOUT`` bounds then is said in :mod:`geocomm.comm.nccl`.

A transforming codec's map (``mapper``) runs per piece, in order: ``read``
of the stage's pieces into a staging buffer, the batched encode, then
``encoded`` per piece; ``done`` per piece after the batched decode. The
owner's mapped piece and the received bodies are encoded as they are added
up, unless the map tracks what was encoded (error feedback: it needs the
sum). A piece inside one tensor with a split map (GeoFP8's, fp8 teams) is
mapped by the kernels themselves, one launch per piece: the encoder reads
the source and quantizes x - A V^T, the decoder adds (sum_i A_i) V^T to
what it decodes (``RangeMap.split``; native/gc_pipeline.cu, gc_split).

:class:`CudaKernels` launches the kernels; :class:`HostKernels` runs the same
contract per piece through the C core on NumPy arrays: the reference the CUDA
kernels must equal byte for byte (perf/gpu_check.py compares them), and with
NumPy arrays the whole batched pipeline runs on a CPU for the tests.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import numpy as np

from geocomm.codecs.formats import Split
from geocomm.codecs.geo import kernels as geo_kernels
from geocomm.comm.base import Communicator
from geocomm.engine.arithmetic import divide
from geocomm.engine.device_tables import (
    BF16,
    BLOCK,
    COUNT,
    INDEX,
    MXFP4,
    MXFP8,
    NVFP4,
    NVFP4_THREADS,
    RAW,
    SCALES,
    TILES,
    VALUES,
    WIRE,
    Exchange,
    StageTables,
    WireFormat,
    body_layout,
    call_tables,
    decode_walk,
    encode_walk,
    launch_grid,
)
from geocomm.engine.graphs import Graphs
from geocomm.engine.layout import (
    PieceAccess,
    Pieces,
    array_module,
    quantization_stream,
    run_schedule,
)
from geocomm.engine.protocols import RangeMap
from geocomm.kernels import cuda, cuda_build, native

_SOURCE = "gc_pipeline.cu"
_INCLUDE_LINES = ('#include "gc_cuda.cu"', '#include "gc_linalg.h"')


# ---------------------------------------------------------------------------
# kernels


class Segments:
    """A segment table: host rows (for the grids), the device copy the kernels read, and
    the launch grid of each walk over them, computed once."""

    __slots__ = ("device", "grids", "rows", "singles")

    def __init__(self, rows: np.ndarray, device: Any):
        self.rows, self.device = rows, device
        self.grids: dict[tuple[str, int], tuple[int, int] | None] = {}
        self.singles: dict[int, Segments] = {}

    def row(self, i: int) -> Segments:
        """The one-row table of row ``i`` (a view of this one's device copy), made once."""
        single = self.singles.get(i)
        if single is None:
            single = self.singles[i] = Segments(self.rows[i : i + 1], self.device[i : i + 1])
        return single

    def grid(self, walk: str, fmt: WireFormat) -> tuple[int, int] | None:
        """:func:`launch_grid` of ``walk`` over these rows (None: no value to launch for)."""
        key = (walk, fmt.block)
        if key not in self.grids:
            self.grids[key] = launch_grid(walk, self.rows, fmt)
        return self.grids[key]


class Incoming(NamedTuple):
    """``count`` wire bodies, one every ``stride`` bytes of ``wire``, that an encoder adds
    (in order) to its piece's values: what the all-to-all brought to the owner."""

    wire: Any
    count: int  # type: ignore[assignment]  # a field, shadowing tuple.count on purpose
    stride: int


@functools.cache
def kernel_source() -> str:
    """gc_pipeline.cu with gc_cuda.cu (and gc_scalar.h) and gc_linalg.h inlined: one
    NVRTC unit."""
    directory = cuda_build.source_dir()
    text = (directory / _SOURCE).read_text()
    for line in _INCLUDE_LINES:
        if line not in text:
            raise RuntimeError(f"{_SOURCE} does not contain the line {line!r}")
    linalg = (directory / "gc_linalg.h").read_text().replace('#include "gc_scalar.h"', "", 1)
    text = text.replace(_INCLUDE_LINES[0], cuda.kernel_source(), 1)
    return text.replace(_INCLUDE_LINES[1], linalg, 1)


def _u64(v: int) -> np.uint64:
    result: np.uint64 = np.uint64(v)
    return result


def _check_split(split: Split | None, walk: str) -> None:
    """Only the fp8 team kernels run a split map (the contract of both kernel classes)."""
    if split is not None and walk != "team":
        raise ValueError(f"only the fp8 team kernels run a split map, not the {walk} walk")


def _split_args(split: Split) -> tuple[Any, ...]:
    """The split kernels' last arguments (native/gc_pipeline.cu, gc_split): t0, n, k,
    the coefficients of the rows from t0 / n on, the basis."""
    coef, vt = split.coef, split.vt
    k = vt.shape[0]
    if not (
        coef.dtype == vt.dtype == np.float32
        and coef.flags.c_contiguous
        and vt.flags.c_contiguous
        and coef.ndim == vt.ndim == 2
        and coef.shape[1] == k
        and vt.shape[1] == split.n
    ):
        raise ValueError(
            "a split map needs C-contiguous float32 coefficients (rows, k) and basis (k, n), "
            f"got {coef.dtype} {coef.shape} and {vt.dtype} {vt.shape} for n={split.n}"
        )
    return (_u64(split.lo), _u64(split.n), _u64(k), coef, vt)


class CudaKernels:
    """The launches of native/gc_pipeline.cu on the current stream (CuPy arrays).

    ``encode`` encodes every piece of ``seg`` (plus ``incoming``) into ``wire``
    with rounding stream ``rounding_stream``, whose key the kernels read from ``key``
    (a device array of one uint64 holding ``fmt.key(rounding_stream)``; None: a new
    one); ``reduce`` writes the sums as fp32 into ``out``; ``decode`` decodes every
    piece into ``out``. ``amax``: a zeroed uint32 scratch with the slots the rows name
    (fp8 tile walk only). ``split`` (fp8 teams, a one-row ``seg``): the piece's split
    map (:class:`~geocomm.codecs.formats.Split`), which ``encode`` applies to the
    values before anything is added and ``decode`` to the decoded values, in the same
    pass. The values read and written move with the call's arrays
    (:func:`geocomm.kernels.cuda.moved`: a CUDA graph of a call serves calls on other
    arrays).
    """

    def __init__(self) -> None:
        self.cupy = cuda.require()

    def _kernel(self, name: str) -> Any:
        return cuda_build.kernel(self.cupy, name, kernel_source)

    def encode(self, fmt: WireFormat, x: Any, seg: Segments, wire: Any, amax: Any,
               incoming: Incoming | None = None, rounding_stream: int = 0,
               key: Any = None, split: Split | None = None) -> None:  # fmt: skip
        walk = encode_walk(fmt)
        _check_split(split, walk)
        grid = seg.grid(walk, fmt)
        if grid is None:
            return
        inc = incoming or Incoming(wire, 0, 0)  # a valid pointer the kernel never reads
        head = (x, cuda.moved(x), seg.device, inc.wire, np.uint32(inc.count), _u64(inc.stride))
        if not fmt.stochastic:
            key = seg.device  # a valid pointer the kernels never read
        elif key is None:
            key = self.cupy.asarray([fmt.key(rounding_stream)], dtype=np.uint64)
        rounding = (np.int32(fmt.stochastic), key, wire)
        e5m2, rceil = np.int32(fmt.e5m2), np.int32(fmt.rceil)
        threads = (cuda.THREADS,)
        if fmt.family in (RAW, BF16):
            self._kernel("gc_pipe_value_encode")(
                grid, threads, (np.int32(fmt.family), *head, *rounding)
            )
        elif fmt.family == NVFP4:
            self._kernel("gc_pipe_nvfp4_encode")(grid, (NVFP4_THREADS,), (*head, *rounding))
        elif fmt.family == MXFP4:
            self._kernel("gc_pipe_mxfp4_encode")(grid, threads, (*head, rceil, *rounding))
        elif fmt.family == MXFP8:  # the "mx" walk
            self._kernel("gc_pipe_mxfp8_encode")(grid, threads, (*head, e5m2, rceil, *rounding))
        elif walk == "team":
            name = cuda.team_kernel("gc_pipe_fp8_encode_team", fmt.block)
            args = (*head, np.uint32(cuda.team_shift(fmt.block)), e5m2, *rounding)
            if split is not None:
                name, args = name + "_split", (*args, *_split_args(split))
            self._kernel(name)(grid, threads, args)
        else:
            tile = _u64(cuda.TILE)
            self._kernel("gc_pipe_amax_tiles")(grid, threads, (*head, e5m2, tile, amax))
            self._kernel("gc_pipe_fp8_encode_tiles")(
                grid, threads, (*head, e5m2, tile, amax, *rounding)
            )

    def set_call(self, slots: Any, keys: tuple[int, int], source: Any, result: Any,
                 origin: tuple[int, int]) -> None:  # fmt: skip
        """In stream order: ``slots[0:2]`` = ``keys`` (a call's stochastic-rounding keys),
        ``slots[2:4]`` = how far ``source`` and ``result`` lie from ``origin`` (the
        addresses the kernels about to run were given: their ``moved``)."""
        self._kernel("gc_pipe_set_call")(
            (1,), (32,),
            (slots, _u64(keys[0]), _u64(keys[1]), source, _u64(origin[0]), result,
             _u64(origin[1])),
        )  # fmt: skip

    def reduce(self, fmt: WireFormat, x: Any, seg: Segments, incoming: Incoming, out: Any) -> None:
        grid = seg.grid("quad", fmt)
        if grid is not None:
            self._kernel("gc_pipe_reduce")(
                grid,
                (cuda.THREADS,),
                (
                    np.int32(fmt.family),
                    np.int32(fmt.e5m2),
                    x,
                    cuda.moved(x),
                    seg.device,
                    incoming.wire,
                    np.uint32(incoming.count),
                    _u64(incoming.stride),
                    out,
                    cuda.moved(out, writes=True),
                ),
            )

    def decode(
        self, fmt: WireFormat, wire: Any, seg: Segments, out: Any, split: Split | None = None
    ) -> None:
        walk = decode_walk(fmt)
        _check_split(split, walk)
        grid = seg.grid(walk, fmt)
        if grid is None:
            return
        e5m2, place = np.int32(fmt.e5m2), (out, cuda.moved(out, writes=True))
        if walk == "chunk":
            self._kernel("gc_pipe_e2m1_decode")(
                grid, (cuda.THREADS,), (np.int32(fmt.family == MXFP4), wire, seg.device, *place)
            )
        elif walk == "quad":
            self._kernel("gc_pipe_decode")(
                grid, (cuda.THREADS,), (np.int32(fmt.family), e5m2, wire, seg.device, *place)
            )
        elif walk == "team":
            args = (wire, seg.device, np.uint32(cuda.team_shift(fmt.block)), e5m2, *place)
            if split is None:
                self._kernel("gc_pipe_fp8_decode_team")(grid, (cuda.THREADS,), args)
            else:
                self._kernel("gc_pipe_fp8_decode_team_split")(
                    grid, (cuda.THREADS,), (*args, *_split_args(split))
                )
        else:
            self._kernel("gc_pipe_fp8_decode_tiles")(
                grid, (cuda.THREADS,), (wire, seg.device, _u64(cuda.TILE), e5m2, *place)
            )


class HostKernels:
    """The kernels' contract run piece by piece by the C core on NumPy arrays: the
    bytes and values :class:`CudaKernels` must produce. Every row's layout columns
    are checked against :func:`body_layout` (a wrong table fails loudly here). The C
    core takes the rounding stream itself: ``key`` goes unused."""

    def _pieces(self, fmt: WireFormat, seg: Segments) -> Any:
        for row in seg.rows.astype(np.int64):
            n = int(row[COUNT])
            if (int(row[SCALES]), int(row[BLOCK]), int(row[TILES])) != body_layout(fmt, n):
                raise ValueError(
                    f"segment row {row.tolist()} disagrees with the layout of "
                    f"{n} values: {body_layout(fmt, n)}"
                )
            if n:
                yield int(row[VALUES]), n, int(row[WIRE]), int(row[INDEX])

    def _sum(
        self,
        fmt: WireFormat,
        values: np.ndarray,
        incoming: Incoming | None,
        split: Split | None = None,
    ) -> np.ndarray:
        total = values.astype(np.float32, copy=True)
        if split is not None:  # the map first, then the bodies (as the kernels do)
            geo_kernels.expand(values, split.lo, split.n, split.coef, split.vt, -1.0, total)
        if incoming is not None:
            size = fmt.wire_size(total.size)
            for r in range(incoming.count):
                body = incoming.wire[r * incoming.stride : r * incoming.stride + size]
                self._decode_body(fmt, body, total, accumulate=True)
        return total

    def _decode_body(
        self, fmt: WireFormat, body: np.ndarray, out: np.ndarray, accumulate: bool = False
    ) -> None:
        if fmt.family == RAW:
            values = body[: 4 * out.size].view("<f4")
            if not accumulate:
                out[...] = values
                return
            with np.errstate(invalid="ignore"):  # inf - inf is a NaN like any other
                out += values
            native.gpu_nans(out)
        else:
            native.decode(fmt.native_id, body, fmt.block, out, accumulate)

    def encode(
        self,
        fmt: WireFormat,
        x: np.ndarray,
        seg: Segments,
        wire: np.ndarray,
        amax: Any,
        incoming: Incoming | None = None,
        rounding_stream: int = 0,
        key: Any = None,
        split: Split | None = None,
    ) -> None:
        _check_split(split, encode_walk(fmt))
        for values, n, at, index in self._pieces(fmt, seg):
            total = self._sum(fmt, x[values : values + n], incoming, split)
            body = wire[at : at + fmt.wire_size(n)]
            if fmt.family == RAW:
                body[...] = total.view(np.uint8)
            else:
                native.encode(fmt.native_id, total, fmt.block, body, flags=fmt.flags, seed=fmt.seed,
                              rounding_stream=rounding_stream, offset=index)  # fmt: skip

    def set_call(self, slots: np.ndarray, keys: tuple[int, int], source: np.ndarray,
                 result: np.ndarray, origin: tuple[int, int]) -> None:  # fmt: skip
        slots[0:2] = keys  # NumPy calls run where they are: nothing moves

    def reduce(
        self, fmt: WireFormat, x: np.ndarray, seg: Segments, incoming: Incoming, out: np.ndarray
    ) -> None:
        for values, n, _, _ in self._pieces(fmt, seg):
            out[values : values + n] = self._sum(fmt, x[values : values + n], incoming)

    def decode(
        self,
        fmt: WireFormat,
        wire: np.ndarray,
        seg: Segments,
        out: np.ndarray,
        split: Split | None = None,
    ) -> None:
        _check_split(split, decode_walk(fmt))
        for values, n, at, _ in self._pieces(fmt, seg):
            piece = out[values : values + n]
            self._decode_body(fmt, wire[at : at + fmt.wire_size(n)], piece)
            if split is not None:
                geo_kernels.expand(piece, split.lo, split.n, split.coef, split.vt, 1.0, piece)


# ---------------------------------------------------------------------------
# the plan of a call, made once per signature


class StagePlan(NamedTuple):
    """One stage of a :class:`DevicePlan`: its three segment tables and two exchanges."""

    send: Segments
    own: Segments
    gather: Segments
    tables: StageTables


class DevicePlan:
    """Everything the device calls of one signature share, made at its first call.

    The segment tables of every stage (built on the host, uploaded once), the launch
    grids, the kernels' buffers (double-buffered all-to-all and all-gather bodies,
    the staging buffer of mapped calls, the fp8 tile walk's amax slots) and, per
    divisor, the CUDA graph of a call: the signature's first call runs eagerly, its
    second is captured (CuPy stream capture, the NCCL transfers included) and every
    later one replays it with one graph launch
    (:class:`~geocomm.engine.graphs.Graphs`), on every rank alike, as NCCL requires:
    which arrays a call names never decides it. The kernels read and write the
    caller's arrays at the addresses they were captured with plus a shift they read
    from the plan's :attr:`slots`, and a call whose arrays lie elsewhere, or that
    rounds stochastically (new keys every call, read from the slots too), first
    writes them (:meth:`bind`: one launch of one thread, queued on the current
    stream). Graphs need a communicator that can be captured (``capturing()``,
    NCCL's); a call with a map runs eagerly here, and its caller may capture the
    whole mapped call (:func:`geocomm.engine.run.compressed`), with :meth:`prepare`
    outside the graph and :meth:`eager` inside.

    ``kernels``: :class:`CudaKernels` (default) or :class:`HostKernels` (NumPy arrays,
    tests). The plan's buffers are used by one call at a time: a call on another stream
    than the last one first waits for the last one's work, and once the plan is
    dropped the streams its signature's buffers came from wait for the last call's
    (:meth:`__del__`).
    """

    def __init__(
        self,
        comm: Communicator,
        fmt: WireFormat,
        pieces: Pieces,
        result_offset: int,
        gather: bool,
        staged: bool,
        xp: Any,
        kernels: Any = None,
    ):
        self.comm, self.fmt, self.pieces = comm, fmt, pieces
        self.result_offset, self.gather, self.staged = result_offset, gather, staged
        self.xp = xp
        self.kernels = CudaKernels() if kernels is None else kernels
        tables = self.tables = call_tables(fmt, pieces, comm.rank, result_offset, gather, staged)
        self.table = xp.asarray(tables.rows)  # one upload for every stage of every call
        self.stages = [
            StagePlan(self._segments(s.send), self._segments(s.own), self._segments(s.gather), s)
            for s in tables.stages
        ]
        self.a2a_send = [xp.empty(tables.send_bytes, np.uint8) for _ in range(2)]
        self.a2a_recv = [xp.empty(tables.recv_bytes, np.uint8) for _ in range(2)]
        self.ag_buf = [xp.empty(tables.gather_bytes, np.uint8) for _ in range(2)]
        # staged mapped values (None when no piece is staged: then encode reads none)
        self.staging: Any = xp.empty(tables.staged, np.float32) if tables.staged else None
        self.amax = xp.zeros(max(tables.amax, 1), np.uint32)
        #: what a call's kernels read (bind): the stochastic-rounding keys of its two
        #: quantizations and how far its source and result lie from the kernels'
        #: arguments (the bytes they add: gc_moved in native/gc_scalar.h)
        self.slots = xp.zeros(4, np.uint64)
        self.key_views = (self.slots[0:1], self.slots[1:2])
        self._moved: tuple[int, int] | None = (0, 0)  # the shifts the slots hold (None: unknown)
        #: the CUDA graphs of its calls without a map, by divisor
        self.graphs = Graphs(None if staged else comm, xp)
        self._last_stream: Any = None
        #: every stream a call of the plan ran on, by handle: the streams of CuPy's pool
        #: that hold its buffers and those of its signature (:meth:`__del__`)
        self._streams: dict[int, Any] = {}
        if xp is not np:
            home = xp.cuda.get_current_stream()
            self._streams[home.ptr] = home

    def __del__(self) -> None:
        """Dropped (its signature evicted, its communicator gone): every stream its
        signature's buffers came from waits for the work of its last call. CuPy's pool
        hands a freed block out again at once on the stream it was allocated on, and
        that stream's later work is then ordered after what the plan's calls queued on
        the others."""
        last = self._last_stream
        if last is None or all(ptr == last.ptr for ptr in self._streams):
            return
        try:
            event = last.record()
            for ptr, stream in self._streams.items():
                if ptr != last.ptr:
                    stream.wait_event(event)
        except Exception:  # CUDA gone at interpreter exit: nothing to order
            pass

    def _segments(self, span: slice) -> Segments:
        return Segments(self.tables.rows[span], self.table[span])

    def bind(
        self,
        source: Any,
        result: Any,
        rounding_stream: int = 0,
        origin: tuple[int, int] | None = None,
        here: tuple[int, int] | None = None,
    ) -> None:
        """Queue, outside any graph, what a call's kernels read from :attr:`slots`: a
        stochastic call's keys (this rank's quantization stream 1, for its pieces of
        other shards, then 2, its own sum) and how far ``source`` and ``result`` (at
        ``here``: their addresses, if known) lie from ``origin`` (the addresses the
        kernels were given: a graph's; None: these, an eager call). Nothing when the
        slots hold zero shifts and nearest rounding needs no key: steady calls on the
        arrays of their graph's capture queue no launch. (Not when they hold the same
        nonzero shifts: a caller's graph that captured a call rewrites the slots with
        its own, zero, whenever it runs.) A call that the caller's capture of the
        current stream records writes the slots in that graph, and the host no longer
        knows what they hold until the next write."""
        if here is None:
            here = _address(source), _address(result)
        if origin is None or origin == here:
            moved = (0, 0)
        else:
            moved = ((here[0] - origin[0]) % 2**64, (here[1] - origin[1]) % 2**64)
        recorded = (
            origin is None  # only eager bodies run under a caller's capture
            and self.xp is not np
            and self.xp.cuda.get_current_stream().is_capturing()
        )
        if not recorded and not self.fmt.stochastic and moved == self._moved == (0, 0):
            return
        keys = (0, 0)
        if self.fmt.stochastic:
            me, key = self.comm.rank, self.fmt.key
            keys = (
                key(quantization_stream(rounding_stream, me, 1)),
                key(quantization_stream(rounding_stream, me, 2)),
            )
        self.kernels.set_call(self.slots, keys, source, result, origin or here)
        self._moved = None if recorded else moved

    def prepare(self) -> None:
        """What every call queues first, outside any graph: an order after the plan's
        last call when the current stream changed (the buffers are the plan's, not the
        stream's)."""
        if self.xp is not np:
            stream = self.xp.cuda.get_current_stream()
            last = self._last_stream
            if last is not None and last.ptr != stream.ptr:
                stream.wait_event(last.record())
                self._streams.setdefault(stream.ptr, stream)
            self._last_stream = stream

    def moving(self, source: Any, result: Any) -> Any:
        """A context in which kernels read and write ``source`` and ``result`` (and views
        of them) moved by the shifts :meth:`bind` writes
        (:func:`geocomm.kernels.cuda.moving`); nothing moves on NumPy arrays."""
        if self.xp is np:
            return contextlib.nullcontext()
        slots = self.slots
        source_span = (_address(source), _address(source) + source.nbytes, slots[2:3])
        result_span = (_address(result), _address(result) + result.nbytes, slots[3:4])
        return cuda.moving(cuda.Moves(source_span, result_span))

    def eager(
        self,
        source: Any,
        result: Any,
        mapper: RangeMap | None = None,
        rounding_stream: int = 0,
        divisor: int = 0,
    ) -> None:
        """One call's work, queued on the current stream as it comes (after :meth:`prepare`
        and :meth:`bind`), its kernels :meth:`moving` with its arrays."""
        with self.moving(source, result):
            BatchedPipeline.of(self, source, result, mapper, rounding_stream, divisor).run()

    def run(
        self,
        source: Any,
        result: Any,
        mapper: RangeMap | None = None,
        rounding_stream: int = 0,
        divisor: int = 0,
    ) -> None:
        """One call from ``source`` into ``result``, queued on the current stream: a call
        without a map through :attr:`graphs` (keyed by ``divisor``), one with a map
        eagerly. ``divisor``: divide the result by it afterwards (an average; 0: no
        division), in the graph too."""
        self.prepare()
        if mapper is not None or self.graphs.comm is None:
            self.bind(source, result, rounding_stream)
            self.eager(source, result, mapper, rounding_stream, divisor)
            return
        here = (int(source.data.ptr), int(result.data.ptr))  # CuPy arrays: graphs
        self.graphs.run(
            divisor,
            lambda: self.eager(source, result, None, rounding_stream, divisor),
            here=here,
            bind=lambda origin: self.bind(source, result, rounding_stream, origin, here),
        )


def _address(a: Any) -> int:
    """Where an array's first value lies (a CuPy array's device address; 0 on the host,
    where nothing moves)."""
    return int(a.data.ptr) if hasattr(a.data, "ptr") else 0


class BatchedPipeline(PieceAccess):
    """The staged algorithm of :class:`~geocomm.engine.host.Pipeline` (same phases, same
    schedule, :func:`~geocomm.engine.layout.run_schedule`; same bits) with one launch
    per phase and stage and no host waits, over a :class:`DevicePlan`'s tables and
    buffers; see the module docstring. ``fmt``: the codec's :func:`wire_format`;
    ``kernels``: :class:`CudaKernels` for CuPy arrays (default), :class:`HostKernels` for
    NumPy arrays (tests); ``comm``'s requests must offer ``wait_stream()``. Made this
    way it plans its call alone; :meth:`of` runs a call of an existing plan.
    """

    def __init__(
        self,
        comm: Communicator,
        fmt: WireFormat,
        pieces: Pieces,
        source: Any,
        result: Any,
        result_offset: int,
        gather: bool,
        mapper: RangeMap | None = None,
        rounding_stream: int = 0,
        kernels: Any = None,
        plan: DevicePlan | None = None,
        divisor: int = 0,
    ):
        if plan is None:
            xp = array_module(source)
            plan = DevicePlan(
                comm, fmt, pieces, result_offset, gather, mapper is not None, xp, kernels
            )
            plan.bind(source, result, rounding_stream)  # a plan's own calls bind in run()
        self.plan = plan
        self.comm, self.fmt, self.pieces = plan.comm, plan.fmt, plan.pieces
        self.source, self.result, self.mapper = source, result, mapper
        self.result_offset, self.gather = plan.result_offset, plan.gather
        self.me = plan.comm.rank
        self.kernels = plan.kernels
        self.rounding_streams = (
            quantization_stream(rounding_stream, self.me, 1),
            quantization_stream(rounding_stream, self.me, 2),
        )
        # the owner's sum goes straight into its encoding unless something needs it as fp32
        self.fused = plan.gather and (mapper is None or not mapper.tracks_encoding)
        if plan.tables.amax:  # the fp8 tile walk's slots start at zero every call
            plan.amax.fill(0)
        self.a2a_req: dict[int, Any] = {}
        self.ag_req: dict[int, Any] = {}
        self.divisor = divisor

    @classmethod
    def of(
        cls,
        plan: DevicePlan,
        source: Any,
        result: Any,
        mapper: RangeMap | None = None,
        rounding_stream: int = 0,
        divisor: int = 0,
    ) -> BatchedPipeline:
        """A call of ``plan`` from ``source`` into ``result`` (divided by ``divisor`` after
        the last stage, unless 0)."""
        return cls(
            plan.comm, plan.fmt, plan.pieces, source, result, plan.result_offset, plan.gather,
            mapper, rounding_stream, plan=plan, divisor=divisor,
        )  # fmt: skip

    # -- helpers ------------------------------------------------------------
    def _wait(self, requests: dict[int, Any], s: int) -> None:
        """Order the current stream after stage ``s``'s transfer (no host wait)."""
        request = requests.pop(s, None)
        if request is not None:
            request.wait_stream()

    def _exchange(self, send: Any, recv: Any, exchange: Exchange) -> Any:
        if self.comm.size == 1:  # nothing to move: the own piece never travels
            return None
        return self.comm.alltoallv(
            send,
            exchange.send_counts,
            exchange.send_displs,
            recv,
            exchange.recv_counts,
            exchange.recv_displs,
        )

    def _send_pieces(self, s: int) -> list[tuple[int, int]]:
        return [self.pieces.piece_range(j, s) for j in range(self.comm.size) if j != self.me]

    # -- phases ---------------------------------------------------------------
    def _splits(self, ranges: list[tuple[int, int]], back: bool) -> list[Any]:
        """The split map of each range that the kernels run themselves (fp8 teams),
        None where the pipeline maps step by step (:meth:`RangeMap.split`)."""
        if self.mapper is None or encode_walk(self.fmt) != "team":
            return [None] * len(ranges)
        return [self.mapper.split(lo, hi, back) for lo, hi in ranges]

    def encode_stage(self, s: int) -> None:
        plan = self.plan
        seg, wire = plan.stages[s].send, plan.a2a_send[s % 2]
        keyed = {"rounding_stream": self.rounding_streams[0], "key": plan.key_views[0]}
        if self.mapper is None:
            self.kernels.encode(self.fmt, self.source, seg, wire, plan.amax, **keyed)
            return
        # a mapped call: split pieces are mapped by the encoder as it reads them; the
        # others are mapped into their place in the staging buffer first
        ranges = self._send_pieces(s)
        splits = self._splits(ranges, back=False)
        staged = [i for i, split in enumerate(splits) if split is None]
        x = plan.staging
        for i in staged:
            (lo, hi), at = ranges[i], int(seg.rows[i, VALUES])
            self.mapper.read(lo, hi, x[at : at + hi - lo])
        if len(staged) == len(ranges):
            self.kernels.encode(self.fmt, x, seg, wire, plan.amax, **keyed)
        else:
            for i, split in enumerate(splits):
                if split is None:
                    self.kernels.encode(self.fmt, x, seg.row(i), wire, plan.amax, **keyed)
                    continue
                at = int(seg.rows[i, VALUES])  # the row reads x[at:]: the piece's input
                values = self.mapper.values[ranges[i][0] - at :]
                self.kernels.encode(self.fmt, values, seg.row(i), wire, plan.amax, split=split,
                                    **keyed)  # fmt: skip
        for i in staged:
            (lo, hi), row = ranges[i], seg.rows[i]
            at, body = int(row[VALUES]), int(row[WIRE])
            self.mapper.encoded(
                lo, hi, x[at : at + hi - lo], wire[body : body + self.fmt.wire_size(hi - lo)]
            )

    def start_alltoall(self, s: int) -> None:
        plan = self.plan
        exchange = plan.stages[s].tables.alltoall
        request = self._exchange(plan.a2a_send[s % 2], plan.a2a_recv[s % 2], exchange)
        if request is not None:
            self.a2a_req[s] = request

    def reduce_stage(self, s: int) -> None:
        """The owner's piece (exact) plus the N - 1 received bodies in rank order: encoded
        at once (fused), or stored as fp32 in the result (reduce-scatter, maps)."""
        self._wait(self.a2a_req, s)
        plan, stage = self.plan, self.plan.stages[s]
        lo, hi = self.pieces.piece_range(self.me, s)
        split = self._splits([(lo, hi)], back=False)[0] if self.fused else None
        own = self._read(lo, hi) if split is None else self.mapper.values[lo:hi]
        incoming = Incoming(plan.a2a_recv[s % 2], self.comm.size - 1, stage.tables.own_bytes)
        if self.fused:
            self.kernels.encode(
                self.fmt,
                own,
                stage.own,
                plan.ag_buf[s % 2],
                plan.amax,
                incoming,
                rounding_stream=self.rounding_streams[1],
                key=plan.key_views[1],
                split=split,
            )
            return
        self.kernels.reduce(self.fmt, own, stage.own, incoming, self._local(lo, hi))
        if not self.gather:  # reduce-scatter: the owner's sum is final
            self._done(lo, hi)

    def reencode_stage(self, s: int) -> None:
        if self.fused:  # done by reduce_stage
            return
        plan, stage = self.plan, self.plan.stages[s]
        lo, hi = self.pieces.piece_range(self.me, s)
        values = self._local(lo, hi)
        self.kernels.encode(
            self.fmt,
            values,
            stage.own,
            plan.ag_buf[s % 2],
            plan.amax,
            rounding_stream=self.rounding_streams[1],
            key=plan.key_views[1],
        )
        if self.mapper is not None:
            at = int(stage.own.rows[0, WIRE])
            wire = plan.ag_buf[s % 2][at : at + stage.tables.own_bytes]
            self.mapper.encoded(lo, hi, values, wire)

    def start_allgather(self, s: int) -> None:
        buf = self.plan.ag_buf[s % 2]
        request = self._exchange(buf, buf, self.plan.stages[s].tables.allgather)
        if request is not None:
            self.ag_req[s] = request

    def decode_stage(self, s: int) -> None:
        self._wait(self.ag_req, s)
        seg, wire = self.plan.stages[s].gather, self.plan.ag_buf[s % 2]
        ranges = [self.pieces.piece_range(j, s) for j in range(self.comm.size)]
        splits = self._splits(ranges, back=True)
        if not any(split is not None for split in splits):
            self.kernels.decode(self.fmt, wire, seg, self.result)
            for lo, hi in ranges:
                self._done(lo, hi)
            return
        for j, split in enumerate(splits):  # split pieces are mapped back as they decode
            self.kernels.decode(self.fmt, wire, seg.row(j), self.result, split=split)
            if split is None:
                self._done(*ranges[j])

    def release(self) -> None:
        """The average's division, if any. Nothing to give back: the buffers are the
        plan's, and the next call on the current stream is ordered after this one's
        transfers (each phase that reads what a transfer brought waited for it;
        :meth:`DevicePlan.prepare` orders a call on another stream after the last one)."""
        if self.divisor:
            divide(self.result, self.divisor)

    def run(self) -> None:
        run_schedule(self)
