"""The quantizing formats: ``none``, ``bf16``, ``fp8`` (E4M3FN / E5M2), ``nvfp4``,
``mxfp8`` and ``mxfp4`` (OCP Microscaling).

Each codec maps flat float32 data to a wire body laid out as in
``native/geocomm.h``; the native C core does the work and
``geocomm.codecs.reference`` defines the bytes it must produce.

Every lossy format takes ``rounding="nearest"`` (default: round to nearest
even) or ``"stochastic"`` with a ``seed``: then E[decode(encode(x))] = x up to
fp32 scale arithmetic, and the random bits of element i are a pure function of
(seed, rounding stream, offset + i), where ``encode_wire(x, wire,
rounding_stream=, offset=)`` gets both from the caller (``encode`` uses 0 and 0). Nearest
rounding ignores them, and its configs (hence frames) do not mention rounding.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, TypedDict

import numpy as np

from geocomm.codecs.base import WireOf
from geocomm.codecs.frames import FramedCodec
from geocomm.kernels import native


class NoneCodec(FramedCodec):
    """No compression: the body is the raw little-endian float32 values."""

    codec_id: ClassVar[str] = "none"
    lossless: ClassVar[bool] = True

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    def wire_size(self, n: int) -> int:
        return 4 * native.check_count(n)

    def encode_wire(
        self, x: np.ndarray, wire: np.ndarray, *, rounding_stream: int = 0, offset: int = 0
    ) -> None:
        wire[: 4 * x.size] = x.view(np.uint8)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        values = wire[: 4 * out.size].view("<f4")
        if accumulate:  # a NaN sum as the C core's and a GPU's
            out += values
            native.gpu_nans(out)
        else:
            out[...] = values

    def decode_wire_onto(self, wire: np.ndarray, base: np.ndarray, out: np.ndarray) -> None:
        if isinstance(out, np.ndarray):  # one pass; device arrays as the base class
            np.add(base, wire[: 4 * out.size].view("<f4"), out=out)
            native.gpu_nans(out)
        else:
            super().decode_wire_onto(wire, base, out)


def _backend(array: Any) -> Any:
    """The codec core for ``array``: the C core for NumPy, the CUDA kernels for CuPy."""
    if type(array).__module__.startswith("cupy"):
        from geocomm.kernels import cuda

        return cuda
    return native


ROUNDINGS = ("nearest", "stochastic")


class RoundingArgs(TypedDict):
    """The rounding keywords of ``native.encode`` and ``native.geo_encode``."""

    flags: int
    seed: int
    rounding_stream: int
    offset: int


class NativeFormat(FramedCodec):
    """A codec whose body is one native format: subclasses set ``codec_id`` and
    ``_fmt`` (the format's name in ``native.FORMAT_NAMES``; its id comes from the
    compiled core when encoding, so configuring a codec needs no build) and
    override ``__init__``/``get_config`` when they take more than the rounding.

    NumPy arrays run through the C core, CuPy arrays through the CUDA kernels
    built from the same arithmetic (``native/gc_scalar.h``): same bytes.
    """

    _fmt: str
    _block: int = 0
    rounding: str = "nearest"
    scale_rule: str = "floor"  # MX formats only
    seed: int = 0

    def __init__(self, rounding: str = "nearest", seed: int = 0):
        self._set_rounding(rounding, seed)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, **self._rounding_config()}

    def _set_rounding(self, rounding: str, seed: int) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        seed = native.check_u64(seed, "seed")
        if rounding == "nearest" and seed:  # not in the config: it would be lost there
            raise ValueError(f"a seed ({seed}) is for rounding='stochastic' only")
        self.rounding = rounding
        self.seed = seed

    def _rounding_config(self) -> dict[str, Any]:
        """Config entries of the rounding: none for the default (so old configs stay valid)."""
        if self.rounding == "nearest":
            return {}
        return {"rounding": self.rounding, "seed": self.seed}

    @property
    def _flags(self) -> int:
        """gc_encode_ex flags (the compiled core's constants)."""
        flags = native.STOCHASTIC if self.rounding == "stochastic" else 0
        return flags | (native.RCEIL if self.scale_rule == "rceil" else 0)

    def native_wire(self) -> tuple[str, int, int]:
        """What the wire bytes are, for the batched device pipeline: (the format's name
        in ``native.FORMAT_NAMES``, its scaling block, the gc_encode_ex flags)."""
        return self._fmt, self._block, self._flags

    def wire_size(self, n: int) -> int:
        return native.wire_size(self._fmt, n, self._block)

    def encode_wire(
        self, x: np.ndarray, wire: np.ndarray, *, rounding_stream: int = 0, offset: int = 0
    ) -> None:
        _backend(x).encode(
            self._fmt, x, self._block, wire, **self._rounding_args(rounding_stream, offset)
        )

    def _rounding_args(self, rounding_stream: int, offset: int) -> RoundingArgs:
        """The rounding keywords of the cores' encodes for one call."""
        return RoundingArgs(
            flags=self._flags, seed=self.seed, rounding_stream=rounding_stream, offset=offset
        )

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        _backend(out).decode(self._fmt, wire, self._block, out, accumulate)

    def decode_wire_onto(self, wire: np.ndarray, base: np.ndarray, out: np.ndarray) -> None:
        """In one pass for host arrays (the C core); on the device as the base class."""
        if _backend(out) is native:
            native.decode_onto(self._fmt, wire, self._block, base, out)
        else:
            super().decode_wire_onto(wire, base, out)

    def encode_split_wire(
        self, x: np.ndarray, split: Split, wire: np.ndarray, *, rounding_stream: int = 0,
        offset: int = 0,
    ) -> None:  # fmt: skip
        """:meth:`encode_wire` of x - coef vt (``split``, over the range x of its
        matrix) in one pass, without storing the difference: the same bytes.
        Host arrays only (the C core)."""
        native.geo_encode(
            self._fmt, x, *split, self._block, wire, **self._rounding_args(rounding_stream, offset)
        )

    def decode_split_wire(self, wire: np.ndarray, split: Split, out: np.ndarray) -> None:
        """out = :meth:`decode_wire` + coef vt (``split``, over the range out of its
        matrix) in one pass: the same values. Host arrays only."""
        native.geo_decode(self._fmt, wire, *split, self._block, out)


class Split(NamedTuple):
    """A split map over a range of a row-major matrix of ``n`` columns, for the
    split calls of :class:`NativeFormat` and the device pipeline's split kernels: the
    range starts at flat index ``lo``, ``coef`` holds k coefficients per row it
    touches, ``vt`` the k x n basis, ``packed`` its ``native.geo_pack`` layout
    (``native/geocomm.h``, gc_geo_encode; None for CuPy arrays, whose kernels read
    ``vt``)."""

    lo: int
    n: int
    coef: Any
    vt: Any
    packed: Any


def round_trip(codec: Any, values: Any, out: Any) -> Any:
    """out = flat float32 ``values`` as ``codec``'s wire carries them (encoded, then
    decoded; ``out`` may be ``values``); returns out. NumPy or CuPy arrays."""
    size = codec.wire_size(values.size)
    if type(values).__module__.startswith("cupy"):
        import cupy

        wire = cupy.empty(size, cupy.uint8)
    else:
        wire = np.empty(size, np.uint8)
    codec.encode_wire(values, wire)
    codec.decode_wire(wire, out)
    return out


def inherits(obj: Any, base: type, *names: str) -> bool:
    """Whether ``obj`` uses ``base``'s own methods ``names`` (no subclass changed them)."""
    return all(getattr(type(obj), name) is getattr(base, name) for name in names)


def sent_codec(codec: Any) -> Any:
    """The codec whose bytes ``codec`` sends: through the wrappers (WireOf) that pass
    their wire codec's encode and decode on unchanged."""
    while isinstance(codec, WireOf) and inherits(codec, WireOf, "encode_wire", "decode_wire"):
        codec = codec.wire_codec
    return codec


def split_format(codec: Any) -> NativeFormat | None:
    """The native format ``codec`` sends when its bytes are that format's own (so its
    split calls give them), else None."""
    sent = sent_codec(codec)
    if isinstance(sent, NativeFormat) and inherits(
        sent, NativeFormat, "encode_wire", "decode_wire", "wire_size"
    ):
        return sent
    return None


class BF16Codec(NativeFormat):
    """bfloat16 (nearest even or stochastic rounding): 2 bytes per value, no scales."""

    codec_id: ClassVar[str] = "bf16"
    _fmt = "bf16"


# block lengths reach the C core as size_t; larger ones mean "one block" anyway
MAX_BLOCK = 2**48


def check_frame_scales(raw: np.ndarray, fmt: str) -> None:
    """ValueError unless the fp32 scales ``raw`` (bytes) of a frame are what an encoder
    writes, amax / FMAX of finite values: finite and not negative. A frame that passed
    its CRC with others was made by hand, and would decode to NaNs or flipped signs."""
    scales = np.frombuffer(raw.tobytes(), "<f4")
    if not (np.isfinite(scales) & ~np.signbit(scales)).all():
        raise ValueError(f"{fmt} frame holds a scale no encoder writes (non-finite or negative)")


class FP8Codec(NativeFormat):
    """FP8 with one fp32 scale per ``block`` values (``block=0``: one per wire body, a
    frame's tensor or, in a collective, a shard).

    ``fmt`` is ``"e4m3"`` (E4M3FN, max 448) or ``"e5m2"`` (max 57344).
    """

    codec_id: ClassVar[str] = "fp8"

    def __init__(
        self, fmt: str = "e4m3", block: int = 128, rounding: str = "nearest", seed: int = 0
    ):
        if fmt not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8 fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
        if (
            not isinstance(block, (int, np.integer))
            or isinstance(block, bool)
            or not 0 <= block <= MAX_BLOCK
        ):
            raise ValueError(f"fp8 block must be an integer in [0, {MAX_BLOCK}], got {block!r}")
        self.fmt = fmt
        self.block = int(block)
        self._fmt = fmt
        self._block = self.block
        self._set_rounding(rounding, seed)

    def scale_span(self) -> int:
        return self.block

    def get_config(self) -> dict[str, Any]:
        return {
            "id": self.codec_id,
            "fmt": self.fmt,
            "block": self.block,
            **self._rounding_config(),
        }

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        """Decode a frame's body, its fp32 block scales checked first (they lead it)."""
        blocks = -(-out.size // (self.block or out.size)) if out.size else 0
        check_frame_scales(body[: 4 * blocks], "fp8")
        super().decode_frame_body(body, out)


class NVFP4Codec(NativeFormat):
    """NVFP4: E2M1 values, one E4M3 scale per 16 values, one fp32 scale per
    superblock of 4096 values (so aligned pieces encode as the whole would).

    Stochastic rounding rounds the block scales up (never to a smaller
    scale), so no value saturates at 6 block scales.
    """

    codec_id: ClassVar[str] = "nvfp4"
    _fmt = "nvfp4"

    def scale_span(self) -> int:
        return 4096

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        """Decode a frame's body, its scales checked first: the fp32 superblock scales
        (they lead it) and the E4M3 block scales after them, which an encoder writes
        not negative (the NaN code 0x7f: the block held a non-finite value)."""
        supers = -(-out.size // 4096)
        check_frame_scales(body[: 4 * supers], "nvfp4")
        if (body[4 * supers : 4 * supers + -(-out.size // 16)] & 0x80).any():
            raise ValueError("nvfp4 frame holds a scale no encoder writes (a negative block scale)")
        super().decode_frame_body(body, out)


SCALE_RULES = ("floor", "rceil")


class _MXCodec(NativeFormat):
    """OCP Microscaling: one E8M0 scale 2^X per 32 values (wire layout in native/geocomm.h).

    ``scale_rule="floor"`` is the OCP rule X = floor(log2 amax) - EMAX (the
    largest values of a block may saturate at the element maximum);
    ``"rceil"`` rounds X up so that nothing saturates (except in blocks
    within 2^(EMAX+1) / FMAX of fp32's largest value, where X is capped at
    127 - EMAX so that decoded values stay finite). The default is floor with
    nearest rounding and rceil with stochastic rounding, which needs it: a
    saturated value is biased whatever the rounding.
    """

    def scale_span(self) -> int:
        return 32

    def _set_scale_rule(self, scale_rule: str | None) -> None:
        if scale_rule is None:
            scale_rule = "rceil" if self.rounding == "stochastic" else "floor"
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
        if scale_rule == "floor" and self.rounding == "stochastic":
            raise ValueError(
                "stochastic rounding needs scale_rule='rceil': the floor rule "
                "saturates a block's largest values, which biases them"
            )
        self.scale_rule = scale_rule


class MXFP8Codec(_MXCodec):
    """MXFP8: ``fmt="e4m3"`` (max 448) or ``"e5m2"`` (max 57344) codes, E8M0 scale per 32.

    Non-finite values keep their position like fp8 (E4M3: NaN; E5M2: inf/NaN).
    """

    codec_id: ClassVar[str] = "mxfp8"

    def __init__(
        self,
        fmt: str = "e4m3",
        scale_rule: str | None = None,
        rounding: str = "nearest",
        seed: int = 0,
    ):
        if fmt not in ("e4m3", "e5m2"):
            raise ValueError(f"mxfp8 fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
        self.fmt = fmt
        self._fmt = f"mxfp8_{fmt}"
        self._set_rounding(rounding, seed)
        self._set_scale_rule(scale_rule)

    def get_config(self) -> dict[str, Any]:
        mine = {"id": self.codec_id, "fmt": self.fmt, "scale_rule": self.scale_rule}
        return {**mine, **self._rounding_config()}

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        """Decode a frame's body, its E8M0 scales (they lead it) checked first: an MXFP8
        encoder never writes the NaN scale 0xff (a non-finite value keeps its own code;
        MXFP4 marks a non-finite block with it)."""
        if (body[: -(-out.size // 32)] == 0xFF).any():
            raise ValueError("mxfp8 frame holds a scale no encoder writes (the NaN scale 0xff)")
        super().decode_frame_body(body, out)


class MXFP4Codec(_MXCodec):
    """MXFP4: E2M1 codes (two per byte), E8M0 scale per 32 values.

    E2M1 has no NaN: a block holding a non-finite value gets the NaN scale
    0xff, so all its 32 values decode as NaN.
    """

    codec_id: ClassVar[str] = "mxfp4"
    _fmt = "mxfp4"

    def __init__(self, scale_rule: str | None = None, rounding: str = "nearest", seed: int = 0):
        self._set_rounding(rounding, seed)
        self._set_scale_rule(scale_rule)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "scale_rule": self.scale_rule, **self._rounding_config()}
