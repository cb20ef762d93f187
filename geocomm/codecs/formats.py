"""The quantizing formats: ``none``, ``bf16``, ``fp8`` (E4M3FN / E5M2), ``nvfp4``.

Each codec maps flat float32 data to a wire body laid out as in
``native/geocomm.h``; the native C core does the work and
``geocomm.codecs._reference`` defines the bytes it must produce.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from geocomm import _nativecodec as native
from geocomm.codecs.base import Codec


class NoneCodec(Codec):
    """No compression: the body is the raw little-endian float32 values."""

    codec_id: ClassVar[str] = "none"
    lossless: ClassVar[bool] = True

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    def wire_size(self, n: int) -> int:
        return 4 * n

    def encode_wire(self, x: np.ndarray, wire: np.ndarray) -> None:
        wire[: 4 * x.size] = x.view(np.uint8)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        values = wire[: 4 * out.size].view("<f4")
        if accumulate:
            out += values
        else:
            out[...] = values


def _backend(array: Any) -> Any:
    """The codec core for ``array``: the C core for NumPy, the CUDA kernels for CuPy."""
    if type(array).__module__.startswith("cupy"):
        from geocomm import cuda

        return cuda
    return native


class _NativeFormat(Codec):
    """A codec whose body is one native format (subclasses set ``_fmt``/``_block``).

    NumPy arrays run through the C core, CuPy arrays through the CUDA kernels
    built from the same arithmetic (``native/gc_scalar.h``): same bytes.
    """

    _fmt: int
    _block: int = 0

    def wire_size(self, n: int) -> int:
        return native.wire_size(self._fmt, n, self._block)

    def encode_wire(self, x: np.ndarray, wire: np.ndarray) -> None:
        _backend(x).encode(self._fmt, x, self._block, wire)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        _backend(out).decode(self._fmt, wire, self._block, out, accumulate)


class BF16Codec(_NativeFormat):
    """bfloat16 with round-to-nearest-even: 2 bytes per value, no scales."""

    codec_id: ClassVar[str] = "bf16"
    _fmt = native.BF16

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}


# block lengths reach the C core as size_t; larger ones mean "one block" anyway
MAX_BLOCK = 2**48


class FP8Codec(_NativeFormat):
    """FP8 with one fp32 scale per ``block`` values (``block=0``: one per tensor).

    ``fmt`` is ``"e4m3"`` (E4M3FN, max 448) or ``"e5m2"`` (max 57344).
    """

    codec_id: ClassVar[str] = "fp8"

    def __init__(self, fmt: str = "e4m3", block: int = 128):
        if fmt not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8 fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
        if (not isinstance(block, (int, np.integer)) or isinstance(block, bool)
                or not 0 <= block <= MAX_BLOCK):
            raise ValueError(f"fp8 block must be an integer in [0, {MAX_BLOCK}], got {block!r}")
        self.fmt = fmt
        self.block = int(block)
        self._fmt = native.FORMATS[fmt]
        self._block = self.block

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "fmt": self.fmt, "block": self.block}


class NVFP4Codec(_NativeFormat):
    """NVFP4: E2M1 values, one E4M3 scale per 16 values, one fp32 scale per tensor."""

    codec_id: ClassVar[str] = "nvfp4"
    _fmt = native.NVFP4

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}
