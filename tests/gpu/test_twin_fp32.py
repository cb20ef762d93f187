"""The twin's fp32 is CUDA's, not the host's (tests/twin/cuda_twin_fp32.h).

g++ on x86-64 computes a kernel's fp32 with SSE; a GPU differs wherever IEEE 754
leaves a choice or C++ leaves the result undefined, and the twin follows the GPU
in each (the CUDA C++ Programming Guide, "Floating-Point Standard", and the PTX
ISA's cvt, min/max, neg/abs and .ftz): NaN results, float-to-integer
conversions, min/max with NaNs and signed zeros, division and reciprocal, fused
multiply-add, flush-to-zero. Each test launches a hand-written kernel and
demands CUDA's answer exactly; where this host is x86-64, it also shows the
host's own answer differs, which is the bug the twin could not see before
(issue 39: the C core and the twin, both x86, wrote -6 where a GPU writes +6).
"""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest
from test_twin_runtime import build

from geocomm.kernels import cuda

CANONICAL = 0x7FFFFFFF  # the only NaN an fp32 operation produces on an NVIDIA GPU
X86 = platform.machine().lower() in ("x86_64", "amd64")
F32 = np.float32
u32 = np.uint32


def floats(*patterns: int) -> np.ndarray:
    return np.array(patterns, np.uint32).view(F32)


def host_bits(f) -> int:
    with np.errstate(all="ignore"):
        return int(np.asarray(f(), F32).view(np.uint32))


# ---------------------------------------------------------------------------
# NaN results

NAN_KERNEL = r"""
/* x: inf, 0, 1, NaN 0xffc00001, NaN 0x7fc00002 */
extern "C" __global__ void nan_results(const float *x, unsigned int *out)
{
    float inf = x[0], zero = x[1], one = x[2], nneg = x[3], npos = x[4];
    float r[] = {inf * zero,        inf - inf,           zero / zero,      nneg + one,
                 one * npos,        -(inf * zero),       sqrtf(-one),      fmaf(inf, zero, one),
                 __fmul_rn(inf, zero), __fadd_rn(nneg, one), __fdiv_rn(zero, zero),
                 __fsqrt_rn(-one),  __frcp_rn(nneg),     __fmaf_rn(npos, one, one),
                 fminf(nneg, npos), fmaxf(npos, nneg),   (float)(double)nneg,
                 /* moves and sign operations keep a NaN's payload */
                 nneg,              -npos,               fabsf(nneg),      copysignf(npos, -one),
                 __uint_as_float(0xffc00003u)};
    for (unsigned int i = 0; i < sizeof r / sizeof r[0]; ++i)
        out[i] = __float_as_uint(r[i]);
}
"""


def test_nan_results_are_the_canonical_nan():
    # CUDA guide: an fp32 operation's NaN result is the quiet NaN 0x7fffffff (17 of
    # them here, conversions included); neg, abs, copysign and moves are bit
    # operations that keep a NaN's payload (fp32's are IEEE-compliant: only fp64 neg
    # and abs pass a NaN unchanged). Exact expected bits.
    x = np.concatenate([np.array([np.inf, 0, 1], F32), floats(0xFFC00001, 0x7FC00002)])
    out = np.zeros(22, u32)
    build(NAN_KERNEL, "-fmad=false", "-ftz=false").function("nan_results").launch(1, 1, (x, out))
    kept = [0xFFC00001, 0xFFC00002, 0x7FC00001, 0xFFC00002, 0xFFC00003]
    assert out.tolist() == [CANONICAL] * 17 + kept
    if X86:  # SSE's answers, which the C core gives: the sign bit set, a payload passed on
        assert host_bits(lambda: F32(np.inf) * F32(0)) == 0xFFC00000
        assert host_bits(lambda: floats(0xFFC00001)[0] + F32(1)) == 0xFFC00001


# ---------------------------------------------------------------------------
# float to integer

CONVERT_KERNEL = r"""
extern "C" __global__ void convert(const float *x, int *i32, unsigned int *u32,
                                   long long *i64, unsigned char *u8, int *b)
{
    unsigned int k = threadIdx.x;
    i32[k] = (int)x[k];
    u32[k] = (unsigned int)(x[k] * 1.0f); /* an expression converts alike */
    i64[k] = (long long)x[k];
    u8[k] = (unsigned char)x[k];
    b[k] = (bool)x[k];
}
"""

#: NaNs and infinities, values past the ranges or on their edges, fractions
CONVERT_INPUTS = [math.nan, -math.nan, math.inf, -math.inf]
CONVERT_INPUTS += [3e9, -3e9, 2147483520.0, 2.0**31, -(2.0**31), 1e19, -1e19, 300.0, -3.0, 255.9]
CONVERT_INPUTS += [-0.5, 0.5, 1.9, -1.9, 0.0, -0.0]


#: the ranges of the kernel's int, unsigned int, long long and unsigned char
CONVERT_RANGES = [(-(2**31), 2**31 - 1), (0, 2**32 - 1), (-(2**63), 2**63 - 1), (0, 255)]


def cvt_rzi(v: float, lo: int, hi: int) -> int:
    """PTX cvt.rzi to an integer type of range [lo, hi]: toward zero, saturated, NaN 0."""
    if math.isnan(v):
        return 0
    return lo if v <= lo else hi if v >= hi else math.trunc(v)


def test_float_to_integer_saturates_and_nan_is_0():
    # PTX cvt.rzi (what a C++ cast compiles to): saturation to the destination's
    # range, NaN -> 0; C++ calls both undefined, and SSE gives INT_MIN. Exact values.
    x = np.array(CONVERT_INPUTS, F32)
    n = x.size
    outs = [np.zeros(n, d) for d in (np.int32, np.uint32, np.int64, np.uint8, np.int32)]
    kernel = build(CONVERT_KERNEL, "-fmad=false", "-ftz=false").function("convert")
    kernel.launch(1, n, (x, *outs))
    for out, (lo, hi) in zip(outs[:4], CONVERT_RANGES, strict=True):
        assert out.tolist() == [cvt_rzi(float(v), lo, hi) for v in x]
    assert outs[4].tolist() == [int(float(v) != 0) for v in x]  # NaN is true
    if X86:
        with np.errstate(invalid="ignore"):
            assert int(np.array([np.nan], F32).astype(np.int32)[0]) == -(2**31)


# ---------------------------------------------------------------------------
# min and max

MINMAX_KERNEL = r"""
extern "C" __global__ void minmax(const float *a, const float *b, unsigned int *out)
{
    unsigned int k = threadIdx.x, n = blockDim.x;
    out[k] = __float_as_uint(fminf(a[k], b[k]));
    out[n + k] = __float_as_uint(fmaxf(a[k], b[k]));
    out[2 * n + k] = __float_as_uint(min(a[k], b[k]));
    out[3 * n + k] = __float_as_uint(max(a[k], b[k]));
}
"""


def ptx_minmax(a: np.float32, b: np.float32, smaller: bool) -> int:
    """PTX min/max.f32: a NaN operand gives the other one, two the canonical NaN;
    -0 < +0; otherwise the smaller (larger) value."""
    if np.isnan(a) and np.isnan(b):
        return CANONICAL
    if np.isnan(a) or np.isnan(b):
        return int((b if np.isnan(a) else a).view(u32))
    key = (float(a), not np.signbit(a)), (float(b), not np.signbit(b))  # -0 sorts first
    pick = a if (key[0] <= key[1]) == smaller else b
    return int(pick.view(u32))


def test_min_max_follow_ptx_for_nan_and_signed_zeros():
    # fminf/fmaxf/min/max are PTX min/max.f32; glibc's fminf(+0, -0) is +0 (the
    # first operand), PTX's -0. Exact bits for every pair.
    a = np.concatenate(
        [np.array([np.nan, 1, np.nan, 0.0, -0.0, 1, -np.inf, 2.0**-140], F32), floats(0xFFC00001)]
    )
    b = np.concatenate(
        [np.array([1, np.nan, np.nan, -0.0, 0.0, 2, 3, -(2.0**-140)], F32), floats(0x7FC00002)]
    )
    n = a.size
    out = np.zeros(4 * n, u32)
    build(MINMAX_KERNEL, "-fmad=false", "-ftz=false").function("minmax").launch(1, n, (a, b, out))
    lows = [ptx_minmax(p, q, True) for p, q in zip(a, b, strict=True)]
    highs = [ptx_minmax(p, q, False) for p, q in zip(a, b, strict=True)]
    assert out.tolist() == lows + highs + lows + highs
    assert lows[3] == 0x80000000 and highs[4] == 0  # the signed zeros, spelled out


# ---------------------------------------------------------------------------
# division, reciprocal, fused multiply-add

DIVIDE_KERNEL = r"""
extern "C" __global__ void divide(const float *a, const float *b, unsigned int *out)
{
    unsigned int k = threadIdx.x, n = blockDim.x;
    out[k] = __float_as_uint(a[k] / b[k]);
    out[n + k] = __float_as_uint(__fdiv_rn(a[k], b[k]));
    out[2 * n + k] = __float_as_uint(__frcp_rn(b[k]));
}
extern "C" __global__ void fused(const float *a, const float *b, const float *c,
                                 unsigned int *out)
{
    out[0] = __float_as_uint(a[0] * b[0] + c[0]); /* -fmad=false: two roundings */
    out[1] = __float_as_uint(fmaf(a[0], b[0], c[0]));
    out[2] = __float_as_uint(__fmaf_rn(a[0], b[0], c[0]));
}
"""


def ieee(values: np.ndarray) -> list[int]:
    """The bits of IEEE float32 results (NumPy's division is correctly rounded) as
    the GPU holds them: any NaN canonical."""
    return [CANONICAL if np.isnan(v) else int(v.view(u32)) for v in values]


#: x / 0 of both signs, 0 / 0, inf / inf, x / inf, an overflow, subnormal quotients
DIVIDENDS = np.array([1, 1, -1, 0, np.inf, 1, 3e38, 2.0**-140, 1, 7], F32)
DIVISORS = np.array([3, 0, 0, 0, np.inf, np.inf, 1e-5, 3, 2.0**-140, -0.0], F32)


def test_division_and_reciprocal_are_ieee():
    # -prec-div=true (NVRTC_OPTIONS): / , __fdiv_rn and __frcp_rn are correctly
    # rounded IEEE division, subnormal quotients kept (-ftz=false), NaNs canonical.
    rng = np.random.default_rng(5)
    wide = rng.standard_normal(22) * np.exp2(rng.integers(-60, 60, 22))
    a = np.concatenate([DIVIDENDS, rng.standard_normal(22)]).astype(F32)
    b = np.concatenate([DIVISORS, wide]).astype(F32)
    n = a.size
    out = np.zeros(3 * n, u32)
    build(DIVIDE_KERNEL, "-fmad=false", "-ftz=false").function("divide").launch(1, n, (a, b, out))
    with np.errstate(all="ignore"):
        quotient, reciprocal = a / b, F32(1) / b
    assert out.tolist() == ieee(quotient) * 2 + ieee(reciprocal)


@pytest.mark.parametrize(
    "abc,unfused,fused",
    [
        # a * b = 1 + 2^-11 + 2^-24 exactly: rounded to 1 + 2^-11 before adding -1
        ((1 + 2.0**-12, 1 + 2.0**-12, -1.0), 2.0**-11, 2.0**-11 + 2.0**-24),
        ((np.inf, 0.0, 1.0), np.nan, np.nan),
    ],
)
def test_fma_fuses_only_where_written(abc, unfused, fused):
    # -fmad=false: a * b + c rounds twice; fmaf and __fmaf_rn round once (exact
    # expected values, derived in the comments); an invalid fma is the canonical NaN.
    a, b, c = (np.array([v], F32) for v in abc)
    out = np.zeros(3, u32)
    build(DIVIDE_KERNEL, "-fmad=false", "-ftz=false").function("fused").launch(1, 1, (a, b, c, out))
    assert out.tolist() == ieee(np.array([unfused, fused, fused], F32))


# ---------------------------------------------------------------------------
# flush to zero

FTZ_KERNEL = r"""
/* s: a subnormal; t: 2^-70, whose square is subnormal; one: 1 (loaded, so that
 * s * one is not folded away) */
extern "C" __global__ void flush(const float *x, unsigned int *out)
{
    float s = x[0], t = x[1], one = x[2];
    float r[] = {s * one, t * t, -s, fabsf(-s), fminf(s, 1.0f), fmaxf(-s, -1.0f),
                 __saturatef(s), s};
    for (unsigned int i = 0; i < sizeof r / sizeof r[0]; ++i)
        out[i] = __float_as_uint(r[i]);
    out[8] = s > 0.0f;
    out[9] = (unsigned int)(s * 0x1p127f * 0x1p22f); /* 2^9 unless s was flushed */
}
"""


@pytest.mark.parametrize("ftz", [False, True])
def test_ftz_flushes_every_fp32_instruction(ftz):
    # -ftz=true flushes subnormal inputs and results of every fp32 instruction to
    # sign-preserving zero: arithmetic, comparisons and conversions (the host's
    # MXCSR.FTZ|DAZ) and neg, abs, min, max, saturate (PTX neg.ftz, abs.ftz,
    # min.ftz ...: SSE's sign-bit operations do not flush); a move does not.
    s = F32(2.0**-140)
    x = np.array([s, 2.0**-70, 1.0], F32)
    out = np.zeros(10, u32)
    image = build(FTZ_KERNEL, f"-ftz={'true' if ftz else 'false'}", "-fmad=false")
    image.function("flush").launch(1, 1, (x, out))
    sb, neg = int(s.view(u32)), int(s.view(u32)) | 0x80000000
    if ftz:
        want = [0, 0, 0x80000000, 0, 0, 0x80000000, 0, sb, 0, 0]
    else:
        want = [sb, sb, neg, sb, sb, neg, sb, sb, 1, 512]
    assert out.tolist() == want


# ---------------------------------------------------------------------------
# issue 39: the old NVFP4 zero-scale element rule

OLD_RULE_KERNEL = r"""
/* The element code of an NVFP4 block whose scale is 0, as the old
 * gc_quant_factor set it up (pre 2^64, factor 0), and as it is now. */
extern "C" __global__ void zero_scale_codes(const float *x, unsigned char *old_codes,
                                            unsigned char *new_codes)
{
    unsigned int k = threadIdx.x;
    old_codes[k] = gc_e2m1_code((x[k] * 0x1p64f) * 0.0f, 0, 0u);
    float pre, factor = gc_quant_factor(0.0f, 1.0f, &pre);
    new_codes[k] = gc_nvfp4_keeps_codes(0.0f) ? gc_e2m1_code((x[k] * pre) * factor, 0, 0u) : 0u;
}
"""


def test_old_nvfp4_zero_scale_rule_differs_from_the_host():
    # The old rule formed (x * 2^64) * 0 = inf * 0 for |x| > 2^64: the twin's NaN is
    # the GPU's canonical one, so its code is +6 (0x7), where x86 and so the C core
    # wrote -6 (0xf): the twin's bytes check now fails on the old code. The rule of
    # gc_scalar.h writes 0 without forming a NaN, everywhere alike.
    x = np.array([1e25, -1e25, 1e21, -1e30, 57344.0, -465.0, -0.0, 0.0], F32)
    old, new = np.zeros(x.size, np.uint8), np.zeros(x.size, np.uint8)
    image = build(cuda.kernel_source() + OLD_RULE_KERNEL, *cuda.NVRTC_OPTIONS, name="gc.cu")
    image.function("zero_scale_codes").launch(1, x.size, (x, old, new))
    assert old.tolist() == [0x7, 0x7, 0x7, 0x7, 0x0, 0x8, 0x8, 0x0]
    assert new.tolist() == [0] * x.size
    if X86:  # the same arithmetic on this host: the NaN's sign bit set, -6
        with np.errstate(all="ignore"):
            q = (x * F32(2.0**64)) * F32(0)
        host = np.where(np.isnan(q), 7, 0) | (np.signbit(q) << 3)
        assert host.tolist() == [0xF, 0xF, 0xF, 0xF, 0x0, 0x8, 0x8, 0x0]
