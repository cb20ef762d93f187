"""The communicator protocol every backend (MPI, NCCL) implements.

Collectives in geocomm only ever ask a communicator to *move bytes*
(all-to-all, all-gather) or to run the plain, uncompressed all-reduce that is
the ``codec="none"`` baseline. Nonblocking calls return a :class:`Request`;
``test()`` also drives progress for backends (MPI) that only progress inside
library calls.
"""

from __future__ import annotations

import math
import os
import time
from typing import Protocol, runtime_checkable

import numpy as np

DEFAULT_TIMEOUT_S = 300.0


class CollectiveTimeout(TimeoutError):
    """A peer did not take part in a collective within the timeout.

    The communicator is unusable afterwards (requests are still posted; NCCL
    aborts its communicator): let the exception end the process. Uncaught, it
    aborts the whole job (:mod:`geocomm.comm.abort`) instead of leaving the
    other ranks waiting.
    """


def timeout_seconds() -> float:
    """The collective timeout: ``GEOCOMM_TIMEOUT`` seconds (default 300, 0 = none)."""
    text = os.environ.get("GEOCOMM_TIMEOUT", "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = math.nan
    if not value >= 0:  # NaN and negative numbers alike
        raise ValueError(
            f"GEOCOMM_TIMEOUT must be a number of seconds >= 0 (0: no timeout), got {text!r}"
        )
    return value if value > 0 else math.inf


@runtime_checkable
class Request(Protocol):
    def test(self) -> bool:
        """True once complete; makes progress on the transfer."""

    def wait(self) -> None:
        """Block until complete."""


#: Requests a wait gave up on. They are still posted (MPI cannot cancel a collective),
#: so they and the buffers they hold are kept: a late peer's data lands in memory
#: nothing else has taken, even where a caller catches the timeout and goes on.
_ABANDONED: list[Request] = []


def wait(request: Request, what: str, rank: int, timeout: float | None = None) -> None:
    """Wait for ``request``, testing it (which also drives progress) until it
    completes; raise :class:`CollectiveTimeout` naming ``what`` and ``rank``
    after ``timeout`` seconds (default :func:`timeout_seconds`). Before
    raising, calls the request's ``on_timeout()`` if it has one (NCCL aborts
    its communicator there, cancelling the transfers that cannot finish).

    A request with ``wait_for(seconds) -> bool`` (one that completes on a
    thread of its own, like torch.distributed's) is slept on instead of
    polled: a waiting worker thread then leaves the CPU to the training it
    overlaps (polling took the DDP hook's worker CPU time that backward needs)."""
    limit = timeout_seconds() if timeout is None else timeout
    if request.test():
        return
    start = time.monotonic()
    pause = 0.0
    block = getattr(request, "wait_for", None)
    while not request.test():
        waited = time.monotonic() - start
        if waited > limit:
            on_timeout = getattr(request, "on_timeout", None)
            if on_timeout is not None:
                on_timeout()
            _ABANDONED.append(request)  # still posted: its buffers must outlive it
            raise CollectiveTimeout(
                f"geocomm: rank {rank} waited {waited:.1f} s for {what}; a peer rank failed, "
                "exited or never called it (GEOCOMM_TIMEOUT sets the limit)"
            )
        if block is not None:
            block(min(limit - waited, 0.1) + 1e-3)
        # spin first (latency), then back off to sleeps of at most 1 ms
        elif waited > 1e-3:
            pause = min(max(pause * 2, 1e-5), 1e-3)
            time.sleep(pause)


def wait_ordered(request: Request, what: str, rank: int) -> None:
    """Order what the caller does next after ``request``: a device request (one with
    ``wait_stream()``, NCCL's) makes the current stream wait for it, without a host
    wait (:mod:`geocomm.comm.nccl` says what times out then); any other is
    :func:`wait`-ed for."""
    wait_stream = getattr(request, "wait_stream", None)
    if wait_stream is not None:
        wait_stream()
    else:
        wait(request, what, rank)


@runtime_checkable
class Communicator(Protocol):
    """Rank, size and byte-moving collectives over flat contiguous arrays.

    ``backend`` names the transport ("mpi", "nccl", "gloo", ...: the cost model's
    key, :mod:`geocomm.engine.costs`); ``device_arrays`` says whether it moves
    device (CuPy) arrays, which the engine then keeps on the device (a host
    communicator gets CuPy arrays staged through host memory).
    """

    rank: int
    size: int
    backend: str
    device_arrays: bool

    def alltoallv(
        self,
        send: np.ndarray,
        send_counts: np.ndarray,
        send_displs: np.ndarray,
        recv: np.ndarray,
        recv_counts: np.ndarray,
        recv_displs: np.ndarray,
    ) -> Request:
        """Start an all-to-all of uint8 segments (counts/displacements in bytes)."""

    def allgatherv(
        self, send: np.ndarray, recv: np.ndarray, counts: np.ndarray, displs: np.ndarray
    ) -> Request:
        """Start an all-gather of uint8 segments of per-rank byte counts."""

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        """Plain blocking all-reduce (``op`` "sum" or "max") of float32/float64 arrays."""

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        """Blocking all-gather of a small int64 vector; returns (size, len) rows."""

    def barrier(self) -> None:
        """Block until every rank arrives."""
