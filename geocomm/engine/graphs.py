"""CUDA graphs of a plan's calls (docs/design.md, "The collective"): a call whose
device work depends only on things the caller names in a key (the plan's
buffers, what the kernels read from device memory, the arrays' addresses where
the kernels cannot take others) is run eagerly the first time its key comes,
captured the second (CuPy stream capture, the NCCL transfers included) and
replayed with one graph launch every later time. Keys that alternate are
captured alike: the keys seen once are remembered, as many as graphs are
kept. What a body allocates while it is captured comes from an
:class:`Arena`, sized by the key's eager run.

NCCL lets a transfer be captured, and a graph of it be replayed, only on every
rank alike, so a key must be alike on every rank whenever the calls are: where
a rank's arrays lie is a rank-local fact. Kernels that read the caller's arrays
through a shift in device memory take a call's arrays wherever they lie: the
caller's ``bind`` writes the shift before each call (:meth:`Graphs.run`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from geocomm._environ import switch
from geocomm.engine.protocols import Capturable

#: the alignment of every block an arena hands out (cudaMalloc's)
ALIGN = 256

#: what graphs dropped while a launch of them may still run wrote (Graphs.release)
_ORPHANED: list[Any] = []


def refused_by_capture(cupy: Any, exc: BaseException) -> bool:
    """Whether ``exc`` says that an operation was refused under stream capture (or came
    after one that invalidated the capture): more than its eager run's memory
    (:class:`ArenaExhausted`), a CUDA runtime call (``CUDARuntimeError``), a kernel
    launch (CuPy launches through the driver API: ``CUDADriverError``), an NCCL call
    (``NcclError``), or one of CuPy's own guards, which raise a plain RuntimeError
    ("the current stream is capturing, so H2D transfers are disallowed",
    cupy/cuda/memory.pyx; "the stream was capturing, but an error has invalidated the
    capture sequence", runtime.streamIsCapturing)."""
    if isinstance(exc, ArenaExhausted):
        return True
    kinds = [
        cupy.cuda.runtime.CUDARuntimeError,
        getattr(getattr(cupy.cuda, "driver", None), "CUDADriverError", None),
        getattr(sys.modules.get("cupy.cuda.nccl"), "NcclError", None),
    ]
    if isinstance(exc, tuple(kind for kind in kinds if isinstance(kind, type))):
        return True
    return type(exc) is RuntimeError and "captur" in str(exc)


def enabled() -> bool:
    """Whether calls may be captured into CUDA graphs: ``GEOCOMM_GRAPHS`` (on unless set
    off: :func:`geocomm._environ.switch`; every rank must set it alike)."""
    return switch("GEOCOMM_GRAPHS") is not False


def _aligned(nbytes: int) -> int:
    return -(-max(int(nbytes), 0) // ALIGN) * ALIGN


class ArenaExhausted(RuntimeError):
    """A captured body asked for more memory than its eager run did."""


class Arena:
    """Device memory for the temporaries of captured bodies: one allocation of
    ``nbytes``, handed out in blocks of :data:`ALIGN` bytes in the order a body
    asks, from the start at each capture (:meth:`serving`), through CuPy's
    ``using_allocator``. The graphs keep it, so every replay writes its temporaries
    where no array of CuPy's pool lives (the pool would hand a freed block to other
    arrays while the graph still writes it)."""

    def __init__(self, cupy: Any, nbytes: int):
        self.cupy, self.nbytes, self.used = cupy, nbytes, 0
        self.memory = cupy.cuda.alloc(nbytes)

    def malloc(self, nbytes: int) -> Any:
        start, self.used = self.used, self.used + _aligned(nbytes)
        if self.used > self.nbytes:
            raise ArenaExhausted(f"a captured body asked for more than its {self.nbytes} bytes")
        return self.memory + start

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Every allocation of this thread inside comes from the arena, from its start."""
        self.used = 0
        with self.cupy.cuda.using_allocator(self.malloc):
            yield


@contextlib.contextmanager
def measured(cupy: Any) -> Iterator[list[int]]:
    """The bytes an :class:`Arena` needs for what this thread allocates inside (the
    list's one value, counted as it goes); the allocations are the current
    allocator's."""
    allocate = cupy.cuda.get_allocator()
    total = [0]

    def malloc(nbytes: int) -> Any:
        total[0] += _aligned(nbytes)
        return allocate(nbytes)

    with cupy.cuda.using_allocator(malloc):
        yield total


class Graphs:
    """The graphs of one plan's calls over ``comm`` on arrays of namespace ``xp``, by key
    (every call runs eagerly when ``comm`` is None or cannot be captured, or ``xp`` is
    NumPy); at most :attr:`KEPT`, the least recently
    launched dropped first.

    :meth:`run` ``(key, body, keep, here, bind)``: ``body()`` queues the call's work on
    the current stream and returns what the host needs of it afterwards (arrays the
    work writes, say); a replay returns what the captured run returned, so its arrays
    must be the graph's: the caller's buffers, or what the body allocated (from the
    plan's :class:`Arena` under capture: its graphs never run at once, the plan's calls
    being ordered, so they share one, as large as the largest body's, and an array one
    returns holds until the plan's next call). A captured body never waits for the
    device (the host cannot wait under capture) and must allocate as it did in the
    key's eager run.
    ``keep``: what owns buffers the graph uses that its caller may let go of before
    the graph (kept alive with it, and from the key's first eager run on: no other
    buffer takes an address the key names, so keys match alike on every rank; its
    identity belongs in the key). ``here``: where
    the call's arrays lie (anything; a graph remembers its capture's), and
    ``bind(origin)`` queues, outside any graph and before the call's work, what the
    body's kernels read to find this call's arrays: ``origin`` is the ``here`` of the
    capture whose graph is about to replay, None where the body runs now. A body that
    fails to capture (an operation CUDA cannot capture, or more memory than its eager
    run took) runs eagerly, and the plan stops capturing, on every rank alike: a capture
    that failed on one rank is given up on all (``comm.captured_everywhere``). A call made while
    the current stream is being captured already (a plan's call inside another's
    graph) runs its body: the outer capture records it.
    """

    #: graphs kept per plan, oldest dropped first
    KEPT = 4

    def __init__(self, comm: Any, xp: Any):
        #: the communicator while calls can be captured (None: eager calls)
        self.comm: Capturable | None = (
            comm if xp is not np and isinstance(comm, Capturable) and enabled() else None
        )
        self.cupy = xp
        #: key -> (graph, the capture's record, the body's return, its arena, keep, here)
        self.kept: dict[Hashable, tuple[Any, Any, Any, Arena, Any, Any]] = {}
        #: keys run eagerly once, oldest first -> (the bytes that run allocated, its keep)
        self._seen: dict[Hashable, tuple[int, Any]] = {}
        self._stream: Any = None  # the plan's capture stream, made at its first capture
        self._arena: Arena | None = None  # what its captured bodies allocate
        #: a graph just captured, while the ranks agree whether to keep it (_capture)
        self._pending: Any = None

    def run(
        self,
        key: Hashable,
        body: Callable[[], Any],
        keep: Any = None,
        here: Any = None,
        bind: Callable[[Any], None] = lambda origin: None,
    ) -> Any:
        comm = self.comm
        if comm is None:
            bind(None)
            return body()
        stream = self.cupy.cuda.get_current_stream()
        if stream.is_capturing():
            bind(None)
            return body()
        comm.check_usable()  # a closed or aborted communicator's graphs are gone
        kept = self.kept.pop(key, None)  # put back last: the most recently launched
        if kept is None and key not in self._seen:  # new: eager, captured on a repeat
            bind(None)
            with measured(self.cupy) as nbytes:
                returned = body()
            self._seen[key] = nbytes[0], keep
            while len(self._seen) > self.KEPT:
                self._seen.pop(next(iter(self._seen)))
            return returned
        if kept is None:
            bind(None)  # on the current stream, before the graph that is launched on it
            kept = self._capture(comm, body, self._seen.pop(key)[0], keep, here)
            if kept is None:  # capture failed: this plan's calls run eagerly from now on
                return body()
        else:
            bind(kept[5])
        self.kept[key] = kept
        while len(self.kept) > self.KEPT:
            self.kept.pop(next(iter(self.kept)))
        graph, record, returned = kept[:3]
        graph.launch(stream=stream)
        comm.track(stream, record)
        return returned

    def _capture(
        self, comm: Capturable, body: Callable[[], Any], nbytes: int, keep: Any, here: Any
    ) -> tuple[Any, Any, Any, Arena, Any, Any] | None:
        """What :attr:`kept` holds of ``body``'s graph, captured on a stream of the
        plan's own (the current stream may be the legacy default stream, which cannot be
        captured) with the plan's arena, grown to ``nbytes`` (an empty one, which refuses
        every allocation, when the eager run made none); None when capture failed
        (nothing ran; the plan stops capturing)."""
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=True)
        capture = self._stream
        if nbytes and (self._arena is None or self._arena.nbytes < nbytes):
            self._arena = Arena(self.cupy, nbytes)  # graphs made before keep the old one
        # a body whose eager run allocated nothing gets an arena that refuses everything
        arena = self._arena if nbytes and self._arena else Arena(self.cupy, 0)
        graph, returned, failed = None, None, False
        with comm.capturing() as record:
            capture.begin_capture()
            try:
                with capture, arena.serving():
                    returned = body()
            except Exception as exc:
                if not refused_by_capture(self.cupy, exc):
                    raise
                failed = True  # an operation capture does not take: discarded below
            finally:
                try:
                    graph = capture.end_capture()
                except Exception:  # capture broken by an unsupported operation
                    graph = None
        if graph is not None and not failed:
            hold = getattr(comm, "hold_graphs", None)
            if hold is not None:  # NCCL: the communicator drops its graphs before it ends
                hold(self)
            self._pending = graph  # held there alone: an abort in the exchange drops it
        graph = None
        # given up on every rank alike when it failed on one (NCCL's rule): the ranks
        # whose capture succeeded drop their graph, whose work never ran
        try:
            agreed = comm.captured_everywhere(self._pending is not None)
        finally:
            graph, self._pending = self._pending, None
        if not agreed or graph is None:
            self.comm = None
            return None
        return graph, record, returned, arena, keep, here

    def release(self, drained: bool = True) -> None:
        """Drop every graph (the communicator refuses later calls: it is ending). NCCL's
        ``ncclCommDestroy`` and ``ncclCommAbort`` wait until every CUDA graph that
        captured a transfer of the communicator has been destroyed, so the communicator
        calls this before it ends (:meth:`geocomm.comm.nccl.NCCLCommunicator.close`).
        ``drained``: no launch of them can still be running; otherwise (an abort) what
        they write (their arenas, returns and kept buffers) stays allocated for good."""
        if not drained:
            _ORPHANED.extend(entry[1:] for entry in self.kept.values())
        self.kept.clear()
        self._seen.clear()
        self._pending = None
