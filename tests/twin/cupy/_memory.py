"""Device memory of the twin: host buffers with red zones, found by address.

Every allocation is its own NumPy buffer: ``REDZONE`` poisoned bytes, the
payload, ``REDZONE`` more. The payload starts poisoned too (``cupy.empty`` is
uninitialised memory; a read of bytes nobody wrote then yields huge values
rather than plausible zeros). :func:`check_redzones` runs after every kernel
launch, copy and transfer: a write past either end of an allocation (a bound
check loosened from ``<`` to ``<=``) changes a red-zone byte and raises
:class:`OutOfBounds`. Addresses are real host addresses, so kernels compiled
for the host use them as they are; :func:`find` maps an address back to its
allocation (NCCL and memcpy take raw pointers).

A pool, as CuPy's: the memory of an allocation that died (every array and
pointer into it gone) goes back to the free blocks of the stream it was allocated
on, and the next allocation of the same size on that stream takes it again, at
the same address, with its stale bytes and its access history. CuPy hands a freed
block out again on its own stream only, trusting that stream's order: work that
another stream queued on the block before it was freed comes before the new
owner's only if the block's stream waited for that stream, and the stream-order
checker (:mod:`cupy._device`) reports the new owner's first access otherwise,
as the race it would be on a GPU. A dead allocation's address is no longer
:func:`find`'s, so a pointer kept past its array's death still fails as before.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref

import numpy as np

#: Guard bytes on each side of an allocation.
REDZONE = 256
#: The byte every guard and every fresh payload holds: 0x7E7E7E7E is a large finite
#: float32 (8.4e37), so a stray read changes an amax instead of vanishing as a zero.
POISON = 0x7E


#: What the host asked of the device, counted for the tests of geocomm's steady state:
#: ``allocations`` (every device allocation), ``launches`` (work queued on a stream:
#: kernels, copies, fills, NCCL groups), ``captured`` (work captured into a graph),
#: ``graph_launches``, ``events`` (records), ``syncs`` (the host waiting for the device:
#: stream, event and device synchronizations, copies to the host).
counters: collections.Counter[str] = collections.Counter()
_counters_lock = threading.Lock()


def count(kind: str) -> None:
    with _counters_lock:
        counters[kind] += 1


class OutOfBounds(RuntimeError):
    """A kernel, copy or transfer wrote outside its allocation, or a pointer names no
    live allocation."""


class Allocation:
    """One device allocation: ``nbytes`` payload bytes at host address ``ptr``."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, nbytes: int, stream: int | None = None):
        """A block of ``nbytes`` for ``stream`` (the pool's, when it holds a freed one of
        that size; None: always a new one, never pooled)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        self.id = next(Allocation._ids)
        count("allocations")
        self.nbytes = int(nbytes)
        freed = _take_freed(stream, self.nbytes) if stream is not None else None
        if freed is None:
            self.raw = np.full(self.nbytes + 2 * REDZONE, POISON, np.uint8)
            # per-range access history for the stream-order checker (geocomm twin _device)
            self.writes: list = []
            self.reads: list = []
        else:
            self.raw, self.writes, self.reads = freed
        self.ptr = int(self.raw.ctypes.data) + REDZONE
        self.payload = self.raw[REDZONE : REDZONE + self.nbytes]
        _register(self)
        freed = None if stream is None else (stream, self.raw, self.writes, self.reads)
        weakref.finalize(self, _release, self.ptr, freed)

    def __repr__(self) -> str:
        return f"<twin allocation #{self.id} of {self.nbytes} bytes>"

    def redzones_intact(self) -> bool:
        raw = self.raw
        return bool(
            (raw[:REDZONE] == POISON).all() and (raw[REDZONE + self.nbytes :] == POISON).all()
        )


_lock = threading.Lock()
_starts: list[int] = []  # sorted payload addresses of live allocations
_by_start: dict[int, weakref.ref] = {}


def _register(alloc: Allocation) -> None:
    with _lock:
        bisect.insort(_starts, alloc.ptr)
        _by_start[alloc.ptr] = weakref.ref(alloc)


def _release(ptr: int, freed: tuple | None) -> None:
    """A dead allocation: its address leaves :func:`find`'s view, then its block (when
    pooled: ``freed``) joins the free ones."""
    _unregister(ptr)
    if freed is not None:
        _give_back(*freed)


#: Freed blocks (raw buffer, writes, reads) by (stream, payload bytes), oldest first
_free: collections.OrderedDict[tuple[int, int], list[tuple]] = collections.OrderedDict()
_free_bytes = 0
#: what the pool keeps at most; the oldest blocks beyond it go for good
POOL_BYTES = 256 << 20


def _take_freed(stream: int, nbytes: int) -> tuple | None:
    global _free_bytes
    with _lock:
        blocks = _free.get((stream, nbytes))
        if not blocks:
            return None
        _free_bytes -= nbytes
        block = blocks.pop()
        if not blocks:
            del _free[(stream, nbytes)]
        return block


def _give_back(stream: int, raw: np.ndarray, writes: list, reads: list) -> None:
    global _free_bytes
    nbytes = raw.size - 2 * REDZONE
    with _lock:
        _free.setdefault((stream, nbytes), []).append((raw, writes, reads))
        _free_bytes += nbytes
        while _free_bytes > POOL_BYTES:
            key, blocks = next(iter(_free.items()))
            _free_bytes -= blocks.pop(0)[0].size - 2 * REDZONE
            if not blocks:
                del _free[key]


def _unregister(ptr: int) -> None:
    with _lock:
        ref = _by_start.get(ptr)
        if ref is not None and ref() is not None:  # the address is a new allocation's
            return
        i = bisect.bisect_left(_starts, ptr)
        if i < len(_starts) and _starts[i] == ptr:
            del _starts[i]
        _by_start.pop(ptr, None)


def find(ptr: int, nbytes: int) -> tuple[Allocation, int]:
    """(allocation, byte offset) of the ``nbytes`` bytes at ``ptr``; raises
    :class:`OutOfBounds` unless they lie inside one live allocation."""
    ptr, nbytes = int(ptr), int(nbytes)
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        ref = _by_start.get(_starts[i]) if i >= 0 else None
    alloc = ref() if ref is not None else None
    if alloc is None or not (alloc.ptr <= ptr and ptr + nbytes <= alloc.ptr + alloc.nbytes):
        raise OutOfBounds(
            f"twin: {nbytes} bytes at address {ptr:#x} lie in no live device allocation"
        )
    return alloc, ptr - alloc.ptr


def check_redzones(allocations, what: str) -> None:
    """Raise :class:`OutOfBounds` naming ``what`` if any allocation's guard bytes changed."""
    for alloc in allocations:
        if not alloc.redzones_intact():
            raw = alloc.raw
            low = np.flatnonzero(raw[:REDZONE] != POISON)
            high = np.flatnonzero(raw[REDZONE + alloc.nbytes :] != POISON)
            where = (
                f"{REDZONE - int(low[0])} bytes before its start"
                if low.size
                else f"{int(high[0])} bytes past its end ({alloc.nbytes} bytes)"
            )
            raise OutOfBounds(f"twin: {what} wrote outside {alloc!r}: {where}")


# pinned host memory


_pinned: dict[int, weakref.ref[np.ndarray]] = {}
_pinned_lock = threading.Lock()


def alloc_pinned(nbytes: int) -> np.ndarray:
    """``cupy.cuda.alloc_pinned_memory``: host memory (a uint8 array, which
    ``numpy.frombuffer`` reads) that an asynchronous copy to the host may target."""
    if nbytes < 0:
        raise ValueError(f"cannot allocate {nbytes} bytes of pinned memory")
    block = np.zeros(max(int(nbytes), 1), np.uint8)
    with _pinned_lock:
        for ptr in [p for p, ref in _pinned.items() if ref() is None]:
            del _pinned[ptr]
        _pinned[block.ctypes.data] = weakref.ref(block)
    return block


def is_pinned(a: np.ndarray) -> bool:
    """Whether all of ``a``'s memory lies in one live block of pinned memory."""
    start = a.__array_interface__["data"][0]
    end = start + a.nbytes
    with _pinned_lock:
        for ptr, ref in _pinned.items():
            block = ref()
            if block is not None and ptr <= start and end <= ptr + block.nbytes:
                return True
    return False
