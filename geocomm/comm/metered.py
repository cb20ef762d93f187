"""A communicator that counts what it sends (docs/design.md, "Architecture").

:class:`MeteredComm` wraps any :class:`~geocomm.comm.base.Communicator`; the
torch adapters meter their own traffic with it, studies report wire and
side-channel bytes with it (also importable as ``geocomm.testing.MeteredComm``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

#: what a communicator whose transfers can be captured into CUDA graphs has
#: (geocomm.engine.protocols.Capturable, a layer above this one)
CAPTURE_PROTOCOL = ("capturing", "track", "check_usable", "captured_everywhere")


class MeteredComm:
    """A communicator that forwards every call to ``comm`` and counts what it sends.

    ``sent``: bytes this rank passed to all-to-alls and all-gathers (its own
    segments only, as a network would see them), ``calls``: number of
    collective calls; :meth:`reset` zeroes both. Over a communicator whose transfers
    can be captured into CUDA graphs it can be too (``capturing``, ``track``,
    ``check_usable``, ``captured_everywhere``): a capture counts nothing, and every
    launch of its graph counts what the capture would have.
    """

    def __init__(self, comm: Any, parent: MeteredComm | None = None):
        self.comm = comm
        self.rank, self.size, self.backend = comm.rank, comm.size, comm.backend
        self.device_arrays = comm.device_arrays
        self.sent = 0
        self.calls = 0
        self.parent = parent  # a sub-communicator's counts go to its parent's too
        if hasattr(comm, "node_key"):
            self.node_key = comm.node_key
        if hasattr(comm, "world_ranks"):
            self.world_ranks = comm.world_ranks
        if hasattr(comm, "subgroups"):
            self.subgroups = self._subgroups
        if hasattr(comm, "start_allgather_int64"):
            self.start_allgather_int64 = comm.start_allgather_int64
        if hasattr(comm, "settlers"):  # one list: the wrapped communicator runs them
            self.settlers = comm.settlers
        if hasattr(comm, "abort_local"):
            self.abort_local = comm.abort_local
        if all(hasattr(comm, name) for name in CAPTURE_PROTOCOL):
            self.capturing, self.track = self._capturing, self._track
            self.check_usable = comm.check_usable
            self.captured_everywhere = comm.captured_everywhere
        if hasattr(comm, "hold_graphs"):
            self.hold_graphs = comm.hold_graphs

    def _count(self, nbytes: int, calls: int = 1) -> None:
        meter: MeteredComm | None = self
        while meter is not None:
            meter.calls += calls
            meter.sent += nbytes
            meter = meter.parent

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[list[int]]:
        """The wrapped communicator's capture; yields [bytes, calls] of what was captured
        (counted by :meth:`_track` at each launch, not now)."""
        sent, calls = self.sent, self.calls
        captured = [0, 0]
        with self.comm.capturing():
            yield captured
        captured[:] = [self.sent - sent, self.calls - calls]
        self._count(-captured[0], -captured[1])

    def _track(self, stream: Any, captured: list[int] | None = None) -> None:
        if captured is not None:
            self._count(*captured)
        self.comm.track(stream)

    def _subgroups(self, groups: list[list[int]]) -> MeteredComm:
        """The wrapped communicator's sub-communicator, metered into this one too."""
        return MeteredComm(self.comm.subgroups(groups), parent=self)

    def reset(self) -> None:
        self.sent = self.calls = 0

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        self._count(int(np.sum(send_counts)) - int(send_counts[self.rank]))
        return self.comm.alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs)

    def allgatherv(self, send, recv, counts, displs):
        self._count(int(counts[self.rank]) * (self.size - 1))
        return self.comm.allgatherv(send, recv, counts, displs)

    def allreduce(self, send, recv, op):
        self._count(2 * send.nbytes * (self.size - 1) // max(self.size, 1))
        return self.comm.allreduce(send, recv, op)

    def allgather_int64(self, values):
        return self.comm.allgather_int64(values)

    def barrier(self):
        return self.comm.barrier()
