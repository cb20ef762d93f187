/*
 * What codec.c calls of geometry.c beyond the binding contract (geocomm.h),
 * and the floating-point mode both run their entry points in.
 */
#ifndef GC_INTERNAL_H
#define GC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/* gc_geo_expand into out != x with out written around the cache (whole
 * lines, non-temporal) where the AVX-512 loops run and the range is whole
 * rows; elsewhere gc_geo_expand. The same values either way. */
int gc_geo_expand_stream(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                         const float *vt, const float *packed, size_t k, float sign, float *out);

/* out = the fp8 values of a body's range + sign * coef vt, in one pass with
 * out written around the cache: codes and scales are the range's sections
 * of an E4M3 (e5m2 0) or E5M2 body whose range starts on a block boundary,
 * one fp32 scale per `block` values. Returns 0 when done, 1 (nothing
 * written) where it does not apply: the AVX-512 loops are off, the range is
 * not whole rows of a multiple of 32 columns, or block is not a power of two
 * from 16 (the caller then decodes and expands in two steps: the same
 * values). */
int gc_geo_decode_fp8_stream(int e5m2, const uint8_t *scales, const uint8_t *codes, size_t block,
                             size_t lo, size_t len, size_t n, const float *coef,
                             const float *packed, size_t k, float sign, float *out);

/* ---- the floating-point mode ----------------------------------------------
 * The codec's bytes assume IEEE 754's default mode: round to nearest even,
 * subnormal inputs and results kept, no trap on any exception (the GPU
 * kernels compile with -ftz=false; the core with -fno-trapping-math). A
 * process may run in another: torch.set_flush_denormal(True) and libraries
 * linked with -ffast-math set flush-to-zero and denormals-are-zero (the same
 * call then wrote other bytes than the GPU and codecs/reference.py), and
 * feenableexcept() traps (inf - inf in a sum then raised SIGFPE). So every
 * entry point of geocomm.h that computes runs its body in the default mode
 * and gives the caller's back: gc_ieee_enter sets it and returns the
 * caller's, gc_ieee_leave restores that (exception flags raised in between
 * included). Threads a body starts inherit the mode (POSIX). The body is a
 * GC_NOINLINE function: the compiler may move floating-point arithmetic
 * across a change of mode, but not out of a call it may not analyse. */
#if defined(__GNUC__) && !defined(__clang__)
#define GC_NOINLINE __attribute__((noipa))
#else
#define GC_NOINLINE __attribute__((noinline))
#endif

#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE_MATH__))
#include <xmmintrin.h>
typedef unsigned gc_fpmode;
/* MXCSR: every exception masked (bits 7-12); FTZ (15), DAZ (6) and the
 * rounding control (13-14) cleared */
static inline gc_fpmode gc_ieee_enter(void)
{
    gc_fpmode caller = _mm_getcsr();
    _mm_setcsr((caller | 0x1f80u) & ~(0x8000u | 0x0040u | 0x6000u));
    return caller;
}
static inline void gc_ieee_leave(gc_fpmode caller) { _mm_setcsr(caller); }
#elif defined(__aarch64__)
typedef uint64_t gc_fpmode;
/* FPCR: the trap enables IOE..IXE (bits 8-12) and IDE (15), FZ (24), FZ16 (19),
 * RMode (22-23), and FEAT_AFP's FIZ (0) and AH (1) cleared */
static inline gc_fpmode gc_ieee_enter(void)
{
    gc_fpmode caller;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(caller) : : "memory");
    gc_fpmode ieee = caller & ~((gc_fpmode)0x9f03u | (1ull << 19) | (3ull << 22) | (1ull << 24));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(ieee) : "memory");
    return caller;
}
static inline void gc_ieee_leave(gc_fpmode caller)
{
    __asm__ __volatile__("msr fpcr, %0" : : "r"(caller) : "memory");
}
#else
#include <fenv.h>
typedef fenv_t gc_fpmode; /* no portable flush-to-zero switch: traps and rounding only */
static inline gc_fpmode gc_ieee_enter(void)
{
    gc_fpmode caller;
    feholdexcept(&caller); /* saves the environment, masks every trap */
    fesetround(FE_TONEAREST);
    return caller;
}
static inline void gc_ieee_leave(gc_fpmode caller) { fesetenv(&caller); }
#endif

/* `result = call`, `call` (of a GC_NOINLINE function) run in the default mode. */
#define GC_IEEE(result, call)                                                                     \
    do {                                                                                           \
        gc_fpmode gc_caller_mode_ = gc_ieee_enter();                                               \
        result = call;                                                                             \
        gc_ieee_leave(gc_caller_mode_);                                                            \
    } while (0)

#endif /* GC_INTERNAL_H */
