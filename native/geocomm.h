/*
 * geocomm native codec: the whole C API, and the cffi binding contract
 * (bindings/build_native.py reads this file as its cdef, so it holds only
 * constants, and prototypes; preprocessor lines are skipped there).
 *
 * A "wire body" is the headerless encoding of n fp32 values, little endian:
 *   GC_E4M3, GC_E5M2  ceil(n / block) fp32 scales, then n one-byte codes.
 *                     block == 0 means one scale for all n values.
 *   GC_NVFP4          ceil(n / 4096) fp32 superblock scales, then ceil(n / 16)
 *                     E4M3 block scales, then ceil(n / 2) bytes of E2M1 codes
 *                     (element 2i in the low nibble, 2i + 1 in the high
 *                     nibble). Superblock k holds values [4096 k, 4096 k +
 *                     4096) of the body (the last one may be shorter); its
 *                     scale is its finite amax / (6 * 448), and block j's
 *                     scale code is relative to the scale of superblock
 *                     16 j / 4096. So the bytes of values [a, b), a a
 *                     multiple of 4096 and b one or n, do not depend on the
 *                     values outside [a, b): a body is the section-wise
 *                     concatenation of the bodies of pieces cut at multiples
 *                     of 4096 (encoded with offset + a), and a body of n <=
 *                     4096 values has one scale (the whole body's).
 *   GC_BF16           n two-byte bfloat16 codes.
 *   GC_MXFP8_E4M3,    OCP Microscaling: ceil(n / 32) E8M0 scale bytes (2^(c - 127),
 *   GC_MXFP8_E5M2     0xff NaN), then n one-byte E4M3 / E5M2 codes.
 *   GC_MXFP4          ceil(n / 32) E8M0 scale bytes, then ceil(n / 2) bytes of
 *                     E2M1 codes packed as in GC_NVFP4.
 * n == 0 encodes as an empty body. Scales inside a body need no alignment.
 * Functions return 0 on success and GC_EINVAL for an unknown format.
 * Thread-safe: the only global state is gc_codec_simd's and gc_codec_threads'
 * settings.
 */
#ifndef GEOCOMM_H
#define GEOCOMM_H

#include <stddef.h>
#include <stdint.h>

#define GC_E4M3 1
#define GC_E5M2 2
#define GC_NVFP4 3
#define GC_BF16 4
#define GC_MXFP8_E4M3 5
#define GC_MXFP8_E5M2 6
#define GC_MXFP4 7
/* gc_encode_ex flags */
#define GC_STOCHASTIC 1
#define GC_RCEIL 2
/* values per scale: NVFP4 E4M3 block scale, NVFP4 fp32 superblock scale, MX
 * E8M0 scale (gc_scalar.h defines the same for the C loops and the CUDA
 * kernels; tests/test_cuda_source.py checks that they agree) */
#define GC_NVFP4_BLOCK 16
#define GC_NVFP4_SUPERBLOCK 4096
#define GC_MX_BLOCK 32
/* gc_codec_simd levels, and the most threads per call */
#define GC_SIMD_PORTABLE 0
#define GC_SIMD_AVX512 1
#define GC_SIMD_AUTO -1
#define GC_SIMD_CURRENT -2
#define GC_MAX_THREADS 64
#define GC_EINVAL -22
#define GC_ENOMEM -12

/* Bytes of the wire body of n values (block is ignored by all but E4M3, E5M2). */
size_t gc_wire_size(int fmt, size_t n, size_t block);

/* Encode n fp32 values into wire, which holds gc_wire_size(fmt, n, block);
 * rounds to nearest even (gc_encode_ex with flags 0). */
int gc_encode(int fmt, const float *x, size_t n, size_t block, uint8_t *wire);

/* gc_encode with options. flags: GC_STOCHASTIC rounds every code (and the
 * NVFP4 block scales upward, so nothing saturates) stochastically, with
 * E[decoded] = input up to fp32 scale arithmetic; the random bits of element
 * i are a pure function of (seed, stream, offset + i) (gc_scalar.h:
 * gc_sr_key, gc_sr_bits), so one call or several calls over consecutive
 * pieces with the matching offsets give the same bits. GC_RCEIL (MX formats
 * only) rounds the shared exponent up so that no element saturates, instead
 * of the OCP floor rule (gc_scalar.h: gc_mx_exponent). seed, stream and offset are ignored without
 * GC_STOCHASTIC. GC_EINVAL for an unknown format or flag, or GC_RCEIL on a
 * non-MX format. */
int gc_encode_ex(int fmt, const float *x, size_t n, size_t block, uint8_t *wire, unsigned flags,
                 uint64_t seed, uint64_t stream, uint64_t offset);

/* Decode a wire body of n values into out; with accumulate != 0 the values
 * are added to out (fp32, element by element) instead of stored, a NaN sum
 * written as a GPU's add writes it (0x7fffffff). */
int gc_decode(int fmt, const uint8_t *wire, size_t n, size_t block, float *out,
              int accumulate);

/* out = base + decode(wire) for n values, element by element in fp32 (a NaN
 * sum written as gc_decode's): the
 * bits of copying base into out and then decoding with accumulate, in one
 * pass over memory (the pipeline's own piece plus a peer's; out is streamed,
 * never read, where the AVX-512 loops run, and goes through the cache tile
 * by tile elsewhere). base == out is gc_decode's accumulate; otherwise the
 * two must not overlap. GC_EINVAL for an unknown format or a NULL base. */
int gc_decode_onto(int fmt, const uint8_t *wire, size_t n, size_t block, const float *base,
                   float *out);

/* The vector loops of the codec and of the geometry kernels below:
 * GC_SIMD_PORTABLE (0) the portable C loops,
 * GC_SIMD_AVX512 (1) AVX-512 loops where the CPU has AVX-512 F/BW/DQ/VL
 * (x86-64 gcc builds; elsewhere, or on a CPU without it, 0), GC_SIMD_AUTO
 * the widest the CPU has (the default), GC_SIMD_CURRENT only asks. Every
 * path writes the same bytes and values. Returns the path now in use; it
 * holds for the whole process. */
int gc_codec_simd(int level);

/* Threads an encode or decode call may use (count > 0 sets it, at most
 * GC_MAX_THREADS; 0 only asks; 1 at start). A call of n values uses
 * min(count, n / 2^19) threads, each on whole blocks (whole superblocks,
 * groups), so the bytes do not depend on the count. Returns the count. */
int gc_codec_threads(int count);

/*
 * GeoFP8 geometry kernels. Matrices are row-major float32; a "range" is the
 * flat element range [lo, lo + len) of an m x n matrix, which may start and
 * end inside rows (a shard). vt is a k x n basis (one basis vector per row),
 * coef holds k coefficients per row the range touches (gc_geo_rows rows, the
 * first being row lo / n). Every sum runs in the fixed order of
 * native/gc_linalg.h, so results are bitwise identical on any CPU, with any
 * thread count, and in the CUDA kernels. Return GC_EINVAL for bad arguments.
 */

/* Rows of an n-column matrix that the range [lo, lo + len) touches. */
size_t gc_geo_rows(size_t lo, size_t len, size_t n);

/* coef[r][l] = dot of the range's part of row r with vt[l] (partial rows give
 * partial dot products). Non-finite x count as 0. Returns the number of rows
 * that held a non-finite value (or an overflow), else GC_EINVAL. */
int64_t gc_geo_project(const float *x, size_t lo, size_t len, size_t n, const float *vt,
                       size_t k, float *coef);

/* out = x + sign * (coef vt) over the range: out[e] = x[e] + sign * sum_l
 * coef[r][l] vt[l][j] for element e in row r, column j; sign is 1 or -1.
 * out may be x. packed: vt as gc_geo_pack lays it out, or NULL (then it is
 * packed for this call); the result does not depend on it. */
int gc_geo_expand(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                  const float *vt, const float *packed, size_t k, float sign, float *out);

/* Floats of vt's packed layout (column panels, each holding every basis row's
 * part contiguously), and the packing itself. */
size_t gc_geo_packed_size(size_t k, size_t n);
int gc_geo_pack(const float *vt, size_t k, size_t n, float *packed);

/* The split residual of a whole m x n matrix in one pass over it:
 * coef = gc_geo_project(x) rounded to bfloat16 (nearest even, gc_bf16_code:
 * the values GeoFP8's side channel carries), then out = x - coef vt
 * (gc_geo_expand with sign -1), block of rows by block of rows. Same bits as
 * the three steps. */
int64_t gc_geo_residual(const float *x, size_t m, size_t n, const float *vt, size_t k,
                        float *coef, float *out);

/* gc_encode_ex of the range's x - coef vt (gc_geo_expand with sign -1) without
 * storing the difference: the same bytes as the two calls, in one pass (tile
 * by tile, whole scaling blocks each; threads as gc_encode_ex). wire holds
 * gc_wire_size(fmt, len, block); packed is gc_geo_pack(vt). */
int gc_geo_encode(int fmt, const float *x, size_t lo, size_t len, size_t n, const float *coef,
                  const float *vt, const float *packed, size_t k, size_t block, uint8_t *wire,
                  unsigned flags, uint64_t seed, uint64_t stream, uint64_t offset);

/* out = decode(wire) + coef vt over the range: gc_decode, then gc_geo_expand
 * with sign 1 in place, in one pass (the same values; a large out is written
 * around the cache). wire holds gc_wire_size(fmt, len, block); packed is
 * gc_geo_pack(vt). */
int gc_geo_decode(int fmt, const uint8_t *wire, size_t lo, size_t len, size_t n,
                  const float *coef, const float *vt, const float *packed, size_t k, size_t block,
                  float *out);

/* acc[l][j] += sum over the range's rows r of coef[r][l] x[r][j], in tiles of
 * GC_ACC_ROWS rows (gc_linalg.h's "accumulate" order); acc is k x n. Non-finite
 * x make acc non-finite. Returns 0, GC_EINVAL or GC_ENOMEM. */
int gc_geo_accumulate(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                      size_t k, float *acc);

/* Sum of x[i]^2 in fp64 (fixed order); non-finite if x holds a non-finite. */
double gc_geo_sumsq(const float *x, size_t len);

/* Orthonormalize the k rows of the k x n matrix `rows` in place (classical
 * Gram-Schmidt twice, fp64, gc_linalg.h's "ortho" order); non-finite entries
 * read as 0, and a row lost to the ones before it (or zero) becomes a
 * pseudo-random direction drawn from `seed` (after GC_ORTHO_ATTEMPTS draws the
 * last is kept however little of it is left: never, for k <= n), so the rows
 * are always finite. The CUDA kernel gc_geo_orthonormalize gives the same bits.
 * k <= n. Returns 0, GC_EINVAL or GC_ENOMEM. */
int gc_geo_orthonormalize(float *rows, size_t k, size_t n, uint64_t seed);

#endif /* GEOCOMM_H */
