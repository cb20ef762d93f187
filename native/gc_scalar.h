/*
 * Per-element and per-block arithmetic of every geocomm wire format.
 *
 * This header is the single definition of the codec arithmetic. It compiles
 * as C99 (included by codec.c, whose loops call it) and as CUDA (its text is
 * prepended to the CuPy kernels at run time), so the CPU tests exercise the
 * exact operations the GPU runs. GC_FN expands to `static inline` in C and
 * `__device__ __forceinline__` in CUDA. Only fp32 arithmetic is used: no
 * fp64, no libm calls beyond fabsf, no fast-math assumptions.
 *
 * Conventions (DESIGN section 3):
 *   scale = amax / FMAX            (fp32; 0 for an all-zero block)
 *   code  = RNE(clamp(x * (FMAX / amax), -FMAX, FMAX))
 *   amax ignores non-finite inputs; a non-finite input encodes as NaN in
 *   E4M3FN, keeps its inf/NaN code in E5M2.
 * When amax is tiny (< 2^-100) FMAX / amax would overflow, so both factors
 * are pre-multiplied by 2^64 (exact, a power of two); see gc_quant_factor.
 */
#ifndef GC_SCALAR_H
#define GC_SCALAR_H

#ifdef __CUDACC__
#define GC_FN __device__ __forceinline__
typedef unsigned int gc_u32;
typedef unsigned char gc_u8;
typedef unsigned short gc_u16;
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define GC_FN static inline
typedef uint32_t gc_u32;
typedef uint8_t gc_u8;
typedef uint16_t gc_u16;
#endif

#define GC_E4M3_MAX 448.0f
#define GC_E5M2_MAX 57344.0f
#define GC_E2M1_MAX 6.0f
#define GC_NVFP4_BLOCK 16

GC_FN gc_u32 gc_bits(float f)
{
#ifdef __CUDACC__
    return __float_as_uint(f);
#else
    gc_u32 u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

GC_FN float gc_float(gc_u32 u)
{
#ifdef __CUDACC__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* 1 when f is neither inf nor NaN (exponent field not all ones). */
GC_FN int gc_finite(float f) { return (gc_bits(f) & 0x7f800000u) != 0x7f800000u; }

/* |f| for finite f, 0 otherwise: the contribution of f to a block's amax. */
GC_FN float gc_amax_term(float f) { return gc_finite(f) ? fabsf(f) : 0.0f; }

/* min(|q|, fmax), and fmax for NaN q (like fminf, but vectorizes as minps). */
GC_FN float gc_min_abs(float q, float fmax)
{
    float a = fabsf(q);
    return a < fmax ? a : fmax;
}

/*
 * Round |r| (finite, already clamped to the format's max) to a small float
 * format with MBITS mantissa bits and exponent bias BIAS; returns the code
 * without its sign bit. Normals: round-to-nearest-even on the fp32 bit
 * pattern. Subnormals (|r| < 2^(1-BIAS)): adding 2^(23 + 1 - BIAS - MBITS)
 * lets the fp32 adder round to the subnormal quantum, and the difference of
 * bit patterns counts quanta; it continues seamlessly into the normals.
 */
GC_FN gc_u32 gc_round_minifloat(float r, int mbits, int bias)
{
    gc_u32 bits = gc_bits(r);
    int shift = 23 - mbits;
    gc_u32 odd = (bits >> shift) & 1u;
    gc_u32 normal = ((bits + ((1u << (shift - 1)) - 1u) + odd) >> shift)
                    - ((gc_u32)(127 - bias) << mbits);
    float magic = gc_float((gc_u32)(127 + 23 + 1 - bias - mbits) << 23);
    gc_u32 subnormal = gc_bits(r + magic) - gc_bits(magic);
    float min_normal = gc_float((gc_u32)(127 + 1 - bias) << 23);
    return r < min_normal ? subnormal : normal;
}

/* q (already x * factor) to E4M3FN: saturate finite, NaN for non-finite x. */
GC_FN gc_u8 gc_e4m3_code(float q, float x)
{
    gc_u32 sign = (gc_bits(x) >> 24) & 0x80u;
    float r = gc_min_abs(q, GC_E4M3_MAX);
    gc_u32 mag = gc_round_minifloat(r, 3, 7);
    return (gc_u8)(sign | (gc_finite(x) ? mag : 0x7fu));
}

/* q to E5M2: saturate finite, keep inf (0x7c) and NaN (0x7e) codes. */
GC_FN gc_u8 gc_e5m2_code(float q, float x)
{
    gc_u32 sign = (gc_bits(x) >> 24) & 0x80u;
    float r = gc_min_abs(q, GC_E5M2_MAX);
    gc_u32 mag = gc_round_minifloat(r, 2, 15);
    /* 0x7e for NaN (mantissa != 0), 0x7c for inf: bit 23 of mantissa +
     * 0x7fffff is set exactly when the mantissa is non-zero (arithmetic
     * instead of a comparison keeps the loop vectorizable) */
    gc_u32 nan_bit = (((gc_bits(x) & 0x007fffffu) + 0x007fffffu) >> 23) & 1u;
    gc_u32 special = 0x7cu | (nan_bit << 1);
    return (gc_u8)(sign | (gc_finite(x) ? mag : special));
}

/* q to E2M1 (4-bit code in the low nibble), saturating; q must be finite. */
GC_FN gc_u8 gc_e2m1_code(float q)
{
    gc_u32 sign = (gc_bits(q) >> 28) & 0x8u;
    float r = gc_min_abs(q, GC_E2M1_MAX);
    return (gc_u8)(sign | gc_round_minifloat(r, 1, 1));
}

GC_FN float gc_e4m3_value(gc_u32 c)
{
    gc_u32 mag = c & 0x7fu;
    float normal = gc_float((mag << 20) + (120u << 23));
    float subnormal = (float)(int)(mag & 7u) * 0x1p-9f;
    float v = (mag >> 3) ? normal : subnormal;
    v = (mag == 0x7fu) ? gc_float(0x7fc00000u) : v;
    return (c & 0x80u) ? -v : v;
}

GC_FN float gc_e5m2_value(gc_u32 c)
{
    gc_u32 mag = c & 0x7fu;
    float normal = gc_float((mag << 21) + (112u << 23));
    float subnormal = (float)(int)(mag & 3u) * 0x1p-16f;
    float v = (mag >> 2) ? normal : subnormal;
    v = (mag == 0x7cu) ? gc_float(0x7f800000u) : v;
    v = (mag > 0x7cu) ? gc_float(0x7fc00000u) : v;
    return (c & 0x80u) ? -v : v;
}

GC_FN float gc_e2m1_value(gc_u32 c)
{
    gc_u32 mag = c & 7u;
    float normal = gc_float((mag + (126u << 1)) << 22);
    float v = (mag >> 1) ? normal : (float)(int)(mag & 1u) * 0.5f;
    return (c & 8u) ? -v : v;
}

/* fp32 to bfloat16, round-to-nearest-even; any NaN becomes the canonical
 * quiet NaN 0x7fc0 with its sign (as ml_dtypes does). */
GC_FN gc_u16 gc_bf16_code(float x)
{
    gc_u32 bits = gc_bits(x);
    gc_u32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    gc_u32 nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
    int is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
    return (gc_u16)(is_nan ? nan : rounded);
}

GC_FN float gc_bf16_value(gc_u32 c) { return gc_float(c << 16); }

/*
 * Factor that maps a block with maximum |x| = amax onto [-fmax, fmax]:
 * q = (x * *pre) * factor. *pre is 1, or 2^64 when amax is so small that
 * fmax / amax would overflow. Returns 0 for amax == 0 (all codes 0).
 */
GC_FN float gc_quant_factor(float amax, float fmax, float *pre)
{
    float p = amax < 0x1p-100f ? 0x1p64f : 1.0f;
    *pre = p;
    return amax > 0.0f ? fmax / (amax * p) : 0.0f;
}

/*
 * NVFP4 block scale: the E4M3 code of ((bamax / 6) * tpre) * tfactor, where
 * tfactor = gc_quant_factor(tensor_amax, 6 * 448, &tpre) maps the tensor's
 * amax onto the largest block scale. A block holding a non-finite value
 * gets the NaN code 0x7f (and payload codes 0), so its 16 values decode as
 * NaN.
 */
GC_FN gc_u8 gc_nvfp4_scale_code(float bamax, float tpre, float tfactor, int block_finite)
{
    float s = ((bamax / GC_E2M1_MAX) * tpre) * tfactor;
    return block_finite ? gc_e4m3_code(s, 0.0f) : (gc_u8)0x7fu;
}

#endif /* GC_SCALAR_H */
