/*
 * geocomm native codec: the whole C API, and the cffi binding contract
 * (bindings/build_native.py reads this file as its cdef, so it holds only
 * constants, and prototypes; preprocessor lines are skipped there).
 *
 * A "wire body" is the headerless encoding of n fp32 values, little endian:
 *   GC_E4M3, GC_E5M2  ceil(n / block) fp32 scales, then n one-byte codes.
 *                     block == 0 means one scale for all n values.
 *   GC_NVFP4          one fp32 tensor scale, ceil(n / 16) E4M3 block scales,
 *                     then ceil(n / 2) bytes of E2M1 codes (element 2i in
 *                     the low nibble, 2i + 1 in the high nibble).
 *   GC_BF16           n two-byte bfloat16 codes.
 * n == 0 encodes as an empty body. Scales inside a body need no alignment.
 * Functions return 0 on success and GC_EINVAL for an unknown format.
 * Thread-safe: no global state.
 */
#ifndef GEOCOMM_H
#define GEOCOMM_H

#include <stddef.h>
#include <stdint.h>

#define GC_E4M3 1
#define GC_E5M2 2
#define GC_NVFP4 3
#define GC_BF16 4
#define GC_EINVAL -22

/* Bytes of the wire body of n values (block is ignored by NVFP4 and BF16). */
size_t gc_wire_size(int fmt, size_t n, size_t block);

/* Encode n fp32 values into wire, which holds gc_wire_size(fmt, n, block). */
int gc_encode(int fmt, const float *x, size_t n, size_t block, uint8_t *wire);

/* Decode a wire body of n values into out; with accumulate != 0 the values
 * are added to out (fp32, element by element) instead of stored. */
int gc_decode(int fmt, const uint8_t *wire, size_t n, size_t block, float *out,
              int accumulate);

#endif /* GEOCOMM_H */
