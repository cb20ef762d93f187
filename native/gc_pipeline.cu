/*
 * Batched kernels of the GPU pipeline (geocomm/engine/device.py): one launch
 * encodes, sums or decodes every piece of a pipeline stage.
 *
 * The pieces of a launch are the rows of a segment table, GC_SEG_FIELDS
 * 64-bit words per piece, all computed on the host (so no kernel divides by a
 * number it was not given):
 *
 *   GC_SEG_VALUES  first value of the piece in the values array
 *   GC_SEG_COUNT   its number of values n (0: nothing to do)
 *   GC_SEG_WIRE    first byte of its wire body in the wire buffer
 *   GC_SEG_INDEX   global index of its first value: the stochastic-rounding
 *                  counter of value i is index + i, as in the C core
 *   GC_SEG_AMAX    its first slot in the zeroed amax scratch (fp8 tile walk)
 *   GC_SEG_SCALES  scales of its body: fp8 ceil(n / block), NVFP4
 *                  superblocks ceil(n / 4096), MX ceil(n / 32), else 0
 *   GC_SEG_BLOCK   fp8: the scaling block its walk uses
 *   GC_SEG_TILES   fp8 tile walk: tiles per scaling block
 *
 * blockIdx.y is the row; blockIdx.x and threadIdx.x walk the piece as the
 * single-body kernels of gc_cuda.cu walk a body (fp8 teams and tiles, teams
 * of 8 lanes per MX block, four values per thread, and for NVFP4 one thread
 * block of GC_NVFP4_THREADS threads per superblock).
 *
 * Encoders encode the sum of a piece's values and `nin` incoming wire bodies
 * of the same format and length (body r at in + r * in_stride), added in
 * order, one fp32 add each (gc_sum_at). The first quantization passes nin = 0;
 * the owner's re-encode passes the N - 1 bodies the all-to-all brought, in
 * rank order, which is the C path's sum (own piece first, then the ranks in
 * increasing order) bit for bit, without writing it to memory. gc_pipe_reduce
 * writes that sum as fp32 instead (reduce-scatter, and calls whose map needs
 * the sum); the decoders decode every piece of a stage into its place.
 *
 * Encoders read their stochastic-rounding key (gc_sr_key of the call's
 * quantization stream) from device memory: see gc_load_key. Every kernel reads
 * the caller's values, and writes its results, at its argument's address plus
 * a shift it reads from device memory (`moved`: gc_moved in gc_scalar.h), so a
 * CUDA graph of a call serves every later call, wherever its arrays lie.
 *
 * The _split kernels (fp8 teams) run GeoFP8's split map in the same pass
 * (gc_split): the encoder quantizes x - A V^T, the decoder writes its value
 * plus (sum_i A_i) V^T, each element's map being gc_geo_expand's chain of
 * native/gc_linalg.h, so the bytes and values are those of the map into a
 * buffer followed by the plain kernel. They take one piece (a one-row table)
 * that lies inside one mapped tensor.
 *
 * Every value comes from the gc_scalar.h functions with the operands and
 * order of gc_cuda.cu (whose helpers this file includes), so the bytes and
 * values are the C core's; compile with the same flags (-fmad=false
 * -ftz=false -prec-div=true). Kernels expect blockDim.x to be a multiple of
 * 32 (GC_NVFP4_THREADS exactly, for gc_pipe_nvfp4_encode).
 */
#include "gc_cuda.cu"
#include "gc_linalg.h"

#define GC_SEG_VALUES 0
#define GC_SEG_COUNT 1
#define GC_SEG_WIRE 2
#define GC_SEG_INDEX 3
#define GC_SEG_AMAX 4
#define GC_SEG_SCALES 5
#define GC_SEG_BLOCK 6
#define GC_SEG_TILES 7
#define GC_SEG_FIELDS 8

/* Format families (geocomm/engine/device_tables.py mirrors these numbers). */
#define GC_PIPE_RAW 0 /* fp32 values as they are: the lossless codec */
#define GC_PIPE_FP8 1
#define GC_PIPE_NVFP4 2
#define GC_PIPE_BF16 3
#define GC_PIPE_MXFP8 4
#define GC_PIPE_MXFP4 5

/* One row of a segment table (see the top of this file). */
struct gc_seg {
    gc_u64 values, count, wire, index, amax, scales, block, tiles;
};

GC_DEV gc_seg gc_seg_row(const gc_u64 *table)
{
    const gc_u64 *t = table + (gc_u64)blockIdx.y * GC_SEG_FIELDS;
    gc_seg s;
    s.values = t[GC_SEG_VALUES];
    s.count = t[GC_SEG_COUNT];
    s.wire = t[GC_SEG_WIRE];
    s.index = t[GC_SEG_INDEX];
    s.amax = t[GC_SEG_AMAX];
    s.scales = t[GC_SEG_SCALES];
    s.block = t[GC_SEG_BLOCK];
    s.tiles = t[GC_SEG_TILES];
    return s;
}

/* The incoming bodies an encoder adds to its values (count 0: none). */
struct gc_in {
    const unsigned char *wire;
    unsigned int count;
    gc_u64 stride;
    int family;
    int e5m2;
};

GC_DEV gc_in gc_in_make(const unsigned char *wire, unsigned int count, gc_u64 stride, int family,
                        int e5m2)
{
    gc_in in;
    in.wire = wire;
    in.count = count;
    in.stride = stride;
    in.family = family;
    in.e5m2 = e5m2;
    return in;
}

/* Code i of packed E2M1 codes (element 2p in the low nibble, 2p + 1 in the high). */
GC_DEV gc_u32 gc_nibble(const unsigned char *codes, gc_u64 i)
{
    gc_u32 byte = codes[i / 2];
    return (i & 1u) ? byte >> 4 : byte & 0xfu;
}

/* Value i of the wire body `wire` of n values with `scales` scales, of
 * format `family` (fp8: value i lies in scaling block k), decoded as the
 * decoders of gc_cuda.cu decode it. */
GC_DEV float gc_body_value(int family, int e5m2, const unsigned char *wire, gc_u64 n,
                           gc_u64 scales, gc_u64 k, gc_u64 i)
{
    switch (family) {
    case GC_PIPE_FP8:
        return __fmul_rn(gc_fp8_value(e5m2, wire[4 * scales + i]), gc_load_f32(wire + 4 * k));
    case GC_PIPE_NVFP4: {
        const unsigned char *bscales = wire + 4 * scales;
        const unsigned char *codes = bscales + gc_ceil_div(n, GC_NVFP4_BLOCK);
        float scale = __fmul_rn(gc_e4m3_value(bscales[i / GC_NVFP4_BLOCK]),
                                gc_load_f32(wire + 4 * (i / GC_NVFP4_SUPERBLOCK)));
        return __fmul_rn(gc_e2m1_value(gc_nibble(codes, i)), scale);
    }
    case GC_PIPE_BF16:
        return gc_bf16_value((gc_u32)wire[2 * i] | ((gc_u32)wire[2 * i + 1] << 8));
    case GC_PIPE_MXFP8:
        return __fmul_rn(gc_fp8_value(e5m2, wire[scales + i]),
                         gc_e8m0_value(wire[i / GC_MX_BLOCK]));
    case GC_PIPE_MXFP4:
        return __fmul_rn(gc_e2m1_value(gc_nibble(wire + scales, i)),
                         gc_e8m0_value(wire[i / GC_MX_BLOCK]));
    default:
        return gc_load_f32(wire + 4 * i);
    }
}

/* v (value i of piece s) plus value i of every incoming body, in order, one
 * IEEE add each: what the C core's decode with accumulate does per body. */
GC_DEV float gc_sum_at(gc_in in, const gc_seg &s, float v, gc_u64 k, gc_u64 i)
{
    for (unsigned int r = 0; r < in.count; ++r)
        v = __fadd_rn(v, gc_body_value(in.family, in.e5m2, in.wire + r * in.stride, s.count,
                                       s.scales, k, i));
    return v;
}

/* v = the sums (gc_sum_at) of the four values of piece s from i on, those below
 * end (fp8: scaling block k); the others 0: the encoders' four per access. */
GC_DEV void gc_sums4(gc_in in, const gc_seg &s, const float *x, gc_u64 k, gc_u64 i, gc_u64 end,
                     float *v)
{
    gc_load4_f32(x + s.values + i, end - i, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) /* v in registers: indices known once unrolled */
        if (i + j < end)
            v[j] = gc_sum_at(in, s, v[j], k, i + j);
}

/* An encoder's stochastic-rounding key, read from device memory (`sr_key`, one
 * u64) rather than passed by value: a CUDA graph keeps the arguments it
 * captured, so a replayed call reads the key gc_pipe_set_call wrote just before
 * the replay (DevicePlan.bind in geocomm/engine/device.py). Nearest rounding
 * (sr == 0) reads nothing. */
GC_DEV gc_u64 gc_load_key(int sr, const gc_u64 *sr_key) { return sr ? *sr_key : 0u; }

/* A call's slots, written by one thread in stream order before its kernels (no
 * host-to-device copy, which from pageable memory may wait for the stream):
 * slots[0], slots[1] = its two stochastic-rounding keys; slots[2], slots[3] = how
 * far its source and result lie from where the kernels about to run were given
 * them (source_origin, result_origin: their addresses; gc_moved). It takes the
 * arrays as arrays, read and written, so a stream-order checker (the CPU twin's)
 * sees the call's accesses here, where a replay's kernels name the capture's. */
extern "C" __global__ void gc_pipe_set_call(gc_u64 *slots, gc_u64 first, gc_u64 second,
                                            const float *source, gc_u64 source_origin,
                                            float *result, gc_u64 result_origin)
{
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        slots[0] = first;
        slots[1] = second;
        slots[2] = (gc_u64)source - source_origin;
        slots[3] = (gc_u64)result - result_origin;
    }
}

/* ---- encoders ----------------------------------------------------------------- */

/* RAW and BF16: four values per thread (a 16-byte load of values where aligned;
 * BF16 codes in two 4-byte stores where aligned). */
extern "C" __global__ void gc_pipe_value_encode(int family, const float *x, const gc_u64 *moved,
                                                const gc_u64 *table, const unsigned char *in,
                                                unsigned int nin, gc_u64 in_stride, int sr,
                                                const gc_u64 *sr_key, unsigned char *wire)
{
    x = gc_moved(x, moved);
    const gc_u64 key = gc_load_key(sr, sr_key);
    gc_seg s = gc_seg_row(table);
    gc_u64 i = 4 * gc_global_id();
    if (i >= s.count)
        return;
    gc_in incoming = gc_in_make(in, nin, in_stride, family, 0);
    float v[4];
    gc_load4_f32(x + s.values + i, s.count - i, v);
    gc_u64 have = gc_min_u64(4, s.count - i);
    for (gc_u64 j = 0; j < have; ++j)
        v[j] = gc_sum_at(incoming, s, v[j], 0, i + j);
    unsigned char *w = wire + s.wire;
    if (family == GC_PIPE_BF16) {
        gc_u8 c[8];
        for (int j = 0; j < 4; ++j) {
            gc_u16 code = gc_bf16_code(v[j], sr, gc_rnd_at(sr, key, s.index + i + j));
            c[2 * j] = (gc_u8)code;
            c[2 * j + 1] = (gc_u8)(code >> 8);
        }
        gc_store4_u8(w + 2 * i, 2 * have, c);
        if (have > 2)
            gc_store4_u8(w + 2 * i + 4, 2 * have - 4, c + 4);
    } else {
        for (gc_u64 j = 0; j < have; ++j)
            gc_store_f32(w + 4 * (i + j), v[j]);
    }
}

/* A piece's split map (GeoFP8: geocomm/codecs/geo/maps.py, SplitPlan): value p of
 * the piece is element t0 + p of its tensor, a row-major matrix of n columns;
 * coef holds the k coefficients of each row from row t0 / n on, vt the (k, n)
 * basis. k == 0: no map. */
struct gc_split {
    gc_u64 t0, n, k;
    const float *coef, *vt;
};

/* v[q] + sign * (coef row . vt column) for values p .. p + 3 of the piece, those
 * below `avail` (the others stay as they are: an encoder's zeros past a block's
 * end must not enter its amax): gc_geo_expand's element, chain over l in order. */
GC_DEV void gc_split4(const gc_split &m, gc_u64 p, gc_u64 avail, float sign, float *v)
{
    gc_u64 t = m.t0 + p;
    gc_u64 r = t / m.n - m.t0 / m.n, j = t % m.n;
    for (int q = 0; q < 4 && (gc_u64)q < avail; ++q) {
        float c = 0.0f;
        for (gc_u64 l = 0; l < m.k; ++l)
            c = gc_mad(c, m.coef[r * m.k + l], m.vt[l * m.n + j]);
        v[q] = __fadd_rn(v[q], __fmul_rn(sign, c));
        if (++j == m.n) {
            j = 0;
            ++r;
        }
    }
}

/* FP8 with a block of at most GC_TEAM_MAX values: 2^lshift lanes per scaling
 * block, four consecutive values per lane and step (as gc_fp8_encode_team, and
 * like it in two kernels: one step for blocks up to 128, GC_TEAM_STEPS in
 * gc_pipe_fp8_encode_team_wide), their sums formed once and kept in registers
 * between the amax and the codes. */
template <int STEPS>
GC_DEV void gc_pipe_fp8_encode_team_run(const float *x, const gc_u64 *moved,
                                        const gc_u64 *table, const unsigned char *in,
                                        unsigned int nin, gc_u64 in_stride, unsigned int lshift,
                                        int e5m2, int sr, const gc_u64 *sr_key,
                                        unsigned char *wire, const gc_split &map)
{
    x = gc_moved(x, moved);
    const gc_u64 key = gc_load_key(sr, sr_key);
    const unsigned int width = 1u << lshift;
    gc_seg s = gc_seg_row(table);
    if (s.block > 4 * 32 * STEPS) /* the caller chose the wrong kernel: values would go */
        __trap();
    gc_u64 g = gc_global_id();
    gc_u64 k = g >> lshift;
    unsigned int lane = (unsigned int)g & (width - 1u);
    gc_u64 start = k * s.block;
    gc_u64 len = k < s.scales ? gc_min_u64(s.block, s.count - start) : 0;
    /* gc_sum_at's adds, body by body: each body's scale read once, its codes four
     * at a time (values past len stay 0: their codes read as 0) */
    auto add = [&](gc_u64 at, float *v) {
        if (map.k) /* the own values mapped first, then the bodies added, as the host does */
            gc_split4(map, start + at, len - at, -1.0f, v);
        for (unsigned int r = 0; r < nin; ++r) {
            const unsigned char *body = in + r * in_stride;
            float scale = gc_load_f32(body + 4 * k);
            gc_u32 c[4];
            gc_load4_u8(body + 4 * s.scales + start + at, len - at, c);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                v[j] = __fadd_rn(v[j], __fmul_rn(gc_fp8_value(e5m2, c[j]), scale));
        }
    };
    unsigned char *w = wire + s.wire;
    gc_fp8_team_block<STEPS>(x + s.values + start, len, lane, width, add, e5m2, sr, key,
                             s.index + start, w + 4 * k, w + 4 * s.scales + start);
}

extern "C" __global__ void gc_pipe_fp8_encode_team(const float *x, const gc_u64 *moved,
                                                   const gc_u64 *table, const unsigned char *in,
                                                   unsigned int nin, gc_u64 in_stride,
                                                   unsigned int lshift, int e5m2, int sr,
                                                   const gc_u64 *sr_key, unsigned char *wire)
{
    gc_pipe_fp8_encode_team_run<1>(x, moved, table, in, nin, in_stride, lshift, e5m2, sr, sr_key,
                                   wire, gc_split{0, 1, 0, nullptr, nullptr});
}

extern "C" __global__ void gc_pipe_fp8_encode_team_wide(const float *x, const gc_u64 *moved,
                                                        const gc_u64 *table,
                                                        const unsigned char *in,
                                                        unsigned int nin, gc_u64 in_stride,
                                                        unsigned int lshift, int e5m2, int sr,
                                                        const gc_u64 *sr_key,
                                                        unsigned char *wire)
{
    gc_pipe_fp8_encode_team_run<GC_TEAM_STEPS>(x, moved, table, in, nin, in_stride, lshift, e5m2,
                                               sr, sr_key, wire,
                                               gc_split{0, 1, 0, nullptr, nullptr});
}

/* The team encoders with a split map (t0, n, k, coef, vt: gc_split). */
extern "C" __global__ void gc_pipe_fp8_encode_team_split(
    const float *x, const gc_u64 *moved, const gc_u64 *table, const unsigned char *in,
    unsigned int nin, gc_u64 in_stride, unsigned int lshift, int e5m2, int sr,
    const gc_u64 *sr_key, unsigned char *wire, gc_u64 t0, gc_u64 n, gc_u64 k, const float *coef,
    const float *vt)
{
    gc_pipe_fp8_encode_team_run<1>(x, moved, table, in, nin, in_stride, lshift, e5m2, sr, sr_key,
                                   wire, gc_split{t0, n, k, coef, vt});
}

extern "C" __global__ void gc_pipe_fp8_encode_team_wide_split(
    const float *x, const gc_u64 *moved, const gc_u64 *table, const unsigned char *in,
    unsigned int nin, gc_u64 in_stride, unsigned int lshift, int e5m2, int sr,
    const gc_u64 *sr_key, unsigned char *wire, gc_u64 t0, gc_u64 n, gc_u64 k, const float *coef,
    const float *vt)
{
    gc_pipe_fp8_encode_team_run<GC_TEAM_STEPS>(x, moved, table, in, nin, in_stride, lshift, e5m2,
                                               sr, sr_key, wire, gc_split{t0, n, k, coef, vt});
}

/* FP8 tile walk (larger blocks, block 0), first pass: amax[s.amax + k] =
 * max(itself, bits of the largest finite |sum| of this tile of scaling block
 * k). The scratch must be zeroed before the launch. */
extern "C" __global__ void gc_pipe_amax_tiles(const float *x, const gc_u64 *moved,
                                              const gc_u64 *table, const unsigned char *in,
                                              unsigned int nin, gc_u64 in_stride, int e5m2,
                                              gc_u64 tile, gc_u32 *amax)
{
    x = gc_moved(x, moved);
    gc_seg s = gc_seg_row(table);
    if (s.count == 0) /* the whole thread block: before gc_block_max's barrier */
        return;
    gc_in incoming = gc_in_make(in, nin, in_stride, GC_PIPE_FP8, e5m2);
    gc_u64 k, start, end;
    gc_tile_range(s.count, s.block, s.tiles, tile, &k, &start, &end);
    gc_u32 m = 0;
    for (gc_u64 i = gc_tile_first(start); i < end; i += gc_tile_step()) {
        float v[4];
        gc_sums4(incoming, s, x, k, i, end, v);
        for (int j = 0; j < 4; ++j)
            m = gc_amax_bits(m, v[j]);
    }
    m = gc_block_max(m);
    if (threadIdx.x == 0 && m != 0)
        atomicMax(amax + s.amax + k, m);
}

/* FP8 tile walk, second pass: the codes of this tile with its block's amax. */
extern "C" __global__ void gc_pipe_fp8_encode_tiles(const float *x, const gc_u64 *moved,
                                                    const gc_u64 *table, const unsigned char *in,
                                                    unsigned int nin, gc_u64 in_stride, int e5m2,
                                                    gc_u64 tile, const gc_u32 *amax, int sr,
                                                    const gc_u64 *sr_key, unsigned char *wire)
{
    x = gc_moved(x, moved);
    const gc_u64 key = gc_load_key(sr, sr_key);
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    gc_seg s = gc_seg_row(table);
    if (s.count == 0)
        return;
    gc_in incoming = gc_in_make(in, nin, in_stride, GC_PIPE_FP8, e5m2);
    gc_u64 k, start, end;
    gc_tile_range(s.count, s.block, s.tiles, tile, &k, &start, &end);
    if (start >= end)
        return;
    float bamax = gc_float(amax[s.amax + k]);
    float pre;
    float factor = gc_quant_factor(bamax, fmax, &pre);
    unsigned char *w = wire + s.wire;
    if (threadIdx.x == 0 && start == k * s.block)
        gc_store_f32(w + 4 * k, bamax / fmax);
    unsigned char *codes = w + 4 * s.scales;
    for (gc_u64 i = gc_tile_first(start); i < end; i += gc_tile_step()) {
        float v[4];
        gc_u8 c[4];
        gc_sums4(incoming, s, x, k, i, end, v);
        gc_fp8_codes4(e5m2, v, pre, factor, sr, key, s.index + i, c);
        gc_store4_u8(codes + i, end - i, c);
    }
}

/* NVFP4: one thread block of GC_NVFP4_THREADS threads per superblock
 * (gc_nvfp4_superblock), over the sums of the piece's values and the incoming
 * bodies. */
extern "C" __global__ void gc_pipe_nvfp4_encode(const float *x, const gc_u64 *moved,
                                                const gc_u64 *table, const unsigned char *in,
                                                unsigned int nin, gc_u64 in_stride, int sr,
                                                const gc_u64 *sr_key, unsigned char *wire)
{
    x = gc_moved(x, moved);
    const gc_u64 key = gc_load_key(sr, sr_key);
    gc_seg s = gc_seg_row(table);
    if (blockIdx.x >= s.scales) /* the whole thread block: before any barrier */
        return;
    gc_in incoming = gc_in_make(in, nin, in_stride, GC_PIPE_NVFP4, 0);
    gc_nvfp4_superblock([&](gc_u64 i, float *q) { gc_sums4(incoming, s, x, 0, i, s.count, q); },
                        s.count, blockIdx.x, sr, key, s.index, wire + s.wire);
}

/* MXFP8: 8 lanes per 32-value block, four values per lane (gc_mxfp8_team_block);
 * the incoming bodies added body by body, each one's scale read once, its codes
 * four at a time (gc_sum_at's adds: values past len stay 0). */
extern "C" __global__ void gc_pipe_mxfp8_encode(const float *x, const gc_u64 *moved,
                                                const gc_u64 *table, const unsigned char *in,
                                                unsigned int nin, gc_u64 in_stride, int e5m2,
                                                int rceil, int sr, const gc_u64 *sr_key,
                                                unsigned char *wire)
{
    x = gc_moved(x, moved);
    const gc_u64 key = gc_load_key(sr, sr_key);
    gc_seg s = gc_seg_row(table);
    gc_u64 g = gc_global_id();
    gc_u64 k = g / GC_MX_LANES;
    gc_u64 start = k * GC_MX_BLOCK;
    gc_u64 len = k < s.scales ? gc_min_u64(GC_MX_BLOCK, s.count - start) : 0;
    auto add = [&](gc_u64 at, float *v) {
        for (unsigned int r = 0; r < nin; ++r) {
            const unsigned char *body = in + r * in_stride;
            float scale = gc_e8m0_value(body[k]);
            gc_u32 c[4];
            gc_load4_u8(body + s.scales + start + at, len - at, c);
            for (int j = 0; j < 4; ++j)
                v[j] = __fadd_rn(v[j], __fmul_rn(gc_fp8_value(e5m2, c[j]), scale));
        }
    };
    unsigned char *w = wire + s.wire;
    gc_mxfp8_team_block(x + s.values + start, len, (unsigned int)(g % GC_MX_LANES), add, e5m2,
                        rceil, sr, key, s.index + start, w + k, w + s.scales + start);
}

/* MXFP4: four values (two code bytes) per thread, 8 lanes per 32-value block. */
extern "C" __global__ void gc_pipe_mxfp4_encode(const float *x, const gc_u64 *moved,
                                                const gc_u64 *table, const unsigned char *in,
                                                unsigned int nin, gc_u64 in_stride, int rceil,
                                                int sr, const gc_u64 *sr_key,
                                                unsigned char *wire)
{
    x = gc_moved(x, moved);
    const gc_u64 key = gc_load_key(sr, sr_key);
    gc_seg s = gc_seg_row(table);
    gc_u64 quad = gc_global_id();
    gc_u64 i = 4 * quad;
    float q[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (i < s.count)
        gc_sums4(gc_in_make(in, nin, in_stride, GC_PIPE_MXFP4, 0), s, x, 0, i, s.count, q);
    int finite;
    gc_u32 m = gc_quad_amax(q, GC_MX_LANES, &finite);
    if (i >= s.count)
        return;
    int e = gc_mx_exponent(gc_float(m), 2, GC_E2M1_MAX, rceil);
    unsigned char *w = wire + s.wire;
    gc_e2m1_quad(q, i, s.count, 1.0f, gc_mx_factor(e), finite, sr, key, s.index, w + s.scales);
    if ((quad & (GC_MX_LANES - 1)) == 0)
        w[i / GC_MX_BLOCK] = finite ? (unsigned char)(e + 127) : (unsigned char)0xffu;
}

/* ---- the sum as fp32, and decoders ----------------------------------------------- */

/* out[s.values + i] = the sum of value i and the incoming bodies of `family`:
 * four values per thread (fp8: block s.block). x and out may be one array. */
extern "C" __global__ void gc_pipe_reduce(int family, int e5m2, const float *x,
                                          const gc_u64 *x_moved, const gc_u64 *table,
                                          const unsigned char *in, unsigned int nin,
                                          gc_u64 in_stride, float *out, const gc_u64 *out_moved)
{
    x = gc_moved(x, x_moved);
    out = gc_moved(out, out_moved);
    gc_seg s = gc_seg_row(table);
    gc_u64 i = 4 * gc_global_id();
    if (i >= s.count)
        return;
    gc_in incoming = gc_in_make(in, nin, in_stride, family, e5m2);
    float v[4];
    gc_load4_f32(x + s.values + i, s.count - i, v);
    gc_u64 have = gc_min_u64(4, s.count - i);
    for (gc_u64 j = 0; j < have; ++j)
        v[j] = gc_sum_at(incoming, s, v[j], family == GC_PIPE_FP8 ? (i + j) / s.block : 0, i + j);
    gc_store4_f32(out + s.values + i, s.count - i, v);
}

/* RAW, BF16 and MXFP8 (NVFP4 and MXFP4 take gc_pipe_e2m1_decode, fp8 its teams and
 * tiles): four values per thread, a 16-byte store of values where aligned (MXFP8:
 * a 4-byte load of codes). */
extern "C" __global__ void gc_pipe_decode(int family, int e5m2, const unsigned char *wire,
                                          const gc_u64 *table, float *out, const gc_u64 *moved)
{
    out = gc_moved(out, moved);
    gc_seg s = gc_seg_row(table);
    gc_u64 i = 4 * gc_global_id();
    if (i >= s.count)
        return;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (family == GC_PIPE_MXFP8) {
        gc_mxfp8_values4(wire + s.wire, s.count, e5m2, i, 0, nullptr, v);
    } else {
        gc_u64 have = gc_min_u64(4, s.count - i);
        for (gc_u64 j = 0; j < have; ++j)
            v[j] = gc_body_value(family, e5m2, wire + s.wire, s.count, s.scales, 0, i + j);
    }
    gc_store4_f32(out + s.values + i, s.count - i, v);
}

/* NVFP4 (mx == 0) and MXFP4: one thread per chunk of 16 values of a piece
 * (gc_e2m1_decode_chunk). */
extern "C" __global__ void gc_pipe_e2m1_decode(int mx, const unsigned char *wire,
                                               const gc_u64 *table, float *out,
                                               const gc_u64 *moved)
{
    out = gc_moved(out, moved);
    gc_seg s = gc_seg_row(table);
    gc_u64 i = GC_E2M1_CHUNK * gc_global_id();
    if (i >= s.count)
        return;
    float scale;
    const unsigned char *codes = gc_e2m1_chunk(mx, wire + s.wire, s.count, i, &scale);
    gc_e2m1_decode_chunk(codes, scale, s.count - i, 0, out + s.values + i);
}

/* FP8, team walk: 2^lshift lanes per scaling block, four consecutive values per
 * lane and step (as gc_fp8_decode_team). */
template <class Post>
GC_DEV void gc_pipe_fp8_decode_team_run(const unsigned char *wire, const gc_u64 *table,
                                        unsigned int lshift, int e5m2, float *out,
                                        const gc_u64 *moved, const Post &post)
{
    out = gc_moved(out, moved);
    const unsigned int width = 1u << lshift;
    gc_seg s = gc_seg_row(table);
    gc_u64 g = gc_global_id();
    gc_u64 k = g >> lshift;
    unsigned int lane = (unsigned int)g & (width - 1u);
    if (k >= s.scales)
        return;
    gc_u64 start = k * s.block;
    gc_u64 len = gc_min_u64(s.block, s.count - start);
    const unsigned char *w = wire + s.wire;
    gc_fp8_decode_block(w + 4 * s.scales + start, gc_load_f32(w + 4 * k), len, lane, width, e5m2,
                        0, out + s.values + start,
                        [&](gc_u64 at, float *v) { post(start + at, len - at, v); });
}

extern "C" __global__ void gc_pipe_fp8_decode_team(const unsigned char *wire, const gc_u64 *table,
                                                   unsigned int lshift, int e5m2, float *out,
                                                   const gc_u64 *moved)
{
    gc_pipe_fp8_decode_team_run(wire, table, lshift, e5m2, out, moved,
                                [](gc_u64, gc_u64, float *) {});
}

/* The team decoder with a split map: each value plus the summed coefficients'
 * expansion (sign +1), what the map's inverse adds after a plain decode. */
extern "C" __global__ void gc_pipe_fp8_decode_team_split(const unsigned char *wire,
                                                         const gc_u64 *table, unsigned int lshift,
                                                         int e5m2, float *out,
                                                         const gc_u64 *moved, gc_u64 t0,
                                                         gc_u64 n, gc_u64 k, const float *coef,
                                                         const float *vt)
{
    const gc_split map = gc_split{t0, n, k, coef, vt};
    gc_pipe_fp8_decode_team_run(wire, table, lshift, e5m2, out, moved,
                                [&](gc_u64 p, gc_u64 avail, float *v) {
                                    gc_split4(map, p, avail, 1.0f, v);
                                });
}

/* FP8, tile walk. */
extern "C" __global__ void gc_pipe_fp8_decode_tiles(const unsigned char *wire,
                                                    const gc_u64 *table, gc_u64 tile, int e5m2,
                                                    float *out, const gc_u64 *moved)
{
    out = gc_moved(out, moved);
    gc_seg s = gc_seg_row(table);
    if (s.count == 0)
        return;
    gc_u64 k, start, end;
    gc_tile_range(s.count, s.block, s.tiles, tile, &k, &start, &end);
    if (start < end)
        gc_fp8_decode_tile(wire + s.wire + 4 * s.scales, gc_load_f32(wire + s.wire + 4 * k), e5m2,
                           start, end, 0, out + s.values);
}
