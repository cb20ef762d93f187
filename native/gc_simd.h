/*
 * Which vector paths this build has (host C only). GC_HAVE_AVX512: the
 * AVX-512 loops of codec.c and geometry.c exist (x86-64 gcc builds with
 * clones); gc_codec_simd (geocomm.h) picks them at run time on a CPU that has
 * AVX-512 F/BW/DQ/VL. GC_AVX512 marks a function compiled for those sets.
 */
#ifndef GC_SIMD_H
#define GC_SIMD_H

#if defined(GC_USE_CLONES) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GC_HAVE_AVX512 1
#define GC_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#else
#define GC_HAVE_AVX512 0
#endif

#endif /* GC_SIMD_H */
