/*
 * What codec.c calls of geometry.c beyond the binding contract (geocomm.h).
 */
#ifndef GC_INTERNAL_H
#define GC_INTERNAL_H

#include <stddef.h>

/* gc_geo_expand into out != x with out written around the cache (whole
 * lines, non-temporal) where the AVX-512 loops run and the range is whole
 * rows; elsewhere gc_geo_expand. The same values either way. */
int gc_geo_expand_stream(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                         const float *vt, const float *packed, size_t k, float sign, float *out);

#endif /* GC_INTERNAL_H */
