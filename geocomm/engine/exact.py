"""Exact sums over ranks (docs/design.md, "The collective" and "Transforming codecs"):
:func:`exact_sum` is the lossless, rank-ordered sum the side channels of
transforming codecs use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geocomm.codecs.formats import BF16Codec, NoneCodec
from geocomm.comm.base import Communicator, wait_ordered
from geocomm.engine import device
from geocomm.engine.arithmetic import add_into
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import (
    DEFAULT_STAGE_SIZE,
    CallBytes,
    Pieces,
    array_module,
    call_bytes,
    segments,
)

_PLAIN = NoneCodec()
#: the exact sums' wire formats (a transforming codec's ``side_format``)
_WIRE = {"fp32": _PLAIN, "bf16": BF16Codec()}


#: An exact sum of at most this many values times ranks is one all-gather (every
#: rank adds all rows); larger ones run the pipeline (the shard owners add).
SMALL_SUM_VALUES = 1 << 20


def pipelined(comm: Communicator, size: int) -> bool:
    """Whether an exact sum of ``size`` values runs the pipeline (else it is kernels and
    at most one all-gather)."""
    return comm.size > 1 and size * comm.size > SMALL_SUM_VALUES


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
    CuPy array, the same size on every rank. A sum of one layout that recurs
    keeps an :class:`ExactSum` instead (no allocation per call).
    """
    source = array_module(values).ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return ExactSum(comm, source.size, fmt, array_module(source))(source)


class ExactSum:
    """:func:`exact_sum` of ``size`` values of namespace ``xp`` over ``comm``, with
    every buffer made once: calling it with the values returns their sum, in a buffer
    of its own that the next call overwrites (stream order keeps a device call's
    readers before that). On the device nothing is allocated and the host never
    waits; unless :attr:`pipelined` (a large sum: its pipeline's plan orders and
    captures its own calls), a call is kernels and at most one all-gather, which
    a CUDA graph of its caller's may capture.
    """

    def __init__(self, comm: Communicator, size: int, fmt: str, xp: Any):
        if fmt not in _WIRE:
            raise ValueError(f"an exact sum travels as one of {sorted(_WIRE)}, not {fmt!r}")
        self.comm, self.size, self.wire = comm, size, _WIRE[fmt]
        self.total = xp.empty(size, dtype=np.float32)
        plain = self.wire is _PLAIN
        nbytes = self.wire.wire_size(size)
        #: the wire bytes of a lossy format's round trip or all-gather (None: fp32 itself)
        self.coded = None if plain else xp.empty(nbytes, dtype=np.uint8)
        self.gathered = comm.size > 1 and size > 0 and not pipelined(comm, size)
        self.pipelined = pipelined(comm, size)
        self.rows: Any = None
        self.decoded: Any = None
        self.sent: Any = None
        self.plan: device.DevicePlan | None = None
        self.layout: CallBytes | None = None  # the host pipeline's stages
        if self.gathered:
            shape = (comm.size, size) if plain else (comm.size, nbytes)
            self.rows = xp.empty(shape, dtype=np.float32 if plain else np.uint8)
            self.decoded = None if plain else xp.empty(size, dtype=np.float32)
        elif self.pipelined:  # planned once
            self.sent = None if plain else xp.empty(size, dtype=np.float32)
            self.pieces = Pieces.cut(size, comm.size, max(size, DEFAULT_STAGE_SIZE))
            batched = device.batched_format(comm, _PLAIN, self.total)
            if batched is not None:  # CuPy arrays over NCCL: the batched pipeline
                self.plan = device.DevicePlan(comm, batched, self.pieces, 0, True, False, xp)
            else:
                self.layout = call_bytes(_PLAIN.wire_size, self.pieces, comm.rank)

    def __call__(self, values: Any) -> Any:
        if values.shape != (self.size,) or values.dtype != np.float32:
            raise ValueError(
                f"this exact sum adds ({self.size},) float32 values, got {values.dtype} "
                f"{values.shape}"
            )
        if self.comm.size == 1 or self.size == 0:
            return self._as_sent(values, self.total)
        if self.gathered:
            return self._gathered(values)
        source = values if self.sent is None else self._as_sent(values, self.sent)
        if self.plan is not None:
            self.plan.run(source, self.total)
        else:
            Pipeline(
                self.comm, _PLAIN, self.pieces, source, self.total, 0, True, layout=self.layout
            ).run()
        return self.total

    def _as_sent(self, values: Any, out: Any) -> Any:
        """out = values as the wire carries them (a copy for the lossless wire)."""
        if self.coded is None:
            out[...] = values
        else:
            self.wire.encode_wire(values, self.coded)
            self.wire.decode_wire(self.coded, out)
        return out

    def _gathered(self, values: Any) -> Any:
        """The small route: all-gather every rank's wire bytes, add in rank order."""
        comm, rows, total = self.comm, self.rows, self.total
        coded = values.view(np.uint8) if self.coded is None else self.coded
        if self.coded is not None:
            self.wire.encode_wire(values, coded)
        counts, displs = segments([coded.size] * comm.size)
        wait_ordered(
            comm.allgatherv(coded, rows.reshape(-1).view(np.uint8), counts, displs),
            "an exact sum",
            comm.rank,
        )
        for rank in range(comm.size):
            row = rows[rank]
            if self.decoded is not None:
                self.wire.decode_wire(row, self.decoded)
                row = self.decoded
            if rank == 0:
                total[...] = row
            else:
                add_into(total, row)
        return total
