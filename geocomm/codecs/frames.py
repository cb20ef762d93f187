"""The self-describing frame: header, config, body and CRC32 (docs/design.md, "Formats").

A frame carries magic, version, dtype code, shape, the codec's config (JSON),
the body and a CRC32 of everything before it. :func:`write_frame` and
:func:`parse_frame` know nothing of codecs: the body's expected length comes
from the caller (``body_size``: the codec, or the registry, that reads the
frame). :class:`FramedCodec` is the contract's standalone API over them. This
module imports the contract (``geocomm.codecs.base``) and nothing else of
geocomm's codecs; no registry.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from geocomm.codecs.base import Codec

MAGIC = b"GEOC"
FRAME_VERSION = 1
MAX_NDIM = 32
MAX_COUNT = 2**48  # values per frame; bounds every size computed from a header
# magic, version, dtype code, ndim, reserved, config length, body length
HEAD = struct.Struct("<4sBBBBIQ")
CRC = struct.Struct("<I")

# dtype codes of the frame; the float dtypes geocomm accepts everywhere
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 2,
    np.dtype(ml_dtypes.bfloat16): 3,
    np.dtype(np.float64): 4,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def check_float_array(x: Any, name: str = "x") -> np.ndarray:
    """Return x as a numpy array of a supported float dtype, or raise TypeError."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; geocomm codecs take float32, float16, bfloat16 or float64"
        )
    return x


def write_frame(
    config: dict[str, Any],
    dtype: np.dtype,
    shape: tuple[int, ...],
    body_len: int,
    fill_body: Callable[[np.ndarray], None],
) -> np.ndarray:
    """A frame (uint8 array) of an array of ``dtype`` and ``shape`` whose codec has
    ``config``: ``fill_body`` writes the ``body_len`` bytes of the body it is given."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    head_len = HEAD.size + 8 * len(shape) + len(text)
    frame = np.empty(head_len + body_len + CRC.size, np.uint8)
    head = HEAD.pack(
        MAGIC, FRAME_VERSION, DTYPE_CODES[np.dtype(dtype)], len(shape), 0, len(text), body_len
    )
    head += struct.pack(f"<{len(shape)}Q", *shape) + text
    frame[:head_len] = np.frombuffer(head, np.uint8)
    fill_body(frame[head_len : head_len + body_len])
    crc = zlib.crc32(frame[: head_len + body_len].data)
    frame[head_len + body_len :] = np.frombuffer(CRC.pack(crc), np.uint8)
    return frame


class FrameInfo:
    """Fields of a validated frame."""

    __slots__ = ("body", "config", "dtype", "shape")

    def __init__(
        self, config: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...], body: np.ndarray
    ):
        self.config, self.dtype, self.shape, self.body = config, dtype, shape, body


def parse_frame(buf: Any, body_size: Callable[[dict[str, Any], tuple[int, ...]], int]) -> FrameInfo:
    """Validate a frame completely (sizes, CRC, config, body length); ValueError if bad.

    ``body_size(config, shape)``: the body's length for the codec the frame names
    (raising ValueError when that codec is unusable or not the reader's)."""
    try:
        data = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
    except TypeError as exc:
        raise ValueError(f"a frame must be a bytes-like object: {exc}") from None
    if data.size < HEAD.size + CRC.size:
        raise ValueError(f"frame of {data.size} bytes is shorter than a frame header")
    magic, version, dtype_code, ndim, reserved, config_len, body_len = HEAD.unpack_from(data.data)
    if magic != MAGIC:
        raise ValueError(f"not a geocomm frame (magic {magic!r})")
    if version != FRAME_VERSION:
        raise ValueError(f"unsupported frame version {version} (this is version {FRAME_VERSION})")
    if dtype_code not in CODE_DTYPES:
        raise ValueError(f"unknown dtype code {dtype_code} in frame")
    if ndim > MAX_NDIM:
        raise ValueError(f"frame claims {ndim} dimensions (at most {MAX_NDIM})")
    if reserved != 0:
        raise ValueError(f"frame header's reserved byte is {reserved}, not 0")
    head_len = HEAD.size + 8 * ndim + config_len
    if head_len + body_len + CRC.size != data.size:
        raise ValueError(
            f"frame length {data.size} does not match its header "
            f"({head_len} + {body_len} + {CRC.size} bytes)"
        )
    (crc,) = CRC.unpack_from(data.data, data.size - CRC.size)
    if zlib.crc32(data[: data.size - CRC.size].data) != crc:
        raise ValueError("frame checksum mismatch: the frame is corrupted")
    shape = struct.unpack_from(f"<{ndim}Q", data.data, HEAD.size)
    try:
        config = json.loads(bytes(data[HEAD.size + 8 * ndim : head_len]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        # RecursionError: nesting deeper than the parser recurses ("[[[[...")
        raise ValueError(f"frame codec config is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise ValueError("frame codec config must be an object with a string 'id'")
    if math.prod(shape) > MAX_COUNT or max(shape, default=0) > MAX_COUNT:
        raise ValueError(f"frame shape {shape} holds more than {MAX_COUNT} values")
    expected = body_size(config, tuple(int(d) for d in shape))
    if expected != body_len:
        raise ValueError(f"frame body has {body_len} bytes, shape {shape} needs {expected}")
    body = data[head_len : head_len + body_len]
    return FrameInfo(config, CODE_DTYPES[dtype_code], tuple(int(d) for d in shape), body)


class FramedCodec(Codec):
    """A :class:`~geocomm.codecs.base.Codec` whose ``encode``/``decode`` write and read
    the frame above, its body from the codec's ``encode_frame_body`` /
    ``decode_frame_body``. The base of every built-in codec."""

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = check_float_array(x)
        if x.ndim > MAX_NDIM or x.size > MAX_COUNT:  # what decode would refuse
            raise ValueError(
                f"a frame holds at most {MAX_NDIM} dimensions and {MAX_COUNT} values, "
                f"not {x.ndim} and {x.size}"
            )
        values = np.require(x, np.float32, ["C_CONTIGUOUS", "ALIGNED"])
        return write_frame(
            self.get_config(),
            x.dtype,
            x.shape,
            self.frame_body_size(x.shape),
            lambda body: self.encode_frame_body(values, body),
        )

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        mine = self.get_config()

        def body_size(config: dict[str, Any], shape: tuple[int, ...]) -> int:
            if config != mine:
                raise ValueError(f"frame was written by codec {config}, not {mine}")
            return self.frame_body_size(shape)

        info = parse_frame(buf, body_size)
        if out is not None:
            out = check_float_array(out, "out")
            if out.shape != info.shape:
                raise ValueError(f"out has shape {out.shape}, the frame holds {info.shape}")
            if not out.flags.writeable:
                raise ValueError("out is read-only")
        result = np.empty(info.shape, np.float32)
        self.decode_frame_body(info.body, result)
        if out is None:
            return result.astype(info.dtype, copy=False)
        out[...] = result
        return out
