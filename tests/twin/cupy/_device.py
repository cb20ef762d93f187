"""Streams, events and the stream-order checker of the twin.

Execution. Every stream has a worker thread that runs the stream's queued
operations in order, later than the call that queued them: like a GPU, the
host returns at once and the work happens behind it. An event is a marker in
a stream's queue; ``Stream.wait_event`` queues an operation that blocks the
stream until the event has passed. Kernel launches of all streams take one
device lock (one launch at a time: blocks run one after another). A failing
operation (an out-of-bounds write, a bad launch, an NCCL mismatch) makes the
device error sticky, as CUDA does: every later call into the twin raises
:class:`CUDARuntimeError` with the first failure's message.

Ordering, checked. The checker is a vector clock per stream and one for the
host, advanced at call time (so it does not depend on timing): an operation
queued on stream S may touch bytes last written by an operation on stream T
(or read by one, if it writes them) only if S's clock covers that operation,
i.e. S waited on an event recorded on T after it, or the host synchronized
with T and queued the work on S afterwards. Anything else is a race on a
real GPU, and the twin raises :class:`StreamOrderError` naming both
operations. The host's own reads (``get``) and writes (``set``, ``asarray``)
follow the same rule against its clock, which grows on ``synchronize``.

Graphs. ``Stream.begin_capture`` makes a stream record its work instead of
queuing it; a stream that waits on an event recorded under capture joins the
capture. ``end_capture`` refuses a capture whose joined streams the origin did
not wait for again (CUDA's "unjoined" error) and returns a :class:`Graph`;
``Graph.launch(stream)`` replays every captured operation, in capture order, on
streams of the graph's own, with the events between them, after the launch
stream's earlier work and before its later work. The checker runs on the
replay, so a graph whose nodes miss a dependency fails like eager work would.
Under capture the host may not synchronize with a capturing stream, query a
captured event, read device memory on a capturing stream or write it from the
host (a graph's copy would read the host buffer at every replay, long after
CuPy's staging copy of it is gone; CuPy's concatenate of more than 8 small
arrays uploads a table of their addresses), or allocate on one from the
twin's own allocator (CuPy's pool): the pool would hand the block to
someone else once the array that holds it dies, while every replay of the
graph still writes it (and a pool that asks the driver for memory breaks the
capture), so a graph's buffers are made before it is captured, or come from
memory made before it through ``cupy.cuda.using_allocator``.

Counters. :data:`cupy._memory.counters` counts allocations, launches, captured
operations, graph launches, event records and host synchronizations, so tests
can state what a steady-state call costs the host.

A lagging device. The workers usually drain a queue before the host asks again,
so a host read of results it does not wait for would pass by luck. Inside
:func:`hold` the workers run nothing, as a GPU busy with earlier work, and a
host synchronization, which would then wait for the held work, raises
:class:`DeviceHeld` instead of waiting.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cupy import _memory


class CUDARuntimeError(RuntimeError):
    """The twin's device error (sticky, like CUDA's)."""


class DeviceHeld(RuntimeError):
    """The host would wait for work of a device that a test holds (:func:`hold`)."""


#: Cleared while a test holds the device: the streams' workers run nothing.
_released = threading.Event()
_released.set()


@contextlib.contextmanager
def hold() -> Iterator[None]:
    """The device lagging the host: inside, no stream runs its queue, and a host
    synchronization raises :class:`DeviceHeld` (on a GPU it would wait for the held
    work). The queues run on leaving. Not reentrant."""
    if not _released.is_set():
        raise RuntimeError("twin: the device is held already")
    _released.clear()
    try:
        yield
    finally:
        _released.set()


def _host_waits(what: str, waits: bool) -> None:
    """Count a host synchronization; one that ``waits`` for queued work raises
    inside :func:`hold` instead."""
    if waits and not _released.is_set():
        raise DeviceHeld(f"twin: {what} while the test holds the device (cupy._device.hold)")
    _memory.count("syncs")


class StreamOrderError(RuntimeError):
    """Work touches device memory that another stream wrote (or reads) without an
    event wait, or the host reads memory whose writes it has not waited for."""


#: the sticky device error: (message,) once an operation failed
_failure: list[str] = []
_failure_lock = threading.Lock()
#: one kernel launch, copy or transfer at a time (blocks run one after another)
device_lock = threading.RLock()


def fail(message: str) -> None:
    with _failure_lock:
        if not _failure:
            _failure.append(message)


def check_failure() -> None:
    """Raise the sticky device error, if any."""
    if _failure:
        raise CUDARuntimeError(f"twin device error (sticky): {_failure[0]}")


# ---------------------------------------------------------------------------
# clocks


#: Seconds a synchronization waits on a stream that makes no progress (its queue's head
#: does not change) before it raises; below pytest's timeout, so that the error names
#: the stream and what it waits in.
STUCK_S = float(os.environ.get("GEOCOMM_TWIN_STUCK_S", "240"))

HOST = -1  # the host's clock index (streams are >= 0: the null stream is 0)
_clock_lock = threading.RLock()
_host_clock: dict[int, int] = {}


def _covers(clock: dict[int, int], who: int, seq: int) -> bool:
    return clock.get(who, 0) >= seq


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class Access:
    """One operation's view of a range of an allocation."""

    __slots__ = ("alloc", "hi", "lo")

    def __init__(self, alloc: _memory.Allocation, lo: int, hi: int):
        self.alloc, self.lo, self.hi = alloc, lo, hi


class _Record:
    __slots__ = ("hi", "lo", "seq", "what", "who")

    def __init__(self, lo: int, hi: int, who: int, seq: int, what: str):
        self.lo, self.hi, self.who, self.seq, self.what = lo, hi, who, seq, what


def _name(who: int) -> str:
    return "the host" if who == HOST else f"stream {who:#x}"


def _check_and_record(
    clock: dict[int, int],
    who: int,
    seq: int,
    what: str,
    reads: Iterable[Access],
    writes: Iterable[Access],
) -> None:
    """The checker: raise unless every earlier conflicting access is covered by
    ``clock``, then remember this access."""
    reads, writes = list(reads), list(writes)
    for acc, is_write in [(a, False) for a in reads] + [(a, True) for a in writes]:
        if acc.hi <= acc.lo:
            continue
        conflicts = acc.alloc.writes + (acc.alloc.reads if is_write else [])
        for rec in conflicts:
            if (
                rec.lo < acc.hi
                and acc.lo < rec.hi
                and rec.who != who
                and not _covers(clock, rec.who, rec.seq)
            ):
                verb = "writes" if is_write else "reads"
                kind = "wrote" if rec in acc.alloc.writes else "read"
                raise StreamOrderError(
                    f"twin: {what} on {_name(who)} {verb} bytes [{max(acc.lo, rec.lo)}, "
                    f"{min(acc.hi, rec.hi)}) of {acc.alloc!r}, which {rec.what} on "
                    f"{_name(rec.who)} {kind}, with no event wait (or host synchronization) "
                    "ordering the two"
                )
    for acc in reads:
        if acc.hi > acc.lo:
            _remember(acc.alloc.reads, acc, who, seq, what)
    for acc in writes:
        if acc.hi > acc.lo:
            # a covered write and the reads before it no longer matter where it overwrote
            acc.alloc.reads[:] = [
                r for r in acc.alloc.reads if not (acc.lo <= r.lo and r.hi <= acc.hi)
            ]
            _remember(acc.alloc.writes, acc, who, seq, what)


def _remember(records: list, acc: Access, who: int, seq: int, what: str) -> None:
    records[:] = [r for r in records if not (acc.lo <= r.lo and r.hi <= acc.hi and r.who == who)]
    records.append(_Record(acc.lo, acc.hi, who, seq, what))


def host_access(what: str, reads: Iterable[Access] = (), writes: Iterable[Access] = ()) -> None:
    """The host reads/writes device memory now (after synchronizing what it needed)."""
    check_failure()
    with _clock_lock:
        seq = _host_clock.get(HOST, 0) + 1
        _host_clock[HOST] = seq
        _check_and_record(_host_clock, HOST, seq, what, reads, writes)


# ---------------------------------------------------------------------------
# streams and events


_stream_ids = itertools.count(0x1000, 0x10)
_events_by_ptr: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def event_of(ptr: int) -> Event:
    try:
        return _events_by_ptr[int(ptr)]
    except KeyError:
        raise CUDARuntimeError(f"twin: no event has handle {int(ptr):#x}") from None


_streams_by_ptr: dict[int, Any] = {}


class Event:
    """A marker in a stream's queue (``cupy.cuda.Event``)."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ):
        _events_by_ptr[id(self)] = self
        self._passed = threading.Event()
        self._passed.set()  # never recorded: complete, as in CUDA
        self.clock: dict[int, int] = {}
        self.stream: Stream | None = None
        self.capture: _Capture | None = None  # recorded under that capture

    def record(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).record(self)

    def _not_captured(self, what: str) -> None:
        if self.capture is not None:
            raise CUDARuntimeError(
                f"cudaErrorStreamCaptureUnsupported: {what} of an event recorded under capture"
            )

    def status(self) -> int:
        """cudaEventQuery: 0 (cudaSuccess) once the work before the event completed, 600
        (cudaErrorNotReady) before; the sticky device error's status (999 here) once the
        device failed, 900 (cudaErrorStreamCaptureUnsupported) for an event recorded
        under capture. CUDA returns these codes; it raises nothing."""
        if self.capture is not None:
            return 900
        if _failure:
            return 999
        return 0 if self._passed.is_set() else 600

    @property
    def done(self) -> bool:
        """CuPy's ``Event.done``: ``eventQuery(ptr) == 0``, False on any error."""
        return self.status() == 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        check_failure()  # CUDA returns the sticky error at once, waiting for nothing
        self._not_captured("a synchronization")
        _host_waits("an event synchronization", not self._passed.is_set())
        while not self._passed.wait(0.05):
            check_failure()
        check_failure()
        with _clock_lock:
            _merge(_host_clock, self.clock)

    @property
    def ptr(self) -> int:
        return id(self)


class Stream:
    """A CUDA stream of the twin: a queue run in order by its own worker thread."""

    null: Stream  # set below

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else next(_stream_ids)
        self.non_blocking = non_blocking
        self.clock: dict[int, int] = {}
        self.seq = 0
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self.capture: _Capture | None = None
        _streams_by_ptr[self.ptr] = self

    def __repr__(self) -> str:
        return f"<twin Stream {self.ptr:#x}>"

    @classmethod
    def from_external(cls, obj: Any) -> Stream:
        """CuPy 14's wrapper of a foreign stream: ``obj.__cuda_stream__()`` gives
        (version, handle); the twin knows only its own streams' handles."""
        protocol = getattr(obj, "__cuda_stream__", None)
        if protocol is None:
            raise TypeError(f"{type(obj).__name__} has no __cuda_stream__ protocol")
        return stream_of(protocol()[1])

    # -- queue -----------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run, name=f"twin-{self.ptr:#x}", daemon=True
            )
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.notify_all()
                    self._cv.wait()
                op = self._queue[0]
            _released.wait()
            try:
                if not _failure:
                    op()
            except BaseException as exc:  # the sticky device error
                fail(
                    f"{getattr(op, 'what', 'an operation')} on {_name(self.ptr)}: "
                    f"{type(exc).__name__}: {exc}"
                )
            finally:
                del op  # with the queue's reference below, what it held (arrays) may die
                with self._cv:
                    self._queue.popleft()

    def enqueue(
        self,
        fn: Callable[[], None],
        what: str,
        reads: Iterable[Access] = (),
        writes: Iterable[Access] = (),
    ) -> None:
        """Queue ``fn`` (run later by the worker, in order); check its accesses now. Under
        capture: record it in the graph instead."""
        check_failure()
        if self.capture is not None:
            self.capture.add(("op", self, fn, what, list(reads), list(writes)))
            _memory.count("captured")
            return
        _memory.count("launches")
        self._enqueue(fn, what, reads, writes)

    def _enqueue(
        self,
        fn: Callable[[], None],
        what: str,
        reads: Iterable[Access] = (),
        writes: Iterable[Access] = (),
    ) -> None:
        with _clock_lock:
            _merge(self.clock, _host_clock)  # what the host did or waited for comes first
            self.seq += 1
            self.clock[self.ptr] = self.seq
            _check_and_record(self.clock, self.ptr, self.seq, what, reads, writes)
        fn.what = what  # type: ignore[attr-defined]
        self._push(fn)

    def _push(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._queue.append(fn)
            self._ensure_worker()
            self._cv.notify_all()

    def record(self, event: Event | None = None) -> Event:
        _memory.count("events")
        return self._record(event)

    def _record(self, event: Event | None = None) -> Event:
        check_failure()
        event = event or Event()
        if self.capture is not None:
            event.capture, event.stream = self.capture, self
            self.capture.add(("record", self, event))
            return event
        event.capture = None
        event._passed = passed = threading.Event()
        with _clock_lock:
            _merge(self.clock, _host_clock)
            event.clock = dict(self.clock)
            event.clock[self.ptr] = self.seq
        event.stream = self

        def mark() -> None:
            passed.set()

        mark.what = "an event"  # type: ignore[attr-defined]
        self._push(mark)
        return event

    def wait_event(self, event: Event) -> None:
        check_failure()
        if event.capture is not None or self.capture is not None:
            self._wait_captured(event)
            return
        with _clock_lock:
            _merge(self.clock, event.clock)
        passed = event._passed

        def block() -> None:
            while not passed.wait(0.05):
                if _failure:
                    return

        block.what = "an event wait"  # type: ignore[attr-defined]
        self._push(block)

    def _wait_captured(self, event: Event) -> None:
        """A wait under capture: on an event of the capture (joining it, if this stream
        was not capturing yet); an event recorded outside is refused, as in CUDA."""
        capture = event.capture
        if capture is None:
            raise CUDARuntimeError(
                "cudaErrorStreamCaptureIsolation: a capturing stream waits for an event "
                "recorded outside the capture"
            )
        if self.capture is None:
            capture.join(self)
        elif self.capture is not capture:
            raise CUDARuntimeError("cudaErrorStreamCaptureMerge: two captures would merge")
        capture.add(("wait", self, event))

    def _not_capturing(self, what: str) -> None:
        if self.capture is not None:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} under capture")

    # -- graphs ----------------------------------------------------------------
    def begin_capture(self, mode: Any = None) -> None:
        check_failure()
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self.capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is capturing already")
        self.capture = _Capture(self)

    def is_capturing(self) -> bool:
        return self.capture is not None

    def end_capture(self) -> Graph:
        capture = self.capture
        if capture is None or capture.origin is not self:
            raise CUDARuntimeError(
                "cudaErrorStreamCaptureWrongThread: capture did not begin on this stream"
            )
        try:
            capture.check_joined()
        finally:
            for stream in capture.streams:
                stream.capture = None
        graph = Graph(capture.nodes, capture.__dict__.get("on_launch", ()))
        for hook in capture.__dict__.get("on_graph", ()):  # NCCL's persistent references
            hook(graph)
        return graph

    @property
    def done(self) -> bool:
        check_failure()
        self._not_capturing("a query")
        with self._cv:
            return not self._queue

    def synchronize(self) -> None:
        self._not_capturing("a synchronization")
        _host_waits("a stream synchronization", bool(self._queue))
        self._synchronize()

    def _synchronize(self) -> None:
        """Wait for the queue to drain; a queue whose head stays for STUCK_S seconds (a
        transfer whose peer never comes) raises, naming what it waits in, instead of
        hanging."""
        head, since = None, time.monotonic()
        with self._cv:
            while self._queue:
                if _failure:
                    break
                if self._queue[0] is not head:
                    head, since = self._queue[0], time.monotonic()
                elif time.monotonic() - since > STUCK_S:
                    what = getattr(head, "what", "an operation")
                    raise CUDARuntimeError(
                        f"twin: {_name(self.ptr)} made no progress for {STUCK_S:g} s: it "
                        f"waits in {what} ({len(self._queue)} operations queued)"
                    )
                self._cv.wait(0.05)
        check_failure()
        with _clock_lock:
            _merge(_host_clock, self.clock)
            _host_clock[self.ptr] = max(_host_clock.get(self.ptr, 0), self.seq)

    # -- current stream --------------------------------------------------------
    def use(self) -> Stream:
        _local().stack[-1:] = [self]
        return self

    def __enter__(self) -> Stream:
        _local().stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local().stack.pop()


class ExternalStream(Stream):
    """CuPy 13's wrapper of a foreign stream: deprecated in CuPy 14, as here."""

    def __new__(cls, ptr: int, device_id: int = -1):  # type: ignore[misc]
        import warnings

        warnings.warn(
            "cupy.cuda.ExternalStream is deprecated; use cupy.cuda.Stream.from_external instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return stream_of(ptr)


class _Capture:
    """The work of a capture in capture order: ``("op", stream, fn, what, reads,
    writes)``, ``("record", stream, event)``, ``("wait", stream, event)``."""

    def __init__(self, origin: Stream):
        self.origin = origin
        self.streams: list[Stream] = [origin]
        self.nodes: list[tuple] = []
        self.last: dict[int, int] = {}  # a stream's last node
        self.recorded: dict[int, int] = {}  # an event's record node
        self.joined: dict[int, int] = {}  # the last node of a stream the origin waited for

    def join(self, stream: Stream) -> None:
        stream.capture = self
        self.streams.append(stream)

    def add(self, node: tuple) -> None:
        stream, at = node[1], len(self.nodes)
        if node[0] == "record":
            self.recorded[id(node[2])] = at
        elif node[0] == "wait" and stream is self.origin:
            recorder = node[2].stream.ptr
            self.joined[recorder] = max(self.joined.get(recorder, -1), self.recorded[id(node[2])])
        self.last[stream.ptr] = at
        self.nodes.append(node)

    def check_joined(self) -> None:
        """CUDA's rule: every stream that joined the capture ends with work the origin
        waited for."""
        for stream in self.streams[1:]:
            if self.joined.get(stream.ptr, -1) < self.last.get(stream.ptr, -1):
                raise CUDARuntimeError(
                    f"cudaErrorStreamCaptureUnjoined: {_name(stream.ptr)} joined the capture "
                    "and the capturing stream did not wait for its last work"
                )


class Graph:
    """A captured graph (``cupy.cuda.graph.Graph``): ``launch(stream)`` replays it,
    first calling ``on_launch`` (what its capture's users asked to hear of each launch,
    on the host, in launch order)."""

    def __init__(self, nodes: list[tuple], on_launch: Any = ()):
        self.nodes = nodes
        self._on_launch = tuple(on_launch)
        self._streams: dict[int, Stream] = {}  # a captured stream's replay stream

    def _replay_stream(self, captured: Stream) -> Stream:
        stream = self._streams.get(captured.ptr)
        if stream is None:
            stream = self._streams[captured.ptr] = Stream(non_blocking=True)
        return stream

    def launch(self, stream: Stream | None = None) -> None:
        check_failure()
        stream = stream or current_stream()
        if stream.capture is not None:
            raise NotImplementedError("twin: a graph launched under capture")
        _memory.count("graph_launches")
        for hook in self._on_launch:
            hook()
        start = stream._record()
        used = {node[1].ptr: self._replay_stream(node[1]) for node in self.nodes}
        for replay in used.values():
            replay.wait_event(start)
        events: dict[int, Event] = {}
        for node in self.nodes:
            replay = used[node[1].ptr]
            if node[0] == "op":
                _, _, fn, what, reads, writes = node
                replay._enqueue(fn, f"{what} (graph)", reads, writes)
            elif node[0] == "record":
                events[id(node[2])] = replay._record()
            else:
                replay.wait_event(events[id(node[2])])
        for replay in used.values():
            stream.wait_event(replay._record())

    def upload(self, stream: Stream | None = None) -> None:
        """Nothing to prepare on the twin."""


Stream.null = Stream(null=True)


def stream_of(ptr: int) -> Stream:
    try:
        return _streams_by_ptr[int(ptr)]
    except KeyError:
        raise CUDARuntimeError(f"twin: no stream has handle {int(ptr):#x}") from None


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Stream] = [Stream.null]


_tls = _Local()


def _local() -> _Local:
    return _tls


def current_stream() -> Stream:
    return _tls.stack[-1]


def synchronize_all() -> None:
    """The device synchronization: every stream (none may be capturing)."""
    streams = list(_streams_by_ptr.values())
    for stream in streams:
        stream._not_capturing("a device synchronization")
    _host_waits("a device synchronization", any(s._queue for s in streams))
    for stream in streams:
        stream._synchronize()


def access(array: Any) -> Access:
    """The byte range an array (or view) covers in its allocation."""
    return Access(array._alloc, array._lo, array._hi)
