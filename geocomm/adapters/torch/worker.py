"""One daemon thread running jobs in submission order, for the DDP hook and the
torch.distributed backend: collectives queued in the same order on every rank run
in that order, while the caller (autograd's backward) goes on.

At interpreter exit every running worker finishes its queued jobs and stops
(:func:`_close_at_exit`, an ``atexit`` handler, so before Python finalizes). A
daemon thread left running would be inside torch's C++ with the GIL released
(a collective, or ``Future.set_result`` waking the main thread, which may then
exit at once); taking the GIL back during finalization makes CPython end the
thread with ``pthread_exit``, whose unwinding through torch's ``noexcept`` GIL
guard aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

#: how long exit waits, in all, for the workers' queued jobs (each rank runs the same
#: queue, so they finish unless a peer is gone or stuck)
EXIT_WAIT_S = 60.0

_running: weakref.WeakSet[Worker] = weakref.WeakSet()


class Worker:
    """One daemon thread running jobs in submission order (the same on every rank).

    A job's exception goes to its future (DDP raises it from backward), so a
    failure never kills the thread silently nor leaves the future pending. Jobs run
    under ``torch.no_grad()``: like torch's own collectives they write tensors in
    place whatever grad mode the submitting thread had (grad mode is per thread, and
    a new thread's is on).
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closing = False  # the thread has its stop marker and runs out its queue
        self._aborted: BaseException | None = None  # what every later job fails with
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None], future: torch.futures.Future) -> None:
        with self._lock:
            if self._aborted is not None:
                future.set_exception(self._aborted)
                return
            if self._thread is not None and self._closing:
                # a close is under way: the jobs before its marker run first, in order
                self._thread.join()
                self._thread, self._closing = None, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
                _running.add(self)
            self._queue.put((job, future))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, future = item
            try:
                with torch.no_grad():
                    job()
            except BaseException as exc:
                future.set_exception(exc)

    def abort(self, error: BaseException) -> None:
        """Fail the queued jobs' futures, and every later job's, with ``error``, and stop
        the thread after the job it runs; never waits (a job stuck on a peer that is
        gone ends when its collective does)."""
        with self._lock:
            self._aborted = error
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].set_exception(error)
            if self._thread is not None:
                self._queue.put(None)
                self._closing = True

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs and stop the thread, waiting at most ``timeout``
        seconds (None: until done); whether the thread stopped. A job submitted while
        a close is under way waits for it."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return True
            if not self._closing:
                self._queue.put(None)
                self._closing = True
        thread.join(timeout)
        if thread.is_alive():
            return False
        with self._lock:
            if self._thread is thread:
                self._thread, self._closing = None, False
                _running.discard(self)
        return True


@atexit.register
def _close_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for worker in list(_running):
        if not worker.close(max(0.0, deadline - time.monotonic())):
            print(
                f"geocomm: worker {worker.name!r} still runs a queued collective at exit "
                f"after {EXIT_WAIT_S:.0f} s (is a peer rank gone?); the process may abort",
                file=sys.stderr,
            )
