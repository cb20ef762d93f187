"""``cupy.cuda`` of the twin: devices, streams, events, NVRTC, modules, NCCL."""

from __future__ import annotations

from typing import Any

from cupy import _memory
from cupy._core import Device, MemoryPointer, get_allocator, using_allocator
from cupy._device import CUDARuntimeError, Event, ExternalStream, Stream, StreamOrderError
from cupy._device import current_stream as _current_stream
from cupy.cuda import function, nvrtc, runtime

__all__ = [
    "CUDARuntimeError",
    "Device",
    "Event",
    "ExternalStream",
    "MemoryPointer",
    "Stream",
    "StreamOrderError",
    "alloc",
    "alloc_pinned_memory",
    "function",
    "get_allocator",
    "get_current_stream",
    "get_device_id",
    "nccl",
    "nvrtc",
    "runtime",
    "using_allocator",
]


def alloc(size: int) -> MemoryPointer:
    """``cupy.cuda.alloc``: ``size`` bytes from this thread's allocator."""
    pointer: MemoryPointer = get_allocator()(size)
    return pointer


def alloc_pinned_memory(size: int) -> Any:
    """Pinned host memory of ``size`` bytes (``numpy.frombuffer`` reads it)."""
    return _memory.alloc_pinned(size)


def get_current_stream(device_id: int | None = None) -> Stream:
    return _current_stream()


def get_device_id() -> int:
    return Device().id


def __getattr__(name: str) -> Any:
    if name == "nccl":  # needs mpi4py: imported on first use
        import importlib

        return importlib.import_module("cupy.cuda.nccl")
    raise AttributeError(f"module 'cupy.cuda' (twin) has no attribute {name!r}")
