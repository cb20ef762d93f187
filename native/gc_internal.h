/*
 * What codec.c calls of geometry.c beyond the binding contract (geocomm.h).
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

#endif /* GC_INTERNAL_H */
