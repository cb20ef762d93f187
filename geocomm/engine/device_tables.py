"""What the batched GPU pipeline does per stage, planned on the host: pure functions.

:func:`call_tables` turns a call's :class:`~geocomm.engine.layout.Pieces`, the rank
and the codec's :class:`WireFormat` into the segment tables of every stage
(one row of ``FIELDS`` per piece) and the byte exchanges of its two grouped
transfers. Nothing here touches a device, so the tests check every table on
the CPU; :mod:`geocomm.engine.device` uploads and launches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from geocomm.codecs.formats import NoneCodec, sent_codec, split_format
from geocomm.engine.layout import Pieces, call_bytes
from geocomm.engine.protocols import WireCodec
from geocomm.kernels import cuda, native

#: The columns of a segment table (native/gc_pipeline.cu: GC_SEG_<NAME>).
FIELDS = ("values", "count", "wire", "index", "amax", "scales", "block", "tiles")
VALUES, COUNT, WIRE, INDEX, AMAX, SCALES, BLOCK, TILES = range(len(FIELDS))
#: Format families (native/gc_pipeline.cu: GC_PIPE_<NAME>).
RAW, FP8, NVFP4, BF16, MXFP8, MXFP4 = range(6)
#: Threads per superblock of the NVFP4 encoder (GC_NVFP4_THREADS).
NVFP4_THREADS = cuda.NVFP4_THREADS
#: Largest grid y (pieces per launch) and x (thread blocks) of one launch.
GRID_Y_MAX = 65_535
GRID_X_MAX = 2**31 - 1


# ---------------------------------------------------------------------------
# the wire format a codec sends


@dataclass(frozen=True)
class WireFormat:
    """What the batched kernels need to know of a codec's wire bytes.

    ``fmt``: the C core's format id (None for RAW: the lossless codec's fp32
    bytes); ``block``: fp8's scaling block (0: one per body); ``rceil``: MX's
    scale rule; ``stochastic`` and ``seed``: the rounding.
    """

    family: int
    fmt: int | None = None
    e5m2: bool = False
    block: int = 0
    rceil: bool = False
    stochastic: bool = False
    seed: int = 0

    @property
    def native_id(self) -> int:
        """The native format id (``fmt``; the raw fp32 family has none)."""
        if self.fmt is None:
            raise ValueError("the raw fp32 wire has no native format id")
        return self.fmt

    def wire_size(self, n: int) -> int:
        return 4 * n if self.family == RAW else cuda.wire_size(self.native_id, n, self.block)

    @property
    def flags(self) -> int:
        """gc_encode_ex flags of the C core."""
        return (native.STOCHASTIC if self.stochastic else 0) | (native.RCEIL if self.rceil else 0)

    def key(self, rounding_stream: int) -> int:
        """The kernels' stochastic-rounding key of ``rounding_stream`` (0: nearest)."""
        if not self.stochastic:
            return 0
        return native.sr_key(self.seed, rounding_stream)


def wire_format(codec: WireCodec) -> WireFormat | None:
    """The native format ``codec`` sends (wrappers send their wire codec's bytes), or
    None when its bytes are its own (then the host-driven pipeline runs it)."""
    if type(sent_codec(codec)) is NoneCodec:
        return WireFormat(RAW)
    native_format = split_format(codec)
    if native_format is None:
        return None
    name, block, flags = native_format.native_wire()
    fmt = native.format_id(name)
    family = {
        native.E4M3: FP8,
        native.E5M2: FP8,
        native.NVFP4: NVFP4,
        native.BF16: BF16,
        native.MXFP8_E4M3: MXFP8,
        native.MXFP8_E5M2: MXFP8,
        native.MXFP4: MXFP4,
    }[fmt]
    return WireFormat(
        family,
        fmt,
        e5m2=fmt in (native.E5M2, native.MXFP8_E5M2),
        block=block,
        rceil=bool(flags & native.RCEIL),
        stochastic=bool(flags & native.STOCHASTIC),
        seed=native_format.seed,
    )


# ---------------------------------------------------------------------------
# segment tables and launch grids (pure functions of the host numbers)


def team_walk(fmt: WireFormat) -> bool:
    """fp8 with 1 <= block <= TEAM_MAX walks a body by teams of lanes, else by tiles."""
    return 1 <= fmt.block <= cuda.TEAM_MAX


def body_layout(fmt: WireFormat, n: int) -> tuple[int, int, int]:
    """(scales, block, tiles) of a body of ``n`` values: the GC_SEG_SCALES, GC_SEG_BLOCK
    and GC_SEG_TILES of its row. The fp8 tile walk caps the block at n (block 0 is
    one scale for the body), as geocomm.kernels.cuda.fp8_launch does."""
    if n == 0:
        return 0, 0, 0
    if fmt.family == FP8:
        if team_walk(fmt):
            return -(-n // fmt.block), fmt.block, 0
        block = n if fmt.block == 0 or fmt.block > n else fmt.block
        return -(-n // block), block, -(-block // cuda.TILE)
    if fmt.family == NVFP4:
        return -(-n // native.NVFP4_SUPERBLOCK), 0, 0
    if fmt.family in (MXFP8, MXFP4):
        return -(-n // native.MX_BLOCK), 0, 0
    return 0, 0, 0


class Piece(NamedTuple):
    """Where one piece lies: first value (in the launch's values array), count,
    first wire byte (in its wire buffer), global index of its first value."""

    values: int
    count: int  # type: ignore[assignment]  # a field, shadowing tuple.count on purpose
    wire: int
    index: int  # type: ignore[assignment]  # a field, shadowing tuple.index on purpose


def segment_rows(fmt: WireFormat, pieces: list[Piece], amax: int = 0) -> tuple[np.ndarray, int]:
    """The segment table of ``pieces`` and the amax slots after it: the fp8 tile walk
    takes ``scales`` zeroed slots per piece, from ``amax`` on."""
    rows = np.zeros((len(pieces), len(FIELDS)), np.uint64)
    for row, piece in zip(rows, pieces, strict=True):
        scales, block, tiles = body_layout(fmt, piece.count)
        row[:] = (*piece, amax if tiles else 0, scales, block, tiles)
        amax += scales if tiles else 0
    return rows, amax


def encode_walk(fmt: WireFormat) -> str:
    """How the encoder of ``fmt`` walks a piece: one thread per ``quad`` of values (raw
    fp32, bfloat16, MXFP4), an NVFP4 ``superblock`` per thread block, an MXFP8 team of
    8 lanes per block (``mx``), an fp8 ``team`` or ``tile``."""
    if fmt.family == FP8:
        return "team" if team_walk(fmt) else "tile"
    return {NVFP4: "superblock", MXFP8: "mx"}.get(fmt.family, "quad")


def decode_walk(fmt: WireFormat) -> str:
    """How the decoder walks: fp8 as its encoder, NVFP4 and MXFP4 one thread per
    ``chunk`` of 16 values, every other format one thread per ``quad`` of values."""
    if fmt.family == FP8:
        return encode_walk(fmt)
    return "chunk" if fmt.family in (NVFP4, MXFP4) else "quad"


def launch_grid(walk: str, rows: np.ndarray, fmt: WireFormat) -> tuple[int, int] | None:
    """(thread blocks along x, pieces along y) of a launch over ``rows``, or None when
    no piece holds a value. x covers the piece that needs the most."""
    if rows.shape[0] == 0 or not rows[:, COUNT].any():
        return None
    if rows.shape[0] > GRID_Y_MAX:
        raise ValueError(f"{rows.shape[0]} pieces exceed one launch's {GRID_Y_MAX}")
    count, scales = int(rows[:, COUNT].max()), int(rows[:, SCALES].max())
    if walk == "quad":
        quads = -(-count // 4)
        blocks = -(-quads // cuda.THREADS)
    elif walk == "mx":
        blocks = -(-(scales * cuda.MX_LANES) // cuda.THREADS)
    elif walk == "chunk":
        chunks = -(-count // cuda.E2M1_CHUNK)
        blocks = -(-chunks // cuda.THREADS)
    elif walk == "team":
        blocks = -(-(scales << cuda.team_shift(fmt.block)) // cuda.THREADS)
    elif walk == "tile":
        blocks = int((rows[:, SCALES] * rows[:, TILES]).max())
    else:  # superblock
        blocks = scales
    if blocks > GRID_X_MAX:
        raise ValueError(f"{blocks} thread blocks exceed one grid")
    return blocks, rows.shape[0]


@dataclass(frozen=True)
class Exchange:
    """Byte counts and displacements of one all-to-all (Communicator.alltoallv)."""

    send_counts: np.ndarray
    send_displs: np.ndarray
    recv_counts: np.ndarray
    recv_displs: np.ndarray


@dataclass(frozen=True)
class StageTables:
    """One stage: row ranges of the call's table (``send``: this rank's pieces of the
    other shards, in rank order; ``own``: its own piece; ``gather``: every shard's
    piece), the two exchanges, and the byte size of the owner's body (the stride of
    the bodies the all-to-all brings)."""

    send: slice
    own: slice
    gather: slice
    alltoall: Exchange
    allgather: Exchange
    own_bytes: int


@dataclass(frozen=True)
class CallTables:
    """Every stage of a call; ``rows`` is the one table they index (uploaded once).
    Buffer sizes are the largest any stage needs: ``send_bytes``/``recv_bytes`` of the
    all-to-all, ``gather_bytes`` of the all-gather, ``staged`` values of the staging
    buffer (calls with a map), ``amax`` slots of the fp8 tile walk's scratch."""

    rows: np.ndarray
    stages: list[StageTables] = field(repr=False)
    send_bytes: int
    recv_bytes: int
    gather_bytes: int
    staged: int
    amax: int


def call_tables(
    fmt: WireFormat,
    pieces: Pieces,
    rank: int,
    result_offset: int = 0,
    gather: bool = True,
    staged: bool = False,
) -> CallTables:
    """The tables and exchanges of every stage of a call on ``rank``.

    Send rows read values at their absolute index (the source array), or, when
    ``staged``, packed in rank order from 0 (the staging buffer the map's reads
    are copied to); they write the all-to-all's send buffer. The own row reads
    from 0 (the owner's values are passed as their own array) and writes the
    owner's place in the all-gather buffer, where the all-gather sends it from.
    Gather rows read the all-gather buffer and write ``result`` (whose first
    value has index ``result_offset``); reduce-scatter (``gather=False``) has
    none. Pure: identical on every call of the same shape.
    """
    size = pieces.size
    rows: list[np.ndarray] = []
    stages = []
    at = amax = staged_values = 0
    layout = call_bytes(fmt.wire_size, pieces, rank)
    for stage in layout.stages:
        ranges, mine = stage.ranges, stage.sizes[rank]
        send_counts, send_displs = stage.send_counts, stage.send_displs
        recv_counts, recv_displs = stage.recv_counts, stage.recv_displs
        gather_counts, gather_displs = stage.gather_counts, stage.gather_displs
        send, packed = [], 0
        for j, (lo, hi) in enumerate(ranges):
            if j != rank:
                send.append(Piece(packed if staged else lo, hi - lo, int(send_displs[j]), lo))
                packed += hi - lo
        lo, hi = ranges[rank]
        own = [Piece(0, hi - lo, int(gather_displs[rank]), lo)]
        gathered = (
            [
                Piece(a - result_offset, b - a, int(gather_displs[j]), a)
                for j, (a, b) in enumerate(ranges)
            ]
            if gather
            else []
        )
        send_rows, amax = segment_rows(fmt, send, amax)
        own_rows, amax = segment_rows(fmt, own, amax)
        gather_rows, _ = segment_rows(fmt, gathered)
        spans = []
        for table in (send_rows, own_rows, gather_rows):
            rows.append(table)
            spans.append(slice(at, at + table.shape[0]))
            at += table.shape[0]
        others = gather_counts.copy()
        others[rank] = 0
        send_span, own_span, gather_span = spans
        stages.append(
            StageTables(
                send_span,
                own_span,
                gather_span,
                alltoall=Exchange(send_counts, send_displs, recv_counts, recv_displs),
                allgather=Exchange(
                    np.where(np.arange(size) == rank, 0, mine),
                    np.full(size, gather_displs[rank]),
                    others,
                    gather_displs,
                ),
                own_bytes=mine,
            )
        )
        staged_values = max(staged_values, packed if staged else 0)
    table = np.concatenate(rows) if rows else np.zeros((0, len(FIELDS)), np.uint64)
    return CallTables(
        table,
        stages,
        layout.send_bytes,
        layout.recv_bytes,
        layout.gather_bytes,
        staged_values,
        amax,
    )
