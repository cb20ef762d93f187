"""The codec contract and the self-describing frame.

A :class:`Codec` turns float arrays into bytes and back. It has two faces:

* the standalone API, ``encode(x) -> frame`` / ``decode(frame, out=None)``,
  where a frame carries magic, version, codec config, dtype, shape, the wire
  body and a CRC32, and ``decode`` rejects anything malformed with
  ``ValueError``;
* the wire API used inside collectives, where no header travels and every
  rank derives the layout from the element count: ``wire_size(n)``,
  ``encode_wire(x, wire, stream=0, offset=0)``, ``decode_wire(wire, out,
  accumulate)`` on flat float32 arrays.

``get_config()`` is JSON-able and defines equality:
``get_codec(c.get_config()) == c``.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

MAGIC = b"GEOC"
FRAME_VERSION = 1
MAX_NDIM = 32
MAX_COUNT = 2**48  # values per frame; bounds every size computed from a header
# magic, version, dtype code, ndim, reserved, config length, body length
_HEAD = struct.Struct("<4sBBBBIQ")
_CRC = struct.Struct("<I")

# dtype codes of the frame; the float dtypes geocomm accepts everywhere
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 2,
    np.dtype(ml_dtypes.bfloat16): 3,
    np.dtype(np.float64): 4,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def check_float_array(x: Any, name: str = "x") -> np.ndarray:
    """Return x as a numpy array of a supported float dtype, or raise TypeError."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; geocomm codecs take float32, float16, bfloat16 "
            "or float64"
        )
    return x


class Codec(ABC):
    """Base class of every geocomm codec (see the module docstring)."""

    codec_id: ClassVar[str]
    #: True when decode(encode(x)) == x exactly (then collectives may sum natively)
    lossless: ClassVar[bool] = False

    # ---- configuration ----------------------------------------------------
    @abstractmethod
    def get_config(self) -> dict[str, Any]:
        """JSON-able parameters including ``"id"``; ``from_config`` inverts it."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        params = dict(config)
        codec_id = params.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise ValueError(f"config id {codec_id!r} does not match codec {cls.codec_id!r}")
        return cls(**params)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"

    # ---- wire API (headerless, flat float32) -------------------------------
    @abstractmethod
    def wire_size(self, n: int) -> int:
        """Bytes of the wire body of ``n`` values."""

    @abstractmethod
    def encode_wire(self, x: np.ndarray, wire: np.ndarray, *, stream: int = 0,
                    offset: int = 0) -> None:
        """Encode flat contiguous float32 ``x`` into ``wire[:wire_size(x.size)]``.

        Stochastic rounding draws the random bits of ``x[i]`` from (the
        codec's seed, ``stream``, ``offset + i``), both integers in [0, 2^64):
        ``offset`` is the global index of ``x[0]``, so encoding pieces with
        their offsets gives each element the bits of one whole call. Codecs
        that round to nearest ignore both.
        """

    @abstractmethod
    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        """Decode ``out.size`` values from ``wire`` into ``out`` (``+=`` if accumulate)."""

    def for_count(self, count: int, backend: str | None = None, size: int = 2) -> Codec:
        """The codec that carries a message of ``count`` values on ``size`` ranks of
        the communicator ``backend`` (``Communicator.backend``): itself; ``auto``
        chooses by size. Depends on what every rank shares only, so all choose alike."""
        return self

    # ---- frame bodies (override when the body depends on more than the count) --
    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        """Bytes of the frame body for an array of ``shape``."""
        return self.wire_size(math.prod(shape))

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        """Encode float32 ``x`` (its own shape) into ``body``."""
        self.encode_wire(x.reshape(-1), body)

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        """Decode ``body`` into float32 ``out`` (the frame's shape)."""
        self.decode_wire(body, out.reshape(-1))

    # ---- standalone API ----------------------------------------------------
    def encode(self, x: np.ndarray) -> np.ndarray:
        """Self-describing frame (uint8 array) of x; any shape, a float dtype."""
        x = check_float_array(x)
        values = np.ascontiguousarray(x, np.float32)
        config = json.dumps(self.get_config(), sort_keys=True, separators=(",", ":")).encode()
        body_len = self.frame_body_size(x.shape)
        head_len = _HEAD.size + 8 * x.ndim + len(config)
        frame = np.empty(head_len + body_len + _CRC.size, np.uint8)
        head = _HEAD.pack(MAGIC, FRAME_VERSION, DTYPE_CODES[x.dtype], x.ndim, 0,
                          len(config), body_len)
        head += struct.pack(f"<{x.ndim}Q", *x.shape) + config
        frame[:head_len] = np.frombuffer(head, np.uint8)
        self.encode_frame_body(values, frame[head_len : head_len + body_len])
        crc = zlib.crc32(frame[: head_len + body_len])
        frame[head_len + body_len :] = np.frombuffer(_CRC.pack(crc), np.uint8)
        return frame

    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Array from a frame of this codec; ``out`` (right shape, any float dtype) is filled."""
        info = parse_frame(buf)
        if info.config != self.get_config():
            raise ValueError(f"frame was written by codec {info.config}, not {self.get_config()}")
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


class WireOf:
    """Mixin: the wire API of another codec, ``self.wire_codec`` (a codec that wraps
    one and sends its bytes: GeoFP8 its quantizer, error feedback its inner codec)."""

    wire_codec: Codec

    def wire_size(self, n: int) -> int:
        return self.wire_codec.wire_size(n)

    def encode_wire(self, x: Any, wire: Any, *, stream: int = 0, offset: int = 0) -> None:
        self.wire_codec.encode_wire(x, wire, stream=stream, offset=offset)

    def decode_wire(self, wire: Any, out: Any, accumulate: bool = False) -> None:
        self.wire_codec.decode_wire(wire, out, accumulate)


class StatefulCodec(Codec):
    """A codec with state that lives across calls (GeoFP8's bases, error feedback's
    residuals). The collectives compare ``state_checksum`` across ranks before
    every call; checkpoints carry ``state_dict``."""

    @abstractmethod
    def state_checksum(self, key: Any = None) -> int:
        """CRC32 of one key's state (or of all, key None); equal on ranks that agree."""

    @abstractmethod
    def reset_state(self) -> None:
        """Forget every key's state."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state as plain values and NumPy arrays (for checkpoints)."""

    @abstractmethod
    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""


class TransformingCodec(StatefulCodec):
    """A codec that maps each tensor before quantizing and keeps per-key state (GeoFP8).

    Its protocol with the collectives (docs/design.md, "Transforming codecs"):

    * ``plan = codec.plan(x, shape, key, bounds)``: local, decided from shape,
      config and the key's state only; None means plain quantization;
    * ``plan.forward(x, out)`` writes the mapped values and sets ``plan.side``,
      this rank's contribution to an exact side sum (or None); a plan with
      ``ranged`` true also offers ``plan.begin(x)`` (sets ``side``) and then
      ``plan.forward_range(values, lo, out)`` for any flat range;
    * after the quantized sum, ``plan.inverse(values, lo, side_sum)`` maps a
      flat range of the result back in place (any range for a ranged plan,
      whole rows otherwise);
    * if ``plan.refreshes``, the collective drives the generator
      ``codec.refresh(plan, shard, lo, side_sum)``: every array it yields is
      summed exactly over the ranks and sent back into it.

    The codec never talks to a communicator, and its state changes only from
    summed values, so every rank stays alike; ``state_checksum`` proves it.
    """

    @abstractmethod
    def plan(self, x: Any, shape: Sequence[int], key: Any, bounds: Sequence[int]) -> Any:
        """This call's plan for flat float32 ``x`` of a tensor of ``shape``, or None."""

    @abstractmethod
    def refresh(self, plan: Any, shard: Any, lo: int, side_sum: Any
                ) -> Generator[Any, Any, None]:
        """Rounds that update the plan's key from this rank's shard of the result."""


class FrameInfo:
    """Fields of a validated frame."""

    __slots__ = ("body", "config", "dtype", "shape")

    def __init__(self, config: dict, dtype: np.dtype, shape: tuple[int, ...], body: np.ndarray):
        self.config, self.dtype, self.shape, self.body = config, dtype, shape, body


def parse_frame(buf: Any) -> FrameInfo:
    """Validate a frame completely (sizes, CRC, config, body length); ValueError if bad."""
    try:
        data = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
    except TypeError as exc:
        raise ValueError(f"a frame must be a bytes-like object: {exc}") from None
    if data.size < _HEAD.size + _CRC.size:
        raise ValueError(f"frame of {data.size} bytes is shorter than a frame header")
    magic, version, dtype_code, ndim, _reserved, config_len, body_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a geocomm frame (magic {magic!r})")
    if version != FRAME_VERSION:
        raise ValueError(f"unsupported frame version {version} (this is version {FRAME_VERSION})")
    if dtype_code not in _CODE_DTYPES:
        raise ValueError(f"unknown dtype code {dtype_code} in frame")
    if ndim > MAX_NDIM:
        raise ValueError(f"frame claims {ndim} dimensions (at most {MAX_NDIM})")
    head_len = _HEAD.size + 8 * ndim + config_len
    if head_len + body_len + _CRC.size != data.size:
        raise ValueError(
            f"frame length {data.size} does not match its header "
            f"({head_len} + {body_len} + {_CRC.size} bytes)"
        )
    (crc,) = _CRC.unpack_from(data, data.size - _CRC.size)
    if zlib.crc32(data[: data.size - _CRC.size]) != crc:
        raise ValueError("frame checksum mismatch: the frame is corrupted")
    shape = struct.unpack_from(f"<{ndim}Q", data, _HEAD.size)
    try:
        config = json.loads(bytes(data[_HEAD.size + 8 * ndim : head_len]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        # RecursionError: nesting deeper than the parser recurses ("[[[[...")
        raise ValueError(f"frame codec config is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise ValueError("frame codec config must be an object with a string 'id'")
    if math.prod(shape) > MAX_COUNT:
        raise ValueError(f"frame shape {shape} holds more than {MAX_COUNT} values")
    from geocomm.codecs.registry import get_codec  # the registry imports this module

    try:
        codec = get_codec(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"frame names an unusable codec {config}: {exc}") from None
    expected = codec.frame_body_size(tuple(shape))
    if expected != body_len:
        raise ValueError(f"frame body has {body_len} bytes, shape {shape} needs {expected}")
    body = data[head_len : head_len + body_len]
    return FrameInfo(config, _CODE_DTYPES[dtype_code], tuple(int(d) for d in shape), body)
