"""``cupy.cuda.stream`` of the twin."""

from cupy._device import Event, ExternalStream, Stream

__all__ = ["Event", "ExternalStream", "Stream"]
