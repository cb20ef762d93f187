"""Exact sums over ranks and the IEEE fp32 arithmetic every device shares
(docs/design.md, "The collective" and "Transforming codecs").

:func:`exact_sum` is the lossless, rank-ordered sum the side channels of
transforming codecs use; :func:`add_into`, :func:`subtract_from` and
:func:`divide` compute in IEEE fp32 with the same bits on NumPy and CuPy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geocomm.codecs.formats import BF16Codec, NoneCodec, round_trip
from geocomm.comm.base import Communicator, wait_ordered
from geocomm.engine import device
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import DEFAULT_STAGE_SIZE, Pieces, array_module, segments

_PLAIN = NoneCodec()
#: the exact sums' wire formats (a transforming codec's ``side_format``)
_WIRE = {"fp32": _PLAIN, "bf16": BF16Codec()}


def add_into(acc: Any, values: Any) -> None:
    """``acc += values`` in fp32, the same bits on every device: one IEEE addition per
    value, rounded to nearest, subnormals kept. NumPy arrays add in place with NumPy;
    CuPy arrays with :func:`geocomm.kernels.cuda.add` (CuPy's own ``+=`` is compiled with
    ``-ftz=true`` and flushes subnormals, so the GPU would disagree with the CPU).
    ``acc``, ``values``: C-contiguous float32 arrays of one size and kind; ``values``
    may be ``acc`` itself, else it must not overlap it."""
    if array_module(acc) is np:
        np.add(acc, values, out=acc)
    else:
        from geocomm.kernels import cuda

        cuda.add(acc, values)


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


def subtract_from(values: Any, decoded: Any) -> None:
    """``decoded = values - decoded`` in place (what a quantization lost), the same bits
    on every device: IEEE fp32, rounded to nearest, subnormals kept. NumPy computes
    ``-1 * decoded + values`` as it always has (the IEEE difference; of two NaNs it
    keeps decoded's, as ``np.subtract`` would not); CuPy arrays go through
    :func:`geocomm.kernels.cuda.subtract` (CuPy's own arithmetic flushes subnormals; GPU NaNs
    are canonical anyway). C-contiguous float32 arrays of one size and kind, apart."""
    if array_module(decoded) is np:
        np.multiply(decoded, -1, out=decoded)
        np.add(decoded, values, out=decoded)
    else:
        from geocomm.kernels import cuda

        cuda.subtract(decoded, values, decoded)


def divide(values: Any, size: int) -> None:
    """values /= size in place, one IEEE division per value on every device (CuPy's
    own elementwise kernels flush subnormals to zero, so CuPy arrays get ours)."""
    if array_module(values) is np:
        values /= values.dtype.type(size)
    else:
        from geocomm.kernels import cuda

        cuda.divide(values, size)
