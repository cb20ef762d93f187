"""Several ranks in one process: loopback communicators and lockstep pipelines.

:func:`loopback` makes N communicators that copy between the ranks' buffers
(NumPy or CuPy); :func:`run_lockstep` runs N ranks' pipelines over them
phase by phase: the batched GPU pipeline at several ranks on one device or
on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from geocomm.engine.layout import schedule

__all__ = ["LoopbackComm", "loopback", "run_lockstep"]


class _Exchange:
    """One collective call of every rank: what each posted, and whether it has moved."""

    def __init__(self, size: int):
        self.posts: list[Any] = [None] * size
        self.moved = False

    def move(self) -> None:
        """Copy every posted send segment into its receiver's buffer (once all posted)."""
        for r, (_, _, _, recv, recv_counts, recv_displs) in enumerate(self.posts):
            for p, (send, send_counts, send_displs, *_) in enumerate(self.posts):
                count = int(send_counts[r])
                if count != int(recv_counts[p]):
                    raise ValueError(
                        f"rank {p} sends {count} bytes to rank {r}, "
                        f"which expects {int(recv_counts[p])}"
                    )
                if count:
                    at, to = int(send_displs[r]), int(recv_displs[p])
                    recv[to : to + count] = send[at : at + count]
        self.moved = True


class _LoopbackRequest:
    def __init__(self, exchange: _Exchange):
        self.exchange = exchange

    def test(self) -> bool:
        return self.exchange.moved

    def wait(self) -> None:
        if not self.exchange.moved:
            raise RuntimeError("a loopback collective waited before every rank posted it")

    wait_stream = wait  # the copies ran in order on the one current stream


class LoopbackComm:
    """Rank ``rank`` of ``size`` ranks in this process (see :func:`loopback`).

    The k-th collective call of every rank forms one exchange; when the last
    rank posts it, every segment is copied to its receiver (on the current
    stream for CuPy buffers), so the send buffers are read as they were when
    posted, as NCCL reads them in stream order. ``backend`` and ``device_arrays``
    are what the communicator reports (the cost model's key; whether the engine
    keeps CuPy arrays on the device).
    """

    def __init__(
        self, hub: list[_Exchange], rank: int, size: int, backend: str, device_arrays: bool
    ):
        self.hub, self.rank, self.size, self.backend = hub, rank, size, backend
        self.device_arrays = device_arrays
        self.calls = 0

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        if self.calls == len(self.hub):
            self.hub.append(_Exchange(self.size))
        exchange = self.hub[self.calls]
        self.calls += 1
        exchange.posts[self.rank] = (send, send_counts, send_displs, recv, recv_counts, recv_displs)
        if all(post is not None for post in exchange.posts):
            exchange.move()
        return _LoopbackRequest(exchange)

    def allgatherv(self, send, recv, counts, displs):
        mine = int(counts[self.rank])
        return self.alltoallv(
            send, np.full(self.size, mine), np.zeros(self.size, np.int64), recv, counts, displs
        )


def loopback(
    size: int, backend: str = "loopback", *, device_arrays: bool = False
) -> list[LoopbackComm]:
    """``size`` communicators of one loopback group, rank 0 first."""
    hub: list[_Exchange] = []
    return [LoopbackComm(hub, rank, size, backend, device_arrays) for rank in range(size)]


def run_lockstep(pipelines: Sequence[Any]) -> None:
    """Run every rank's pipeline (one per rank, in rank order) phase by phase:
    each phase of the schedule on every rank before the next phase, so every
    collective is posted by all ranks before any rank waits for it."""
    first = pipelines[0]
    for phase, stage in schedule(first.pieces.stages, first.gather):
        for pipe in pipelines:
            getattr(pipe, phase)(stage)
    for pipe in pipelines:
        pipe.release()
