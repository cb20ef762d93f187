"""The compiled C core (``geocomm._native``) with checked arguments: the CPU twin of
:mod:`geocomm.kernels.cuda`.

``available`` says whether the extension was built; every function raises
:class:`NativeBuildMissing` with a message saying how to build it when it was
not. Arguments are validated here (dtype, contiguity, sizes), so the C code
never sees a buffer shorter than the header promises.

The format ids (``E4M3`` ... ``MXFP4``, ``FORMATS`` by name), the
gc_encode_ex flags (``STOCHASTIC``, ``RCEIL``) and the layout constants
(``NVFP4_BLOCK``, ``NVFP4_SUPERBLOCK``, ``MX_BLOCK``) are the ``GC_*``
constants of the compiled cdef (``native/geocomm.h``), never numbers written
here; without the build, reading one raises :class:`NativeBuildMissing`.
Functions take a format as its id or its name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

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

#: format names of the C API (id: the cdef's GC_<NAME UPPER-CASED>)
FORMAT_NAMES = ("e4m3", "e5m2", "nvfp4", "bf16", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")
_MX_NAMES = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")
#: module constants read from the cdef: format ids, gc_encode_ex flags (stochastic
#: rounding; the MX round-up "rceil" scale rule), values per scale
CDEF_NAMES = (
    *(name.upper() for name in FORMAT_NAMES),
    "STOCHASTIC",
    "RCEIL",
    "NVFP4_BLOCK",
    "NVFP4_SUPERBLOCK",
    "MX_BLOCK",
)
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


if _lib is not None:
    E4M3, E5M2, NVFP4, BF16 = _lib.GC_E4M3, _lib.GC_E5M2, _lib.GC_NVFP4, _lib.GC_BF16
    MXFP8_E4M3, MXFP8_E5M2, MXFP4 = _lib.GC_MXFP8_E4M3, _lib.GC_MXFP8_E5M2, _lib.GC_MXFP4
    STOCHASTIC, RCEIL = _lib.GC_STOCHASTIC, _lib.GC_RCEIL
    NVFP4_BLOCK, NVFP4_SUPERBLOCK = _lib.GC_NVFP4_BLOCK, _lib.GC_NVFP4_SUPERBLOCK
    MX_BLOCK = _lib.GC_MX_BLOCK
    FORMATS: dict[str, int] = {name: getattr(_lib, f"GC_{name.upper()}") for name in FORMAT_NAMES}
    MX_FORMATS: tuple[int, ...] = tuple(FORMATS[name] for name in _MX_NAMES)


def __getattr__(name: str) -> Any:
    """Only reached without the build (with it, the cdef's constants are module globals)."""
    if name in (*CDEF_NAMES, "FORMATS", "MX_FORMATS"):
        require()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def format_id(fmt: int | str) -> int:
    """The id of format ``fmt`` (an id or a name of FORMAT_NAMES); ValueError if unknown."""
    require()
    code = FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if isinstance(code, bool) or code not in FORMATS.values():
        raise ValueError(f"unknown format {fmt!r}")
    assert code is not None  # checked just above: a known format id
    return int(code)


#: the most values a wire body may hold: every size computed from it fits 64 bits
MAX_WIRE_VALUES = 1 << 56


def check_count(n: Any, name: str = "n") -> int:
    """``n`` as a count of values: an integer in [0, :data:`MAX_WIRE_VALUES`], else
    TypeError or ValueError."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name} must be an integer count of values, got {n!r}")
    if not 0 <= n <= MAX_WIRE_VALUES:
        raise ValueError(f"{name} must lie in [0, 2^56], got {n}")
    return int(n)


#: The one NaN a GPU's fp32 arithmetic writes, and the C core's sums and maps.
GPU_NAN = np.uint32(0x7FFFFFFF).view(np.float32)


def gpu_nans(values: np.ndarray) -> None:
    """Write every NaN of the NumPy array ``values`` as :data:`GPU_NAN`, as the C core
    writes its sums: NumPy's arithmetic on x86 keeps a NaN operand's sign and sets it
    for inf - inf, and an encoder puts a NaN's sign in its code. The NaN-free common
    case costs one max (it propagates NaNs), no array of flags."""
    if values.size and np.isnan(values.max()):
        values[np.isnan(values)] = GPU_NAN


def check_block(block: Any) -> int:
    """``block`` as an fp8 scaling block (0: one scale for all the values): an integer
    in [0, 2^56], else TypeError or ValueError."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"block must be an integer, got {block!r}")
    if not 0 <= block <= MAX_WIRE_VALUES:
        raise ValueError(f"block must lie in [0, 2^56], got {block}")
    return int(block)


def wire_size(fmt: int | str, n: int, block: int = 0) -> int:
    """Bytes of the headerless wire body of ``n`` values (the C gc_wire_size); every
    call of the core checks its block here first."""
    fmt = format_id(fmt)  # first: it raises NativeBuildMissing without the build
    return int(_lib.gc_wire_size(fmt, check_count(n), check_block(block)))


_MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """SplitMix64's finalizer (``gc_mix64``): a 64-bit mix with every input bit reaching
    every output bit."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sr_key(seed: int, rounding_stream: int) -> int:
    """``gc_sr_key``: the stochastic-rounding key of (seed, rounding stream), computed
    once per call for the kernels, which take it as an argument."""
    return mix64(mix64(seed) ^ rounding_stream)


def _check_f32(x: np.ndarray, name: str, writable: bool = False) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous float32 numpy array")
    if not x.flags.aligned:  # the C core reads and writes floats where they lie
        raise ValueError(f"{name} is not aligned to 4 bytes (copy it first)")
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
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or not 0 <= value <= U64_MAX
    ):
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def check_flags(fmt: int | str, flags: int) -> int:
    """Validated gc_encode_ex flags for ``fmt`` (ValueError as the C core would refuse them)."""
    fmt, flags = format_id(fmt), int(flags)
    if flags & ~(STOCHASTIC | RCEIL) or (flags & RCEIL and fmt not in MX_FORMATS):
        raise ValueError(f"flags {flags} are not valid for format {fmt}")
    return flags


def encode(
    fmt: int | str,
    x: np.ndarray,
    block: int,
    wire: np.ndarray,
    *,
    flags: int = 0,
    seed: int = 0,
    rounding_stream: int = 0,
    offset: int = 0,
) -> None:
    """Encode the float32 values of ``x`` into the first bytes of ``wire`` (gc_encode_ex).

    ``flags``: STOCHASTIC and/or RCEIL; with STOCHASTIC the random bits of
    element i come from (seed, rounding_stream, offset + i).
    """
    fmt, flags, bits = _encode_args(fmt, x, block, wire, flags, seed, rounding_stream, offset)
    source = _ffi.from_buffer("float[]", x)
    target = _ffi.from_buffer("uint8_t[]", wire, require_writable=True)
    rc = _lib.gc_encode_ex(fmt, source, x.size, block, target, flags, *bits)
    if rc:
        raise ValueError(f"the native core refused format {fmt} with flags {flags} ({rc})")


def _encode_args(
    fmt: int | str, x: np.ndarray, block: int, wire: np.ndarray, flags: int, seed: int,
    rounding_stream: int, offset: int,
) -> tuple[int, int, tuple[int, int, int]]:  # fmt: skip
    """An encode's checked (format id, flags, (seed, rounding_stream, offset))."""
    fmt = format_id(fmt)
    _check_f32(x, "x")
    _check_wire(wire, wire_size(fmt, x.size, block), writable=True)
    bits = (check_u64(seed, "seed"), check_u64(rounding_stream, "rounding_stream"),
            check_u64(offset, "offset"))  # fmt: skip
    return fmt, check_flags(fmt, flags), bits


def decode(
    fmt: int | str, wire: np.ndarray, block: int, out: np.ndarray, accumulate: bool = False
) -> None:
    """Decode ``out.size`` values from ``wire`` into (or, accumulating, onto) ``out``."""
    fmt = format_id(fmt)
    _check_f32(out, "out", writable=True)
    _check_wire(wire, wire_size(fmt, out.size, block))
    rc = _lib.gc_decode(
        fmt,
        _ffi.from_buffer("uint8_t[]", wire),
        out.size,
        block,
        _ffi.from_buffer("float[]", out, require_writable=True),
        int(accumulate),
    )
    if rc:
        raise ValueError(f"the native core refused format {fmt} ({rc})")


def decode_onto(
    fmt: int | str, wire: np.ndarray, block: int, base: np.ndarray, out: np.ndarray
) -> None:
    """out = base + the ``out.size`` values decoded from ``wire`` (fp32, element by
    element; one pass over memory). ``base`` is ``out`` itself (an accumulating
    decode) or shares no memory with it."""
    fmt = format_id(fmt)
    _check_f32(out, "out", writable=True)
    _check_f32(base, "base")
    if base.size != out.size:
        raise ValueError(f"base holds {base.size} values, out {out.size}")
    same = base.ctypes.data == out.ctypes.data
    if not same and np.may_share_memory(base, out):
        raise ValueError("base overlaps out without being out")
    _check_wire(wire, wire_size(fmt, out.size, block))
    rc = _lib.gc_decode_onto(
        fmt,
        _ffi.from_buffer("uint8_t[]", wire),
        out.size,
        block,
        _ffi.from_buffer("float[]", base),
        _ffi.from_buffer("float[]", out, require_writable=True),
    )
    if rc:
        raise ValueError(f"the native core refused format {fmt} ({rc})")


# ---------------------------------------------------------------------------
# GeoFP8 geometry kernels (native/geocomm.h: the contract and the fixed order)


def _f32(a: np.ndarray, name: str, size: int | None = None, writable: bool = False) -> None:
    _check_f32(a, name, writable)
    if size is not None and a.size != size:
        raise ValueError(f"{name} holds {a.size} values, expected {size}")


def geo_rows(lo: int, length: int, n: int) -> int:
    """Rows of an n-column matrix that the flat range [lo, lo + length) touches."""
    require()
    return int(_lib.gc_geo_rows(lo, length, n))


def _range(x: np.ndarray, lo: int, n: int) -> tuple[Any, int, int, int]:
    """The arguments the geometry calls start with: the range's values, where it
    starts in the matrix, its length, the row length."""
    return (_ffi.from_buffer("float[]", x), lo, x.size, n)


def geo_project(x: np.ndarray, lo: int, n: int, vt: np.ndarray) -> tuple[np.ndarray, int]:
    """(coef (rows, k), rows that held a non-finite value) for the range x starting at lo."""
    k = vt.shape[0]
    _f32(x, "x")
    _f32(vt, "vt", k * n)
    coef = np.empty((geo_rows(lo, x.size, n), k), np.float32)
    got = _lib.gc_geo_project(
        *_range(x, lo, n),
        _ffi.from_buffer("float[]", vt),
        k,
        _ffi.from_buffer("float[]", coef, require_writable=True),
    )
    if got < 0:
        raise ValueError(f"gc_geo_project refused its arguments ({got})")
    return coef, int(got)


def aligned_empty(count: int) -> np.ndarray:
    """An uninitialized float32 array of ``count`` values starting on a 64-byte
    cache line (NumPy's large arrays start 16 bytes past one, which splits
    every AVX-512 load)."""
    buf = np.empty(count + 16, np.float32)
    skip = (-buf.ctypes.data % 64) // 4
    return buf[skip : skip + count]


def geo_pack(vt: np.ndarray) -> np.ndarray:
    """vt (k, n) in the packed layout gc_geo_expand reads fastest, on whole cache lines."""
    k, n = vt.shape
    _f32(vt, "vt")
    require()
    packed = aligned_empty(int(_lib.gc_geo_packed_size(k, n)))
    _lib.gc_geo_pack(
        _ffi.from_buffer("float[]", vt),
        k,
        n,
        _ffi.from_buffer("float[]", packed, require_writable=True),
    )
    return packed


def geo_expand(
    x: np.ndarray,
    lo: int,
    n: int,
    coef: np.ndarray,
    vt: np.ndarray,
    sign: float,
    out: np.ndarray,
    packed: np.ndarray | None = None,
) -> None:
    """out = x + sign * coef vt over the range (out may be x); ``packed``: geo_pack(vt)."""
    k = vt.shape[0]
    _f32(x, "x")
    _f32(out, "out", x.size, writable=True)
    _f32(vt, "vt", k * n)
    _f32(coef, "coef", geo_rows(lo, x.size, n) * k)
    if packed is not None:
        _f32(packed, "packed", int(_lib.gc_geo_packed_size(k, n)))
    rc = _lib.gc_geo_expand(
        _ffi.from_buffer("float[]", x),
        lo,
        x.size,
        n,
        _ffi.from_buffer("float[]", coef),
        _ffi.from_buffer("float[]", vt),
        _ffi.NULL if packed is None else _ffi.from_buffer("float[]", packed),
        k,
        sign,
        _ffi.from_buffer("float[]", out, require_writable=True),
    )
    if rc:
        raise ValueError(f"gc_geo_expand refused its arguments ({rc})")


def geo_residual(x: np.ndarray, n: int, vt: np.ndarray, out: np.ndarray) -> np.ndarray:
    """coef = project(x) and out = x - coef vt for the whole matrix x (m*n values), one pass."""
    k = vt.shape[0]
    _f32(x, "x")
    _f32(out, "out", x.size, writable=True)
    _f32(vt, "vt", k * n)
    m = x.size // n
    coef = np.empty((m, k), np.float32)
    got = _lib.gc_geo_residual(
        _ffi.from_buffer("float[]", x),
        m,
        n,
        _ffi.from_buffer("float[]", vt),
        k,
        _ffi.from_buffer("float[]", coef, require_writable=True),
        _ffi.from_buffer("float[]", out, require_writable=True),
    )
    if got < 0:
        raise ValueError(f"gc_geo_residual refused its arguments ({got})")
    return coef


def _split_args(lo: int, length: int, n: int, coef: np.ndarray, vt: np.ndarray,
                packed: np.ndarray) -> tuple[Any, ...]:  # fmt: skip
    """The (lo, len, n, coef, vt, packed, k) arguments of a split call, checked."""
    k = vt.shape[0]
    _f32(vt, "vt", k * n)
    _f32(coef, "coef", geo_rows(lo, length, n) * k)
    _f32(packed, "packed", int(_lib.gc_geo_packed_size(k, n)))
    return (
        lo,
        length,
        n,
        _ffi.from_buffer("float[]", coef),
        _ffi.from_buffer("float[]", vt),
        _ffi.from_buffer("float[]", packed),
        k,
    )


def geo_encode(
    fmt: int | str,
    x: np.ndarray,
    lo: int,
    n: int,
    coef: np.ndarray,
    vt: np.ndarray,
    packed: np.ndarray,
    block: int,
    wire: np.ndarray,
    *,
    flags: int = 0,
    seed: int = 0,
    rounding_stream: int = 0,
    offset: int = 0,
) -> None:
    """:func:`encode` of x - coef vt over the range (:func:`geo_expand` with sign -1)
    in one pass: the same bytes, without storing the difference."""
    fmt, flags, bits = _encode_args(fmt, x, block, wire, flags, seed, rounding_stream, offset)
    rc = _lib.gc_geo_encode(
        fmt,
        _ffi.from_buffer("float[]", x),
        *_split_args(lo, x.size, n, coef, vt, packed),
        block,
        _ffi.from_buffer("uint8_t[]", wire, require_writable=True),
        flags,
        *bits,
    )
    if rc:
        raise ValueError(f"gc_geo_encode refused its arguments ({rc})")


def geo_decode(
    fmt: int | str,
    wire: np.ndarray,
    lo: int,
    n: int,
    coef: np.ndarray,
    vt: np.ndarray,
    packed: np.ndarray,
    block: int,
    out: np.ndarray,
) -> None:
    """out = :func:`decode` of wire + coef vt over the range (:func:`geo_expand`
    with sign 1) in one pass: the same values."""
    fmt = format_id(fmt)
    _check_f32(out, "out", writable=True)
    _check_wire(wire, wire_size(fmt, out.size, block))
    rc = _lib.gc_geo_decode(
        fmt,
        _ffi.from_buffer("uint8_t[]", wire),
        *_split_args(lo, out.size, n, coef, vt, packed),
        block,
        _ffi.from_buffer("float[]", out, require_writable=True),
    )
    if rc:
        raise ValueError(f"gc_geo_decode refused its arguments ({rc})")


def geo_accumulate(x: np.ndarray, lo: int, n: int, coef: np.ndarray, acc: np.ndarray) -> None:
    """acc (k, n) += coef^T x over the range's rows, in row order."""
    k = acc.shape[0]
    _f32(x, "x")
    _f32(acc, "acc", k * n, writable=True)
    _f32(coef, "coef", geo_rows(lo, x.size, n) * k)
    rc = _lib.gc_geo_accumulate(
        *_range(x, lo, n),
        _ffi.from_buffer("float[]", coef),
        k,
        _ffi.from_buffer("float[]", acc, require_writable=True),
    )
    if rc:
        raise ValueError(f"gc_geo_accumulate refused its arguments ({rc})")


def geo_sumsq(x: np.ndarray) -> float:
    """Sum of squares of x in fp64, in a fixed order."""
    _f32(x, "x")
    require()
    return float(_lib.gc_geo_sumsq(_ffi.from_buffer("float[]", x), x.size))


def geo_orthonormalize(rows: np.ndarray, seed: int) -> None:
    """Orthonormalize the rows of the (k, n) float32 matrix in place (k <= n)."""
    _f32(rows, "rows", writable=True)
    k, n = rows.shape
    require()
    rc = _lib.gc_geo_orthonormalize(
        _ffi.from_buffer("float[]", rows, require_writable=True), k, n, seed & (2**64 - 1)
    )
    if rc:
        raise ValueError(f"gc_geo_orthonormalize refused a {k} x {n} matrix ({rc})")


# ---------------------------------------------------------------------------
# Threads and vector loops of the codec (native/geocomm.h: gc_codec_threads,
# gc_codec_simd). Neither changes a byte: threads split a call on whole blocks.

#: environment variables read at import for the codec's thread count, first set wins
THREAD_VARIABLES = ("GEOCOMM_CODEC_THREADS", "OMP_NUM_THREADS")
#: the most threads a call uses (``GC_MAX_THREADS`` of native/geocomm.h): larger
#: requests are clamped here, before they reach C's int
MAX_THREADS = 64
#: gc_codec_simd levels by name
SIMD_LEVELS = {"portable": 0, "avx512": 1}


def threads_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The codec's thread count the environment asks for.

    ``GEOCOMM_CODEC_THREADS`` if set (a positive integer, else ValueError),
    else the first entry of ``OMP_NUM_THREADS`` (what the launcher gives each
    rank; ignored unless a positive integer), else 1.
    """
    env = os.environ if environ is None else environ
    value = env.get(THREAD_VARIABLES[0], "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{THREAD_VARIABLES[0]} must be a positive integer, got {value!r}")
        return min(int(value), MAX_THREADS)
    first = env.get(THREAD_VARIABLES[1], "").split(",")[0].strip()
    return min(int(first), MAX_THREADS) if first.isdigit() and int(first) > 0 else 1


def set_threads(count: int) -> int:
    """Let each encode/decode call use up to ``count`` threads (large calls only); returns it."""
    require()
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"thread count must be a positive integer, got {count!r}")
    return int(_lib.gc_codec_threads(min(int(count), MAX_THREADS)))


def threads() -> int:
    """The thread count encode/decode calls may use now."""
    require()
    return int(_lib.gc_codec_threads(0))


def set_simd(level: str) -> str:
    """Use the ``"portable"`` C loops, the ``"avx512"`` ones (where the CPU has them) or the
    widest available (``"auto"``), in the codec and the geometry kernels alike (the
    bits do not change); returns the level now in use."""
    require()
    if level != "auto" and level not in SIMD_LEVELS:
        raise ValueError(f"simd level must be 'auto' or one of {sorted(SIMD_LEVELS)}")
    got = _lib.gc_codec_simd(_lib.GC_SIMD_AUTO if level == "auto" else SIMD_LEVELS[level])
    return next(name for name, code in SIMD_LEVELS.items() if code == got)


def simd() -> str:
    """The vector loops in use: ``"portable"`` or ``"avx512"``."""
    require()
    got = _lib.gc_codec_simd(_lib.GC_SIMD_CURRENT)
    return next(name for name, code in SIMD_LEVELS.items() if code == got)


if _lib is not None:
    _lib.gc_codec_threads(threads_from_env())
