/*
 * Which vector paths this build has (host C only). GC_HAVE_AVX512: the
 * AVX-512 loops of codec.c and geometry.c exist (x86-64 gcc builds with
 * clones); gc_codec_simd (geocomm.h) picks them at run time on a CPU that has
 * AVX-512 F/BW/DQ/VL. GC_AVX512 marks a function compiled for those sets.
 * gc_sink: how the AVX-512 loops of both files write float vectors around
 * the cache.
 */
#ifndef GC_SIMD_H
#define GC_SIMD_H

#if defined(GC_USE_CLONES) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GC_HAVE_AVX512 1
#define GC_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#else
#define GC_HAVE_AVX512 0
#endif

/* Outputs from this many bytes up are written around the cache. A host
 * pipeline's pieces are 4 MiB / ranks at its default stage (512 KiB at 8
 * ranks) and land in a result that does not stay in a core's caches: fp8
 * decodes of 512 KiB into successive pieces of a 64 MiB array took 3.4 ms per
 * 16M values streamed, 9.2 stored (256 KiB: 3.8 and 9.6). Into one buffer
 * already in cache, storing is faster (2.5 and 2.9 ms against 3.3 and 3.7),
 * which is why smaller outputs, more likely to be such buffers, are stored. */
#define GC_STREAM_BYTES ((size_t)1 << 18)

#if GC_HAVE_AVX512
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* Ask for the cache line `bytes` past p. The address is computed as an
 * integer: it may lie past the end of p's array (a prefetch never faults),
 * and a pointer formed there would be undefined behaviour. */
#define GC_PREFETCH(p, bytes) _mm_prefetch((const char *)((uintptr_t)(p) + (bytes)), _MM_HINT_T0)

GC_AVX512 static inline __m512i v_u32(uint32_t c) { return _mm512_set1_epi32((int)c); }

/* gc_e4m3_value / gc_e5m2_value of 16 codes (dwords): the magnitude's
 * normal pattern or its subnormal multiple of the quantum, NaN (and E5M2's
 * inf) codes replaced, then the sign bit set (what -v does). */
GC_AVX512 static inline __m512 v_fp8_value(int e5m2, __m512i c)
{
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    __m512i mag = _mm512_and_si512(c, v_u32(0x7fu));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, v_u32(0x80u)), 24);
    __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, (unsigned)(23 - mbits)),
                                      v_u32((uint32_t)(127 - bias) << 23));
    __m512 quantum = _mm512_castsi512_ps(v_u32((uint32_t)(127 + 1 - bias - mbits) << 23));
    __m512i sub = _mm512_castps_si512(_mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(mag, v_u32((1u << mbits) - 1u))), quantum));
    __mmask16 is_normal = _mm512_test_epi32_mask(mag, v_u32(0x7fu << mbits & 0x7fu));
    __m512i v = _mm512_mask_blend_epi32(is_normal, sub, normal);
    if (e5m2) {
        v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, v_u32(0x7cu)), v,
                                    v_u32(0x7f800000u));
        v = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(mag, v_u32(0x7cu)), v,
                                    v_u32(0x7fc00000u));
    } else {
        v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, v_u32(0x7fu)), v,
                                    v_u32(0x7fc00000u));
    }
    return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
}

/* gc_gpu_nan of 16 lanes. */
GC_AVX512 static inline __m512 v_gpu_nans(__m512 v)
{
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_castsi512_ps(v_u32(0x7fffffffu)));
}

/* Where a loop's vectors go: vector m holds out[16 m .. 16 m + 16), put in
 * order m = 0, 1, ... With `stream`, whole 64-byte lines are written
 * non-temporally: out lies k floats past a line start, so line m is the
 * last k values of vector m - 1 and the first 16 - k of vector m (one
 * two-source permute); the partial first and last lines are written with
 * masked stores. Line m holds nothing past vector m, so a loop may read
 * vector m + 1 of out after putting m. Without `stream`, plain stores. */
typedef struct {
    float *out;
    __m512 prev;
    __m512i idx;
    unsigned k;
    int stream;
} gc_sink;

/* A sink streaming when `stream` and out is float-aligned. */
GC_AVX512 static inline gc_sink sink_open_as(float *out, int stream)
{
    gc_sink s;
    s.out = out;
    s.stream = stream && ((uintptr_t)out & 3u) == 0;
    s.k = (unsigned)(((uintptr_t)out & 63u) / 4u);
    s.prev = _mm512_setzero_ps();
    s.idx = _mm512_add_epi32(_mm512_set1_epi32(16 - (int)s.k),
                             _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    return s;
}

GC_AVX512 static inline void sink_put(gc_sink *s, size_t m, __m512 v)
{
    if (!s->stream) {
        _mm512_storeu_ps(s->out + 16 * m, v);
    } else if (s->k == 0) {
        _mm512_stream_ps(s->out + 16 * m, v);
    } else {
        /* line m starts at out + 16 m - k: line 0 before out, so its part is
         * the first 16 - k values of v, stored from out (no pointer before it) */
        if (m == 0)
            _mm512_mask_storeu_ps(s->out, (__mmask16)((1u << (16 - s->k)) - 1u), v);
        else
            _mm512_stream_ps(s->out + (16 * m - s->k),
                             _mm512_permutex2var_ps(s->prev, s->idx, v));
        s->prev = v;
    }
}

/* After vectors 0 .. m - 1: the rest of the last line. */
GC_AVX512 static inline void sink_finish(gc_sink *s, size_t m)
{
    if (s->stream && s->k && m)
        _mm512_mask_storeu_ps(s->out + (16 * m - s->k), (__mmask16)((1u << s->k) - 1u),
                              _mm512_permutex2var_ps(s->prev, s->idx, s->prev));
}

/* sink_finish, and the fence that orders the streamed lines before whatever
 * the caller does next. */
GC_AVX512 static inline void sink_close(gc_sink *s, size_t m)
{
    sink_finish(s, m);
    if (s->stream)
        _mm_sfence();
}
#endif

#endif /* GC_SIMD_H */
