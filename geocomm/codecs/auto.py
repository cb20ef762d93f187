"""``codec="auto"``: compress only messages large enough for it to pay.

Below ``crossover_bytes`` (of fp32 data) the fixed costs of the compressed
algorithm (two collectives instead of one, encode and decode calls) exceed
what fewer bytes save, so the plain all-reduce is used; at and above it the
``codec`` given (default ``fp8``). The choice depends only on the element
count, the backend and the rank count, which every rank shares, so all ranks
choose alike. By default (``crossover_bytes=None``) the crossover is the
backend's: measured for host backends, modelled for devices, where a launch
costs microseconds and the link moves hundreds of GB/s; a number fixes it for
every backend. The engine's cost model makes the choice
(:func:`geocomm.engine.costs.codec_for`); this class only holds the
configuration.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from geocomm.codecs.base import Codec, StatefulCodec
from geocomm.codecs.formats import NoneCodec
from geocomm.codecs.frames import FramedCodec


class AutoCodec(FramedCodec):
    """Chooses between the plain collective and ``codec`` by message size."""

    codec_id: ClassVar[str] = "auto"

    def __init__(self, codec: Any = "fp8", crossover_bytes: int | None = None):
        from geocomm.codecs.registry import get_codec

        self.inner = get_codec(codec)
        if isinstance(self.inner, AutoCodec) or self.inner.lossless:
            raise ValueError("auto needs a compressing codec to switch to")
        if isinstance(self.inner, StatefulCodec):
            # its state would live behind auto, out of checkpoints and cross-rank checks
            raise ValueError(
                f"auto switches to a stateless codec, not {self.inner.get_config()} "
                "(use a stateful codec, GeoFP8 or error feedback, directly)"
            )
        if crossover_bytes is not None and (
            isinstance(crossover_bytes, bool)
            or not isinstance(crossover_bytes, (int, np.integer))
            or crossover_bytes < 0
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

    @property
    def plain(self) -> Codec:
        """The codec below the crossover: the plain collective."""
        return self._plain

    # standalone frames and the wire API use the compressing codec
    def scale_span(self) -> int:
        return self.inner.scale_span()

    def wire_size(self, n: int) -> int:
        return self.inner.wire_size(n)

    def encode_wire(
        self, x: np.ndarray, wire: np.ndarray, *, rounding_stream: int = 0, offset: int = 0
    ) -> None:
        self.inner.encode_wire(x, wire, rounding_stream=rounding_stream, offset=offset)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        self.inner.decode_wire(wire, out, accumulate)

    def decode_wire_onto(self, wire: np.ndarray, base: np.ndarray, out: np.ndarray) -> None:
        self.inner.decode_wire_onto(wire, base, out)

    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        return self.inner.frame_body_size(shape)

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        self.inner.encode_frame_body(x, body)

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        self.inner.decode_frame_body(body, out)
