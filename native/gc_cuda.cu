/*
 * CUDA kernels of the geocomm codec: the GPU twin of codec.c.
 *
 * Every value a kernel computes comes from the gc_scalar.h functions that
 * codec.c calls, with the same operands in the same order, so a kernel writes
 * the same wire bytes (native/geocomm.h) and decodes the same fp32 values as
 * the C core. Only the walk over the data differs:
 *
 *   fp8, block <= 1024   "team" kernels: a power-of-two group of lanes
 *                        (<= one warp) per scaling block, each lane taking
 *                        four consecutive values per step (one 16-byte load,
 *                        one 4-byte store of codes where aligned) and keeping
 *                        them in registers: one pass over memory. The block
 *                        amax is an xor-shuffle reduction inside the team.
 *   fp8, larger blocks   "tile" kernels: each thread block handles one tile
 *   (and block 0)        of one scaling block, each thread four consecutive
 *                        values at a time. Encoding takes two passes:
 *                        gc_amax_tiles (atomicMax into a zeroed u32 per
 *                        scaling block), then gc_fp8_encode_tiles.
 *   NVFP4 encode         one thread block per superblock of 4096 values
 *                        (gc_nvfp4_superblock, shared with the pipeline):
 *                        each thread holds four runs of four values (16-byte
 *                        loads where aligned) in registers from the
 *                        superblock amax to the codes, one pass.
 *   BF16                 four values per thread (16-byte loads of values,
 *                        4-byte accesses of codes where aligned).
 *   MXFP8                8 lanes per 32-value block, four consecutive values
 *                        per lane (16-byte loads, 4-byte code stores where
 *                        aligned), the amax an xor-shuffle over the 8 lanes;
 *                        decode four values per thread.
 *   MXFP4                four values (two code bytes) per thread, 8 lanes
 *                        per 32-value block.
 *   E2M1 decode          NVFP4 and MXFP4: one kernel, one thread per 16 values
 *                        (8 code bytes, one scale): 4-byte loads of codes and
 *                        16-byte stores of values where aligned.
 *   divide               one thread per value (op="avg" of the collectives).
 *
 * Encoders take the rounding (sr: 0 nearest even, 1 stochastic) and, for
 * stochastic rounding, key = gc_sr_key(seed, stream) and the global index
 * `offset` of x[0]: value i draws gc_sr_bits(key, offset + i), as in codec.c.
 *
 * Block amaxes are unsigned maxima of the fp32 bit patterns with the sign
 * cleared and non-finite values as 0, exactly like codec.c: for non-negative
 * floats the bit order is the numeric order, and a max does not depend on the
 * reduction order.
 *
 * Build flags matter for bit-exactness: compile with -fmad=false (no
 * contraction of a*b+c into an FMA), -ftz=false (subnormals are codes and
 * scales too) and -prec-div=true (IEEE division for amax / FMAX). The decode
 * multiply-add is written with __fmul_rn/__fadd_rn as well, which are never
 * contracted. geocomm/kernels/cuda.py compiles this file with NVRTC itself (CuPy's
 * RawModule would append -ftz=true).
 *
 * fp8 kernels take nblocks = ceil(n / block) from the caller: a 64-bit
 * division per thread would cost more than the memory traffic.
 *
 * Scales inside a wire body have no alignment guarantee, so they are stored
 * and loaded byte by byte (little endian). All element indices are 64-bit.
 * Kernels expect blockDim.x to be a multiple of 32 (GC_NVFP4_THREADS exactly,
 * for gc_nvfp4_encode). The fp8 team kernels cover blocks of at most
 * GC_TEAM_MAX values (the Python side sends larger ones to the tile kernels).
 */
#include "gc_scalar.h"

#define GC_DEV __device__ __forceinline__
#define GC_FULL_MASK 0xffffffffu

/* ---- helpers --------------------------------------------------------------- */

GC_DEV void gc_store_f32(unsigned char *p, float f)
{
    gc_u32 u = gc_bits(f);
    p[0] = (unsigned char)u;
    p[1] = (unsigned char)(u >> 8);
    p[2] = (unsigned char)(u >> 16);
    p[3] = (unsigned char)(u >> 24);
}

GC_DEV float gc_load_f32(const unsigned char *p)
{
    return gc_float((gc_u32)p[0] | ((gc_u32)p[1] << 8) | ((gc_u32)p[2] << 16) |
                    ((gc_u32)p[3] << 24));
}

GC_DEV gc_u64 gc_ceil_div(gc_u64 a, gc_u64 b) { return (a + b - 1) / b; }

GC_DEV gc_u64 gc_min_u64(gc_u64 a, gc_u64 b) { return a < b ? a : b; }

GC_DEV gc_u64 gc_global_id(void) { return (gc_u64)blockIdx.x * blockDim.x + threadIdx.x; }

/* Fold f into the running amax bits m (non-finite values count as 0). */
GC_DEV gc_u32 gc_amax_bits(gc_u32 m, float f)
{
    gc_u32 b = gc_bits(f) & 0x7fffffffu;
    b = b < 0x7f800000u ? b : 0u;
    return b > m ? b : m;
}

/* Max of m over the aligned group of `width` lanes (a power of two <= 32) that
 * holds this lane. Every lane of the warp must call it with the same width. */
GC_DEV gc_u32 gc_team_max(gc_u32 m, unsigned int width)
{
    for (unsigned int off = width >> 1; off > 0; off >>= 1) {
        gc_u32 other = __shfl_xor_sync(GC_FULL_MASK, m, off);
        m = other > m ? other : m;
    }
    return m;
}

/* Max of m over the thread block; the result is valid in thread 0. Every
 * thread of the block must call it. */
GC_DEV gc_u32 gc_block_max(gc_u32 m)
{
    __shared__ gc_u32 warp_max[32];
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x >> 5;
    m = gc_team_max(m, 32);
    if (lane == 0)
        warp_max[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < (blockDim.x >> 5) ? warp_max[lane] : 0u;
        m = gc_team_max(m, 32);
    }
    return m;
}

GC_DEV gc_u8 gc_fp8_code(int e5m2, float q, float x, int sr, gc_u32 rnd)
{
    return e5m2 ? gc_e5m2_code(q, x, sr, rnd) : gc_e4m3_code(q, x, sr, rnd);
}

GC_DEV float gc_fp8_value(int e5m2, gc_u32 c)
{
    return e5m2 ? gc_e5m2_value(c) : gc_e4m3_value(c);
}


/*
 * The tile of blockIdx.x: scaling blocks of `block` values are cut into
 * `tiles_per_block` tiles of `tile` values; the grid enumerates them scaling
 * block by scaling block. Sets the scaling block *k and the element range
 * [*start, *end) (empty for a tile past the end of the data).
 */
GC_DEV void gc_tile_range(gc_u64 n, gc_u64 block, gc_u64 tiles_per_block, gc_u64 tile,
                          gc_u64 *k, gc_u64 *start, gc_u64 *end)
{
    /* blockIdx.x and tiles_per_block are < 2^31 (one grid), so a 32-bit
     * division is exact and much cheaper than a 64-bit one */
    gc_u64 t = blockIdx.x;
    gc_u64 kk = (unsigned int)t / (unsigned int)tiles_per_block;
    gc_u64 block_start = kk * block;
    gc_u64 s = block_start + (t - kk * tiles_per_block) * tile;
    gc_u64 e = gc_min_u64(gc_min_u64(s + tile, block_start + block), n);
    *k = kk;
    *start = s;
    *end = s < e ? e : s;
}

/* ---- four consecutive values per lane (team kernels) ------------------------ */

/* Largest fp8 block of the team kernels (TEAM_MAX of geocomm/kernels/cuda.py):
 * a team of at most 32 lanes, four values per lane and step, covers it in
 * GC_TEAM_STEPS steps. A kernel's step loops run a constant number of steps
 * (the ones past the block doing nothing), so they unroll and a lane's values
 * stay in registers (no stack: tests/test_cuda_source.py). */
#define GC_TEAM_MAX 1024
#define GC_TEAM_STEPS (GC_TEAM_MAX / (4 * 32))

/* Where a lane's values of step t begin within its scaling block. */
GC_DEV gc_u64 gc_team_at(int t, unsigned int lane, unsigned int width)
{
    return 4 * ((gc_u64)t * width + lane);
}

/* c[j] = p[j] for j < 4 where j < avail, else 0: one 4-byte load when aligned and full. */
GC_DEV void gc_load4_u8(const unsigned char *p, gc_u64 avail, gc_u32 *c)
{
    if (avail >= 4 && gc_aligned(p, 4)) {
        uchar4 q = *reinterpret_cast<const uchar4 *>(p);
        c[0] = q.x;
        c[1] = q.y;
        c[2] = q.z;
        c[3] = q.w;
        return;
    }
    for (int j = 0; j < 4; ++j)
        c[j] = (gc_u64)j < avail ? (gc_u32)p[j] : 0u;
}

/* p[j] = c[j] for j < 4 where j < avail: one 4-byte store when aligned and full. */
GC_DEV void gc_store4_u8(unsigned char *p, gc_u64 avail, const gc_u8 *c)
{
    if (avail >= 4 && gc_aligned(p, 4)) {
        uchar4 q;
        q.x = c[0];
        q.y = c[1];
        q.z = c[2];
        q.w = c[3];
        *reinterpret_cast<uchar4 *>(p) = q;
        return;
    }
    for (int j = 0; j < 4; ++j)
        if ((gc_u64)j < avail)
            p[j] = c[j];
}

/* c[j] = the fp8 code of v[j], j < 4, quantized with pre and factor (value j draws
 * the stochastic-rounding index `index` + j). */
GC_DEV void gc_fp8_codes4(int e5m2, const float *v, float pre, float factor, int sr, gc_u64 key,
                          gc_u64 index, gc_u8 *c)
{
    for (int j = 0; j < 4; ++j)
        c[j] = gc_fp8_code(e5m2, (v[j] * pre) * factor, v[j], sr, gc_rnd_at(sr, key, index + j));
}

/* v = the fp8 values of the four codes at cb (those below avail) times `scale`;
 * accumulate: ob's values plus them, one IEEE add each. */
GC_DEV void gc_fp8_values4(const unsigned char *cb, float scale, gc_u64 avail, int e5m2,
                           int accumulate, const float *ob, float *v)
{
    gc_u32 c[4];
    gc_load4_u8(cb, avail, c);
    for (int j = 0; j < 4; ++j)
        v[j] = __fmul_rn(gc_fp8_value(e5m2, c[j]), scale);
    if (accumulate) {
        float o[4];
        gc_load4_f32(ob, avail, o);
        for (int j = 0; j < 4; ++j)
            v[j] = __fadd_rn(o[j], v[j]);
    }
}

/* This lane's values of one scaling block of `len` values (codes cb, decoded into
 * ob, times `scale`), four per step; accumulate: ob + value, one IEEE add each;
 * then post(at, v) may change the four values at block offset `at` before they
 * are stored. */
template <class Post>
GC_DEV void gc_fp8_decode_block(const unsigned char *cb, float scale, gc_u64 len,
                                unsigned int lane, unsigned int width, int e5m2, int accumulate,
                                float *ob, const Post &post)
{
#pragma unroll
    for (int t = 0; t < GC_TEAM_STEPS; ++t) {
        gc_u64 at = gc_team_at(t, lane, width);
        if (at < len) {
            float v[4];
            gc_fp8_values4(cb + at, scale, len - at, e5m2, accumulate, ob + at, v);
            post(at, v);
            gc_store4_f32(ob + at, len - at, v);
        }
    }
}

/* ---- the tile walk (fp8 blocks above GC_TEAM_MAX, block 0) ------------------ */

/* A thread of a tile kernel takes four consecutive values at a time: from
 * gc_tile_first(start) on, gc_tile_step() apart. */
GC_DEV gc_u64 gc_tile_first(gc_u64 start) { return start + 4 * (gc_u64)threadIdx.x; }
GC_DEV gc_u64 gc_tile_step(void) { return 4 * (gc_u64)blockDim.x; }

/* The values [start, end) of one scaling block's tile, decoded from `codes` times
 * `scale` into out (accumulate: out + value), four per access. */
GC_DEV void gc_fp8_decode_tile(const unsigned char *codes, float scale, int e5m2, gc_u64 start,
                               gc_u64 end, int accumulate, float *out)
{
    for (gc_u64 i = gc_tile_first(start); i < end; i += gc_tile_step()) {
        float v[4];
        gc_fp8_values4(codes + i, scale, end - i, e5m2, accumulate, out + i, v);
        gc_store4_f32(out + i, end - i, v);
    }
}

/* ---- block amax (two-pass paths) ------------------------------------------- */

/* amax[k] = max(amax[k], bits of max |x| over the finite values of this tile
 * of scaling block k). amax must be zeroed before the first launch. */
extern "C" __global__ void gc_amax_tiles(const float *x, gc_u64 n, gc_u64 block,
                                         gc_u64 tiles_per_block, gc_u64 tile, gc_u32 *amax)
{
    gc_u64 k, start, end;
    gc_tile_range(n, block, tiles_per_block, tile, &k, &start, &end);
    gc_u32 m = 0;
    for (gc_u64 i = gc_tile_first(start); i < end; i += gc_tile_step()) {
        float v[4];
        gc_load4_f32(x + i, end - i, v); /* values past end read as 0 */
        for (int j = 0; j < 4; ++j)
            m = gc_amax_bits(m, v[j]);
    }
    m = gc_block_max(m);
    if (threadIdx.x == 0 && m != 0)
        atomicMax(amax + k, m);
}

/* ---- FP8 (E4M3FN / E5M2) ----------------------------------------------------- */

/*
 * One lane's part of the fp8 team encode of one scaling block of `len` values:
 * values xb[at, at + 4) per step, plus add(at, v) (what else the encoder sums
 * into those four values), kept in registers between the team's amax and the
 * codes. The block's scale goes to `scale_at`, its codes to cb; value i draws
 * the stochastic-rounding index `index` + i. Every lane of the team calls it
 * (len 0 past the last block: the amax shuffle needs all lanes). STEPS steps
 * cover blocks of up to 4 * 32 * STEPS values.
 */
template <int STEPS, class Add>
GC_DEV void gc_fp8_team_block(const float *xb, gc_u64 len, unsigned int lane,
                              unsigned int width, const Add &add, int e5m2, int sr, gc_u64 key,
                              gc_u64 index, unsigned char *scale_at, unsigned char *cb)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    float v[4 * STEPS];
    gc_u32 m = 0;
#pragma unroll
    for (int t = 0; t < STEPS; ++t) {
        gc_u64 at = gc_team_at(t, lane, width);
        if (at < len) {
            gc_load4_f32(xb + at, len - at, v + 4 * t); /* values past len read as 0 */
            add(at, v + 4 * t);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                m = gc_amax_bits(m, v[4 * t + j]);
        }
    }
    float amax = gc_float(gc_team_max(m, width));
    if (len == 0)
        return;

    float pre;
    float factor = gc_quant_factor(amax, fmax, &pre);
    if (lane == 0)
        gc_store_f32(scale_at, amax / fmax);
#pragma unroll
    for (int t = 0; t < STEPS; ++t) {
        gc_u64 at = gc_team_at(t, lane, width);
        if (at < len) {
            gc_u8 c[4];
            gc_fp8_codes4(e5m2, v + 4 * t, pre, factor, sr, key, index + at, c);
            gc_store4_u8(cb + at, len - at, c);
        }
    }
}

/* Team encode: 2^lshift lanes per scaling block of `block` values
 * (gc_fp8_team_block). gc_fp8_encode_team takes one step (blocks up to 128, in
 * few registers, so many warps fit on an SM), gc_fp8_encode_team_wide
 * GC_TEAM_STEPS. */
template <int STEPS>
GC_DEV void gc_fp8_encode_team_run(const float *x, gc_u64 n, gc_u64 block, gc_u64 nblocks,
                                   unsigned int lshift, int e5m2, int sr, gc_u64 key,
                                   gc_u64 offset, unsigned char *wire)
{
    if (block > 4 * 32 * STEPS) /* the caller chose the wrong kernel: values would go */
        __trap();
    const unsigned int width = 1u << lshift;
    gc_u64 g = gc_global_id();
    gc_u64 k = g >> lshift;
    unsigned int lane = (unsigned int)g & (width - 1u);
    gc_u64 start = k * block;
    gc_u64 len = k < nblocks ? gc_min_u64(block, n - start) : 0;
    gc_fp8_team_block<STEPS>(x + start, len, lane, width, [](gc_u64, float *) {}, e5m2, sr, key,
                             offset + start, wire + 4 * k, wire + 4 * nblocks + start);
}

extern "C" __global__ void gc_fp8_encode_team(const float *x, gc_u64 n, gc_u64 block,
                                              gc_u64 nblocks, unsigned int lshift, int e5m2,
                                              int sr, gc_u64 key, gc_u64 offset,
                                              unsigned char *wire)
{
    gc_fp8_encode_team_run<1>(x, n, block, nblocks, lshift, e5m2, sr, key, offset, wire);
}

extern "C" __global__ void gc_fp8_encode_team_wide(const float *x, gc_u64 n, gc_u64 block,
                                                   gc_u64 nblocks, unsigned int lshift,
                                                   int e5m2, int sr, gc_u64 key, gc_u64 offset,
                                                   unsigned char *wire)
{
    gc_fp8_encode_team_run<GC_TEAM_STEPS>(x, n, block, nblocks, lshift, e5m2, sr, key, offset,
                                          wire);
}

/* Tile encode, second pass after gc_amax_tiles filled amax[k]. */
extern "C" __global__ void gc_fp8_encode_tiles(const float *x, gc_u64 n, gc_u64 block,
                                               gc_u64 nblocks, gc_u64 tiles_per_block,
                                               gc_u64 tile, const gc_u32 *amax, int e5m2,
                                               int sr, gc_u64 key, gc_u64 offset,
                                               unsigned char *wire)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    gc_u64 k, start, end;
    gc_tile_range(n, block, tiles_per_block, tile, &k, &start, &end);
    if (start >= end)
        return;
    float bamax = gc_float(amax[k]);
    float pre;
    float factor = gc_quant_factor(bamax, fmax, &pre);
    if (threadIdx.x == 0 && start == k * block)
        gc_store_f32(wire + 4 * k, bamax / fmax);
    unsigned char *codes = wire + 4 * nblocks;
    for (gc_u64 i = gc_tile_first(start); i < end; i += gc_tile_step()) {
        float v[4];
        gc_u8 c[4];
        gc_load4_f32(x + i, end - i, v);
        gc_fp8_codes4(e5m2, v, pre, factor, sr, key, offset + i, c);
        gc_store4_u8(codes + i, end - i, c);
    }
}

/* Team decode: 2^lshift lanes per scaling block (one scale load per lane), four
 * consecutive values per lane and step. */
extern "C" __global__ void gc_fp8_decode_team(const unsigned char *wire, gc_u64 n, gc_u64 block,
                                              gc_u64 nblocks, unsigned int lshift, int e5m2,
                                              int accumulate, float *out)
{
    const unsigned int width = 1u << lshift;
    gc_u64 g = gc_global_id();
    gc_u64 k = g >> lshift;
    unsigned int lane = (unsigned int)g & (width - 1u);
    if (k >= nblocks)
        return;
    gc_u64 start = k * block;
    gc_u64 len = gc_min_u64(block, n - start);
    gc_fp8_decode_block(wire + 4 * nblocks + start, gc_load_f32(wire + 4 * k), len, lane, width,
                        e5m2, accumulate, out + start, [](gc_u64, float *) {});
}

/* Tile decode for large blocks. */
extern "C" __global__ void gc_fp8_decode_tiles(const unsigned char *wire, gc_u64 n, gc_u64 block,
                                               gc_u64 nblocks, gc_u64 tiles_per_block, gc_u64 tile,
                                               int e5m2, int accumulate, float *out)
{
    gc_u64 k, start, end;
    gc_tile_range(n, block, tiles_per_block, tile, &k, &start, &end);
    if (start >= end)
        return;
    float scale = gc_load_f32(wire + 4 * k);
    gc_fp8_decode_tile(wire + 4 * nblocks, scale, e5m2, start, end, accumulate, out);
}

/* ---- NVFP4 ------------------------------------------------------------------- */

/* The amax bits of this lane's four values q over the aligned team of `lanes`
 * lanes that holds their scaling block, and in *finite whether all of the
 * block's values are finite. Every lane of the warp must call it. */
GC_DEV gc_u32 gc_quad_amax(const float *q, unsigned int lanes, int *finite)
{
    gc_u32 bad = 0, m = 0;
    for (int j = 0; j < 4; ++j) {
        bad |= (gc_u32)!gc_finite(q[j]);
        m = gc_amax_bits(m, q[j]);
    }
    *finite = gc_team_max(bad, lanes) == 0;
    return gc_team_max(m, lanes);
}

/* The E2M1 code byte of values x0 (global rounding index `index`) and x1 (absent
 * unless has1), quantized as (x * pre) * factor (MX: pre 1, exact); 0 for a block
 * that keeps no codes (MX: not finite; NVFP4: gc_nvfp4_keeps_codes). */
GC_DEV unsigned char gc_e2m1_pair(float x0, float x1, int has1, float pre, float factor,
                                  int kept, int sr, gc_u64 key, gc_u64 index)
{
    gc_u32 c0 = kept ? gc_e2m1_code((x0 * pre) * factor, sr, gc_rnd_at(sr, key, index)) : 0u;
    gc_u32 c1 = kept && has1 ? gc_e2m1_code((x1 * pre) * factor, sr,
                                            gc_rnd_at(sr, key, index + 1))
                             : 0u;
    return (unsigned char)(c0 | (c1 << 4));
}

/* The code bytes of the four values q from value i on (of n; i even) into codes
 * (the second byte only when value i + 2 exists): gc_e2m1_pair twice, value i
 * drawing the rounding index `index` + i. */
GC_DEV void gc_e2m1_quad(const float *q, gc_u64 i, gc_u64 n, float pre, float factor, int kept,
                         int sr, gc_u64 key, gc_u64 index, unsigned char *codes)
{
    codes[i / 2] = gc_e2m1_pair(q[0], q[1], i + 1 < n, pre, factor, kept, sr, key, index + i);
    if (i + 2 < n)
        codes[i / 2 + 1] =
            gc_e2m1_pair(q[2], q[3], i + 3 < n, pre, factor, kept, sr, key, index + i + 2);
}

/* Threads per NVFP4 superblock of the encoders (NVFP4_THREADS in Python), each
 * holding GC_NVFP4_QUADS runs of four values in registers. */
#define GC_NVFP4_THREADS 256
#define GC_NVFP4_QUADS (GC_NVFP4_SUPERBLOCK / 4 / GC_NVFP4_THREADS)

/*
 * Superblock k of an NVFP4 body of n values into the body `w`, by one thread
 * block of GC_NVFP4_THREADS threads (every thread calls it, with the same k):
 * thread t holds the four values from 4 (t + GC_NVFP4_THREADS r) on, r <
 * GC_NVFP4_QUADS, in registers, so the values are read once; load4(i, v) loads
 * values i .. i + 3 of the body (i < n; those past n as 0), value i drawing the
 * stochastic-rounding index index + i. The superblock amax is a block
 * reduction, each 16-value block's amax and finiteness a reduction over its 4
 * lanes (quads are aligned by 4).
 */
template <class Load4>
GC_DEV void gc_nvfp4_superblock(const Load4 &load4, gc_u64 n, gc_u64 k, int sr, gc_u64 key,
                                gc_u64 index, unsigned char *w)
{
    __shared__ gc_u32 super_bits;
    const float smax = GC_E2M1_MAX * GC_E4M3_MAX;
    const unsigned int lanes = GC_NVFP4_BLOCK / 4;
    gc_u64 first = k * (GC_NVFP4_SUPERBLOCK / 4) + threadIdx.x;

    float v[4 * GC_NVFP4_QUADS];
    gc_u32 m = 0;
#pragma unroll
    for (int r = 0; r < GC_NVFP4_QUADS; ++r) {
        gc_u64 i = 4 * (first + (gc_u64)r * GC_NVFP4_THREADS);
        float *q = v + 4 * r;
        if (i < n)
            load4(i, q);
        else
            q[0] = q[1] = q[2] = q[3] = 0.0f;
        for (int j = 0; j < 4; ++j)
            m = gc_amax_bits(m, q[j]);
    }
    m = gc_block_max(m);
    if (threadIdx.x == 0)
        super_bits = m;
    __syncthreads();

    float super_amax = gc_float(super_bits);
    float spre;
    float sfactor = gc_quant_factor(super_amax, smax, &spre);
    float scale = super_amax / smax;
    unsigned char *bscales = w + 4 * gc_ceil_div(n, GC_NVFP4_SUPERBLOCK);
    unsigned char *codes = bscales + gc_ceil_div(n, GC_NVFP4_BLOCK);
#pragma unroll
    for (int r = 0; r < GC_NVFP4_QUADS; ++r) {
        gc_u64 quad = first + (gc_u64)r * GC_NVFP4_THREADS;
        int finite;
        gc_u32 bm = gc_quad_amax(v + 4 * r, lanes, &finite);
        if (4 * quad >= n)
            continue;
        gc_u8 sc = gc_nvfp4_scale_code(gc_float(bm), spre, sfactor, finite, sr);
        float bscale = gc_e4m3_value(sc) * scale;
        float pre;
        float factor = gc_quant_factor(bscale, 1.0f, &pre);
        gc_e2m1_quad(v + 4 * r, 4 * quad, n, pre, factor, gc_nvfp4_keeps_codes(bscale), sr, key,
                     index, codes);
        if ((quad & (lanes - 1)) == 0)
            bscales[quad / lanes] = sc;
    }
    if (threadIdx.x == 0)
        gc_store_f32(w + 4 * k, scale);
}

/* One thread block of GC_NVFP4_THREADS threads per superblock: one pass over x. */
extern "C" __global__ void gc_nvfp4_encode(const float *x, gc_u64 n, int sr, gc_u64 key,
                                           gc_u64 offset, unsigned char *wire)
{
    gc_nvfp4_superblock([&](gc_u64 i, float *q) { gc_load4_f32(x + i, n - i, q); }, n,
                        blockIdx.x, sr, key, offset, wire);
}

/* ---- BF16 -------------------------------------------------------------------- */

/* Four values per thread: one 16-byte load of values and two 4-byte stores of
 * their codes (decode: the reverse) where aligned, one at a time elsewhere. */
extern "C" __global__ void gc_bf16_encode(const float *x, gc_u64 n, int sr, gc_u64 key,
                                          gc_u64 offset, unsigned char *wire)
{
    gc_u64 i = 4 * gc_global_id();
    if (i >= n)
        return;
    float v[4];
    gc_u8 c[8];
    gc_load4_f32(x + i, n - i, v);
    for (int j = 0; j < 4; ++j) {
        gc_u16 code = gc_bf16_code(v[j], sr, gc_rnd_at(sr, key, offset + i + j));
        c[2 * j] = (gc_u8)code;
        c[2 * j + 1] = (gc_u8)(code >> 8);
    }
    gc_u64 bytes = 2 * (n - i);
    gc_store4_u8(wire + 2 * i, bytes, c);
    if (bytes > 4)
        gc_store4_u8(wire + 2 * i + 4, bytes - 4, c + 4);
}

extern "C" __global__ void gc_bf16_decode(const unsigned char *wire, gc_u64 n, int accumulate,
                                          float *out)
{
    gc_u64 i = 4 * gc_global_id();
    if (i >= n)
        return;
    gc_u64 bytes = 2 * (n - i);
    gc_u32 c[8];
    gc_load4_u8(wire + 2 * i, bytes, c);
    if (bytes > 4)
        gc_load4_u8(wire + 2 * i + 4, bytes - 4, c + 4);
    else
        c[4] = c[5] = c[6] = c[7] = 0u;
    float v[4];
    for (int j = 0; j < 4; ++j)
        v[j] = gc_bf16_value(c[2 * j] | (c[2 * j + 1] << 8));
    if (accumulate) {
        float o[4];
        gc_load4_f32(out + i, n - i, o);
        for (int j = 0; j < 4; ++j)
            v[j] = __fadd_rn(o[j], v[j]);
    }
    gc_store4_f32(out + i, n - i, v);
}

/* ---- MX (MXFP8, MXFP4) ---------------------------------------------------------- */

/* Lanes per MXFP8 block: four values each. */
#define GC_MX_LANES (GC_MX_BLOCK / 4)

/* This lane's four values of one MXFP8 block of `len` values (len 0 past the
 * last block: every lane of the team calls it, for the amax shuffle), add(at,
 * v) changing them first (the pipeline's incoming bodies); the block's E8M0
 * scale goes to *scale_at, its codes to cb. Value j of the lane draws the
 * stochastic-rounding index `index` + at + j. */
template <class Add>
GC_DEV void gc_mxfp8_team_block(const float *xb, gc_u64 len, unsigned int lane, const Add &add,
                                int e5m2, int rceil, int sr, gc_u64 key, gc_u64 index,
                                unsigned char *scale_at, unsigned char *cb)
{
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    gc_u32 m = 0;
    gc_u64 at = gc_team_at(0, lane, GC_MX_LANES);
    if (at < len) {
        gc_load4_f32(xb + at, len - at, v); /* values past len read as 0 */
        add(at, v);
        for (int j = 0; j < 4; ++j)
            m = gc_amax_bits(m, v[j]);
    }
    m = gc_team_max(m, GC_MX_LANES);
    if (at >= len)
        return;
    int e = gc_mx_exponent(gc_float(m), e5m2 ? 15 : 8, e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX, rceil);
    float factor = gc_mx_factor(e);
    if (lane == 0)
        *scale_at = (unsigned char)(e + 127);
    gc_u8 c[4];
    for (int j = 0; j < 4; ++j)
        c[j] = gc_fp8_code(e5m2, v[j] * factor, v[j], sr, gc_rnd_at(sr, key, index + at + j));
    gc_store4_u8(cb + at, len - at, c);
}

extern "C" __global__ void gc_mxfp8_encode(const float *x, gc_u64 n, int e5m2, int rceil, int sr,
                                           gc_u64 key, gc_u64 offset, unsigned char *wire)
{
    gc_u64 g = gc_global_id();
    gc_u64 k = g / GC_MX_LANES;
    gc_u64 nblocks = gc_ceil_div(n, GC_MX_BLOCK);
    gc_u64 start = k * GC_MX_BLOCK;
    gc_u64 len = k < nblocks ? gc_min_u64(GC_MX_BLOCK, n - start) : 0;
    gc_mxfp8_team_block(x + start, len, (unsigned int)(g % GC_MX_LANES),
                        [](gc_u64, float *) {}, e5m2, rceil, sr, key, offset + start, wire + k,
                        wire + nblocks + start);
}

/* Four values (two code bytes) per thread, 8 lanes per 32-value block. */
extern "C" __global__ void gc_mxfp4_encode(const float *x, gc_u64 n, int rceil, int sr,
                                           gc_u64 key, gc_u64 offset, unsigned char *wire)
{
    gc_u64 quad = gc_global_id();
    gc_u64 i = 4 * quad;
    float q[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (i < n)
        gc_load4_f32(x + i, n - i, q);
    int finite;
    gc_u32 m = gc_quad_amax(q, GC_MX_LANES, &finite);
    if (i >= n)
        return;
    int e = gc_mx_exponent(gc_float(m), 2, GC_E2M1_MAX, rceil);
    gc_u64 nblocks = gc_ceil_div(n, GC_MX_BLOCK);
    gc_e2m1_quad(q, i, n, 1.0f, gc_mx_factor(e), finite, sr, key, offset, wire + nblocks);
    if ((quad & (GC_MX_LANES - 1)) == 0)
        wire[i / GC_MX_BLOCK] = finite ? (unsigned char)(e + 127) : (unsigned char)0xffu;
}

/* The four MXFP8 values from i on (those below n; one block holds them all) of
 * the body `wire` of n values, as gc_fp8_values4 (accumulate: onto ob's). */
GC_DEV void gc_mxfp8_values4(const unsigned char *wire, gc_u64 n, int e5m2, gc_u64 i,
                             int accumulate, const float *ob, float *v)
{
    gc_fp8_values4(wire + gc_ceil_div(n, GC_MX_BLOCK) + i, gc_e8m0_value(wire[i / GC_MX_BLOCK]),
                   n - i, e5m2, accumulate, ob, v);
}

/* Four values per thread: a 4-byte load of codes, a 16-byte store of values. */
extern "C" __global__ void gc_mxfp8_decode(const unsigned char *wire, gc_u64 n, int e5m2,
                                           int accumulate, float *out)
{
    gc_u64 i = 4 * gc_global_id();
    if (i >= n)
        return;
    float v[4];
    gc_mxfp8_values4(wire, n, e5m2, i, accumulate, out + i, v);
    gc_store4_f32(out + i, n - i, v);
}

/* E2M1 decode (NVFP4, MXFP4): a thread takes a chunk of 16 values, which share one
 * scale (an NVFP4 block, half an MX block). */
#define GC_E2M1_CHUNK 16

/* The codes of the chunk of values [i, i + GC_E2M1_CHUNK) of a body `w` of n
 * values, NVFP4 (mx == 0) or MXFP4, and in *scale the scale they share. */
GC_DEV const unsigned char *gc_e2m1_chunk(int mx, const unsigned char *w, gc_u64 n, gc_u64 i,
                                          float *scale)
{
    if (mx) {
        *scale = gc_e8m0_value(w[i / GC_MX_BLOCK]);
        return w + gc_ceil_div(n, GC_MX_BLOCK) + i / 2;
    }
    const unsigned char *bscales = w + 4 * gc_ceil_div(n, GC_NVFP4_SUPERBLOCK);
    float super_scale = gc_load_f32(w + 4 * (i / GC_NVFP4_SUPERBLOCK));
    *scale = __fmul_rn(gc_e4m3_value(bscales[i / GC_NVFP4_BLOCK]), super_scale);
    return bscales + gc_ceil_div(n, GC_NVFP4_BLOCK) + i / 2;
}

/* Values [0, min(GC_E2M1_CHUNK, len)) of a chunk (codes: 8 bytes, value 2b in the
 * low nibble of byte b) times `scale` into out; accumulate: out + value, one IEEE
 * add each. Two 4-byte loads of codes and four 16-byte stores where aligned. */
GC_DEV void gc_e2m1_decode_chunk(const unsigned char *codes, float scale, gc_u64 len,
                                 int accumulate, float *out)
{
    gc_u64 bytes = (len + 1) / 2;
    gc_u32 b[8];
    gc_load4_u8(codes, bytes, b);
    if (bytes > 4)
        gc_load4_u8(codes + 4, bytes - 4, b + 4);
    else
        b[4] = b[5] = b[6] = b[7] = 0u;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        if (4 * (gc_u64)q < len) {
            float v[4];
            for (int j = 0; j < 4; ++j)
                v[j] = __fmul_rn(gc_e2m1_value((b[2 * q + j / 2] >> (4 * (j & 1))) & 0xfu), scale);
            if (accumulate) {
                float o[4];
                gc_load4_f32(out + 4 * q, len - 4 * q, o);
                for (int j = 0; j < 4; ++j)
                    v[j] = __fadd_rn(o[j], v[j]);
            }
            gc_store4_f32(out + 4 * q, len - 4 * q, v);
        }
    }
}

/* NVFP4 (mx == 0) and MXFP4 (mx != 0) decode: one thread per chunk of 16 values. */
extern "C" __global__ void gc_e2m1_decode(const unsigned char *wire, gc_u64 n, int mx,
                                          int accumulate, float *out)
{
    gc_u64 i = GC_E2M1_CHUNK * gc_global_id();
    if (i >= n)
        return;
    float scale;
    const unsigned char *codes = gc_e2m1_chunk(mx, wire, n, i, &scale);
    gc_e2m1_decode_chunk(codes, scale, n - i, accumulate, out + i);
}

/* ---- op="avg" ------------------------------------------------------------------ */

/* out[i] = f(x[i]) for the four consecutive values of this thread (one 16-byte
 * access each way where aligned); out may be x. */
template <class F> GC_DEV void gc_map4_f32(float *out, const float *x, gc_u64 n, F f)
{
    gc_u64 i = 4 * gc_global_id();
    if (i >= n)
        return;
    float v[4];
    gc_load4_f32(x + i, n - i, v);
    for (int j = 0; j < 4; ++j)
        v[j] = f(v[j]);
    gc_store4_f32(out + i, n - i, v);
}

/* values[i] /= d: one IEEE division, rounded to nearest, subnormals kept (CuPy's
 * elementwise kernels, compiled with -ftz=true, would flush them). Each thread takes
 * four consecutive values (one 16-byte access each way where aligned). The values
 * move (gc_moved): a call's graph divides its result. */
extern "C" __global__ void gc_divide_f32(float *values, const gc_u64 *moved, gc_u64 n, float d)
{
    values = gc_moved(values, moved);
    gc_map4_f32(values, values, n, [d](float v) { return __fdiv_rn(v, d); });
}

extern "C" __global__ void gc_divide_f64(double *values, gc_u64 n, double d)
{
    gc_u64 i = gc_global_id();
    if (i < n)
        values[i] = __ddiv_rn(values[i], d);
}

/* ---- fp32 sums and differences of the collectives ------------------------------- */

/* out[i] = x[i], four values per thread; both move (gc_moved): a call's graph copies
 * a caller's values. */
extern "C" __global__ void gc_copy_f32(float *out, const gc_u64 *out_moved, const float *x,
                                       const gc_u64 *x_moved, gc_u64 n)
{
    gc_map4_f32(gc_moved(out, out_moved), gc_moved(x, x_moved), n, [](float v) { return v; });
}

/* out[i] = a[i] + b[i] (residual: a[i] + (-b[i]), 0 where that is not finite) for
 * four consecutive values per thread, in 16-byte accesses where aligned. Each thread
 * reads its values of a and b before it writes them, so out may be a or b itself. */
GC_DEV void gc_add4_f32(float *out, const float *a, const float *b, gc_u64 n, bool residual)
{
    gc_u64 i = 4 * gc_global_id();
    if (i >= n)
        return;
    float x[4], y[4];
    gc_load4_f32(a + i, n - i, x);
    gc_load4_f32(b + i, n - i, y);
    for (int j = 0; j < 4; ++j) {
        x[j] = __fadd_rn(x[j], residual ? -y[j] : y[j]);
        if (residual && !gc_finite(x[j]))
            x[j] = 0.0f;
    }
    gc_store4_f32(out + i, n - i, x);
}

/* acc[i] += v[i]: one IEEE fp32 addition, rounded to nearest, subnormal operands and
 * results kept (CuPy's `+=` is compiled with -ftz=true and would flush them), so a
 * sum of CuPy arrays equals NumPy's (NaN payloads aside). v may be acc itself. */
extern "C" __global__ void gc_add_f32(float *acc, const float *v, gc_u64 n)
{
    gc_add4_f32(acc, acc, v, n, false);
}

/* out[i] = a[i] - b[i], written as a[i] + (-b[i]) (the negation is exact and IEEE
 * subtraction is that addition, rounded to nearest, subnormals kept), and 0 where it
 * is not finite: error feedback's residual, what a quantization of a lost (b: what it
 * decodes to), which must not send a non-finite value again with every later call.
 * out may be a or b itself. */
extern "C" __global__ void gc_residual_f32(float *out, const float *a, const float *b, gc_u64 n)
{
    gc_add4_f32(out, a, b, n, true);
}
