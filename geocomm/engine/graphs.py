"""CUDA graphs of a plan's calls (docs/design.md, "The collective"): a call whose
device work depends only on things the caller names in a key (the arrays'
addresses, the plan's buffers, what the kernels read from device memory) is
run eagerly the first time its key comes, captured the second (CuPy stream
capture, the NCCL transfers included) and replayed with one graph launch
every later time. Keys that alternate (two buffers used in turn) are
captured alike: the keys seen once are remembered, as many as graphs are
kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from geocomm.engine.protocols import Capturable


class Graphs:
    """The graphs of one plan's calls over ``comm`` on arrays of namespace ``xp``, by key
    (every call runs eagerly when ``comm`` is None or cannot be captured, or ``xp`` is
    NumPy); at most :attr:`KEPT`, the least recently
    launched dropped first.

    :meth:`run` ``(key, body, keep)``: ``body()`` queues the call's work on the
    current stream; for a captured graph it must allocate nothing and never wait for
    the device (the graph keeps writing the memory it captured, and the host cannot
    wait under capture). ``keep``: what owns buffers the graph uses that its caller
    may let go of before the graph (kept alive with it; its identity belongs in
    the key). A body that fails to capture runs eagerly, and the plan stops
    capturing. A call made while the current stream is being captured already (a
    plan's call inside another's graph) runs its body: the outer capture records it.
    """

    #: graphs kept per plan, oldest dropped first
    KEPT = 4

    def __init__(self, comm: Any, xp: Any):
        #: the communicator while calls can be captured (None: eager calls)
        self.comm: Capturable | None = (
            comm if xp is not np and isinstance(comm, Capturable) else None
        )
        self.cupy = xp
        self.kept: dict[Hashable, tuple[Any, Any, Any]] = {}  # key -> (graph, record, keep)
        self._seen: dict[Hashable, None] = {}  # keys run eagerly once, oldest first
        self._stream: Any = None  # the plan's capture stream, made at its first capture

    def run(self, key: Hashable, body: Callable[[], None], keep: Any = None) -> None:
        comm = self.comm
        if comm is None:
            body()
            return
        stream = self.cupy.cuda.get_current_stream()
        if stream.is_capturing():
            body()
            return
        kept = self.kept.pop(key, None)  # put back last: the most recently launched
        if kept is None and key not in self._seen:  # new: eager, captured on a repeat
            self._seen[key] = None
            while len(self._seen) > self.KEPT:
                self._seen.pop(next(iter(self._seen)))
            body()
            return
        if kept is None:
            del self._seen[key]
            captured = self._capture(comm, body)
            if captured is None:
                return
            kept = (*captured, keep)
        self.kept[key] = kept
        while len(self.kept) > self.KEPT:
            self.kept.pop(next(iter(self.kept)))
        graph, captured, _ = kept
        graph.launch(stream=stream)
        comm.track(stream, captured)

    def _capture(self, comm: Capturable, body: Callable[[], None]) -> tuple[Any, Any] | None:
        """(the graph of ``body``, the communicator's record of the capture), captured on
        a stream of the plan's own (the current stream may be the legacy default stream,
        which cannot be captured); None when capture failed: the body then ran eagerly
        and the plan stops capturing."""
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=True)
        capture = self._stream
        graph = None
        with comm.capturing() as captured:
            capture.begin_capture()
            try:
                with capture:
                    body()
            finally:
                try:
                    graph = capture.end_capture()
                except Exception:  # capture broken by an unsupported operation
                    graph = None
        if graph is None:
            self.comm = None
            body()
            return None
        return graph, captured
