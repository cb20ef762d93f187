"""The ``Work`` objects the torch.distributed backend returns and the small helpers its
calls share (reduce ops, the first tensor of a call's arguments)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from geocomm.comm.base import CollectiveTimeout

# torch's stubs overload the collectives' signatures (the Python conveniences beside the
# C++ ones this class overrides): typed as Any, the bases leave the overrides unchecked
ProcessGroupBase: Any = dist.ProcessGroup


WorkBase: Any = dist.Work


class FutureWork(WorkBase):
    """A ``Work`` whose result is ``future``'s: ``wait()`` raises the job's own exception
    (a :class:`CollectiveMismatchError` stays one); C++ callers (DDP) use the future."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the job (a ``timeout`` of zero or None: for as long as it takes; the
        job's own waits are bounded by GEOCOMM_TIMEOUT); raise CollectiveTimeout once a
        positive ``timeout`` passed with the job still running, as gloo raises."""
        seconds = 0.0 if timeout is None else timeout.total_seconds()
        if seconds > 0:
            deadline = time.monotonic() + seconds
            while not self._future.done():
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(
                        f"geocomm: a compressed call did not complete within {timeout} "
                        "(Work.wait's timeout)"
                    )
                time.sleep(0.001)
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def result(self) -> list[torch.Tensor]:
        return self._future.value()


def done_work(value: Any) -> FutureWork:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return FutureWork(future)


def op_name(op: Any) -> str | None:
    """ "sum" or "avg" for the reduce ops geocomm compresses, else None."""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None


def first_tensor(args: Iterable[Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            found = first_tensor(a)
            if found is not None:
                return found
    return None


def future_of(work: Any) -> torch.futures.Future:
    """``work``'s future; for a work without one (gloo's reduce-scatter), a completed
    future after waiting for it here."""
    try:
        return work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        work.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def then_work(work: Any, finish: Callable[[], list]) -> FutureWork:
    """A work that completes with ``finish()`` once ``work`` did."""

    def done(f: torch.futures.Future) -> list:
        f.value()  # raises the work's exception
        return finish()

    return FutureWork(future_of(work).then(done))


def all_of(works: list, value: list) -> FutureWork:
    """One work that completes when every one of ``works`` did, with ``value``."""
    if not works:
        return done_work(value)

    def done(f: torch.futures.Future) -> list:
        for each in f.value():
            each.value()  # raises a failed one's exception
        return value

    return FutureWork(torch.futures.collect_all([future_of(w) for w in works]).then(done))
