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

E4M3, E5M2, NVFP4, BF16 = 1, 2, 3, 4
FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "nvfp4": NVFP4, "bf16": BF16}


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


def encode(fmt: int, x: np.ndarray, block: int, wire: np.ndarray) -> None:
    """Encode the float32 values of ``x`` into the first bytes of ``wire``."""
    _check_f32(x, "x")
    _check_wire(wire, wire_size(fmt, x.size, block), writable=True)
    rc = _lib.gc_encode(fmt, _ffi.from_buffer("float[]", x), x.size, block,
                        _ffi.from_buffer("uint8_t[]", wire, require_writable=True))
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
