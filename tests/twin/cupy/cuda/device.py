"""``cupy.cuda.device`` of the twin."""

from cupy._core import Device

__all__ = ["Device"]
