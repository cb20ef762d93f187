"""Where the values of a call go: shards, pieces, the schedule of phases, the
rounding streams and the stage size (docs/design.md, "The collective").

Pure functions of their arguments: every rank computes the same numbers. The
bottom of :mod:`geocomm.engine` with :mod:`geocomm.engine.costs`, which it imports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from geocomm.engine import costs
from geocomm.kernels.native import mix64

#: Values of the whole buffer per pipeline stage (all shards together) on host
#: backends; devices take :func:`stage_size`.
DEFAULT_STAGE_SIZE = costs.HOST_STAGE_SIZE
#: Pieces start at multiples of this many values from their shard's start, so no
#: scaling block is split (fp8's 128, MX's 32, NVFP4's superblocks of 4096 and
#: blocks of 16), and every scale covers the same values whatever stage_size
#: is: the results' bits do not depend on the stage size.
PIECE_ALIGN = 4096


def quantization_stream(call: int, rank: int, quantization: int) -> int:
    """The stochastic-rounding stream of one quantization of a call: ``call`` identifies
    the call (tensor key and call number), then the encoding rank and which of the two
    quantizations; the element index is the counter within the stream."""
    return mix64(mix64(mix64(call) ^ (rank + 1)) ^ quantization)


def shard_bounds(count: int, size: int) -> np.ndarray:
    """Offsets of the ``np.array_split(range(count), size)`` shards (size + 1 values)."""
    q, r = divmod(count, size)
    j = np.arange(size + 1, dtype=np.int64)
    return j * q + np.minimum(j, r)


@dataclass(frozen=True)
class Pieces:
    """Where every piece of every stage lies; identical on every rank.

    The flat buffer is cut into the ``size`` shards of :func:`shard_bounds`,
    each shard into pieces of ``piece`` values; stage ``s`` moves piece ``s``
    of every shard.
    """

    count: int
    size: int
    bounds: np.ndarray
    piece: int
    stages: int

    @classmethod
    def cut(
        cls, count: int, size: int, stage_size: int = DEFAULT_STAGE_SIZE, span: int = 1
    ) -> Pieces:
        """Cut ``count`` values on ``size`` ranks into pieces for stages of about
        ``stage_size`` values of the whole buffer. Each shard's piece is a multiple of
        ``lcm(PIECE_ALIGN, span)`` (``span``: the codec's :meth:`Codec.scale_span`;
        0 makes each shard one piece), so every scale covers the same values whatever
        the stage size, and so do the bits."""
        if stage_size <= 0:
            raise ValueError(f"stage_size must be positive, got {stage_size}")
        if span < 0:
            raise ValueError(f"span must be >= 0, got {span}")
        bounds = shard_bounds(count, size)
        longest = int(np.max(np.diff(bounds))) if count else 0
        if span == 0:
            piece = max(PIECE_ALIGN, longest)
        else:
            unit = math.lcm(PIECE_ALIGN, span)
            per_shard = -(-stage_size // size)
            piece = max(unit, -(-per_shard // unit) * unit)
        return cls(count, size, bounds, piece, -(-longest // piece))

    def piece_range(self, shard: int, stage: int) -> tuple[int, int]:
        """Absolute [lo, hi) of shard ``shard``'s piece in stage ``stage`` (may be empty)."""
        start, end = int(self.bounds[shard]), int(self.bounds[shard + 1])
        lo = min(start + stage * self.piece, end)
        return lo, min(lo + self.piece, end)


@dataclass(frozen=True)
class StageBytes:
    """One stage of a call on one rank: every shard's piece (absolute [lo, hi), in
    rank order), the wire bytes of each, and the counts and displacements of the
    stage's two exchanges, as read-only arrays. The all-to-all sends this rank's
    pieces of the other shards, packed in rank order, and receives the other
    ranks' pieces of its own shard, packed in rank order, nothing to or from
    itself; the all-gather moves every piece, packed in rank order."""

    ranges: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    send_counts: np.ndarray
    send_displs: np.ndarray
    recv_counts: np.ndarray
    recv_displs: np.ndarray
    gather_counts: np.ndarray
    gather_displs: np.ndarray


@dataclass(frozen=True)
class CallBytes:
    """Every stage of a call on one rank, and the largest byte counts any stage has:
    of the all-to-all's send and receive buffers, of this rank's re-encoded piece,
    and of the all-gather's buffer."""

    stages: list[StageBytes]
    send_bytes: int
    recv_bytes: int
    own_bytes: int
    gather_bytes: int


def call_bytes(wire_size: Callable[[int], int], pieces: Pieces, rank: int) -> CallBytes:
    """The stages of a call on ``rank`` whose codec sends ``wire_size(n)`` bytes for n
    values: what the host and the device pipelines derive once per signature."""
    stages = []
    for s in range(pieces.stages):
        ranges = tuple(pieces.piece_range(j, s) for j in range(pieces.size))
        sizes = tuple(wire_size(hi - lo) for lo, hi in ranges)
        mine = sizes[rank]
        send = segments([0 if j == rank else b for j, b in enumerate(sizes)])
        recv = segments([0 if j == rank else mine for j in range(pieces.size)])
        arrays = (*send, *recv, *segments(list(sizes)))
        for array in arrays:  # every call of the signature passes these: none may change
            array.flags.writeable = False
        stages.append(StageBytes(ranges, sizes, *arrays))

    def largest(counts: Callable[[StageBytes], Any]) -> int:
        return max((int(np.sum(counts(t))) for t in stages), default=0)

    return CallBytes(
        stages,
        largest(lambda t: t.send_counts),
        largest(lambda t: t.recv_counts),
        largest(lambda t: t.sizes[rank]),
        largest(lambda t: t.gather_counts),
    )


def stage_size(backend: str | None, count: int, size: int, ratio: float = costs.FP8_RATIO) -> int:
    """Values per pipeline stage (``stage_size``) for ``count`` values on ``size`` ranks
    of ``backend``: measured for host backends, the cost model's for devices
    (:func:`geocomm.engine.costs.stage_size`, whose docstring states the model);
    ``ratio``: the codec's wire bytes per fp32 byte."""
    return costs.stage_size(backend, count, size, ratio)


def wire_bytes(codec: Any, pieces: Pieces, rank: int, gather: bool = True) -> int:
    """Bytes ``rank`` sends in one compressed all-reduce (``gather=False``:
    reduce-scatter): its pieces for the other shards, plus its re-encoded
    reduced pieces, which N - 1 ranks receive. Side channels of stateful
    codecs are not included (their plans report ``side_bytes``)."""
    total = 0
    for s in range(pieces.stages):
        for j in range(pieces.size):
            lo, hi = pieces.piece_range(j, s)
            if j != rank:
                total += codec.wire_size(hi - lo)
            elif gather:
                total += (pieces.size - 1) * codec.wire_size(hi - lo)
    return total


def array_module(array: Any) -> Any:
    """numpy, or cupy for CuPy arrays (the NCCL backend works on the device)."""
    if type(array).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def segments(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(counts, displacements) of consecutive segments of ``sizes`` (int64)."""
    counts = np.asarray(sizes, dtype=np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return counts, displs


def schedule(stages: int, gather: bool) -> Iterator[tuple[str, int]]:
    """The phases of a call in order, as (phase of
    :class:`~geocomm.engine.protocols.Phases`, stage): three stages in flight, so
    stage s is encoded while s - 1's all-to-all and s - 2's all-gather move."""
    for s in range(stages + 2):
        if s < stages:
            yield "encode_stage", s
            yield "start_alltoall", s
        if 1 <= s <= stages:
            yield "reduce_stage", s - 1
            if gather:
                yield "reencode_stage", s - 1
                yield "start_allgather", s - 1
        if gather and s >= 2:
            yield "decode_stage", s - 2


def run_schedule(pipe: Any) -> None:
    """Run every phase of ``pipe`` (a :class:`~geocomm.engine.protocols.Phases`) in
    :func:`schedule`'s order, then ``release`` it: the one schedule the host and the
    device pipelines share."""
    for phase, s in schedule(pipe.pieces.stages, pipe.gather):
        getattr(pipe, phase)(s)
    pipe.release()


class PieceAccess:
    """Where a pipeline reads a piece's values (``source``, or through the call's
    range ``mapper``) and where its result lies (``result``, whose first value has
    index ``result_offset``): what the host and the device pipeline share."""

    source: Any
    result: Any
    result_offset: int
    mapper: Any

    def _local(self, lo: int, hi: int) -> Any:
        return self.result[lo - self.result_offset : hi - self.result_offset]

    def _read(self, lo: int, hi: int) -> Any:
        return self.source[lo:hi] if self.mapper is None else self.mapper.read(lo, hi)

    def _done(self, lo: int, hi: int) -> bool:
        """Hand [lo, hi) of the result, now final, back to the mapper; True if it took it."""
        if self.mapper is None or hi <= lo:
            return False
        self.mapper.done(lo, hi)
        return True
