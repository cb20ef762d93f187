/*
 * Per-element and per-block arithmetic of every geocomm wire format.
 *
 * This header is the single definition of the codec arithmetic. It compiles
 * as C99 (included by codec.c, whose loops call it) and as CUDA (its text is
 * prepended to the CuPy kernels at run time), so the CPU tests exercise the
 * exact operations the GPU runs. GC_FN expands to `static inline` in C and
 * `__device__ __forceinline__` in CUDA. Only fp32 arithmetic is used: no
 * fp64, no libm calls beyond fabsf, no fast-math assumptions. The CUDA side
 * also holds the kernels' four-value loads and stores (gc_load4_f32,
 * gc_store4_f32), so every kernel unit (codec, pipeline, geometry) shares them.
 *
 * Conventions (docs/design.md, "Formats"):
 *   scale = amax / FMAX            (fp32; 0 for an all-zero block)
 *   code  = RNE(clamp(x * (FMAX / amax), -FMAX, FMAX))
 *   amax ignores non-finite inputs; a non-finite input encodes as NaN in
 *   E4M3FN, keeps its inf/NaN code in E5M2.
 * When amax is tiny (< 2^-100) FMAX / amax would overflow, so both factors
 * are pre-multiplied by 2^64 (exact, a power of two); see gc_quant_factor.
 * q = (x * pre) * factor is finite for every finite x (a block of amax 0 has
 * pre 1 and factor 0, so never 0 * inf); it is NaN only for a non-finite x,
 * whose code never comes from q (fp8 specials, NVFP4 and MXFP4 blocks of
 * codes 0), so no NaN's sign, which CPUs and GPUs set differently, reaches
 * a code. No float is ever converted to an integer type: codes come from
 * bit patterns.
 *
 * Every code function takes `sr` and `rnd`: sr == 0 rounds to nearest even
 * (rnd unused), sr != 0 rounds stochastically with the 32 random bits rnd
 * (gc_sr_bits); the loops pass a constant sr, so the nearest path compiles
 * to what it was before stochastic rounding existed.
 */
#ifndef GC_SCALAR_H
#define GC_SCALAR_H

#ifdef __CUDACC__
#define GC_FN __device__ __forceinline__
typedef unsigned int gc_u32;
typedef unsigned char gc_u8;
typedef unsigned short gc_u16;
typedef unsigned long long gc_u64;
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define GC_FN static inline
typedef uint32_t gc_u32;
typedef uint8_t gc_u8;
typedef uint16_t gc_u16;
typedef uint64_t gc_u64;
#endif

#define GC_E4M3_MAX 448.0f
#define GC_E5M2_MAX 57344.0f
#define GC_E2M1_MAX 6.0f
/* values per scale (the wire layouts of geocomm.h, which defines the same) */
#define GC_NVFP4_BLOCK 16
#define GC_NVFP4_SUPERBLOCK 4096
#define GC_MX_BLOCK 32

/* The bit pattern of an fp32 value, and the value of a bit pattern. */
#ifdef __CUDACC__
GC_FN gc_u32 gc_bits(float f) { return __float_as_uint(f); }
GC_FN float gc_float(gc_u32 u) { return __uint_as_float(u); }
#else
GC_FN gc_u32 gc_bits(float f)
{
    gc_u32 u;
    memcpy(&u, &f, sizeof u);
    return u;
}
GC_FN float gc_float(gc_u32 u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* v, a NaN written as a GPU's arithmetic writes every NaN (0x7fffffff): the C
 * core's sums and maps, whose results are encoded next (an encoder puts a
 * NaN's sign in its code; x86 keeps a NaN operand's sign and sets it for
 * inf - inf). The kernels' own arithmetic needs none. */
GC_FN float gc_gpu_nan(float v) { return v == v ? v : gc_float(0x7fffffffu); }

#ifdef __CUDACC__
/* p moved by *moved bytes (moved NULL: p itself): where a kernel reads or writes
 * a caller's array. A CUDA graph keeps the addresses it captured, and NCCL lets a
 * call be captured or replayed only on every rank alike, so whether a call
 * replays may not depend on where its arrays lie (a rank-local fact). The kernels
 * that run on a caller's arrays inside a call take the arrays of the call they
 * were captured in, plus the shift gc_pipe_set_call (gc_pipeline.cu) wrote for
 * this call in device memory (0 when it runs on those arrays, or eagerly). */
template <class T> GC_FN T *gc_moved(T *p, const gc_u64 *moved)
{
    return moved ? (T *)((gc_u64)p + *moved) : p;
}

/* *p from global memory (ld.global.ca, a plain load's caching): what a load of a
 * pointer made by gc_moved would be if NVVM could see it is global (it cannot, from
 * an integer, and would load through a generic address). */
template <class T> GC_FN T gc_load_global(const T *p) { return __ldca(p); }

/* Device memory, four fp32 values per access: the CUDA kernels' loads and stores. */
GC_FN int gc_aligned(const void *p, unsigned int bytes)
{
    return ((gc_u64)p & (bytes - 1u)) == 0;
}

/* v[j] = p[j] for j < 4 where j < avail, else 0: one 16-byte load when all four
 * exist and p is 16-byte aligned, four loads otherwise (the same values), from
 * global memory (gc_load_global). */
GC_FN void gc_load4_f32(const float *p, gc_u64 avail, float *v)
{
    if (avail >= 4 && gc_aligned(p, 16)) {
        float4 q = gc_load_global(reinterpret_cast<const float4 *>(p));
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
        return;
    }
    for (int j = 0; j < 4; ++j)
        v[j] = (gc_u64)j < avail ? gc_load_global(p + j) : 0.0f;
}

/* p[j] = v[j] for j < 4 where j < avail: one 16-byte store when aligned and full
 * (__stwb: NVVM split a plain float4 store into four in gc_pipe_fp8_decode_team). */
GC_FN void gc_store4_f32(float *p, gc_u64 avail, const float *v)
{
    if (avail >= 4 && gc_aligned(p, 16)) {
        __stwb(reinterpret_cast<float4 *>(p), make_float4(v[0], v[1], v[2], v[3]));
        return;
    }
    for (int j = 0; j < 4; ++j)
        if ((gc_u64)j < avail)
            p[j] = v[j];
}
#endif

/* 1 when f is neither inf nor NaN (exponent field not all ones). */
GC_FN int gc_finite(float f) { return (gc_bits(f) & 0x7f800000u) != 0x7f800000u; }

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

/*
 * Stochastic twin of gc_round_minifloat: |r| rounds to its upper neighbour hi
 * with probability (r - lo) / (hi - lo), else to its lower neighbour lo, so
 * E[value] = r. The fraction is a 32-bit fixed-point number
 * t = floor(2^32 (r - lo) / (hi - lo)) and the code rounds up iff rnd < t:
 * for uniform rnd, P(up) = t / 2^32. That is exact when r - lo is a multiple
 * of 2^-32 (hi - lo), which holds for every r >= 2^-9 (hi - lo) (r has 24
 * significant bits): all normal and subnormal codes' ranges and far below.
 * Smaller r (under 2^-9 of the smallest subnormal) round up with a
 * probability at most 2^-32 too low. r == lo (a representable value, FMAX
 * included) never moves: t = 0.
 *
 * Fixed point: at or above the format's smallest normal, the fp32 pattern
 * with its exponent rebased to BIAS holds the code in its top bits and the
 * fraction in the low 23 - MBITS bits (a carry out of the mantissa steps
 * into the next binade, whose first value is the upper neighbour). Below it,
 * the 24-bit significand m of r holds r in quanta 2^(1 - BIAS - MBITS) with
 * `sh` fraction bits; sh > 32 only when the code is 0 (m < 2^24).
 */
GC_FN gc_u32 gc_round_minifloat_sr(float r, int mbits, int bias, gc_u32 rnd)
{
    gc_u32 bits = gc_bits(r);
    gc_u32 e = bits >> 23;               /* biased fp32 exponent; r >= 0 */
    gc_u32 emin = (gc_u32)(128 - bias);  /* fp32 exponent of the format's smallest normal */
    int normal = e >= emin;
    gc_u32 e1 = e ? e : 1u;              /* fp32 subnormals have exponent 1, no implicit bit */
    gc_u32 m = normal ? bits - ((gc_u32)(127 - bias) << 23)
                      : (bits & 0x007fffffu) | (e ? 0x00800000u : 0u);
    gc_u32 sh = (gc_u32)(23 - mbits) + (normal ? 0u : emin - e1);
    gc_u32 whole = m >> (sh < 31u ? sh : 31u);
    gc_u32 frac = sh <= 32u ? m << (32u - sh) : m >> (sh - 32u < 31u ? sh - 32u : 31u);
    return whole + (rnd < frac);
}

/* |r| rounded to nearest even or (sr) stochastically with rnd. */
GC_FN gc_u32 gc_round_mag(float r, int mbits, int bias, int sr, gc_u32 rnd)
{
    return sr ? gc_round_minifloat_sr(r, mbits, bias, rnd) : gc_round_minifloat(r, mbits, bias);
}

/* q (already x * factor) to E4M3FN: saturate finite, NaN for non-finite x. */
GC_FN gc_u8 gc_e4m3_code(float q, float x, int sr, gc_u32 rnd)
{
    gc_u32 sign = (gc_bits(x) >> 24) & 0x80u;
    float r = gc_min_abs(q, GC_E4M3_MAX);
    gc_u32 mag = gc_round_mag(r, 3, 7, sr, rnd);
    return (gc_u8)(sign | (gc_finite(x) ? mag : 0x7fu));
}

/* q to E5M2: saturate finite, keep inf (0x7c) and NaN (0x7e) codes. */
GC_FN gc_u8 gc_e5m2_code(float q, float x, int sr, gc_u32 rnd)
{
    gc_u32 sign = (gc_bits(x) >> 24) & 0x80u;
    float r = gc_min_abs(q, GC_E5M2_MAX);
    gc_u32 mag = gc_round_mag(r, 2, 15, sr, rnd);
    /* 0x7e for NaN (mantissa != 0), 0x7c for inf: bit 23 of mantissa +
     * 0x7fffff is set exactly when the mantissa is non-zero (arithmetic
     * instead of a comparison keeps the loop vectorizable) */
    gc_u32 nan_bit = (((gc_bits(x) & 0x007fffffu) + 0x007fffffu) >> 23) & 1u;
    gc_u32 special = 0x7cu | (nan_bit << 1);
    return (gc_u8)(sign | (gc_finite(x) ? mag : special));
}

/* q to E2M1 (4-bit code in the low nibble), saturating; q must be finite. */
GC_FN gc_u8 gc_e2m1_code(float q, int sr, gc_u32 rnd)
{
    gc_u32 sign = (gc_bits(q) >> 28) & 0x8u;
    float r = gc_min_abs(q, GC_E2M1_MAX);
    return (gc_u8)(sign | gc_round_mag(r, 1, 1, sr, rnd));
}

/* The value of the magnitude code `mag` (sign bit cleared, specials excluded)
 * of a small float format with MBITS mantissa bits and exponent bias BIAS:
 * normals by placing the code's bits into an fp32 pattern, subnormals as
 * (mantissa) * 2^(1 - BIAS - MBITS). */
GC_FN float gc_minifloat_value(gc_u32 mag, int mbits, int bias)
{
    float normal = gc_float((mag << (23 - mbits)) + ((gc_u32)(127 - bias) << 23));
    float quantum = gc_float((gc_u32)(127 + 1 - bias - mbits) << 23);
    float subnormal = (float)(int)(mag & ((1u << mbits) - 1u)) * quantum;
    return (mag >> mbits) ? normal : subnormal;
}

GC_FN float gc_e4m3_value(gc_u32 c)
{
    gc_u32 mag = c & 0x7fu;
    float v = gc_minifloat_value(mag, 3, 7);
    v = (mag == 0x7fu) ? gc_float(0x7fc00000u) : v;
    return (c & 0x80u) ? -v : v;
}

GC_FN float gc_e5m2_value(gc_u32 c)
{
    gc_u32 mag = c & 0x7fu;
    float v = gc_minifloat_value(mag, 2, 15);
    v = (mag == 0x7cu) ? gc_float(0x7f800000u) : v;
    v = (mag > 0x7cu) ? gc_float(0x7fc00000u) : v;
    return (c & 0x80u) ? -v : v;
}

GC_FN float gc_e2m1_value(gc_u32 c)
{
    float v = gc_minifloat_value(c & 7u, 1, 1);
    return (c & 8u) ? -v : v;
}

/* fp32 to bfloat16, round-to-nearest-even or (sr) stochastically; any NaN
 * becomes the canonical quiet NaN 0x7fc0 with its sign (as ml_dtypes does).
 * A finite x that rounds past the largest finite bfloat16 (0x7f7f,
 * 3.3895e38) saturates to it, with its sign, where a cast (ml_dtypes, torch)
 * gives inf: the codec never turns a finite value into inf, and its bound
 * holds there too (|x| - 0x1.fep127 < 2^-8 |x|). inf stays inf. */
GC_FN gc_u16 gc_bf16_code(float x, int sr, gc_u32 rnd)
{
    gc_u32 bits = gc_bits(x);
    gc_u32 sign = (bits >> 16) & 0x8000u;
    gc_u32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    if (sr) /* the same bits on the magnitude: bfloat16 is an 8-bit-mantissa minifloat */
        rounded = sign | gc_round_minifloat_sr(gc_float(bits & 0x7fffffffu), 7, 127, rnd);
    int finite = (bits & 0x7fffffffu) < 0x7f800000u;
    int is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
    rounded = (finite && (rounded & 0x7fffu) == 0x7f80u) ? (sign | 0x7f7fu) : rounded;
    return (gc_u16)(is_nan ? (sign | 0x7fc0u) : rounded);
}

GC_FN float gc_bf16_value(gc_u32 c) { return gc_float(c << 16); }

/*
 * Factor that maps a block with maximum |x| = amax onto [-fmax, fmax]:
 * q = (x * *pre) * factor. *pre is 1, or 2^64 when amax is so small (but
 * not 0) that fmax / amax would overflow. Returns 0 with *pre 1 for
 * amax == 0 (or NaN): q is then +-0 for any finite x, never 2^64 x * 0,
 * which is 0 * inf (NaN) for |x| > 2^64.
 */
GC_FN float gc_quant_factor(float amax, float fmax, float *pre)
{
    float p = (amax > 0.0f) & (amax < 0x1p-100f) ? 0x1p64f : 1.0f;
    *pre = p;
    return amax > 0.0f ? fmax / (amax * p) : 0.0f;
}

/*
 * NVFP4 block scale: the E4M3 code of ((bamax / 6) * tpre) * tfactor, where
 * tfactor = gc_quant_factor(samax, 6 * 448, &tpre) maps the amax of the
 * block's superblock (GC_NVFP4_SUPERBLOCK values, whose fp32 scale is
 * samax / (6 * 448)) onto the largest block scale. A block holding a
 * non-finite value gets the NaN code 0x7f (and payload codes 0), so its 16
 * values decode as NaN. With `up` (stochastic rounding) the code is rounded
 * up instead of to nearest, so that no value of the block exceeds 6 block
 * scales: a value above 6 would be clamped to 6, a bias no random rounding
 * can undo. (A non-zero block never gets scale 0 then; only a superblock
 * amax below 2688 * 2^-149, whose fp32 superblock scale is 0, still decodes
 * as 0.)
 */
GC_FN gc_u8 gc_nvfp4_scale_code(float bamax, float tpre, float tfactor, int block_finite, int up)
{
    float s = ((bamax / GC_E2M1_MAX) * tpre) * tfactor;
    gc_u8 c = gc_e4m3_code(s, 0.0f, 0, 0u);
    /* up: the next code when c is below s (0x7e, 448, is the largest), and at
     * least the smallest subnormal for a non-zero block whose s underflowed */
    int below = gc_e4m3_value(c) < s || (c == 0u && bamax > 0.0f);
    c = (gc_u8)(c + (up && c < 0x7eu && below));
    return block_finite ? c : (gc_u8)0x7fu;
}

/*
 * Whether an NVFP4 block writes the codes of its values. bscale is the
 * block's decoded scale, gc_e4m3_value(scale code) * superblock scale: a
 * block decodes to code * bscale, so where bscale is 0 (scale code 0: the
 * block's amax is at most 2^-10 / 448 of its superblock's, nearest rounding
 * only; or a superblock scale of 0) or NaN (code 0x7f: the block holds a
 * non-finite value) its codes carry nothing, and every one is written 0
 * (+0) instead (docs/design.md, "Formats").
 */
GC_FN int gc_nvfp4_keeps_codes(float bscale) { return bscale > 0.0f; }

/* ---- MX (OCP Microscaling v1.0) ---------------------------------------------
 *
 * One E8M0 scale 2^X per 32 values (code X + 127; 0xff is NaN), elements in
 * E4M3, E5M2 or E2M1 with largest exponent EMAX (8, 15, 2) and largest value
 * FMAX. X = floor(log2(amax)) - EMAX ("floor", the OCP rule: values up to
 * 2^(EMAX+1) X land above FMAX and saturate) or, with rceil, the smallest X
 * with amax <= FMAX 2^X (nothing saturates). X is clamped to
 * [-127, 127 - EMAX]: below, E8M0's range ends (blocks smaller than 2^-127
 * lose their smallest values); above, FMAX 2^X would overflow fp32, so rceil
 * falls back to floor (and saturates) for amax > FMAX 2^(127 - EMAX), the top
 * 2^(EMAX+1) / FMAX of fp32's range. An all-zero block has X = -127.
 * Elements are x * 2^-X, exact unless they fall below fp32's range.
 */

/* Shared exponent X of a block with finite max |x| = amax (see above). */
GC_FN int gc_mx_exponent(float amax, int emax, float fmax, int rceil)
{
    /* fp32 subnormals are scaled into the normal range (exactly) to read their exponent */
    int sub = amax < 0x1p-126f;
    gc_u32 b = gc_bits(sub ? amax * 0x1p32f : amax);
    int x = (int)(b >> 23) - 127 - (sub ? 32 : 0) - emax;
    /* amax = 1.m * 2^(x + EMAX) exceeds FMAX 2^x = 1.f * 2^(x + EMAX) iff m > f */
    x += rceil && (b & 0x007fffffu) > (gc_bits(fmax) & 0x007fffffu);
    x = amax > 0.0f ? x : -127;
    x = x > 127 - emax ? 127 - emax : x;
    return x < -127 ? -127 : x;
}

/* 2^-X as an fp32 factor (X <= 125, so it is a normal number). */
GC_FN float gc_mx_factor(int x) { return gc_float((gc_u32)(127 - x) << 23); }

/* The value 2^(c - 127) of E8M0 code c (code 0 is 2^-127, an fp32
 * subnormal; 0xff is NaN). */
GC_FN float gc_e8m0_value(gc_u32 c)
{
    float v = c ? gc_float(c << 23) : gc_float(0x00400000u);
    return c == 0xffu ? gc_float(0x7fc00000u) : v;
}

/* ---- stochastic rounding: counter-based random bits -------------------------
 *
 * The random bits of element i of an encode call are a pure function of the
 * codec's seed, the caller's stream and the element's global index
 * offset + i, so they do not depend on how the data is cut into calls:
 *   key(seed, stream)  = mix64(mix64(seed) ^ stream)
 *   bits(key, index)   = mix64(key + (index + 1) * 0x9e3779b97f4a7c15) >> 32
 * mix64 is SplitMix64's finalizer (a bijection of 64-bit words), so
 * bits(key, index) is the upper half of output number `index` (from 0) of a
 * SplitMix64 generator seeded with key. All arithmetic is modulo 2^64.
 */
#define GC_SR_GAMMA 0x9e3779b97f4a7c15ull

GC_FN gc_u64 gc_mix64(gc_u64 z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

GC_FN gc_u64 gc_sr_key(gc_u64 seed, gc_u64 stream) { return gc_mix64(gc_mix64(seed) ^ stream); }

GC_FN gc_u32 gc_sr_bits(gc_u64 key, gc_u64 index)
{
    return (gc_u32)(gc_mix64(key + (index + 1u) * GC_SR_GAMMA) >> 32);
}

/* The rnd argument of the code functions for element `index`: the random
 * bits with sr, else 0 (a constant sr == 0 drops the hash). */
GC_FN gc_u32 gc_rnd_at(int sr, gc_u64 key, gc_u64 index)
{
    return sr ? gc_sr_bits(key, index) : 0u;
}

#endif /* GC_SCALAR_H */
