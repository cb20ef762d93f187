"""Pure-NumPy reference of every wire body (see native/geocomm.h for layouts).

This is the specification in executable form: the native C core and the CuPy
kernels must produce the same bytes for the same input. It favours clarity
over speed; ml_dtypes performs the final casts, so this module also pins the
codec to ml_dtypes' rounding.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FMAX = {"e4m3": F32(448.0), "e5m2": F32(57344.0)}
FP8_DTYPE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
E2M1_MAX = F32(6.0)
NVFP4_BLOCK = 16
TINY = F32(2.0**-100)  # below this amax, FMAX / amax could overflow fp32
PRESCALE = F32(2.0**64)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """View x (1-D float32) as rows of ``block`` values, zero-padded."""
    nblocks = -(-x.size // block)
    padded = np.zeros(nblocks * block, F32)
    padded[: x.size] = x
    return padded.reshape(nblocks, block)


def _amax(rows: np.ndarray) -> np.ndarray:
    """Per-row max |x| over finite values (non-finite values count as 0)."""
    return np.where(np.isfinite(rows), np.abs(rows), F32(0)).max(axis=1)


def _quant_factor(amax: np.ndarray, fmax: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(pre, factor) so that (x * pre) * factor maps amax onto fmax; 0 for amax 0."""
    pre = np.where(amax < TINY, PRESCALE, F32(1)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(amax > 0, fmax / (amax * pre), F32(0)).astype(F32)
    return pre, factor


def _scaled(rows: np.ndarray, pre: np.ndarray, factor: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return (rows * pre[:, None]) * factor[:, None]


def _cast_saturated(q: np.ndarray, sign_of: np.ndarray, fmax, dtype) -> np.ndarray:
    """Clamp |q| to fmax (fmin: NaN q gives fmax), take the sign of sign_of, cast."""
    magnitude = np.fmin(np.abs(q), fmax)
    return np.copysign(magnitude, sign_of).astype(F32).astype(dtype).view(np.uint8)


def fp8_wire_size(n: int, block: int) -> int:
    return 0 if n == 0 else 4 * -(-n // (block or n)) + n


def encode_fp8(x: np.ndarray, fmt: str, block: int) -> np.ndarray:
    """Wire body: fp32 scales (amax / FMAX) per block, then one code per value."""
    n = x.size
    if n == 0:
        return np.zeros(0, np.uint8)
    fmax = FMAX[fmt]
    rows = _blocks(np.ascontiguousarray(x, F32).ravel(), block or n)
    amax = _amax(rows)
    pre, factor = _quant_factor(amax, fmax)
    q = _scaled(rows, pre, factor)
    codes = _cast_saturated(q, rows, fmax, FP8_DTYPE[fmt]).copy()
    bits = rows.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    nonfinite = ~np.isfinite(rows)
    if fmt == "e4m3":
        special = sign | np.uint8(0x7F)
    else:
        special = sign | np.where(bits & 0x007FFFFF, np.uint8(0x7E), np.uint8(0x7C))
    codes[nonfinite] = special[nonfinite]
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
    return values * np.repeat(scales, b)[:n]


def nvfp4_wire_size(n: int) -> int:
    return 0 if n == 0 else 4 + -(-n // NVFP4_BLOCK) + -(-n // 2)


def _e4m3_values(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e4m3fn).astype(F32)


def encode_nvfp4(x: np.ndarray) -> np.ndarray:
    """Wire body: fp32 tensor scale, E4M3 scale per 16 values, packed E2M1 codes."""
    n = x.size
    if n == 0:
        return np.zeros(0, np.uint8)
    flat = np.ascontiguousarray(x, F32).ravel()
    tmax = E2M1_MAX * FMAX["e4m3"]
    tamax = _amax(flat[None, :])
    tpre, tfactor = _quant_factor(tamax, tmax)
    gscale = (tamax / tmax).astype(F32)
    rows = _blocks(flat, NVFP4_BLOCK)
    finite = np.isfinite(rows).all(axis=1)
    s = ((_amax(rows) / E2M1_MAX) * tpre) * tfactor
    scode = _cast_saturated(s, np.zeros_like(s), FMAX["e4m3"], ml_dtypes.float8_e4m3fn).copy()
    scode[~finite] = 0x7F
    eff = _e4m3_values(scode) * gscale
    pre, factor = _quant_factor(np.where(finite, eff, F32(0)).astype(F32), F32(1))
    q = _scaled(rows, pre, factor)
    codes = _cast_saturated(q, q, E2M1_MAX, ml_dtypes.float4_e2m1fn).copy()
    codes[~finite] = 0
    codes = codes.ravel()[:n]
    if n % 2:
        codes = np.append(codes, np.uint8(0))
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return np.concatenate([gscale.astype("<f4").view(np.uint8), scode, packed])


def decode_nvfp4(wire: np.ndarray, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, F32)
    nblocks = -(-n // NVFP4_BLOCK)
    gscale = wire[:4].view("<f4").astype(F32)[0]
    eff = _e4m3_values(wire[4 : 4 + nblocks]) * gscale
    packed = wire[4 + nblocks : 4 + nblocks + -(-n // 2)]
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    values = codes[:n].view(ml_dtypes.float4_e2m1fn).astype(F32)
    return values * np.repeat(eff, NVFP4_BLOCK)[:n]


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """Wire body: one little-endian bfloat16 (round-to-nearest-even) per value."""
    flat = np.ascontiguousarray(x, F32).ravel()
    return flat.astype(ml_dtypes.bfloat16).view("<u2").view(np.uint8).copy()


def decode_bf16(wire: np.ndarray, n: int) -> np.ndarray:
    return wire[: 2 * n].view("<u2").view(ml_dtypes.bfloat16).astype(F32)


def wire_size(fmt: str, n: int, block: int = 0) -> int:
    if fmt in FMAX:
        return fp8_wire_size(n, block)
    if fmt == "nvfp4":
        return nvfp4_wire_size(n)
    if fmt == "bf16":
        return 2 * n
    raise ValueError(f"unknown format {fmt!r}")


def encode(fmt: str, x: np.ndarray, block: int = 0) -> np.ndarray:
    """Reference wire body of x (any shape, cast to float32) in ``fmt``."""
    if fmt in FMAX:
        return encode_fp8(x, fmt, block)
    if fmt == "nvfp4":
        return encode_nvfp4(x)
    if fmt == "bf16":
        return encode_bf16(x)
    raise ValueError(f"unknown format {fmt!r}")


def decode(fmt: str, wire: np.ndarray, n: int, block: int = 0) -> np.ndarray:
    """Reference decode of ``n`` float32 values from a wire body."""
    wire = np.ascontiguousarray(wire, np.uint8)
    if fmt in FMAX:
        return decode_fp8(wire, n, fmt, block)
    if fmt == "nvfp4":
        return decode_nvfp4(wire, n)
    if fmt == "bf16":
        return decode_bf16(wire, n)
    raise ValueError(f"unknown format {fmt!r}")
