"""Pure-NumPy reference of every wire body (see native/geocomm.h for layouts).

This is the specification in executable form: the native C core and the CuPy
kernels must produce the same bytes for the same input. It favours clarity
over speed; ml_dtypes performs the final casts, so this module also pins the
codec to ml_dtypes' rounding.

Stochastic rounding is specified here without bit tricks: a magnitude r
between the neighbouring representable values lo <= r < hi (found in the
sorted table of the format's values) rounds up iff its random word
(``sr_bits``) is below t = floor(2^32 (r - lo) / (hi - lo)), so for uniform
bits E[result] = lo + (hi - lo) t / 2^32, which is r whenever t is an integer
before the floor (the fp32 inputs' residuals have few enough bits for that
down to 2^-9 of the smallest subnormal; below, r is under-rounded by less
than 2^-32 of a quantum).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

F32 = np.float32
FMAX = {"e4m3": F32(448.0), "e5m2": F32(57344.0)}
FP8_DTYPE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
E2M1_MAX = F32(6.0)
NVFP4_BLOCK = 16  # values per E4M3 block scale
NVFP4_SUPERBLOCK = 4096  # values per fp32 superblock scale
TINY = F32(2.0**-100)  # below this amax, FMAX / amax could overflow fp32
PRESCALE = F32(2.0**64)
ROUNDINGS = ("nearest", "stochastic")
SCALE_RULES = ("floor", "rceil")

# ---- counter-based random bits (native/gc_scalar.h: gc_mix64, gc_sr_key, gc_sr_bits) --

_U64 = np.uint64
_GAMMA = _U64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (arithmetic modulo 2^64)."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    result: np.ndarray = z ^ (z >> _U64(31))
    return result


def sr_key(seed: int, rounding_stream: int) -> int:
    """key = mix64(mix64(seed) ^ rounding_stream): one per (seed, rounding stream)."""
    z = _mix64(np.array([seed], _U64)) ^ _U64(rounding_stream)
    return int(_mix64(z)[0])


def sr_bits(seed: int, rounding_stream: int, offset: int, n: int) -> np.ndarray:
    """uint32 words of elements offset .. offset + n - 1: mix64(key + (index + 1) gamma) >> 32.

    That is the upper half of SplitMix64's output number ``index`` from state ``key``.
    """
    index = np.arange(n, dtype=_U64) + _U64(offset)  # wraps modulo 2^64 like size_t
    state = _U64(sr_key(seed, rounding_stream)) + (index + _U64(1)) * _GAMMA
    result: np.ndarray = (_mix64(state) >> _U64(32)).astype(np.uint32)
    return result


@functools.cache
def _grid(dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """(values, codes): the format's non-negative finite values in ascending order.

    bfloat16 does not saturate (nor does ml_dtypes' cast): above its largest
    finite value the next value is 2^128, i.e. the code of inf.
    """
    nbits = {ml_dtypes.bfloat16: 16, ml_dtypes.float4_e2m1fn: 4}.get(dtype, 8)
    codes = np.arange(2 ** (nbits - 1), dtype=np.uint16 if nbits == 16 else np.uint8)
    with np.errstate(invalid="ignore"):  # NaN codes
        values = codes.view(dtype).astype(np.float64)
    keep = np.isfinite(values)
    values, codes = values[keep], codes[keep]
    if dtype == ml_dtypes.bfloat16:
        values = np.append(values, 2.0**128)
        codes = np.append(codes, np.uint16(0x7F80))
    return values, codes


def _round_stochastic(r: np.ndarray, dtype: type, rnd: np.ndarray) -> np.ndarray:
    """Codes of the magnitudes r (0 <= r, at most the top of the grid) rounded stochastically."""
    values, codes = _grid(dtype)
    r = np.asarray(r, np.float64)
    lo = np.searchsorted(values, r, side="right") - 1
    hi = np.minimum(lo + 1, values.size - 1)
    gap = np.where(hi > lo, values[hi] - values[lo], 1.0)  # a power of two: exact division
    with np.errstate(invalid="ignore"):  # inf - 2^128 for bfloat16's inf
        t = np.floor(np.ldexp((r - values[lo]) / gap, 32))
    return np.where(rnd.astype(np.float64) < t, codes[hi], codes[lo])


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """View x (1-D float32) as rows of ``block`` values, zero-padded."""
    nblocks = -(-x.size // block)
    padded = np.zeros(nblocks * block, F32)
    padded[: x.size] = x
    return padded.reshape(nblocks, block)


def _amax(rows: np.ndarray) -> np.ndarray:
    """Per-row max |x| over finite values (non-finite values count as 0)."""
    result: np.ndarray = np.where(np.isfinite(rows), np.abs(rows), F32(0)).max(axis=1)
    return result


def _quant_factor(amax: np.ndarray, fmax: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(pre, factor) so that (x * pre) * factor maps amax onto fmax; (1, 0) for amax 0."""
    pre = np.where((amax > 0) & (amax < TINY), PRESCALE, F32(1)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(amax > 0, fmax / (amax * pre), F32(0)).astype(F32)
    return pre, factor


def _scaled(rows: np.ndarray, pre: np.ndarray, factor: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        result: np.ndarray = (rows * pre[:, None]) * factor[:, None]
        return result


def _cast_saturated(
    q: np.ndarray, sign_of: np.ndarray, fmax: np.float32, dtype: type, rnd: np.ndarray | None = None
) -> np.ndarray:
    """Clamp |q| to fmax (fmin: NaN q gives fmax), take the sign of sign_of, cast.

    ``rnd`` (uint32, shaped like q): round stochastically instead of to nearest.
    """
    magnitude = np.fmin(np.abs(q), fmax)
    if rnd is None:
        nearest = np.copysign(magnitude, sign_of).astype(F32).astype(dtype)
        result: np.ndarray = nearest.view(np.uint8)
        return result
    sign = np.signbit(sign_of).astype(np.uint8) << np.uint8(3 if fmax == E2M1_MAX else 7)
    codes = _round_stochastic(magnitude, dtype, rnd.reshape(q.shape)).astype(np.uint8)
    signed: np.ndarray = codes | sign
    return signed


def _rows_of(rnd: np.ndarray | None, block: int) -> np.ndarray | None:
    """Per-element random words laid out like _blocks (padding gets 0)."""
    if rnd is None:
        return None
    padded = np.zeros(-(-rnd.size // block) * block, np.uint32)
    padded[: rnd.size] = rnd
    return padded.reshape(-1, block)


def _fp8_specials(codes: np.ndarray, rows: np.ndarray, fmt: str) -> None:
    """Non-finite inputs: NaN code (E4M3) or their inf/NaN code (E5M2), with their sign."""
    bits = rows.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    nonfinite = ~np.isfinite(rows)
    if fmt == "e4m3":
        special = sign | np.uint8(0x7F)
    else:
        special = sign | np.where(bits & 0x007FFFFF, np.uint8(0x7E), np.uint8(0x7C))
    codes[nonfinite] = special[nonfinite]


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte, element 2i in the low nibble."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    result: np.ndarray = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return result


def _unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    return codes[:n]


def encode_fp8(x: np.ndarray, fmt: str, block: int, rnd: np.ndarray | None = None) -> np.ndarray:
    """Wire body: fp32 scales (amax / FMAX) per block, then one code per value.

    ``rnd``: one uint32 random word per value for stochastic rounding (None: nearest).
    """
    n = x.size
    if n == 0:
        return np.zeros(0, np.uint8)
    fmax = FMAX[fmt]
    rows = _blocks(np.ascontiguousarray(x, F32).ravel(), block or n)
    amax = _amax(rows)
    pre, factor = _quant_factor(amax, fmax)
    q = _scaled(rows, pre, factor)
    codes = _cast_saturated(q, rows, fmax, FP8_DTYPE[fmt], _rows_of(rnd, block or n)).copy()
    _fp8_specials(codes, rows, fmt)
    scales = (amax / fmax).astype("<f4")
    return np.concatenate([scales.view(np.uint8), codes.ravel()[:n]])


def decode_fp8(wire: np.ndarray, n: int, fmt: str, block: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, F32)
    b = block or n
    nblocks = -(-n // b)
    scales = wire[: 4 * nblocks].view("<f4").astype(F32)
    codes = wire[4 * nblocks : 4 * nblocks + n]
    values = codes.view(FP8_DTYPE[fmt]).astype(F32)
    result: np.ndarray = values * np.repeat(scales, b)[:n]
    return result


def _e4m3_values(codes: np.ndarray) -> np.ndarray:
    result: np.ndarray = codes.view(ml_dtypes.float8_e4m3fn).astype(F32)
    return result


def _e4m3_ceil(s: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """E4M3 codes of the smallest value >= s (0 <= s; at most 448), and at least
    the smallest subnormal (code 1) where ``nonzero`` (s may have underflowed to 0)."""
    values, codes = _grid(ml_dtypes.float8_e4m3fn)
    i = np.searchsorted(values, np.minimum(s.astype(np.float64), 448.0), side="left")
    return np.where(nonzero, np.maximum(codes[i], 1), codes[i]).astype(np.uint8)


def encode_nvfp4(x: np.ndarray, rnd: np.ndarray | None = None) -> np.ndarray:
    """Wire body: fp32 scale per superblock of 4096 values, E4M3 scale per 16
    values (relative to its superblock's scale), packed E2M1 codes.

    With ``rnd`` (stochastic rounding) the block scales round up instead of to
    nearest, so no value exceeds 6 block scales and none saturates. A block whose
    decoded scale (E4M3 scale times superblock scale) is 0 or NaN writes codes 0.
    """
    n = x.size
    if n == 0:
        return np.zeros(0, np.uint8)
    flat = np.ascontiguousarray(x, F32).ravel()
    smax = E2M1_MAX * FMAX["e4m3"]
    samax = _amax(_blocks(flat, NVFP4_SUPERBLOCK))
    spre, sfactor = _quant_factor(samax, smax)
    sscale = (samax / smax).astype(F32)
    rows = _blocks(flat, NVFP4_BLOCK)
    owner = _superblock_of_blocks(rows.shape[0])
    finite = np.isfinite(rows).all(axis=1)
    s = ((_amax(rows) / E2M1_MAX) * spre[owner]) * sfactor[owner]
    if rnd is None:
        scode = _cast_saturated(s, np.zeros_like(s), FMAX["e4m3"], ml_dtypes.float8_e4m3fn)
    else:
        scode = _e4m3_ceil(s, _amax(rows) > 0)
    scode = np.where(finite, scode, np.uint8(0x7F)).astype(np.uint8)
    eff = _e4m3_values(scode) * sscale[owner]
    kept = eff > 0  # false for a zero or NaN block scale (gc_nvfp4_keeps_codes)
    pre, factor = _quant_factor(np.where(kept, eff, F32(0)).astype(F32), F32(1))
    q = _scaled(rows, pre, factor)
    rnd_rows = _rows_of(rnd, NVFP4_BLOCK)
    codes = _cast_saturated(q, q, E2M1_MAX, ml_dtypes.float4_e2m1fn, rnd_rows).copy()
    codes[~kept] = 0
    packed = _pack_nibbles(codes.ravel()[:n])
    return np.concatenate([sscale.astype("<f4").view(np.uint8), scode, packed])


def _superblock_of_blocks(nblocks: int) -> np.ndarray:
    """The superblock of each NVFP4 block of 16 values."""
    return np.arange(nblocks) * NVFP4_BLOCK // NVFP4_SUPERBLOCK


def decode_nvfp4(wire: np.ndarray, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, F32)
    nsuper = -(-n // NVFP4_SUPERBLOCK)
    nblocks = -(-n // NVFP4_BLOCK)
    sscale = wire[: 4 * nsuper].view("<f4").astype(F32)
    bscales = wire[4 * nsuper : 4 * nsuper + nblocks]
    eff = _e4m3_values(bscales) * sscale[_superblock_of_blocks(nblocks)]
    codes = _unpack_nibbles(wire[4 * nsuper + nblocks : 4 * nsuper + nblocks + -(-n // 2)], n)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)
    result: np.ndarray = values * np.repeat(eff, NVFP4_BLOCK)[:n]
    return result


#: the largest finite bfloat16's code (3.3895e38)
BF16_MAX_CODE = 0x7F7F


def encode_bf16(x: np.ndarray, rnd: np.ndarray | None = None) -> np.ndarray:
    """Wire body: one little-endian bfloat16 (round-to-nearest-even) per value; a
    finite value that rounds to inf saturates to the largest finite bfloat16."""
    flat = np.ascontiguousarray(x, F32).ravel()
    if rnd is None:
        codes = flat.astype(ml_dtypes.bfloat16).view("<u2").copy()
    else:
        codes = _round_stochastic(np.abs(flat), ml_dtypes.bfloat16, rnd).astype("<u2")
        codes |= np.signbit(flat).astype("<u2") << np.uint16(15)
        nan = np.isnan(flat)
        codes[nan] = flat[nan].astype(ml_dtypes.bfloat16).view("<u2")  # canonical NaN, its sign
    over = np.isfinite(flat) & ((codes & np.uint16(0x7FFF)) == 0x7F80)
    codes[over] = (codes[over] & np.uint16(0x8000)) | np.uint16(BF16_MAX_CODE)
    body: np.ndarray = codes.view(np.uint8)
    return body


def decode_bf16(wire: np.ndarray, n: int) -> np.ndarray:
    result: np.ndarray = wire[: 2 * n].view("<u2").view(ml_dtypes.bfloat16).astype(F32)
    return result


# ---- MX (OCP Microscaling v1.0) ------------------------------------------------

MX_BLOCK = 32
#: element format of each MX format
MX_ELEMENT = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}
_ELEMENT = {  # (largest value, its exponent, ml_dtypes type)
    "e4m3": (FMAX["e4m3"], 8, ml_dtypes.float8_e4m3fn),
    "e5m2": (FMAX["e5m2"], 15, ml_dtypes.float8_e5m2),
    "e2m1": (E2M1_MAX, 2, ml_dtypes.float4_e2m1fn),
}


def mx_exponents(amax: np.ndarray, element: str, rceil: bool) -> np.ndarray:
    """Shared exponents X (int64) of blocks with finite maxima amax.

    floor: X = floor(log2 amax) - EMAX (OCP); rceil: the smallest X with
    amax <= FMAX 2^X. Clamped to [-127, 127 - EMAX] (E8M0's bottom; FMAX 2^X
    below fp32's overflow); amax 0 gives -127.
    """
    fmax, emax, _ = _ELEMENT[element]
    a = amax.astype(np.float64)
    x = np.frexp(a)[1].astype(np.int64) - 1 - emax  # a = m 2^e, m in [0.5, 1)
    if rceil:
        x += a > np.ldexp(float(fmax), x)  # exact in float64
    return np.clip(np.where(a > 0, x, -127), -127, 127 - emax)


def encode_mx(
    x: np.ndarray, fmt: str, rceil: bool = False, rnd: np.ndarray | None = None
) -> np.ndarray:
    """Wire body: E8M0 scale codes X + 127 per 32 values, then the codes of x * 2^-X.

    MXFP8 keeps non-finite values per element like fp8; an MXFP4 block with a
    non-finite value gets the NaN scale 0xff and codes 0.
    """
    n = x.size
    if n == 0:
        return np.zeros(0, np.uint8)
    element = MX_ELEMENT[fmt]
    fmax, _, dtype = _ELEMENT[element]
    rows = _blocks(np.ascontiguousarray(x, F32).ravel(), MX_BLOCK)
    finite = np.isfinite(rows).all(axis=1)
    exps = mx_exponents(_amax(rows), element, rceil)
    with np.errstate(invalid="ignore"):
        q = rows * np.exp2(-exps).astype(F32)[:, None]  # exact unless below fp32's range
    codes = _cast_saturated(q, rows, fmax, dtype, _rows_of(rnd, MX_BLOCK)).copy()
    scales = (exps + 127).astype(np.uint8)
    if fmt == "mxfp4":
        codes[~finite] = 0
        scales[~finite] = 0xFF
        payload = _pack_nibbles(codes.ravel()[:n])
    else:
        _fp8_specials(codes, rows, element)
        payload = codes.ravel()[:n]
    return np.concatenate([scales, payload])


def decode_mx(wire: np.ndarray, n: int, fmt: str) -> np.ndarray:
    if n == 0:
        return np.zeros(0, F32)
    nblocks = -(-n // MX_BLOCK)
    scales = wire[:nblocks].view(ml_dtypes.float8_e8m0fnu).astype(F32)
    _, _, dtype = _ELEMENT[MX_ELEMENT[fmt]]
    if fmt == "mxfp4":
        codes = _unpack_nibbles(wire[nblocks : nblocks + -(-n // 2)], n)
    else:
        codes = wire[nblocks : nblocks + n]
    with np.errstate(over="ignore", invalid="ignore"):
        result: np.ndarray = codes.view(dtype).astype(F32) * np.repeat(scales, MX_BLOCK)[:n]
        return result


# ---- dispatch --------------------------------------------------------------------

FORMAT_NAMES = (*FMAX, "nvfp4", "bf16", *MX_ELEMENT)


def wire_size(fmt: str, n: int, block: int = 0) -> int:
    """Bytes of the wire body of n values (native/geocomm.h): the reference's one formula."""
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"unknown format {fmt!r}")
    if n == 0:
        return 0
    if fmt in FMAX:
        return 4 * -(-n // (block or n)) + n
    if fmt == "nvfp4":
        return 4 * -(-n // NVFP4_SUPERBLOCK) + -(-n // NVFP4_BLOCK) + -(-n // 2)
    if fmt == "bf16":
        return 2 * n
    return -(-n // MX_BLOCK) + (-(-n // 2) if fmt == "mxfp4" else n)


def encode(
    fmt: str,
    x: np.ndarray,
    block: int = 0,
    *,
    rounding: str = "nearest",
    seed: int = 0,
    rounding_stream: int = 0,
    offset: int = 0,
    scale_rule: str = "floor",
) -> np.ndarray:
    """Reference wire body of x (any shape, cast to float32) in ``fmt``.

    ``rounding="stochastic"``: element i rounds with ``sr_bits(seed, rounding_stream,
    offset + i)``. ``scale_rule`` ("floor" or "rceil") applies to MX formats only.
    """
    if rounding not in ROUNDINGS or scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown rounding {rounding!r} or scale rule {scale_rule!r}")
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"unknown format {fmt!r}")
    if scale_rule != "floor" and fmt not in MX_ELEMENT:
        raise ValueError(f"scale_rule applies to MX formats, not {fmt!r}")
    rnd = sr_bits(seed, rounding_stream, offset, np.size(x)) if rounding == "stochastic" else None
    if fmt in FMAX:
        return encode_fp8(x, fmt, block, rnd)
    if fmt in MX_ELEMENT:
        return encode_mx(x, fmt, scale_rule == "rceil", rnd)
    return encode_nvfp4(x, rnd) if fmt == "nvfp4" else encode_bf16(x, rnd)


def decode(fmt: str, wire: np.ndarray, n: int, block: int = 0) -> np.ndarray:
    """Reference decode of ``n`` float32 values from a wire body."""
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"unknown format {fmt!r}")
    wire = np.ascontiguousarray(wire, np.uint8)
    if fmt in FMAX:
        return decode_fp8(wire, n, fmt, block)
    if fmt in MX_ELEMENT:
        return decode_mx(wire, n, fmt)
    return decode_nvfp4(wire, n) if fmt == "nvfp4" else decode_bf16(wire, n)
