"""Clocks of the GPU perf scripts (perf/gpu_check.py's ``timing``, perf/gpu_timing.py).

:func:`measure` gives what one call of an operation costs in its steady state
(warmed up, calls queued back to back), in seconds per call, three ways:

* ``wall``: ``calls`` calls queued back to back, one synchronization at the
  end, divided by ``calls``: what a loop that never waits for a result sees.
* ``host``: the host's own time per call while the device is held behind a
  spin kernel, so that the host never waits for the device: Python, argument
  checks, allocations and launches. A call that waits for the device inside
  shows: the hold ends before every call is queued (``gated`` is False).
* ``device``: CUDA events around the same queued calls, per call: the
  kernels, copies and transfers and the gaps between them, without the
  host's launch time.

On the CPU twin of CuPy (tests/twin) there is no device timer and no spin
kernel: ``device`` is the host clock from the first queued call to the end
event's synchronization and ``gated`` is None. Those numbers are not
meaningful (host memory, kernels compiled for the CPU and run one block at a
time): the scripts report them and enforce nothing on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: Holds a stream for a number of clock cycles (the calls are queued behind it).
SPIN_SOURCE = r"""
extern "C" __global__ void gc_spin(long long cycles)
{
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""

#: what times ``device`` on the twin, which has no device timer (printed beside it)
TWIN_CLOCK = "the host clock"


def is_twin(cp: Any) -> bool:
    """Whether ``cp`` is the CPU twin of CuPy (tests/twin) rather than CuPy."""
    return bool(getattr(cp, "TWIN", False))


def device_clock(cp: Any) -> str:
    """What measures ``device`` seconds with this ``cp``."""
    return TWIN_CLOCK if is_twin(cp) else "CUDA events"


def sync(cp: Any) -> None:
    cp.cuda.Device().synchronize()


@dataclass(frozen=True)
class CallTime:
    """Seconds per call of one operation (see the module docstring): ``wall``,
    ``host`` and ``device``; ``gated``: whether the host queued every call while
    the device was held (None: not measurable, on the twin); ``calls``: how many
    calls each figure averages."""

    wall_s: float
    host_s: float
    device_s: float
    gated: bool | None
    calls: int

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _clock_hz(cp: Any) -> float:
    try:
        return 1e3 * float(cp.cuda.Device().attributes["ClockRate"])  # kHz
    except Exception:  # an attribute this CUDA no longer reports: assume 2 GHz
        return 2e9


def hold(cp: Any, seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for about ``seconds``
    (no-op on the twin, which cannot spin a device)."""
    if is_twin(cp):
        return
    spin = cp.RawKernel(SPIN_SOURCE, "gc_spin")
    spin((1,), (1,), (np.int64(seconds * _clock_hz(cp)),))


def elapsed(cp: Any, start: Any, end: Any, host_began: float) -> float:
    """Seconds between two recorded events, ``end`` synchronized: CUDA's event
    timer, or on the twin the host clock since ``host_began``."""
    end.synchronize()
    if is_twin(cp):
        return time.perf_counter() - host_began
    return float(cp.cuda.get_elapsed_time(start, end)) / 1e3


def median_seconds(cp: Any, op: Callable[[], Any], repeats: int) -> float:
    """Median wall time of op() between device synchronizations: what a caller
    that waits for each result sees, host overhead included."""
    for _ in range(2):
        op()
    sync(cp)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        sync(cp)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(cp: Any, op: Callable[[], Any], calls: int, warmup: int = 3) -> CallTime:
    """:class:`CallTime` of ``op`` over ``calls`` queued calls, after ``warmup`` calls
    (a device call plans its signature at the first call and captures a CUDA graph
    at the second: the third is the first steady one)."""
    for _ in range(warmup):
        op()
    sync(cp)
    began = time.perf_counter()
    for _ in range(calls):
        op()
    queued = time.perf_counter() - began
    sync(cp)
    wall = (time.perf_counter() - began) / calls
    start, end = cp.cuda.Event(), cp.cuda.Event()
    # held for twice what queueing took unheld: long enough that the device is
    # still busy when the last call has been queued, unless a call waits on it
    hold(cp, 2 * queued + 0.02)
    start.record()
    began = time.perf_counter()
    for _ in range(calls):
        op()
    host = (time.perf_counter() - began) / calls
    gated = None if is_twin(cp) else not start.done
    end.record()
    device = elapsed(cp, start, end, began) / calls
    return CallTime(wall, host, device, gated, calls)
