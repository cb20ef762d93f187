"""``codec="auto"``: compress only messages large enough for it to pay.

Below ``crossover_bytes`` (of fp32 data) the fixed costs of the compressed
algorithm (two collectives instead of one, encode and decode calls) exceed
what fewer bytes save, so the plain all-reduce is used; at and above it the
``codec`` given (default ``fp8``). The choice depends only on the element
count, which every rank shares, so all ranks choose alike. The default
crossover is measured: see perf/results/crossover.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from geocomm.codecs.base import Codec
from geocomm.codecs.formats import NoneCodec

#: Measured on an emulated 10 Gbit/s link, 2 ranks (perf/results/crossover.md):
#: plain wins up to 256 KiB, ties at 1 MiB, fp8 is 3.8x faster at 4 MiB.
DEFAULT_CROSSOVER_BYTES = 2 << 20


class AutoCodec(Codec):
    """Chooses between the plain collective and ``codec`` by message size."""

    codec_id: ClassVar[str] = "auto"

    def __init__(self, codec: Any = "fp8", crossover_bytes: int = DEFAULT_CROSSOVER_BYTES):
        from geocomm.codecs.registry import get_codec

        self.inner = get_codec(codec)
        if isinstance(self.inner, AutoCodec) or self.inner.lossless:
            raise ValueError("auto needs a compressing codec to switch to")
        if not isinstance(crossover_bytes, (int, np.integer)) or crossover_bytes < 0:
            raise ValueError(f"crossover_bytes must be a non-negative integer, got "
                             f"{crossover_bytes!r}")
        self.crossover_bytes = int(crossover_bytes)
        self._plain = NoneCodec()

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "codec": self.inner.get_config(),
                "crossover_bytes": self.crossover_bytes}

    def for_count(self, count: int) -> Codec:
        """The codec used for ``count`` values: plain below the crossover."""
        return self.inner if 4 * count >= self.crossover_bytes else self._plain

    # standalone frames and the wire API use the compressing codec
    def wire_size(self, n: int) -> int:
        return self.inner.wire_size(n)

    def encode_wire(self, x: np.ndarray, wire: np.ndarray, *, stream: int = 0,
                    offset: int = 0) -> None:
        self.inner.encode_wire(x, wire, stream=stream, offset=offset)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        self.inner.decode_wire(wire, out, accumulate)

    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        return self.inner.frame_body_size(shape)

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        self.inner.encode_frame_body(x, body)

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        self.inner.decode_frame_body(body, out)
