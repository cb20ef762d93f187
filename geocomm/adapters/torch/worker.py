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
import weakref
from collections.abc import Callable

import torch

#: how long exit waits for one worker's queued jobs (each rank runs the same queue,
#: so they finish unless a peer is gone)
EXIT_WAIT_S = 120.0

_running: weakref.WeakSet[Worker] = weakref.WeakSet()


class Worker:
    """One daemon thread running jobs in submission order (the same on every rank).

    A job's exception goes to its future (DDP raises it from backward), so a
    failure never kills the thread silently nor leaves the future pending.
    """

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None], future: torch.futures.Future) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
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
                job()
            except BaseException as exc:
                future.set_exception(exc)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs and stop the thread, waiting at most ``timeout``
        seconds (None: until done); whether the thread stopped."""
        with self._lock:
            thread, self._thread = self._thread, None
            _running.discard(self)
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()


@atexit.register
def _close_at_exit() -> None:
    for worker in list(_running):
        if not worker.close(EXIT_WAIT_S):
            print(
                f"geocomm: worker {worker._name!r} still runs a queued collective after "
                f"{EXIT_WAIT_S:.0f} s at exit (is a peer rank gone?); the process may abort",
                file=sys.stderr,
            )
