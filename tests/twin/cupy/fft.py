"""``cupy.fft`` of the twin: nothing is implemented (every name raises when called)."""

from typing import Any

from cupy._core import _not_implemented

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return _not_implemented(f"fft.{name}")
