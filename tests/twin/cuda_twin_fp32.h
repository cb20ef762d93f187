/*
 * fp32 as a CUDA thread computes it: the `float` of the twin's kernel units.
 *
 * g++ on x86-64 computes fp32 with SSE, which differs from an NVIDIA GPU
 * wherever IEEE 754 leaves a choice or C++ leaves the result undefined
 * (CUDA C++ Programming Guide, "Floating-Point Standard"; PTX ISA, cvt,
 * min, max, neg, abs). The differences, and what this file does about each:
 *
 *   NaN results   every NaN an fp32 instruction produces on the GPU is the
 *                 canonical 0x7fffffff. SSE produces 0xffc00000 (sign set)
 *                 for an invalid operation (0 * inf, inf - inf, 0 / 0) and
 *                 passes an input NaN's sign and payload on. Here the
 *                 result of +, -, *, / and of every function below is
 *                 canonical once a float holds it (see "How").
 *   float to int  cvt.rzi truncates and saturates to the destination's
 *                 range, NaN gives 0; SSE's cvttss2si gives the "integer
 *                 indefinite" INT_MIN for NaN and for any value out of
 *                 range, and C++ leaves both undefined. Here a conversion
 *                 follows cvt (cuda_int below).
 *   min, max      fminf, fmaxf, min, max are PTX min/max.f32: a NaN operand
 *                 gives the other operand, two give the canonical NaN, and
 *                 -0 < +0. glibc's fminf returns the first of two zeros.
 *   neg, abs      sign-bit operations on both, NaN included (only fp64's
 *                 pass a NaN unchanged on the GPU); with -ftz=true the
 *                 GPU's neg.ftz and abs.ftz also flush a subnormal operand.
 *   -ftz=true     flushes the subnormal inputs and results of every fp32
 *                 instruction to sign-preserving zero. MXCSR.FTZ|DAZ, set
 *                 for a launch by cuda_twin.h, does that for SSE's
 *                 arithmetic, comparisons and conversions; this file
 *                 flushes in min, max, neg, abs and __saturatef.
 *   division, sqrt, fma  IEEE, correctly rounded, on both with -prec-div=true
 *                 and -prec-sqrt=true (geocomm's NVRTC options); -fmad=false
 *                 builds with -ffp-contract=off (_kernels.py), so a * b + c
 *                 never fuses, as on the GPU.
 *   approximations  __fdividef and rsqrtf are GPU approximations whose bits
 *                 the host cannot reproduce: deleted, so a unit that uses
 *                 one does not build (libm's expf, logf ... take no f32
 *                 either, for the same reason).
 *
 * fp64 stays the host's: the bits of fp64 NaN results, and fp64 neg/abs
 * passing a NaN unchanged, are not modelled (geocomm's fp64 kernels use the
 * __d*_rn intrinsics, and nothing reads the bits of a NaN they make).
 *
 * How: cuda_twin.h ends with `#define float ::gctwin::f32`, so every `float`
 * of a kernel unit (variables, parameters, arrays, __shared__, casts) is an
 * f32, a float in a struct. Arithmetic on an f32 returns an f32x, the SSE
 * result as it is, so that -fmad=true can still contract a * b + c; an f32x
 * becomes an f32 (a variable, an element, a parameter, a return value) with
 * a NaN made canonical. Until then its NaN bits cannot be observed:
 * arithmetic on a NaN gives a NaN whatever its bits, comparisons see only
 * NaN-ness, and bit casts, sign operations and the functions take an f32
 * (negating an f32x stays in the expression, as nvcc folds a negation into
 * the operation). A float literal becomes an f32 with its bits (a constant,
 * not an operation). Only explicit conversions leave an f32, so a kernel
 * that converts a float to an integer implicitly does not build.
 */
#ifndef GCTWIN_CUDA_TWIN_FP32_H
#define GCTWIN_CUDA_TWIN_FP32_H

#include <limits>
#include <math.h>
#include <string.h>
#include <type_traits>
#include <utility>

namespace gctwin {

extern const int module_ftz; /* the unit's -ftz (cuda_twin.h) */

inline unsigned int fbits(float f)
{
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}

inline float bitsf(unsigned int u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The GPU's NaN: the result of every fp32 operation that gives a NaN. */
const unsigned int CANONICAL_NAN = 0x7fffffffu;

inline float canonical(float r) { return r != r ? bitsf(CANONICAL_NAN) : r; }

/* An operand of a flushing instruction: under -ftz=true a subnormal is a
 * zero of its sign. */
inline float ftz_in(float f)
{
    unsigned int u = fbits(f);
    return module_ftz && (u & 0x7f800000u) == 0 ? bitsf(u & 0x80000000u) : f;
}

/* v (fp32) to integer type T as cvt.rzi does it: toward zero, saturated to
 * T's range, NaN -> 0 (bool: v != 0). */
template <class T> inline T cuda_int(float v, std::true_type)
{
    typedef std::numeric_limits<T> L;
    if (std::is_same<T, bool>::value)
        return v != 0.0f;
    if (v != v)
        return T(0);
    const float above = bitsf((unsigned int)(127 + L::digits) << 23); /* 2^digits: past T's max */
    const float lowest = L::is_signed ? -above : 0.0f;                 /* T's smallest, or 0 */
    if (v >= above)
        return L::max();
    if (v <= lowest)
        return L::min();
    return static_cast<T>(v); /* in range: defined */
}

template <class T> inline T cuda_int(float v, std::false_type) { return static_cast<T>(v); }

/* What `(T)v` gives on the GPU for an arithmetic type T. */
template <class T> inline T convert(float v)
{
    return cuda_int<T>(v, std::integral_constant<bool, std::is_integral<T>::value>());
}

template <class T>
using if_arithmetic = typename std::enable_if<std::is_arithmetic<T>::value, int>::type;

struct f32x;

/* A float as a CUDA thread holds it (its NaNs are canonical unless loaded,
 * bit-cast or written as a constant). */
struct f32 {
    float v;
    f32() = default;
    constexpr f32(float x) : v(x) {} /* a constant or a loaded value: its bits */
    /* from another arithmetic type: a conversion, whose NaN is canonical */
    template <class T, if_arithmetic<T> = 0> f32(T x) : v(canonical(static_cast<float>(x))) {}
    inline f32(f32x e);
    template <class T, if_arithmetic<T> = 0> explicit operator T() const { return convert<T>(v); }
};

/* An fp32 expression: the host's result, NaN bits not yet the GPU's. */
struct f32x {
    float v;
    f32x() = default;
    template <class T, if_arithmetic<T> = 0> constexpr f32x(T x) : v(static_cast<float>(x)) {}
    template <class T, if_arithmetic<T> = 0> explicit operator T() const
    {
        return convert<T>(canonical(v));
    }
};

inline f32::f32(f32x e) : v(canonical(e.v)) {}

static_assert(sizeof(f32) == 4 && alignof(f32) == alignof(float) &&
                  std::is_trivially_copyable<f32>::value && std::is_standard_layout<f32>::value,
              "an f32 is a float in memory");

inline float raw(f32 a) { return a.v; }
inline float raw(f32x a) { return a.v; }
template <class T> inline T raw(T a) { return a; }

template <class T>
struct is_f32 : std::integral_constant<bool, std::is_same<T, f32>::value ||
                                                 std::is_same<T, f32x>::value> {};
template <class T>
struct is_operand : std::integral_constant<bool, is_f32<T>::value || std::is_arithmetic<T>::value> {
};
/* Operators take an f32 or f32x with another one or with any arithmetic type. */
template <class A, class B>
using if_mixed = typename std::enable_if<(is_f32<A>::value || is_f32<B>::value) &&
                                             is_operand<A>::value && is_operand<B>::value,
                                         int>::type;

/* The type of `a OP b` in C++ for the underlying types; an fp32 one is an f32x. */
template <class R> struct expression {
    typedef R type;
};
template <> struct expression<float> {
    typedef f32x type;
};

/* The operators (in this namespace: argument-dependent lookup finds them from
 * any namespace of a kernel unit). */
#define GCTWIN_F32_ARITHMETIC(OP)                                                                 \
    template <class A, class B, if_mixed<A, B> = 0>                                                \
    inline typename expression<decltype(raw(std::declval<A>()) OP raw(std::declval<B>()))>::type  \
    operator OP(A a, B b)                                                                          \
    {                                                                                              \
        return raw(a) OP raw(b);                                                                   \
    }                                                                                              \
    template <class B, typename std::enable_if<is_operand<B>::value, int>::type = 0>               \
    inline f32 &operator OP##=(f32 &a, B b)                                                        \
    {                                                                                              \
        return a = f32(a OP b);                                                                    \
    }
GCTWIN_F32_ARITHMETIC(+)
GCTWIN_F32_ARITHMETIC(-)
GCTWIN_F32_ARITHMETIC(*)
GCTWIN_F32_ARITHMETIC(/)
#undef GCTWIN_F32_ARITHMETIC

#define GCTWIN_F32_COMPARISON(OP)                                                                 \
    template <class A, class B, if_mixed<A, B> = 0> inline bool operator OP(A a, B b)              \
    {                                                                                              \
        return raw(a) OP raw(b);                                                                   \
    }
GCTWIN_F32_COMPARISON(==)
GCTWIN_F32_COMPARISON(!=)
GCTWIN_F32_COMPARISON(<)
GCTWIN_F32_COMPARISON(<=)
GCTWIN_F32_COMPARISON(>)
GCTWIN_F32_COMPARISON(>=)
#undef GCTWIN_F32_COMPARISON

inline f32 operator-(f32 a) { return bitsf(fbits(ftz_in(a.v)) ^ 0x80000000u); }
inline f32x operator-(f32x a) { return -a.v; }
inline f32 operator+(f32 a) { return a; }
inline f32x operator+(f32x a) { return a; }

} // namespace gctwin

/* ---- bit casts ------------------------------------------------------------------------- */

inline unsigned int __float_as_uint(gctwin::f32 f) { return gctwin::fbits(f.v); }
inline int __float_as_int(gctwin::f32 f) { return (int)gctwin::fbits(f.v); }
inline gctwin::f32 __uint_as_float(unsigned int u) { return gctwin::bitsf(u); }
inline gctwin::f32 __int_as_float(int i) { return gctwin::bitsf((unsigned int)i); }

/* ---- the fp32 intrinsics: IEEE, round to nearest, never contracted ---------------------- */

inline gctwin::f32 __fadd_rn(gctwin::f32 a, gctwin::f32 b)
{
    return gctwin::f32x(gctwin::arith(gctwin::ADD, a.v, b.v));
}
inline gctwin::f32 __fsub_rn(gctwin::f32 a, gctwin::f32 b)
{
    return gctwin::f32x(gctwin::arith(gctwin::SUB, a.v, b.v));
}
inline gctwin::f32 __fmul_rn(gctwin::f32 a, gctwin::f32 b)
{
    return gctwin::f32x(gctwin::arith(gctwin::MUL, a.v, b.v));
}
inline gctwin::f32 __fdiv_rn(gctwin::f32 a, gctwin::f32 b)
{
    return gctwin::f32x(gctwin::arith(gctwin::DIV, a.v, b.v));
}
inline gctwin::f32 __frcp_rn(gctwin::f32 a)
{
    return gctwin::f32x(gctwin::arith(gctwin::DIV, 1.0f, a.v));
}
inline gctwin::f32 __fsqrt_rn(gctwin::f32 a)
{
    return gctwin::f32x(gctwin::opaque(sqrtf(gctwin::opaque(a.v))));
}
inline gctwin::f32 __fmaf_rn(gctwin::f32 a, gctwin::f32 b, gctwin::f32 c)
{
    return gctwin::f32x(fmaf(a.v, b.v, c.v));
}
/* GPU approximations (__fdividef: 2 ulp, and 0 for 2^126 < |b| < 2^128; rsqrtf:
 * 2 ulp): the host cannot reproduce their bits. */
gctwin::f32 __fdividef(gctwin::f32 a, gctwin::f32 b) = delete;
gctwin::f32 rsqrtf(gctwin::f32 a) = delete;
/* [+0, 1]; NaN gives 0 (libdevice __nv_saturatef) */
inline gctwin::f32 __saturatef(gctwin::f32 a)
{
    float x = gctwin::ftz_in(a.v);
    return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f;
}

/* ---- CUDA's fp32 math functions that are exact ---------------------------------------- */

namespace gctwin {

/* PTX min.f32 / max.f32: a NaN operand gives the other, two the canonical NaN;
 * of two equal values, -0 is the smaller. */
inline f32 ptx_min(f32 a, f32 b)
{
    float x = ftz_in(a.v), y = ftz_in(b.v);
    if (x != x)
        return f32x(y);
    if (y != y || x < y)
        return x;
    return x == y ? bitsf(fbits(x) | fbits(y)) : y; /* either zero negative: -0 */
}

inline f32 ptx_max(f32 a, f32 b)
{
    float x = ftz_in(a.v), y = ftz_in(b.v);
    if (x != x)
        return f32x(y);
    if (y != y || x > y)
        return x;
    return x == y ? bitsf(fbits(x) & fbits(y)) : y; /* either zero positive: +0 */
}

inline f32 ptx_abs(f32 a) { return bitsf(fbits(ftz_in(a.v)) & 0x7fffffffu); }

} // namespace gctwin

/* CUDA names each of these for float (the f-suffixed C name and C++'s
 * overload of the plain name). */
#define GCTWIN_F32_UNARY(FN, EXPR)                                                                 \
    inline gctwin::f32 FN##f(gctwin::f32 a) { return EXPR; }                                       \
    inline gctwin::f32 FN(gctwin::f32 a) { return EXPR; }
#define GCTWIN_F32_BINARY(FN, EXPR)                                                                \
    inline gctwin::f32 FN##f(gctwin::f32 a, gctwin::f32 b) { return EXPR; }                        \
    inline gctwin::f32 FN(gctwin::f32 a, gctwin::f32 b) { return EXPR; }
GCTWIN_F32_UNARY(fabs, gctwin::ptx_abs(a))
GCTWIN_F32_UNARY(sqrt, gctwin::f32x(sqrtf(a.v)))
GCTWIN_F32_UNARY(floor, gctwin::f32x(floorf(a.v)))
GCTWIN_F32_UNARY(ceil, gctwin::f32x(ceilf(a.v)))
GCTWIN_F32_UNARY(trunc, gctwin::f32x(truncf(a.v)))
GCTWIN_F32_UNARY(round, gctwin::f32x(roundf(a.v)))
GCTWIN_F32_UNARY(rint, gctwin::f32x(rintf(a.v)))
GCTWIN_F32_UNARY(nearbyint, gctwin::f32x(nearbyintf(a.v)))
GCTWIN_F32_BINARY(fmin, gctwin::ptx_min(a, b))
GCTWIN_F32_BINARY(fmax, gctwin::ptx_max(a, b))
GCTWIN_F32_BINARY(copysign, gctwin::bitsf((gctwin::fbits(a.v) & 0x7fffffffu) |
                                          (gctwin::fbits(b.v) & 0x80000000u)))
#undef GCTWIN_F32_UNARY
#undef GCTWIN_F32_BINARY
inline gctwin::f32 fmaf(gctwin::f32 a, gctwin::f32 b, gctwin::f32 c) { return __fmaf_rn(a, b, c); }
inline gctwin::f32 fma(gctwin::f32 a, gctwin::f32 b, gctwin::f32 c) { return __fmaf_rn(a, b, c); }
inline gctwin::f32 min(gctwin::f32 a, gctwin::f32 b) { return gctwin::ptx_min(a, b); }
inline gctwin::f32 max(gctwin::f32 a, gctwin::f32 b) { return gctwin::ptx_max(a, b); }
inline bool isnan(gctwin::f32 a) { return a.v != a.v; }
inline bool isinf(gctwin::f32 a) { return (gctwin::fbits(a.v) & 0x7fffffffu) == 0x7f800000u; }
inline bool isfinite(gctwin::f32 a) { return (gctwin::fbits(a.v) & 0x7f800000u) != 0x7f800000u; }
inline bool signbit(gctwin::f32 a) { return (gctwin::fbits(a.v) >> 31) != 0; }

/* ---- vector types ----------------------------------------------------------------------- */

struct float2 {
    gctwin::f32 x, y;
};
struct alignas(16) float4 { /* CUDA's __align__(16) */
    gctwin::f32 x, y, z, w;
};
inline float2 make_float2(gctwin::f32 x, gctwin::f32 y)
{
    float2 v = {x, y};
    return v;
}
inline float4 make_float4(gctwin::f32 x, gctwin::f32 y, gctwin::f32 z, gctwin::f32 w)
{
    float4 v = {x, y, z, w};
    return v;
}
/* st.global.wb.v4.f32: CUDA's store with the default (write-back) cache policy */
inline void __stwb(float4 *p, float4 v) { *p = v; }

#endif /* GCTWIN_CUDA_TWIN_FP32_H */
