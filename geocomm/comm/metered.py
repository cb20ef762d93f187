"""A communicator that counts what it sends (docs/design.md, "Architecture").

:class:`MeteredComm` wraps any :class:`~geocomm.comm.base.Communicator`; the
torch adapters meter their own traffic with it, studies report wire and
side-channel bytes with it (also importable as ``geocomm.testing.MeteredComm``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class MeteredComm:
    """A communicator that forwards every call to ``comm`` and counts what it sends.

    ``sent``: bytes this rank passed to all-to-alls and all-gathers (its own
    segments only, as a network would see them), ``calls``: number of
    collective calls; :meth:`reset` zeroes both.
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
        if hasattr(comm, "subgroups"):
            self.subgroups = self._subgroups

    def _count(self, nbytes: int) -> None:
        meter: MeteredComm | None = self
        while meter is not None:
            meter.calls += 1
            meter.sent += nbytes
            meter = meter.parent

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
