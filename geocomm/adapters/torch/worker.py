"""One daemon thread running jobs in submission order, for the DDP hook and the
torch.distributed backend: collectives queued in the same order on every rank run
in that order, while the caller (autograd's backward) goes on."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


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

    def close(self) -> None:
        """Finish the queued jobs and stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
