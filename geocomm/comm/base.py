"""The communicator protocol every backend (MPI, NCCL) implements.

Collectives in geocomm only ever ask a communicator to *move bytes*
(all-to-all, all-gather) or to run the plain, uncompressed all-reduce that is
the ``codec="none"`` baseline. Nonblocking calls return a :class:`Request`;
``test()`` also drives progress for backends (MPI) that only progress inside
library calls.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Request(Protocol):
    def test(self) -> bool:
        """True once complete; makes progress on the transfer."""

    def wait(self) -> None:
        """Block until complete."""


@runtime_checkable
class Communicator(Protocol):
    """Rank, size and byte-moving collectives over flat contiguous arrays."""

    rank: int
    size: int
    backend: str

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, send_displs: np.ndarray,
                  recv: np.ndarray, recv_counts: np.ndarray,
                  recv_displs: np.ndarray) -> Request:
        """Start an all-to-all of uint8 segments (counts/displacements in bytes)."""

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: np.ndarray,
                   displs: np.ndarray) -> Request:
        """Start an all-gather of uint8 segments of per-rank byte counts."""

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        """Plain blocking all-reduce (``op`` "sum" or "max") of float32/float64 arrays."""

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        """Blocking all-gather of a small int64 vector; returns (size, len) rows."""

    def barrier(self) -> None:
        """Block until every rank arrives."""
