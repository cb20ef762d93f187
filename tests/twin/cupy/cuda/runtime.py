"""``cupy.cuda.runtime`` of the twin: device count, asynchronous copies."""

from __future__ import annotations

import numpy as np

from cupy import _core, _device, _memory
from cupy._device import CUDARuntimeError

__all__ = [
    "CUDARuntimeError",
    "deviceSynchronize",
    "eventQuery",
    "getDevice",
    "getDeviceCount",
    "memcpyAsync",
    "memcpyDeviceToDevice",
]

memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = (
    range(5)
)


def getDeviceCount() -> int:
    return _core.device_count()


def getDevice() -> int:
    return _core._current_device()


def deviceSynchronize() -> None:
    _device.synchronize_all()


def eventQuery(event: int) -> int:
    """CUDA's status of an event (``Event.status``): returned, never raised, as CuPy's
    ``runtime.eventQuery`` does."""
    return _device.event_of(event).status()


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """A device-to-device copy of ``size`` bytes between raw addresses, on ``stream``."""
    _device.check_failure()
    if kind != memcpyDeviceToDevice:
        raise NotImplementedError("the CuPy twin copies device-to-device only through memcpyAsync")
    if size == 0:
        return
    d_alloc, d_off = _memory.find(dst, size)
    s_alloc, s_off = _memory.find(src, size)
    target = d_alloc.payload[d_off : d_off + size]
    source = s_alloc.payload[s_off : s_off + size]

    def copy() -> None:
        with _device.device_lock:
            np.copyto(target, source)

    _device.stream_of(stream).enqueue(
        copy,
        "a device-to-device memcpyAsync",
        [_device.Access(s_alloc, s_off, s_off + size)],
        [_device.Access(d_alloc, d_off, d_off + size)],
    )
