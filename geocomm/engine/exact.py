"""Exact sums over ranks (docs/design.md, "The collective" and "Transforming codecs"):
:func:`exact_sum` is the lossless, rank-ordered sum the side channels of
transforming codecs use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geocomm.codecs.formats import BF16Codec, NoneCodec, round_trip
from geocomm.comm.base import Communicator, wait_ordered
from geocomm.engine import device
from geocomm.engine.arithmetic import add_into
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import DEFAULT_STAGE_SIZE, Pieces, array_module, segments

_PLAIN = NoneCodec()
#: the exact sums' wire formats (a transforming codec's ``side_format``)
_WIRE = {"fp32": _PLAIN, "bf16": BF16Codec()}


#: An exact sum of at most this many values times ranks is one all-gather (every
#: rank adds all rows); larger ones run the pipeline (the shard owners add).
SMALL_SUM_VALUES = 1 << 20


def exact_sum(comm: Communicator, values: Any, fmt: str = "fp32") -> Any:
    """Elementwise fp32 sum over ranks, bitwise identical on every rank.

    ``fmt`` ("fp32" or "bf16") is how each rank's values travel: "bf16" sends
    2 bytes a value (nearest even), exact for values that already are bfloat16
    (a transforming codec's ``side_format`` promises it). Small sums
    (``values.size * N <= SMALL_SUM_VALUES``, the side channels of
    transforming codecs) are one all-gather of those bytes, every rank adding
    the rows in rank order 0, 1, ..., N - 1: one collective's latency, not
    two. Larger ones run the pipeline with the lossless codec (4 bytes a
    value), where the owner of each shard adds its own values and then the
    others' in rank order. Either way the result never depends on arrival
    order or on an MPI reduction's tree. ``values``: a 1-D float32 NumPy or
    CuPy array, the same size on every rank.
    """
    if fmt not in _WIRE:
        raise ValueError(f"an exact sum travels as one of {sorted(_WIRE)}, not {fmt!r}")
    wire = _WIRE[fmt]
    xp = array_module(values)
    source = xp.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    total = xp.empty_like(source)
    if comm.size == 1 or source.size == 0:
        _as_sent(wire, source, total)
        return total
    if source.size * comm.size <= SMALL_SUM_VALUES:
        return _gathered_sum(comm, wire, source, total)
    if wire is not _PLAIN:
        source = _as_sent(wire, source, xp.empty_like(source))
    pieces = Pieces.cut(source.size, comm.size, max(source.size, DEFAULT_STAGE_SIZE))
    batched = device.batched_format(comm, _PLAIN, source)
    if batched is not None:  # CuPy arrays over NCCL: the batched pipeline
        device.BatchedPipeline(comm, batched, pieces, source, total, 0, gather=True).run()
    else:
        Pipeline(comm, _PLAIN, pieces, source, total, 0, gather=True).run()
    return total


def _as_sent(wire: Any, values: Any, out: Any) -> Any:
    """out = values as ``wire`` carries them (a copy for the lossless wire)."""
    if wire is _PLAIN:
        out[...] = values
        return out
    return round_trip(wire, values, out)


def _gathered_sum(comm: Communicator, wire: Any, source: Any, total: Any) -> Any:
    """exact_sum's small route: all-gather every rank's ``wire`` bytes, add in rank order."""
    xp = array_module(source)
    size = wire.wire_size(source.size)
    if wire is _PLAIN:
        coded, rows = source.view(np.uint8), xp.empty((comm.size, source.size), dtype=np.float32)
    else:
        coded, rows = xp.empty(size, dtype=np.uint8), xp.empty((comm.size, size), dtype=np.uint8)
        wire.encode_wire(source, coded)
    counts, displs = segments([size] * comm.size)
    wait_ordered(
        comm.allgatherv(coded, rows.reshape(-1).view(np.uint8), counts, displs),
        "an exact sum",
        comm.rank,
    )
    decoded = None if wire is _PLAIN else xp.empty_like(source)
    for rank in range(comm.size):
        row = rows[rank]
        if decoded is not None:
            wire.decode_wire(row, decoded)
            row = decoded
        if rank == 0:
            total[...] = row
        else:
            add_into(total, row)
    return total
