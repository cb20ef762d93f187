"""Exact sums over ranks (docs/design.md, "The collective" and "Transforming codecs"):
:func:`exact_sum` is the lossless, rank-ordered sum the side channels of
transforming codecs use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geocomm.codecs.formats import BF16Codec, NoneCodec
from geocomm.comm.base import Communicator, wait_ordered
from geocomm.engine.arithmetic import add_into
from geocomm.engine.layout import array_module, segments, shard_bounds

_PLAIN = NoneCodec()
#: the exact sums' wire formats (a transforming codec's ``side_format``)
_WIRE = {"fp32": _PLAIN, "bf16": BF16Codec()}
#: Bytes of one summed value on the sharded route's all-gather (fp32).
SUM_BYTES = 4
#: An exact sum goes as one all-gather while that sends at most this many bytes per
#: rank more than the sharded route would: about what one more collective phase
#: costs on the slowest link the cost model knows (50 us at 10 Gbit/s,
#: :data:`geocomm.engine.costs.HOST_LINKS`). A constant, so every rank agrees.
GATHER_SLACK_BYTES = 1 << 16


def route_bytes(ranks: int, size: int, wire: int) -> tuple[float, float]:
    """Bytes a rank sends to the others in an exact sum of ``size`` values of ``wire``
    bytes each on ``ranks`` ranks: (gathered, sharded). Gathered: its values to every
    other rank, ``wire * size * (N - 1)``. Sharded: each other shard's values to its
    owner, then its own shard's fp32 sum to every other rank,
    ``(wire + 4) * size * (N - 1) / N``. Gathered sends no more for N <= 1 + 4 / wire
    (bf16: up to 3 ranks; fp32: 2)."""
    others = ranks - 1
    return float(wire * size * others), (wire + SUM_BYTES) * size * others / ranks


def gathers(ranks: int, size: int, wire: int) -> bool:
    """Whether an exact sum of ``size`` values of ``wire`` bytes on ``ranks`` ranks is
    one all-gather (else the sharded route): when that sends at most
    :data:`GATHER_SLACK_BYTES` more per rank (:func:`route_bytes`)."""
    gathered, sharded = route_bytes(ranks, size, wire)
    return gathered - sharded <= GATHER_SLACK_BYTES


def exact_sum(comm: Communicator, values: Any, fmt: str = "fp32") -> Any:
    """Elementwise fp32 sum over ranks, bitwise identical on every rank.

    Every rank's values are added in rank order 0, 1, ..., N - 1, whatever the
    route, so the bits never depend on arrival order, on an MPI reduction's tree
    or on the route. ``fmt`` ("fp32" or "bf16") is how each rank's values travel:
    "bf16" sends 2 bytes a value (nearest even), exact for values that already
    are bfloat16 (a transforming codec's ``side_format`` promises it). The route
    is the one that sends fewer bytes (:func:`gathers`): one all-gather of the
    wire bytes, every rank adding all rows (one collective; no more bytes on up
    to 3 ranks, and small sums), or sharded: an all-to-all sends each shard's
    wire bytes to its owner, which adds them, and an all-gather sends the fp32
    sums back (two collectives; about (wire + 4) / N bytes a value where the
    all-gather sends wire times N - 1). ``values``: a 1-D float32 NumPy or CuPy
    array, the same size on every rank. A sum of one layout that recurs keeps
    an :class:`ExactSum` instead (no allocation per call).
    """
    source = array_module(values).ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return ExactSum(comm, source.size, fmt, array_module(source))(source)


class ExactSum:
    """:func:`exact_sum` of ``size`` values of namespace ``xp`` over ``comm``, with
    every buffer made once: calling it with the values returns their sum, in a buffer
    of its own that the next call overwrites (stream order keeps a device call's
    readers before that). A call is kernels and at most two collectives: on the
    device nothing is allocated, the host never waits, and a CUDA graph of the
    caller's may capture it.
    """

    def __init__(self, comm: Communicator, size: int, fmt: str, xp: Any):
        if fmt not in _WIRE:
            raise ValueError(f"an exact sum travels as one of {sorted(_WIRE)}, not {fmt!r}")
        self.comm, self.size, self.wire = comm, size, _WIRE[fmt]
        self.total = xp.empty(size, dtype=np.float32)
        plain = self.wire is _PLAIN
        width = self.wire.wire_size(1)
        #: the wire bytes of a lossy format's round trip or exchange (None: fp32 itself)
        self.coded = None if plain else xp.empty(self.wire.wire_size(size), dtype=np.uint8)
        self.decoded: Any = None  # one row of a lossy format, decoded
        self.rows: Any = None  # every rank's wire bytes of the values this rank adds
        self.mine: Any = None  # the sharded route: this rank's shard of the sum
        ranks = comm.size
        self.gathered = ranks > 1 and size > 0 and gathers(ranks, size, width)
        self.sharded = ranks > 1 and size > 0 and not self.gathered
        if self.gathered:
            self.rows = xp.empty((ranks, size * width), dtype=np.uint8)
            self.decoded = None if plain else xp.empty(size, dtype=np.float32)
        elif self.sharded:
            bounds = shard_bounds(size, ranks)
            lo, hi = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
            self.shard = (lo, hi)
            self.rows = xp.empty((ranks, (hi - lo) * width), dtype=np.uint8)
            self.decoded = None if plain else xp.empty(hi - lo, dtype=np.float32)
            self.mine = xp.empty(hi - lo, dtype=np.float32)
            shards = np.diff(bounds)
            self.to_owners = segments((shards * width).tolist())
            self.from_ranks = segments([(hi - lo) * width] * ranks)
            self.sums = segments((shards * SUM_BYTES).tolist())

    def __call__(self, values: Any) -> Any:
        if values.shape != (self.size,) or values.dtype != np.float32:
            raise ValueError(
                f"this exact sum adds ({self.size},) float32 values, got {values.dtype} "
                f"{values.shape}"
            )
        if not (self.gathered or self.sharded):  # one rank, or nothing to add
            return self._as_sent(values, self.total)
        coded = values.view(np.uint8) if self.coded is None else self.coded
        if self.coded is not None:
            self.wire.encode_wire(values, coded)
        comm, rows = self.comm, self.rows
        if self.gathered:
            counts, displs = segments([coded.size] * comm.size)
            request = comm.allgatherv(coded, rows.reshape(-1), counts, displs)
            wait_ordered(request, "an exact sum", comm.rank)
            self._add_rows(self.total)
            return self.total
        request = comm.alltoallv(coded, *self.to_owners, rows.reshape(-1), *self.from_ranks)
        wait_ordered(request, "an exact sum's all-to-all", comm.rank)
        self._add_rows(self.mine)
        request = comm.allgatherv(self.mine.view(np.uint8), self.total.view(np.uint8), *self.sums)
        wait_ordered(request, "an exact sum's all-gather", comm.rank)
        return self.total

    def _add_rows(self, out: Any) -> None:
        """out = the sum of :attr:`rows` (every rank's wire bytes), in rank order."""
        for rank in range(self.comm.size):
            row = self.rows[rank]
            if self.decoded is None:
                row = row.view(np.float32)
            else:
                self.wire.decode_wire(row, self.decoded)
                row = self.decoded
            if rank == 0:
                out[...] = row
            else:
                add_into(out, row)

    def _as_sent(self, values: Any, out: Any) -> Any:
        """out = values as the wire carries them (a copy for the lossless wire)."""
        if self.coded is None:
            out[...] = values
        else:
            self.wire.encode_wire(values, self.coded)
            self.wire.decode_wire(self.coded, out)
        return out
