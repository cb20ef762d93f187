"""Thin, checked access to the compiled codec core ``geocomm._native``.

``available`` says whether the extension was built; every function raises
:class:`NativeBuildMissing` with a message saying how to build it when it was
not. Arguments are validated here (dtype, contiguity, sizes), so the C code
never sees a buffer shorter than the header promises.
"""

from __future__ import annotations

import numpy as np

try:
    from geocomm._native import ffi as _ffi
    from geocomm._native import lib as _lib
except ImportError as exc:  # the C extension was not built or not installed
    _ffi = _lib = None
    _import_error: ImportError | None = exc
else:
    _import_error = None

available: bool = _lib is not None

E4M3, E5M2, NVFP4, BF16, MXFP8_E4M3, MXFP8_E5M2, MXFP4 = 1, 2, 3, 4, 5, 6, 7
FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "nvfp4": NVFP4, "bf16": BF16,
           "mxfp8_e4m3": MXFP8_E4M3, "mxfp8_e5m2": MXFP8_E5M2, "mxfp4": MXFP4}
MX_FORMATS = (MXFP8_E4M3, MXFP8_E5M2, MXFP4)
#: gc_encode_ex flags: stochastic rounding; the MX round-up ("rceil") scale rule
STOCHASTIC, RCEIL = 1, 2
U64_MAX = 2**64 - 1


class NativeBuildMissing(ImportError):
    """The compiled codec core is not importable."""


def require() -> None:
    """Raise :class:`NativeBuildMissing` with build instructions if the core is absent."""
    if _lib is None:
        raise NativeBuildMissing(
            "geocomm's native codec (geocomm._native) is not built: install the package with "
            "`pip install .` (meson-python compiles native/ with gcc) instead of importing the "
            f"source tree directly. Import error: {_import_error}"
        )


def wire_size(fmt: int, n: int, block: int = 0) -> int:
    """Bytes of the headerless wire body of ``n`` values."""
    require()
    return int(_lib.gc_wire_size(fmt, n, block))


def _check_f32(x: np.ndarray, name: str, writable: bool = False) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous float32 numpy array")
    if writable and not x.flags.writeable:
        raise ValueError(f"{name} is read-only")


def _check_wire(wire: np.ndarray, need: int, writable: bool = False) -> None:
    if not isinstance(wire, np.ndarray) or wire.dtype != np.uint8 or not wire.flags.c_contiguous:
        raise TypeError("wire must be a C-contiguous uint8 numpy array")
    if wire.size < need:
        raise ValueError(f"wire holds {wire.size} bytes, the body needs {need}")
    if writable and not wire.flags.writeable:
        raise ValueError("wire is read-only")


def check_u64(value: int, name: str) -> int:
    """``value`` as a Python int in [0, 2^64), else ValueError."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) \
            or not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def check_flags(fmt: int, flags: int) -> int:
    """Validated gc_encode_ex flags for ``fmt`` (ValueError as the C core would refuse them)."""
    flags = int(flags)
    if flags & ~(STOCHASTIC | RCEIL) or (flags & RCEIL and fmt not in MX_FORMATS):
        raise ValueError(f"flags {flags} are not valid for format {fmt}")
    return flags


def encode(fmt: int, x: np.ndarray, block: int, wire: np.ndarray, *, flags: int = 0,
           seed: int = 0, rng_stream: int = 0, offset: int = 0) -> None:
    """Encode the float32 values of ``x`` into the first bytes of ``wire`` (gc_encode_ex).

    ``flags``: STOCHASTIC and/or RCEIL; with STOCHASTIC the random bits of
    element i come from (seed, rng_stream, offset + i).
    """
    _check_f32(x, "x")
    _check_wire(wire, wire_size(fmt, x.size, block), writable=True)
    flags = check_flags(fmt, flags)
    rc = _lib.gc_encode_ex(fmt, _ffi.from_buffer("float[]", x), x.size, block,
                           _ffi.from_buffer("uint8_t[]", wire, require_writable=True), flags,
                           check_u64(seed, "seed"), check_u64(rng_stream, "stream"),
                           check_u64(offset, "offset"))
    if rc:
        raise ValueError(f"unknown native format {fmt}")


def decode(fmt: int, wire: np.ndarray, block: int, out: np.ndarray,
           accumulate: bool = False) -> None:
    """Decode ``out.size`` values from ``wire`` into (or, accumulating, onto) ``out``."""
    _check_f32(out, "out", writable=True)
    _check_wire(wire, wire_size(fmt, out.size, block))
    rc = _lib.gc_decode(fmt, _ffi.from_buffer("uint8_t[]", wire), out.size, block,
                        _ffi.from_buffer("float[]", out, require_writable=True), int(accumulate))
    if rc:
        raise ValueError(f"unknown native format {fmt}")
