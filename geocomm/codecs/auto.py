"""``codec="auto"``: compress only messages large enough for it to pay.

Below ``crossover_bytes`` (of fp32 data) the fixed costs of the compressed
algorithm (two collectives instead of one, encode and decode calls) exceed
what fewer bytes save, so the plain all-reduce is used; at and above it the
``codec`` given (default ``fp8``). The choice depends only on the element
count, the backend and the rank count, which every rank shares, so all ranks
choose alike. By default (``crossover_bytes=None``) the crossover is the
backend's (:func:`geocomm.engine.costs.crossover_bytes`): measured for host
backends (perf/results/crossover.md), modelled for devices, where a launch
costs microseconds and the link moves hundreds of GB/s; a number fixes it for
every backend.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from geocomm.codecs.base import Codec
from geocomm.codecs.formats import NoneCodec
from geocomm.codecs.frames import FramedCodec
from geocomm.engine import costs

#: The host backends' crossover (measured: see geocomm.engine.costs.HOST_CROSSOVER_BYTES).
DEFAULT_CROSSOVER_BYTES = costs.HOST_CROSSOVER_BYTES
#: Values whose wire size gives the inner codec's wire bytes per fp32 byte (the model's ratio).
_RATIO_VALUES = 1 << 20


class AutoCodec(FramedCodec):
    """Chooses between the plain collective and ``codec`` by message size."""

    codec_id: ClassVar[str] = "auto"

    def __init__(self, codec: Any = "fp8", crossover_bytes: int | None = None):
        from geocomm.codecs.registry import get_codec

        self.inner = get_codec(codec)
        if isinstance(self.inner, AutoCodec) or self.inner.lossless:
            raise ValueError("auto needs a compressing codec to switch to")
        if crossover_bytes is not None and (
            not isinstance(crossover_bytes, (int, np.integer)) or crossover_bytes < 0
        ):
            raise ValueError(
                f"crossover_bytes must be None or a non-negative integer, got {crossover_bytes!r}"
            )
        self.crossover_bytes = None if crossover_bytes is None else int(crossover_bytes)
        self._plain = NoneCodec()

    def get_config(self) -> dict[str, Any]:
        return {
            "id": self.codec_id,
            "codec": self.inner.get_config(),
            "crossover_bytes": self.crossover_bytes,
        }

    def crossover_for(self, backend: str | None = None, size: int = 2) -> int | None:
        """fp32 bytes from which ``count`` values go compressed on ``size`` ranks of
        ``backend`` (None: never): the configured number, else the backend's."""
        if self.crossover_bytes is not None:
            return self.crossover_bytes
        ratio = self.inner.wire_size(_RATIO_VALUES) / (4 * _RATIO_VALUES)
        return costs.crossover_bytes(backend, size, ratio)

    def for_count(self, count: int, backend: str | None = None, size: int = 2) -> Codec:
        """The codec used for ``count`` values on ``size`` ranks of ``backend``: plain
        below the crossover (:meth:`crossover_for`)."""
        crossover = self.crossover_for(backend, size)
        return self.inner if crossover is not None and 4 * count >= crossover else self._plain

    # standalone frames and the wire API use the compressing codec
    def wire_size(self, n: int) -> int:
        return self.inner.wire_size(n)

    def encode_wire(
        self, x: np.ndarray, wire: np.ndarray, *, rounding_stream: int = 0, offset: int = 0
    ) -> None:
        self.inner.encode_wire(x, wire, rounding_stream=rounding_stream, offset=offset)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        self.inner.decode_wire(wire, out, accumulate)

    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        return self.inner.frame_body_size(shape)

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        self.inner.encode_frame_body(x, body)

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        self.inner.decode_frame_body(body, out)
