"""The staged compressed algorithm on the host (docs/design.md, "The collective").

All-reduce of ``count`` values on ``N`` ranks, two quantizations:

1. the flat buffer is cut into the ``N`` shards of :func:`shard_bounds`
   (``np.array_split``); each shard into pieces of :class:`Pieces`, one piece
   per shard per pipeline stage;
2. stage ``s``: every rank encodes piece ``s`` of every other rank's shard
   (each piece on its own, so no header travels) and an all-to-all sends
   shard ``j``'s piece to rank ``j``;
3. rank ``j`` takes its own piece as it is (it never travels, so it is never
   quantized), adds the ``N - 1`` decoded pieces in rank order in fp32
   (deterministic, and independent of whether the result aliases the source),
   re-encodes the sum, and an all-gather sends it to everyone, itself
   included; every rank decodes all pieces from the same bytes, so every rank
   ends with bitwise identical values.

Three stages are in flight: while stage ``s`` is encoded, stage ``s-1``'s
all-to-all and stage ``s-2``'s all-gather move, and every codec call is
followed by a ``test()`` of the open requests so MPI makes progress without a
progress thread. Reduce-scatter is steps 1-3 without the all-gather; the owner
keeps its fp32 sum.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from geocomm.comm.base import Communicator, Request, wait
from geocomm.engine.layout import (
    CallBytes,
    PieceAccess,
    Pieces,
    array_module,
    call_bytes,
    quantization_stream,
    run_schedule,
)
from geocomm.engine.protocols import RangeMap, WireCodec


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
        result: list[np.ndarray] = self.local.free
        return result

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


class Pipeline(PieceAccess):
    """The staged algorithm for one call; phases are separate methods so the
    perf tools can time encode, communication and decode on their own.

    ``source`` holds the values to reduce (or ``mapper`` maps them piece by
    piece); ``result`` receives the sum from absolute index
    ``result_offset`` on and may be ``source``. ``layout``: the call's
    :func:`~geocomm.engine.layout.call_bytes`, kept per signature by the caller
    (default: derived here).
    """

    def __init__(
        self,
        comm: Communicator,
        codec: WireCodec,
        pieces: Pieces,
        source: np.ndarray,
        result: np.ndarray,
        result_offset: int,
        gather: bool,
        mapper: RangeMap | None = None,
        rounding_stream: int = 0,
        layout: CallBytes | None = None,
    ):
        self.comm, self.codec, self.pieces = comm, codec, pieces
        layout = layout if layout is not None else call_bytes(codec.wire_size, pieces, comm.rank)
        self.stages = layout.stages
        # stochastic rounding: every quantization of the call draws from its own
        # stream (this rank's first one, its second one), counted by element index
        self.rounding_streams = (
            quantization_stream(rounding_stream, comm.rank, 1),
            quantization_stream(rounding_stream, comm.rank, 2),
        )
        self.source, self.result, self.mapper = source, result, mapper
        self.result_offset = result_offset  # absolute index of result[0]
        self.gather = gather
        self.open: list[Request] = []
        self.me = comm.rank
        xp = array_module(source)
        # two stages in flight at most per phase: double buffers
        self.a2a_send = [_SCRATCH.take(xp, layout.send_bytes) for _ in range(2)]
        self.a2a_recv = [_SCRATCH.take(xp, layout.recv_bytes) for _ in range(2)]
        self.ag_send = [_SCRATCH.take(xp, layout.own_bytes) for _ in range(2)]
        self.ag_recv = [_SCRATCH.take(xp, layout.gather_bytes) for _ in range(2)]
        self.a2a_req: dict[int, Request] = {}
        self.ag_req: dict[int, Request] = {}

    # -- helpers ------------------------------------------------------------
    def _progress(self) -> None:
        self.open = [r for r in self.open if not r.test()]

    def _done(self, lo: int, hi: int) -> bool:
        if not super()._done(lo, hi):
            return False
        self._progress()
        return True

    # -- phases ---------------------------------------------------------------
    def encode_stage(self, s: int) -> None:
        """This rank's pieces of the other shards, into the all-to-all's send buffer
        (its own piece enters the sum unquantized)."""
        stage, buf = self.stages[s], self.a2a_send[s % 2]
        for j, (lo, hi) in enumerate(stage.ranges):
            if j != self.me:
                at = int(stage.send_displs[j])
                wire, stream = buf[at : at + stage.sizes[j]], self.rounding_streams[0]
                if self.mapper is None or not self.mapper.encode(lo, hi, self.codec, wire, stream):
                    values = self._read(lo, hi)
                    self.codec.encode_wire(values, wire, rounding_stream=stream, offset=lo)
                    if self.mapper is not None:
                        self.mapper.encoded(lo, hi, values, wire)
                self._progress()

    def start_alltoall(self, s: int) -> None:
        stage = self.stages[s]
        req = self.comm.alltoallv(
            self.a2a_send[s % 2],
            stage.send_counts,
            stage.send_displs,
            self.a2a_recv[s % 2],
            stage.recv_counts,
            stage.recv_displs,
        )
        self.a2a_req[s] = req
        self.open.append(req)

    def reduce_stage(self, s: int) -> None:
        """My piece of my shard (exact), then the other ranks' decoded pieces in
        rank order, summed in fp32 into result. Own piece first: out may alias
        the source, and the order must not depend on that. The first peer's
        values are decoded onto my piece (``decode_wire_onto``: the piece is
        read and the sum written in one pass, where a copy into the result
        and an accumulating decode took two)."""
        wait(self.a2a_req.pop(s), f"the all-to-all of stage {s}", self.me)
        stage = self.stages[s]
        lo, hi = stage.ranges[self.me]
        acc = self._local(lo, hi)
        own = self._read(lo, hi)
        seg = stage.sizes[self.me]
        buf = self.a2a_recv[s % 2]
        if self.comm.size == 1:
            acc[...] = own
        for k in range(self.comm.size - 1):
            wire = buf[k * seg : (k + 1) * seg]
            if k == 0:
                self.codec.decode_wire_onto(wire, own, acc)
            else:
                self.codec.decode_wire(wire, acc, accumulate=True)
            self._progress()
        if not self.gather:  # reduce-scatter: the owner's sum is final
            self._done(lo, hi)

    def reencode_stage(self, s: int) -> None:
        """Encode my reduced piece for the all-gather (the second quantization)."""
        lo, hi = self.stages[s].ranges[self.me]
        values = self._local(lo, hi)
        self.codec.encode_wire(
            values, self.ag_send[s % 2], rounding_stream=self.rounding_streams[1], offset=lo
        )
        if self.mapper is not None:
            self.mapper.encoded(lo, hi, values, self.ag_send[s % 2])
        self._progress()

    def start_allgather(self, s: int) -> None:
        stage = self.stages[s]
        send = self.ag_send[s % 2][: stage.sizes[self.me]]
        req = self.comm.allgatherv(
            send, self.ag_recv[s % 2], stage.gather_counts, stage.gather_displs
        )
        self.ag_req[s] = req
        self.open.append(req)

    def decode_stage(self, s: int) -> None:
        wait(self.ag_req.pop(s), f"the all-gather of stage {s}", self.me)
        stage, buf = self.stages[s], self.ag_recv[s % 2]
        for (lo, hi), at, count in zip(
            stage.ranges, stage.gather_displs, stage.gather_counts, strict=True
        ):
            wire = buf[int(at) : int(at + count)]
            if self.mapper is not None and self.mapper.decode(lo, hi, self.codec, wire):
                self._progress()
                continue
            self.codec.decode_wire(wire, self._local(lo, hi))
            self._progress()
            self._done(lo, hi)

    def run(self) -> None:
        run_schedule(self)

    def release(self) -> None:
        """Give the scratch back (every request has completed: each phase waited on its own)."""
        _SCRATCH.give_back(self.a2a_send + self.a2a_recv + self.ag_send + self.ag_recv)
