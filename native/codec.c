/*
 * CPU loops of the geocomm codec. All arithmetic lives in gc_scalar.h; this
 * file only walks blocks and stores results. Hot loops are branch-free per
 * element so the compiler vectorizes them; GC_CLONES builds an AVX2 variant
 * beside the portable one and picks at load time.
 */
#include "geocomm.h"
#include "gc_scalar.h"
#include "gc_simd.h"
#include "gc_internal.h"

#include <pthread.h>
#include <stdlib.h>

/* flatten: every gc_scalar.h function inlines into the loops (gcc left
 * gc_e5m2_code out of line in one clone, a call per value). */
#if defined(GC_USE_CLONES) && defined(__x86_64__) && defined(__GNUC__)
#define GC_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), flatten))
#elif defined(__GNUC__)
#define GC_CLONES __attribute__((flatten))
#else
#define GC_CLONES
#endif


/* The per-format loops below are written once with the rounding mode as a
 * parameter and inlined into one GC_CLONES wrapper per mode: forced, since a
 * loop left out of line would lose the wrapper's vector ISA (gcc declines to
 * inline encode_nvfp4 for its stack frame otherwise). */
#if defined(__GNUC__)
#define GC_INLINE static inline __attribute__((always_inline))
#else
#define GC_INLINE static inline
#endif

/* a / b rounded up, for any a (a + b - 1 would wrap near SIZE_MAX) */
static size_t ceil_div(size_t a, size_t b) { return a / b + (a % b != 0); }

static size_t fp8_block(size_t n, size_t block) { return block ? block : n; }

static int is_mx(int fmt) { return fmt >= GC_MXFP8_E4M3 && fmt <= GC_MXFP4; }

static int known_format(int fmt) { return fmt >= GC_E4M3 && fmt <= GC_MXFP4; }

size_t gc_wire_size(int fmt, size_t n, size_t block)
{
    if (n == 0)
        return 0;
    switch (fmt) {
    case GC_E4M3:
    case GC_E5M2:
        return 4 * ceil_div(n, fp8_block(n, block)) + n;
    case GC_NVFP4:
        return 4 * ceil_div(n, GC_NVFP4_SUPERBLOCK) + ceil_div(n, GC_NVFP4_BLOCK) + ceil_div(n, 2);
    case GC_BF16:
        return 2 * n;
    case GC_MXFP8_E4M3:
    case GC_MXFP8_E5M2:
        return ceil_div(n, GC_MX_BLOCK) + n;
    case GC_MXFP4:
        return ceil_div(n, GC_MX_BLOCK) + ceil_div(n, 2);
    default:
        return 0;
    }
}

static float load_f32(const uint8_t *p)
{
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

static void store_f32(uint8_t *p, float f) { memcpy(p, &f, sizeof f); }

/* The fp32 sum of an accumulating decode (a collective encodes it again), a
 * NaN written as a GPU's (gc_gpu_nan). */
static inline float add_as_gpu(float a, float b) { return gc_gpu_nan(a + b); }

/* Max |x| over the finite values of a block, and whether all are finite. For
 * non-negative floats the order of the bit patterns is the numeric order, so
 * this is an unsigned max; non-finite values are masked to 0 arithmetically,
 * which keeps the reduction in a form gcc vectorizes (a select before the max
 * made it fall back to scalar). */
static inline void block_stats(const float *restrict x, size_t len, float *amax, int *finite)
{
    gc_u32 m = 0, bad = 0;
    for (size_t i = 0; i < len; i++) {
        gc_u32 b = gc_bits(x[i]) & 0x7fffffffu;
        gc_u32 ok = b < 0x7f800000u;
        bad |= ok ^ 1u;
        b &= 0u - ok;
        m = m > b ? m : b;
    }
    *amax = gc_float(m);
    *finite = !bad;
}

/* block_stats without the finiteness (the compiler drops its part). */
static inline float block_amax(const float *restrict x, size_t len)
{
    float amax;
    int finite;
    block_stats(x, len, &amax, &finite);
    return amax;
}

/* The packed bytes of the 4-bit codes c[0..2 len): byte i is c[2i] | c[2i+1]
 * << 4. Read as little-endian 16-bit pairs p = c[2i] | c[2i+1] << 8 (codes
 * below 16), that is the low byte of p | p >> 4: a loop of shifts and packs. */
static inline void pack_nibbles(const gc_u8 *restrict c, size_t len, uint8_t *restrict out)
{
    for (size_t i = 0; i < len; i++) {
        gc_u16 p = (gc_u16)(c[2 * i] | (c[2 * i + 1] << 8));
        out[i] = (uint8_t)(p | (p >> 4));
    }
}

/* E2M1 codes (one per byte) of (x[i] * pre[i]) * factor[i]; element i has
 * the global index `index` + i. With `unit` every pre[i] is 1 (and not
 * read): x * 1 is x for every finite x, and the codes of non-finite values
 * are overwritten by the callers. */
GC_INLINE void e2m1_codes_flat(int sr, int unit, const float *restrict x, size_t len,
                               const float *restrict pre, const float *restrict factor,
                               gc_u8 *restrict c, gc_u64 key, gc_u64 index)
{
    if (unit)
        for (size_t i = 0; i < len; i++)
            c[i] = gc_e2m1_code(x[i] * factor[i], sr, gc_rnd_at(sr, key, index + i));
    else
        for (size_t i = 0; i < len; i++)
            c[i] = gc_e2m1_code((x[i] * pre[i]) * factor[i], sr, gc_rnd_at(sr, key, index + i));
}

/* Max of the |x| bit patterns of 16 values, non-finite ones included (the
 * callers redo a block with block_stats when this reaches 0x7f800000). One
 * literal-length loop: a vector max and one horizontal reduction. */
GC_INLINE gc_u32 raw_amax_bits(const float *restrict x, size_t len)
{
    gc_u32 m = 0;
    for (size_t i = 0; i < len; i++) {
        gc_u32 b = gc_bits(x[i]) & 0x7fffffffu;
        m = m > b ? m : b;
    }
    return m;
}

/* Per-block amax (finite values only) and finiteness of the `count` blocks
 * of `blen` values at x (the last one `last` values long): first the raw max
 * of the |x| patterns of every block (no masking, so the loop is a plain
 * vector max), then, only for the rare block whose raw max is not finite,
 * block_stats again. Same amax and finite as block_stats on every block. */
GC_INLINE void blocks_stats(const float *restrict x, size_t count, size_t blen, size_t last,
                                gc_u32 *restrict amax_bits, int *restrict finite)
{
    size_t full = last == blen ? count : count - 1;
    gc_u32 any_bad = 0;
    for (size_t j = 0; j < full; j++)
        amax_bits[j] = raw_amax_bits(x + j * blen, blen);
    if (full < count)
        amax_bits[full] = raw_amax_bits(x + full * blen, last);
    for (size_t j = 0; j < count; j++) {
        finite[j] = 1;
        any_bad |= amax_bits[j] >= 0x7f800000u;
    }
    if (!any_bad)
        return;
    for (size_t j = 0; j < count; j++)
        if (amax_bits[j] >= 0x7f800000u) {
            float a;
            block_stats(x + j * blen, j < full ? blen : last, &a, &finite[j]);
            amax_bits[j] = gc_bits(a);
        }
}

/* d[j * blen + i] = v[j]: per-block factors spread to one per value, so
 * that the code loops run flat over a group of blocks. */
GC_INLINE void spread(const float *restrict v, size_t count, size_t blen, float *restrict d)
{
    for (size_t j = 0; j < count; j++) {
        float f = v[j];
        float *restrict dj = d + j * blen;
        for (size_t i = 0; i < blen; i++)
            dj[i] = f;
    }
}

/* fp8 codes of (x[i] * pre[i]) * factor[i] (fp8 and MXFP8); element i has
 * the global index `index` + i. With `unit` every pre[i] is 1 (and not
 * read): x * 1 is x for every finite x, and a non-finite x's code does not
 * depend on q. */
GC_INLINE void fp8_codes_flat(int e5m2, int sr, int unit, const float *restrict x, size_t len,
                              const float *restrict pre, const float *restrict factor,
                              uint8_t *restrict c, gc_u64 key, gc_u64 index)
{
    if (e5m2 && unit)
        for (size_t i = 0; i < len; i++)
            c[i] = gc_e5m2_code(x[i] * factor[i], x[i], sr, gc_rnd_at(sr, key, index + i));
    else if (e5m2)
        for (size_t i = 0; i < len; i++)
            c[i] = gc_e5m2_code((x[i] * pre[i]) * factor[i], x[i], sr,
                                gc_rnd_at(sr, key, index + i));
    else if (unit)
        for (size_t i = 0; i < len; i++)
            c[i] = gc_e4m3_code(x[i] * factor[i], x[i], sr, gc_rnd_at(sr, key, index + i));
    else
        for (size_t i = 0; i < len; i++)
            c[i] = gc_e4m3_code((x[i] * pre[i]) * factor[i], x[i], sr,
                                gc_rnd_at(sr, key, index + i));
}

/* ---- FP8 ---------------------------------------------------------------- */

/* fp8 codes of (x * pre) * factor for one block; element i
 * has the global index `index` + i. */
static inline void fp8_block_codes(int e5m2, int sr, const float *restrict xb, size_t len,
                                   float pre, float factor, uint8_t *restrict cb, gc_u64 key,
                                   gc_u64 index)
{
    if (e5m2)
        for (size_t i = 0; i < len; i++)
            cb[i] = gc_e5m2_code((xb[i] * pre) * factor, xb[i], sr, gc_rnd_at(sr, key, index + i));
    else
        for (size_t i = 0; i < len; i++)
            cb[i] = gc_e4m3_code((xb[i] * pre) * factor, xb[i], sr, gc_rnd_at(sr, key, index + i));
}

/* One block: amax, scale, codes. Called with a literal length for full
 * 128-value blocks so the compiler drops the loop tails. */
static inline void encode_fp8_block(int e5m2, int sr, const float *restrict xb, size_t len,
                                    uint8_t *restrict scale, uint8_t *restrict cb, gc_u64 key,
                                    gc_u64 index)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    float amax = block_amax(xb, len);
    float pre;
    float factor = gc_quant_factor(amax, fmax, &pre);
    store_f32(scale, amax / fmax);
    fp8_block_codes(e5m2, sr, xb, len, pre, factor, cb, key, index);
}

/* Blocks of 128 values per group of the fp8 encoder. */
#define GC_FP8_GROUP 16

/* Block 128, group by group: the amaxes of the group's blocks, their scales
 * and factors (one loop across blocks), then the codes of the whole group in
 * one flat loop (encode_fp8_block's arithmetic, value by value). */
GC_INLINE void encode_fp8_128(int e5m2, int sr, const float *restrict x, size_t n,
                              uint8_t *restrict scales, uint8_t *restrict codes, gc_u64 key,
                              gc_u64 offset)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    const size_t glen_max = GC_FP8_GROUP * 128;
    size_t nblocks = ceil_div(n, 128);
    for (size_t g = 0; g < nblocks; g += GC_FP8_GROUP) {
        size_t count = nblocks - g < GC_FP8_GROUP ? nblocks - g : GC_FP8_GROUP;
        size_t start = g * 128;
        size_t glen = n - start < glen_max ? n - start : glen_max;
        gc_u32 amax[GC_FP8_GROUP];
        int finite[GC_FP8_GROUP];
        float pre[GC_FP8_GROUP], factor[GC_FP8_GROUP];
        float pe[GC_FP8_GROUP * 128], fe[GC_FP8_GROUP * 128];
        blocks_stats(x + start, count, 128, glen - (count - 1) * 128, amax, finite);
        int unit = 1;
        for (size_t j = 0; j < count; j++) {
            float a = gc_float(amax[j]);
            store_f32(scales + 4 * (g + j), a / fmax);
            factor[j] = gc_quant_factor(a, fmax, &pre[j]);
            unit &= pre[j] == 1.0f;
        }
        spread(factor, count, 128, fe);
        if (!unit)
            spread(pre, count, 128, pe);
        if (unit && glen == glen_max)
            fp8_codes_flat(e5m2, sr, 1, x + start, glen_max, pe, fe, codes + start, key,
                           offset + start);
        else if (unit)
            fp8_codes_flat(e5m2, sr, 1, x + start, glen, pe, fe, codes + start, key,
                           offset + start);
        else
            fp8_codes_flat(e5m2, sr, 0, x + start, glen, pe, fe, codes + start, key,
                           offset + start);
    }
}

GC_INLINE void encode_fp8(int e5m2, int sr, const float *restrict x, size_t n, size_t block,
                          uint8_t *restrict scales, uint8_t *restrict codes, gc_u64 key,
                          gc_u64 offset)
{
    if (block == 128) {
        encode_fp8_128(e5m2, sr, x, n, scales, codes, key, offset);
        return;
    }
    size_t nblocks = ceil_div(n, block);
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * block;
        size_t len = n - start < block ? n - start : block;
        encode_fp8_block(e5m2, sr, x + start, len, scales + 4 * k, codes + start, key,
                         offset + start);
    }
}

/* Values code * scale of one block (fp8 and MXFP8), stored or accumulated. */
static inline void fp8_block_values(int e5m2, int accumulate, const uint8_t *restrict cb,
                                    size_t len, float scale, float *restrict ob)
{
    for (size_t i = 0; i < len; i++) {
        float v = (e5m2 ? gc_e5m2_value(cb[i]) : gc_e4m3_value(cb[i])) * scale;
        ob[i] = accumulate ? add_as_gpu(ob[i], v) : v;
    }
}

static inline void decode_fp8(int e5m2, int accumulate, const uint8_t *restrict scales,
                              const uint8_t *restrict codes, size_t n, size_t block,
                              float *restrict out)
{
    size_t nblocks = ceil_div(n, block);
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * block;
        size_t len = n - start < block ? n - start : block;
        fp8_block_values(e5m2, accumulate, codes + start, len, load_f32(scales + 4 * k),
                         out + start);
    }
}

/* One compiled function per format and rounding: sr is a constant in each,
 * so the nearest path stays free of the hash. */
#define GC_FP8_ENCODER(name, e5m2, sr)                                                       \
    GC_CLONES static void name(const float *x, size_t n, size_t b, uint8_t *s, uint8_t *c,     \
                               gc_u64 key, gc_u64 off)                                         \
    {                                                                                          \
        encode_fp8(e5m2, sr, x, n, b, s, c, key, off);                                         \
    }
GC_FP8_ENCODER(encode_e4m3, 0, 0)
GC_FP8_ENCODER(encode_e5m2, 1, 0)
GC_FP8_ENCODER(encode_e4m3_sr, 0, 1)
GC_FP8_ENCODER(encode_e5m2_sr, 1, 1)
#define GC_FP8_DECODER(name, e5m2, acc)                                                      \
    GC_CLONES static void name(const uint8_t *s, const uint8_t *c, size_t n, size_t b,         \
                               float *o)                                                       \
    {                                                                                          \
        decode_fp8(e5m2, acc, s, c, n, b, o);                                                  \
    }
GC_FP8_DECODER(decode_e4m3, 0, 0)
GC_FP8_DECODER(decode_e5m2, 1, 0)
GC_FP8_DECODER(accumulate_e4m3, 0, 1)
GC_FP8_DECODER(accumulate_e5m2, 1, 1)

/* ---- E2M1 (NVFP4, MXFP4) ------------------------------------------------- */

/* gc_e2m1_value of every 4-bit code, as a table the vectorizer turns into an
 * in-register permute (test_native.c checks it against gc_e2m1_value). */
static const float gc_e2m1_table[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Values code * eff of one packed E2M1 block starting at an even index. */
static inline void e2m1_block_values(const uint8_t *restrict cb, size_t len, float eff,
                                     int accumulate, float *restrict ob)
{
    for (size_t i = 0; i < len; i++) {
        float v = gc_e2m1_table[(cb[i >> 1] >> ((i & 1) * 4)) & 0xfu] * eff;
        ob[i] = accumulate ? add_as_gpu(ob[i], v) : v;
    }
}

/* ---- NVFP4 -------------------------------------------------------------- */

/* Blocks per group of the NVFP4 decoder (a group lies inside one superblock). */
#define GC_NVFP4_GROUP 64
#if GC_NVFP4_SUPERBLOCK % (GC_NVFP4_GROUP * GC_NVFP4_BLOCK) != 0
#error "an NVFP4 superblock must hold whole groups of blocks"
#endif
#define GC_NVFP4_BLOCKS (GC_NVFP4_SUPERBLOCK / GC_NVFP4_BLOCK)

/* One superblock of len <= GC_NVFP4_SUPERBLOCK values: its fp32 scale at
 * *sscale, its block scales at bscales, its codes at codes; element i has the
 * global index `index` + i. Passes over the superblock (16 KiB, so all but
 * the first read it from L1): the amax and finiteness of every block (the
 * superblock's amax is the max of its blocks' amaxes, the same bits as one
 * max over all its values); the scale codes and factors of all its blocks,
 * one vectorized loop across blocks; the codes of every block, one byte
 * each; their packing into nibbles. */
GC_INLINE void encode_nvfp4_super(int sr, const float *restrict x, size_t len, uint8_t *sscale,
                                  uint8_t *restrict bscales, uint8_t *restrict codes, gc_u64 key,
                                  gc_u64 index)
{
    const float smax = GC_E2M1_MAX * GC_E4M3_MAX;
    size_t nblocks = ceil_div(len, GC_NVFP4_BLOCK);
    size_t last = len - (nblocks - 1) * GC_NVFP4_BLOCK;
    gc_u32 bamax[GC_NVFP4_BLOCKS];
    int finite[GC_NVFP4_BLOCKS], kept[GC_NVFP4_BLOCKS];
    float pre[GC_NVFP4_BLOCKS], factor[GC_NVFP4_BLOCKS];
    gc_u8 c[GC_NVFP4_SUPERBLOCK + 1];
    blocks_stats(x, nblocks, GC_NVFP4_BLOCK, last, bamax, finite);
    gc_u32 m = 0;
    for (size_t j = 0; j < nblocks; j++)
        m = m > bamax[j] ? m : bamax[j];
    float samax = gc_float(m);
    float spre;
    float sfactor = gc_quant_factor(samax, smax, &spre);
    float scale = samax / smax;
    store_f32(sscale, scale);
    for (size_t j = 0; j < nblocks; j++) {
        gc_u8 sc = gc_nvfp4_scale_code(gc_float(bamax[j]), spre, sfactor, finite[j], sr);
        bscales[j] = sc;
        float bscale = gc_e4m3_value(sc) * scale;
        kept[j] = gc_nvfp4_keeps_codes(bscale);
        factor[j] = gc_quant_factor(bscale, 1.0f, &pre[j]);
    }
    /* codes in groups of blocks, with pre and factor spread to one per value
     * so that the code loop runs flat over the group (no per-block
     * overhead); codes of blocks that keep none (a zero or NaN scale) are
     * cleared afterwards */
    for (size_t g = 0; g < nblocks; g += GC_NVFP4_GROUP) {
        size_t count = nblocks - g < GC_NVFP4_GROUP ? nblocks - g : GC_NVFP4_GROUP;
        size_t start = g * GC_NVFP4_BLOCK;
        size_t glen = len - start < GC_NVFP4_GROUP * GC_NVFP4_BLOCK ? len - start
                                                                     : GC_NVFP4_GROUP * GC_NVFP4_BLOCK;
        float pe[GC_NVFP4_GROUP * GC_NVFP4_BLOCK], fe[GC_NVFP4_GROUP * GC_NVFP4_BLOCK];
        int unit = 1; /* every pre 1: x * 1 == x for the finite x that count */
        for (size_t j = 0; j < count; j++)
            unit &= pre[g + j] == 1.0f;
        for (size_t j = 0; j < count; j++) {
            float f = factor[g + j];
            float *d = fe + j * GC_NVFP4_BLOCK;
            for (size_t i = 0; i < GC_NVFP4_BLOCK; i++)
                d[i] = f;
        }
        if (!unit)
            for (size_t j = 0; j < count; j++) {
                float p = pre[g + j];
                float *d = pe + j * GC_NVFP4_BLOCK;
                for (size_t i = 0; i < GC_NVFP4_BLOCK; i++)
                    d[i] = p;
            }
        if (unit && glen == GC_NVFP4_GROUP * GC_NVFP4_BLOCK)
            e2m1_codes_flat(sr, 1, x + start, GC_NVFP4_GROUP * GC_NVFP4_BLOCK, pe, fe, c + start,
                            key, index + start);
        else if (unit)
            e2m1_codes_flat(sr, 1, x + start, glen, pe, fe, c + start, key, index + start);
        else
            e2m1_codes_flat(sr, 0, x + start, glen, pe, fe, c + start, key, index + start);
    }
    int all_kept = 1;
    for (size_t j = 0; j < nblocks; j++)
        all_kept &= kept[j];
    if (!all_kept)
        for (size_t j = 0; j < nblocks; j++)
            if (!kept[j])
                memset(c + j * GC_NVFP4_BLOCK, 0,
                       j + 1 < nblocks ? GC_NVFP4_BLOCK : last);
    c[len] = 0; /* the high nibble of an odd length's last byte */
    if (len == GC_NVFP4_SUPERBLOCK)
        pack_nibbles(c, GC_NVFP4_SUPERBLOCK / 2, codes);
    else
        pack_nibbles(c, (len + 1) / 2, codes);
}

/* Superblock by superblock (geocomm.h: the layout). */
GC_INLINE void encode_nvfp4(int sr, const float *x, size_t n, uint8_t *sscales,
                            uint8_t *bscales, uint8_t *codes, gc_u64 key, gc_u64 offset)
{
    size_t nsuper = ceil_div(n, GC_NVFP4_SUPERBLOCK);
    for (size_t k = 0; k < nsuper; k++) {
        size_t start = k * GC_NVFP4_SUPERBLOCK;
        size_t len = n - start < GC_NVFP4_SUPERBLOCK ? n - start : GC_NVFP4_SUPERBLOCK;
        encode_nvfp4_super(sr, x + start, len, sscales + 4 * k, bscales + start / GC_NVFP4_BLOCK,
                           codes + start / 2, key, offset + start);
    }
}

GC_CLONES static void encode_nvfp4_rn(const float *x, size_t n, uint8_t *s, uint8_t *b,
                                      uint8_t *c, gc_u64 key, gc_u64 off)
{
    encode_nvfp4(0, x, n, s, b, c, key, off);
}
GC_CLONES static void encode_nvfp4_sr(const float *x, size_t n, uint8_t *s, uint8_t *b,
                                      uint8_t *c, gc_u64 key, gc_u64 off)
{
    encode_nvfp4(1, x, n, s, b, c, key, off);
}

GC_CLONES static void decode_nvfp4(int accumulate, const uint8_t *sscales,
                                   const uint8_t *bscales, const uint8_t *codes, size_t n,
                                   float *out)
{
    size_t nblocks = ceil_div(n, GC_NVFP4_BLOCK);
    for (size_t g = 0; g < nblocks; g += GC_NVFP4_GROUP) {
        size_t count = nblocks - g < GC_NVFP4_GROUP ? nblocks - g : GC_NVFP4_GROUP;
        /* a group lies inside one superblock */
        float scale = load_f32(sscales + 4 * (g * GC_NVFP4_BLOCK / GC_NVFP4_SUPERBLOCK));
        float eff[GC_NVFP4_GROUP];
        for (size_t j = 0; j < count; j++)
            eff[j] = gc_e4m3_value(bscales[g + j]) * scale;
        for (size_t j = 0; j < count; j++) {
            size_t start = (g + j) * GC_NVFP4_BLOCK;
            size_t len = n - start < GC_NVFP4_BLOCK ? n - start : GC_NVFP4_BLOCK;
            const uint8_t *cb = codes + start / 2;
            if (len == GC_NVFP4_BLOCK)
                e2m1_block_values(cb, GC_NVFP4_BLOCK, eff[j], accumulate, out + start);
            else
                e2m1_block_values(cb, len, eff[j], accumulate, out + start);
        }
    }
}

/* ---- MX (MXFP8, MXFP4) ---------------------------------------------------- */

/* Blocks per group of the MX encoders. */
#define GC_MX_GROUP 32

/* One E8M0 scale per block (gc_mx_exponent) and the codes of x * 2^-X, one
 * byte each (MXFP8) or packed E2M1 (MXFP4). An MXFP4 block holding a
 * non-finite value gets the NaN scale 0xff and codes 0 (E2M1 has no NaN);
 * MXFP8 keeps non-finite values per element, like fp8. Group by group: the
 * amaxes (and finiteness) of the group's blocks, their E8M0 scales and
 * factors (one loop across blocks), then the codes of the whole group in
 * one flat loop. MXFP4 codes of non-finite blocks are cleared afterwards. */
GC_INLINE void encode_mx(int fmt, int sr, int rceil, const float *restrict x, size_t n,
                         uint8_t *restrict scales, uint8_t *restrict codes, gc_u64 key,
                         gc_u64 offset)
{
    const int e5m2 = fmt == GC_MXFP8_E5M2;
    const int emax = fmt == GC_MXFP4 ? 2 : e5m2 ? 15 : 8;
    const float fmax = fmt == GC_MXFP4 ? GC_E2M1_MAX : e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    const size_t glen_max = GC_MX_GROUP * GC_MX_BLOCK;
    size_t nblocks = ceil_div(n, GC_MX_BLOCK);
    for (size_t g = 0; g < nblocks; g += GC_MX_GROUP) {
        size_t count = nblocks - g < GC_MX_GROUP ? nblocks - g : GC_MX_GROUP;
        size_t start = g * GC_MX_BLOCK;
        size_t glen = n - start < glen_max ? n - start : glen_max;
        size_t last = glen - (count - 1) * GC_MX_BLOCK;
        gc_u32 amax[GC_MX_GROUP];
        int finite[GC_MX_GROUP], all_finite = 1;
        float factor[GC_MX_GROUP], fe[GC_MX_GROUP * GC_MX_BLOCK];
        blocks_stats(x + start, count, GC_MX_BLOCK, last, amax, finite);
        for (size_t j = 0; j < count; j++) {
            int e = gc_mx_exponent(gc_float(amax[j]), emax, fmax, rceil);
            factor[j] = gc_mx_factor(e);
            scales[g + j] = fmt != GC_MXFP4 || finite[j] ? (uint8_t)(e + 127) : 0xffu;
            all_finite &= finite[j];
        }
        spread(factor, count, GC_MX_BLOCK, fe);
        if (fmt == GC_MXFP4) {
            gc_u8 c[GC_MX_GROUP * GC_MX_BLOCK + 1];
            if (glen == glen_max)
                e2m1_codes_flat(sr, 1, x + start, glen_max, fe, fe, c, key, offset + start);
            else
                e2m1_codes_flat(sr, 1, x + start, glen, fe, fe, c, key, offset + start);
            if (!all_finite)
                for (size_t j = 0; j < count; j++)
                    if (!finite[j])
                        memset(c + j * GC_MX_BLOCK, 0, j + 1 < count ? GC_MX_BLOCK : last);
            c[glen] = 0; /* the high nibble of an odd length's last byte */
            if (glen == glen_max)
                pack_nibbles(c, glen_max / 2, codes + start / 2);
            else
                pack_nibbles(c, (glen + 1) / 2, codes + start / 2);
        } else if (glen == glen_max) {
            fp8_codes_flat(e5m2, sr, 1, x + start, glen_max, fe, fe, codes + start, key,
                           offset + start);
        } else {
            fp8_codes_flat(e5m2, sr, 1, x + start, glen, fe, fe, codes + start, key,
                           offset + start);
        }
    }
}

/* One compiled function per MX format and rounding (see the fp8 wrappers). */
#define GC_MX_ENCODER(name, fmt, sr)                                                          \
    GC_CLONES static void name(int rceil, const float *x, size_t n, uint8_t *s, uint8_t *c,  \
                               gc_u64 key, gc_u64 off)                                       \
    {                                                                                        \
        encode_mx(fmt, sr, rceil, x, n, s, c, key, off);                                     \
    }
GC_MX_ENCODER(encode_mxfp8_e4m3, GC_MXFP8_E4M3, 0)
GC_MX_ENCODER(encode_mxfp8_e5m2, GC_MXFP8_E5M2, 0)
GC_MX_ENCODER(encode_mxfp4, GC_MXFP4, 0)
GC_MX_ENCODER(encode_mxfp8_e4m3_sr, GC_MXFP8_E4M3, 1)
GC_MX_ENCODER(encode_mxfp8_e5m2_sr, GC_MXFP8_E5M2, 1)
GC_MX_ENCODER(encode_mxfp4_sr, GC_MXFP4, 1)

static inline void decode_mx_block(int fmt, int accumulate, const uint8_t *restrict cb,
                                   size_t len, float scale, float *restrict ob)
{
    if (fmt == GC_MXFP4 && len == GC_MX_BLOCK) {
        /* two literal 16-value halves: gcc vectorizes those like NVFP4's
         * blocks (a 32-value loop ran at half the speed) */
        e2m1_block_values(cb, 16, scale, accumulate, ob);
        e2m1_block_values(cb + 8, 16, scale, accumulate, ob + 16);
    } else if (fmt == GC_MXFP4) {
        e2m1_block_values(cb, len, scale, accumulate, ob);
    } else {
        fp8_block_values(fmt == GC_MXFP8_E5M2, accumulate, cb, len, scale, ob);
    }
}

GC_INLINE void decode_mx(int fmt, int accumulate, const uint8_t *restrict scales,
                         const uint8_t *restrict codes, size_t n, float *restrict out)
{
    size_t nblocks = ceil_div(n, GC_MX_BLOCK);
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * GC_MX_BLOCK;
        size_t len = n - start < GC_MX_BLOCK ? n - start : GC_MX_BLOCK;
        const uint8_t *cb = codes + (fmt == GC_MXFP4 ? start / 2 : start);
        float scale = gc_e8m0_value(scales[k]);
        if (len == GC_MX_BLOCK)
            decode_mx_block(fmt, accumulate, cb, GC_MX_BLOCK, scale, out + start);
        else
            decode_mx_block(fmt, accumulate, cb, len, scale, out + start);
    }
}

#define GC_MX_DECODER(name, fmt)                                                             \
    GC_CLONES static void name(int acc, const uint8_t *s, const uint8_t *c, size_t n, float *o) \
    {                                                                                          \
        decode_mx(fmt, acc, s, c, n, o);                                                       \
    }
GC_MX_DECODER(decode_mxfp8_e4m3, GC_MXFP8_E4M3)
GC_MX_DECODER(decode_mxfp8_e5m2, GC_MXFP8_E5M2)
GC_MX_DECODER(decode_mxfp4, GC_MXFP4)

/* ---- BF16 --------------------------------------------------------------- */

GC_INLINE void encode_bf16(int sr, const float *x, size_t n, uint8_t *wire, gc_u64 key,
                               gc_u64 offset)
{
    for (size_t i = 0; i < n; i++) {
        gc_u16 c = gc_bf16_code(x[i], sr, gc_rnd_at(sr, key, offset + i));
        memcpy(wire + 2 * i, &c, sizeof c);
    }
}

GC_CLONES static void encode_bf16_rn(const float *x, size_t n, uint8_t *w, gc_u64 key, gc_u64 off)
{
    encode_bf16(0, x, n, w, key, off);
}
GC_CLONES static void encode_bf16_sr(const float *x, size_t n, uint8_t *w, gc_u64 key, gc_u64 off)
{
    encode_bf16(1, x, n, w, key, off);
}

GC_CLONES static void decode_bf16(int accumulate, const uint8_t *wire, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++) {
        gc_u16 c;
        memcpy(&c, wire + 2 * i, sizeof c);
        float v = gc_bf16_value(c);
        out[i] = accumulate ? add_as_gpu(out[i], v) : v;
    }
}

/* ---- AVX-512 loops ------------------------------------------------------
 *
 * Round-to-nearest encoders and every decoder, written with AVX-512
 * intrinsics for x86-64 CPUs that have AVX-512 F/BW/DQ/VL (gc_codec_simd
 * picks them at run time). Each vector operation is the one gc_scalar.h
 * applies to a single value (the same IEEE fp32 operations in the same
 * order, integer steps exactly), so the bytes and values equal those of the
 * portable loops above; test_native.c and tests/codecs compare both paths
 * on random and special inputs. Blocks these loops do not cover (partial
 * blocks and groups, fp8 blocks other than 128 values on encode, blocks
 * with a tiny amax) run the portable per-block code. Decoders of outputs
 * from GC_STREAM_BYTES up write them with non-temporal stores (whole 64-byte
 * lines), which spares reading the lines in first; smaller outputs stay in
 * the cache for whatever reads them next. Decode+accumulate reads every line
 * of out anyway, so it stores normally (streaming them measured slower). */
#if GC_HAVE_AVX512
#include <immintrin.h>

#define GC_AVX512_FLAT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"), flatten))

/* Encoders read a group's values twice (amaxes, codes), the second time
 * from L1; meanwhile they ask for the values this many floats ahead, a few
 * lines per block as they go (a burst of a whole group's lines at once kept
 * fewer of them in flight). Decode+accumulate asks for out GC_PREFETCH_ACC
 * floats ahead. */
#ifndef GC_PREFETCH_AHEAD
#define GC_PREFETCH_AHEAD 4096
#endif
#ifndef GC_PREFETCH_ACC
#define GC_PREFETCH_ACC 4096
#endif


/* Ask for the cache lines of x[GC_PREFETCH_AHEAD + i], i in [0, len) (len
 * a multiple of 16), where that lies before x[left]. Forced inline: gcc
 * split the loop out of line, found it free of side effects and dropped the
 * calls. */
GC_AVX512 __attribute__((always_inline)) static inline void v_prefetch(const float *x, size_t len,
                                                                     size_t left)
{
    if (left >= GC_PREFETCH_AHEAD + len)
        for (size_t i = 0; i < len; i += 16)
            _mm_prefetch((const char *)(x + GC_PREFETCH_AHEAD + i), _MM_HINT_T0);
}

/* Lane j: the unsigned max of the 16 lanes of v[j]. A transpose by halves:
 * each step maxes two vectors' halves into one (3 operations), 45 in all;
 * lane 4 L + s then holds block L + 4 s, which one permute puts in order. */
GC_AVX512 static inline __m512i v_hmax16(__m512i *v)
{
    for (int i = 0; i < 8; i++)
        v[i] = _mm512_max_epu32(_mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0x44),
                                _mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)
        v[i] = _mm512_max_epu32(_mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0x88),
                                _mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_max_epu32(_mm512_unpacklo_epi64(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi64(v[2 * i], v[2 * i + 1]));
    __m512 a = _mm512_castsi512_ps(v[0]), b = _mm512_castsi512_ps(v[1]);
    __m512i m = _mm512_max_epu32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)),
                                 _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xdd)));
    return _mm512_permutexvar_epi32(
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), m);
}

/* The max |x| bit patterns (raw_amax_bits: non-finite values included) of
 * the 16 blocks of blen values (a multiple of 16) at x, lane j block j. */
GC_AVX512 static inline __m512i v_blocks_amax(const float *x, size_t blen)
{
    __m512i part[16];
    for (size_t j = 0; j < 16; j++) {
        __m512i m = _mm512_setzero_si512();
        for (size_t i = 0; i < blen; i += 16)
            m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + j * blen + i)),
                                                     v_u32(0x7fffffffu)));
        part[j] = m;
    }
    return v_hmax16(part);
}

/* gc_round_minifloat of 16 values r (finite, >= 0, clamped), with the fp32
 * adder: for r in [2^E, 2^(E + 1)), E at least the format's smallest normal
 * exponent E0 (subnormals: E = E0), r + 2^(E + 23 - MBITS) rounds r to
 * nearest even on the format's quantum 2^(E - MBITS) at that exponent, and
 * the difference of the bit patterns counts quanta (2^MBITS .. 2^(MBITS + 1)
 * for normals, below 2^MBITS for subnormals); the code adds the exponent
 * part (E - E0) 2^MBITS. Both are exact, so this is gc_round_minifloat's
 * round-to-nearest-even, subnormals included, with no select. */
GC_AVX512 static inline __m512i v_round_minifloat(__m512 r, int mbits, int bias)
{
    const gc_u32 e0 = (gc_u32)(128 - bias) << 23, shift = (gc_u32)(23 - mbits);
    __m512i e = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(r), v_u32(0x7f800000u)),
                                 v_u32(e0));
    __m512i magic = _mm512_add_epi32(e, v_u32(shift << 23));
    /* (s - magic) + (e - e0) >> shift, with the constant e0 >> shift folded in */
    __m512i base = _mm512_add_epi32(magic, v_u32(e0 >> shift));
    __m512i s = _mm512_castps_si512(_mm512_add_ps(r, _mm512_castsi512_ps(magic)));
    return _mm512_add_epi32(_mm512_sub_epi32(s, base), _mm512_srli_epi32(e, shift));
}

/* gc_min_abs: min(|q|, fmax), fmax for NaN q (minps returns its second
 * operand when the first is NaN, as `a < fmax ? a : fmax` does). */
GC_AVX512 static inline __m512 v_min_abs(__m512 q, float fmax)
{
    return _mm512_min_ps(_mm512_abs_ps(q), _mm512_set1_ps(fmax));
}

/* sign | mag: the sign bit of x moved to bit 7 (or `at`), or'ed into mag. */
GC_AVX512 static inline __m512i v_signed(__m512i xb, unsigned shift, gc_u32 bit, __m512i mag)
{
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(xb, shift), v_u32(bit), mag, 0xea);
}

/* The magnitude part of gc_e4m3_code / gc_e5m2_code of 16 finite q >= 0. */
GC_AVX512 static inline __m512i v_fp8_mag(int e5m2, __m512 q)
{
    return e5m2 ? v_round_minifloat(_mm512_min_ps(q, _mm512_set1_ps(GC_E5M2_MAX)), 2, 15)
                : v_round_minifloat(_mm512_min_ps(q, _mm512_set1_ps(GC_E4M3_MAX)), 3, 7);
}

/* gc_e2m1_code of 16 values q, as dwords. */
GC_AVX512 static inline __m512i v_e2m1_code(__m512 q)
{
    return v_signed(_mm512_castps_si512(q), 28, 0x8u,
                    v_round_minifloat(v_min_abs(q, GC_E2M1_MAX), 1, 1));
}

/* The 64 dwords of v[0 .. 4) (each 0 .. 255) as bytes, in the 128-bit lane
 * order of the saturating packs: dword 4 L + k holds v[k]'s dwords 4 L ..
 * 4 L + 3. Three packs instead of four two-uop truncations. */
GC_AVX512 static inline __m512i v_pack4(const __m512i *v)
{
    return _mm512_packus_epi16(_mm512_packus_epi32(v[0], v[1]), _mm512_packus_epi32(v[2], v[3]));
}

/* Bytes of v_pack4's order, bit 7 set where the fp32 bit patterns x[0 .. 4)
 * are negative (signed saturation keeps the sign: finite positive values
 * become at most 0x7f). */
GC_AVX512 static inline __m512i v_pack4_signs(const __m512i *x)
{
    return _mm512_packs_epi16(_mm512_packs_epi32(x[0], x[1]), _mm512_packs_epi32(x[2], x[3]));
}

/* v_pack4's lane order back to element order (dword 4 k + L takes 4 L + k). */
GC_AVX512 static inline __m512i v_unlane(__m512i p)
{
    return _mm512_permutexvar_epi32(
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), p);
}

/* The 64 bytes of fp8 codes of 64 finite values x[0 .. 4) from their
 * magnitude codes mag[0 .. 4) (the sign joins after packing). */
GC_AVX512 static inline __m512i v_fp8_bytes(const __m512i *mag, const __m512i *x)
{
    return v_unlane(_mm512_ternarylogic_epi32(v_pack4_signs(x), _mm512_set1_epi8((char)0x80),
                                              v_pack4(mag), 0xea));
}

/* The 64 packed bytes of 128 E2M1 codes c[0 .. 8) (dwords below 16): packed
 * to bytes (v_pack4), each byte pair joined as lo + 16 hi (maddubs: at most
 * 255), packed again; the words then hold, in lane order, 2 bytes of each
 * vector per lane (word 8 L + k: vector k, lane L), put back in order. */
GC_AVX512 static inline __m512i v_nibbles8(const __m512i *c)
{
    const __m512i pair = _mm512_set1_epi16(0x1001);
    __m512i lo = _mm512_maddubs_epi16(v_pack4(c), pair);
    __m512i hi = _mm512_maddubs_epi16(v_pack4(c + 4), pair);
    return _mm512_permutexvar_epi16(
        _mm512_set_epi16(31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4,
                         27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0),
        _mm512_packus_epi16(lo, hi));
}


/* gc_e2m1_table[c] of the 16 codes packed in 8 bytes (element 2i low). */
GC_AVX512 static inline __m512 v_e2m1_values(const uint8_t *cb, __m512 table)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)cb);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    return _mm512_permutexvar_ps(idx, table);
}

/* The decoders' sink (gc_simd.h): outputs from GC_STREAM_BYTES up stream,
 * unless accumulated. */
GC_AVX512 static inline gc_sink sink_open(float *out, size_t n, int accumulate)
{
    return sink_open_as(out, n * sizeof(float) >= GC_STREAM_BYTES && !accumulate);
}

/* add_as_gpu of 16 lanes. */
GC_AVX512 static inline __m512 v_add_as_gpu(__m512 a, __m512 b)
{
    return v_gpu_nans(_mm512_add_ps(a, b));
}

/* Vector m's values, stored or added to out (read before the sink writes). */
GC_AVX512 static inline void sink_value(gc_sink *s, size_t m, int accumulate, __m512 v)
{
    if (accumulate) {
        GC_PREFETCH(s->out, (16 * m + GC_PREFETCH_ACC) * sizeof(float));
        v = v_add_as_gpu(_mm512_loadu_ps(s->out + 16 * m), v);
    }
    sink_put(s, m, v);
}

/* ---- AVX-512 FP8 ---- */

/* Block-128 encoder, group by group as encode_fp8_128 (GC_FP8_GROUP = 16
 * blocks, one vector of amaxes): scales and factors of the 16 blocks in
 * vector divisions, then the codes of each block with its factor (all
 * values finite: the codes need no non-finite case). A group holding a
 * non-finite value or a block with a tiny amax (gc_quant_factor's pre), and
 * the values after the last whole group, go through encode_fp8_128. */
GC_AVX512 static inline void encode_fp8_128_v(int e5m2, const float *restrict x, size_t n,
                                              uint8_t *restrict scales, uint8_t *restrict codes)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    const size_t glen = GC_FP8_GROUP * 128;
    const __m512 vfmax = _mm512_set1_ps(fmax);
    size_t full = n / glen;
#if GC_FP8_GROUP != 16
#error "the AVX-512 fp8 encoder takes the amaxes of 16 blocks at once"
#endif
    for (size_t g = 0; g < full; g++) {
        const float *xg = x + g * glen;
        uint8_t *sg = scales + 4 * GC_FP8_GROUP * g, *cg = codes + glen * g;
        __m512i am = v_blocks_amax(xg, 128);
        __m512 a = _mm512_castsi512_ps(am);
        if (_mm512_cmpge_epu32_mask(am, v_u32(0x7f800000u))
            || _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ)) {
            encode_fp8_128(e5m2, 0, xg, glen, sg, cg, 0, 0);
            continue;
        }
        /* gc_quant_factor with pre 1 (amax * 1 is amax), and the scales */
        float factor[16];
        _mm512_storeu_ps(factor, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(),
                                                                        _CMP_GT_OQ),
                                                     vfmax, a));
        _mm512_storeu_ps((float *)(void *)sg, _mm512_div_ps(a, vfmax));
        for (size_t j = 0; j < 16; j++) {
            __m512 f = _mm512_set1_ps(factor[j]);
            v_prefetch(xg + 128 * j, 128, n - g * glen - 128 * j);
            for (size_t i = 0; i < 128; i += 64) {
                __m512i xb[4], mag[4];
                for (int t = 0; t < 4; t++) {
                    __m512 v = _mm512_loadu_ps(xg + 128 * j + i + 16 * t);
                    xb[t] = _mm512_castps_si512(v);
                    mag[t] = v_fp8_mag(e5m2, _mm512_mul_ps(_mm512_abs_ps(v), f));
                }
                _mm512_storeu_si512((void *)(cg + 128 * j + i), v_fp8_bytes(mag, xb));
            }
        }
    }
    if (full * glen < n)
        encode_fp8_128(e5m2, 0, x + full * glen, n - full * glen, scales + 4 * GC_FP8_GROUP * full,
                       codes + glen * full, 0, 0);
}

/* fp8 decoder for blocks of a multiple of 16 values. */
GC_AVX512 static inline void decode_fp8_v(int e5m2, int accumulate, const uint8_t *restrict scales,
                                          const uint8_t *restrict codes, size_t n, size_t block,
                                          float *restrict out)
{
    gc_sink s = sink_open(out, n, accumulate);
    size_t nvec = n / 16, per = block / 16;
    for (size_t m0 = 0; m0 < nvec; m0 += per) {
        __m512 scale = _mm512_set1_ps(load_f32(scales + 4 * (m0 / per)));
        size_t end = m0 + per < nvec ? m0 + per : nvec;
        for (size_t m = m0; m < end; m++) {
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(codes + 16 * m)));
            sink_value(&s, m, accumulate, _mm512_mul_ps(v_fp8_value(e5m2, c), scale));
        }
    }
    sink_close(&s, nvec);
    if (n % 16)
        fp8_block_values(e5m2, accumulate, codes + 16 * nvec, n % 16,
                         load_f32(scales + 4 * (16 * nvec / block)), out + 16 * nvec);
}

/* ---- AVX-512 E2M1 (NVFP4, MXFP4) ---- */

/* One whole NVFP4 superblock: the block amaxes 16 blocks at a time (a
 * superblock holding a non-finite value goes to encode_nvfp4_super), the
 * scales as encode_nvfp4_super computes them, then each 16-value block's
 * codes from one vector, with its group's choice of x * factor or
 * (x * pre) * factor (encode_nvfp4_super's unit). */
GC_AVX512 static inline void encode_nvfp4_super_v(const float *restrict x, size_t left,
                                                  uint8_t *sscale, uint8_t *restrict bscales,
                                                  uint8_t *restrict codes)
{
    const float smax = GC_E2M1_MAX * GC_E4M3_MAX;
    gc_u32 bamax[GC_NVFP4_BLOCKS];
    float pre[GC_NVFP4_BLOCKS], factor[GC_NVFP4_BLOCKS];
    __m512i top = _mm512_setzero_si512();
    for (size_t j = 0; j < GC_NVFP4_BLOCKS; j += 16) {
        __m512i am = v_blocks_amax(x + GC_NVFP4_BLOCK * j, GC_NVFP4_BLOCK);
        top = _mm512_max_epu32(top, am);
        _mm512_storeu_si512((void *)(bamax + j), am);
    }
    gc_u32 m = (gc_u32)_mm512_reduce_max_epu32(top);
    if (m >= 0x7f800000u) { /* a non-finite value: the portable loops */
        encode_nvfp4_super(0, x, GC_NVFP4_SUPERBLOCK, sscale, bscales, codes, 0, 0);
        return;
    }
    float samax = gc_float(m), spre;
    float sfactor = gc_quant_factor(samax, smax, &spre);
    float scale = samax / smax;
    store_f32(sscale, scale);
    /* gc_nvfp4_scale_code (finite blocks, nearest: the E4M3 code of a
     * non-negative s) and gc_quant_factor of its value, 16 blocks at once */
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (size_t j = 0; j < GC_NVFP4_BLOCKS; j += 16) {
        __m512 ba = _mm512_loadu_ps((const float *)(const void *)(bamax + j));
        __m512 sv = _mm512_mul_ps(_mm512_mul_ps(_mm512_div_ps(ba, _mm512_set1_ps(GC_E2M1_MAX)),
                                                _mm512_set1_ps(spre)),
                                  _mm512_set1_ps(sfactor));
        __m512i sc = v_round_minifloat(v_min_abs(sv, GC_E4M3_MAX), 3, 7);
        _mm_storeu_si128((__m128i *)(void *)(bscales + j), _mm512_cvtepi32_epi8(sc));
        __m512 val = _mm512_mul_ps(v_fp8_value(0, sc), _mm512_set1_ps(scale));
        __mmask16 kept = _mm512_cmp_ps_mask(val, zero, _CMP_GT_OQ); /* gc_nvfp4_keeps_codes */
        __m512 p = _mm512_mask_blend_ps(
            kept & _mm512_cmp_ps_mask(val, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ), one,
            _mm512_set1_ps(0x1p64f));
        _mm512_storeu_ps(pre + j, p);
        __m512 inverse = _mm512_div_ps(one, _mm512_mul_ps(val, p));
        _mm512_storeu_ps(factor + j, _mm512_mask_blend_ps(kept, zero, inverse));
    }
    for (size_t g = 0; g < GC_NVFP4_BLOCKS; g += GC_NVFP4_GROUP) {
        int unit = 1;
        for (size_t j = g; j < g + GC_NVFP4_GROUP; j++)
            unit &= pre[j] == 1.0f;
        for (size_t j = g; j < g + GC_NVFP4_GROUP; j += 8) {
            __m512i c[8];
            v_prefetch(x + GC_NVFP4_BLOCK * j, 8 * GC_NVFP4_BLOCK, left - GC_NVFP4_BLOCK * j);
            for (size_t t = 0; t < 8; t++) {
                __m512 v = _mm512_loadu_ps(x + GC_NVFP4_BLOCK * (j + t));
                if (!unit)
                    v = _mm512_mul_ps(v, _mm512_set1_ps(pre[j + t]));
                /* factor > 0 exactly where the block keeps its codes; the
                 * others get q = +0, code 0 */
                __mmask16 keep = factor[j + t] > 0.0f ? 0xffff : 0;
                c[t] = v_e2m1_code(_mm512_maskz_mul_ps(keep, v, _mm512_set1_ps(factor[j + t])));
            }
            _mm512_storeu_si512((void *)(codes + GC_NVFP4_BLOCK / 2 * j), v_nibbles8(c));
        }
    }
}

GC_AVX512 static inline void encode_nvfp4_v(const float *x, size_t n, uint8_t *sscales,
                                            uint8_t *bscales, uint8_t *codes)
{
    size_t full = n / GC_NVFP4_SUPERBLOCK;
    for (size_t k = 0; k < full; k++) {
        encode_nvfp4_super_v(x + k * GC_NVFP4_SUPERBLOCK, n - k * GC_NVFP4_SUPERBLOCK,
                             sscales + 4 * k,
                             bscales + k * GC_NVFP4_BLOCKS, codes + k * GC_NVFP4_SUPERBLOCK / 2);
    }
    size_t start = full * GC_NVFP4_SUPERBLOCK, rest = n % GC_NVFP4_SUPERBLOCK;
    if (rest)
        encode_nvfp4_super(0, x + start, rest, sscales + 4 * full,
                           bscales + full * GC_NVFP4_BLOCKS, codes + start / 2, 0, 0);
}

GC_AVX512 static inline void decode_nvfp4_v(int accumulate, const uint8_t *sscales,
                                            const uint8_t *bscales, const uint8_t *codes,
                                            size_t n, float *restrict out)
{
    __m512 table = _mm512_loadu_ps(gc_e2m1_table);
    gc_sink s = sink_open(out, n, accumulate);
    size_t nvec = n / 16;
    for (size_t m0 = 0; m0 < nvec; m0 += GC_NVFP4_BLOCKS) {
        float scale = load_f32(sscales + 4 * (m0 / GC_NVFP4_BLOCKS));
        size_t end = m0 + GC_NVFP4_BLOCKS < nvec ? m0 + GC_NVFP4_BLOCKS : nvec;
        for (size_t m = m0; m < end; m++) {
            __m512 eff = _mm512_set1_ps(gc_e4m3_value(bscales[m]) * scale);
            sink_value(&s, m, accumulate, _mm512_mul_ps(v_e2m1_values(codes + 8 * m, table), eff));
        }
    }
    sink_close(&s, nvec);
    if (n % 16)
        e2m1_block_values(codes + 8 * nvec, n % 16,
                          gc_e4m3_value(bscales[nvec]) *
                              load_f32(sscales + 4 * (nvec / GC_NVFP4_BLOCKS)),
                          accumulate, out + 16 * nvec);
}

/* ---- AVX-512 MX ---- */

/* gc_mx_exponent of 16 finite amaxes. */
GC_AVX512 static inline __m512i v_mx_exponent(__m512 amax, int emax, float fmax, int rceil)
{
    __mmask16 sub = _mm512_cmp_ps_mask(amax, _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ);
    __m512i b = _mm512_castps_si512(_mm512_mask_mul_ps(amax, sub, amax, _mm512_set1_ps(0x1p32f)));
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(127 + emax));
    e = _mm512_mask_sub_epi32(e, sub, e, _mm512_set1_epi32(32));
    if (rceil)
        e = _mm512_mask_add_epi32(e,
                                  _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, v_u32(0x007fffffu)),
                                                          v_u32(gc_bits(fmax) & 0x007fffffu)),
                                  e, _mm512_set1_epi32(1));
    e = _mm512_mask_mov_epi32(_mm512_set1_epi32(-127),
                              _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), e);
    e = _mm512_min_epi32(e, _mm512_set1_epi32(127 - emax));
    return _mm512_max_epi32(e, _mm512_set1_epi32(-127));
}

/* Whole groups of GC_MX_GROUP blocks as encode_mx does them: the amaxes,
 * E8M0 scales and factors 16 blocks at a time, then the codes, 64 bytes at
 * a time (two MXFP8 blocks, four MXFP4 ones). A group holding a non-finite
 * value, and the values after the last whole group, go through encode_mx. */
GC_AVX512 static inline void encode_mx_v(int fmt, int rceil, const float *restrict x, size_t n,
                                         uint8_t *restrict scales, uint8_t *restrict codes)
{
    const int e5m2 = fmt == GC_MXFP8_E5M2;
    const int emax = fmt == GC_MXFP4 ? 2 : e5m2 ? 15 : 8;
    const float fmax = fmt == GC_MXFP4 ? GC_E2M1_MAX : e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    const size_t glen = GC_MX_GROUP * GC_MX_BLOCK;
    const size_t bytes = fmt == GC_MXFP4 ? GC_MX_BLOCK / 2 : GC_MX_BLOCK; /* per block */
#if GC_MX_GROUP != 32
#error "the AVX-512 MX encoder takes the amaxes of 2 x 16 blocks"
#endif
    size_t full = n / glen;
    for (size_t g = 0; g < full; g++) {
        const float *xg = x + g * glen;
        uint8_t *sg = scales + GC_MX_GROUP * g, *cg = codes + bytes * GC_MX_GROUP * g;
        __m512i am[2] = {v_blocks_amax(xg, GC_MX_BLOCK),
                         v_blocks_amax(xg + 16 * GC_MX_BLOCK, GC_MX_BLOCK)};
        if (_mm512_cmpge_epu32_mask(_mm512_max_epu32(am[0], am[1]), v_u32(0x7f800000u))) {
            encode_mx(fmt, 0, rceil, xg, glen, sg, cg, 0, 0);
            continue;
        }
        float factor[GC_MX_GROUP];
        for (int h = 0; h < 2; h++) {
            __m512i e = v_mx_exponent(_mm512_castsi512_ps(am[h]), emax, fmax, rceil);
            _mm512_storeu_si512((void *)(factor + 16 * h),
                                _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), e), 23));
            _mm_storeu_si128((__m128i *)(void *)(sg + 16 * h),
                             _mm512_cvtepi32_epi8(_mm512_add_epi32(e, _mm512_set1_epi32(127))));
        }
        for (size_t j = 0; j < GC_MX_GROUP; j += 64 / bytes) {
            __m512i c[8], xb[4];
            v_prefetch(xg + GC_MX_BLOCK * j, 64 / bytes * GC_MX_BLOCK,
                       n - g * glen - GC_MX_BLOCK * j);
            for (size_t t = 0; t < 64 / bytes * 2; t++) {
                __m512 f = _mm512_set1_ps(factor[j + t / 2]);
                __m512 v = _mm512_loadu_ps(xg + GC_MX_BLOCK * j + 16 * t);
                if (fmt == GC_MXFP4) {
                    c[t] = v_e2m1_code(_mm512_mul_ps(v, f));
                } else {
                    xb[t] = _mm512_castps_si512(v);
                    c[t] = v_fp8_mag(e5m2, _mm512_mul_ps(_mm512_abs_ps(v), f));
                }
            }
            _mm512_storeu_si512((void *)(cg + bytes * j),
                                fmt == GC_MXFP4 ? v_nibbles8(c) : v_fp8_bytes(c, xb));
        }
    }
    if (full * glen < n)
        encode_mx(fmt, 0, rceil, x + full * glen, n - full * glen, scales + GC_MX_GROUP * full,
                  codes + bytes * GC_MX_GROUP * full, 0, 0);
}

/* gc_e8m0_value of 16 scale codes. */
GC_AVX512 static inline __m512 v_e8m0_value(__m128i b)
{
    __m512i c = _mm512_cvtepu8_epi32(b);
    __m512i v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()),
                                        _mm512_slli_epi32(c, 23), v_u32(0x00400000u));
    v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(c, v_u32(0xffu)), v, v_u32(0x7fc00000u));
    return _mm512_castsi512_ps(v);
}

/* The values of one MX block's 32 codes at cb, vectors 0 and 1. */
GC_AVX512 static inline void v_mx_values(int fmt, const uint8_t *cb, __m512 table, __m512 *v)
{
    if (fmt == GC_MXFP4) {
        v[0] = v_e2m1_values(cb, table);
        v[1] = v_e2m1_values(cb + 8, table);
    } else {
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)cb);
        v[0] = v_fp8_value(fmt == GC_MXFP8_E5M2, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)));
        v[1] = v_fp8_value(fmt == GC_MXFP8_E5M2,
                           _mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)));
    }
}

/* fmt a constant (one loop per format): 16 blocks at a time, their E8M0
 * scales decoded in one vector and each broadcast from L1; the blocks after
 * the last 16 go through decode_mx_block. */
GC_AVX512 static inline void decode_mx_v(int fmt, int accumulate, const uint8_t *scales,
                                         const uint8_t *codes, size_t n, float *restrict out)
{
    const size_t bytes = fmt == GC_MXFP4 ? GC_MX_BLOCK / 2 : GC_MX_BLOCK;
    __m512 table = _mm512_loadu_ps(gc_e2m1_table);
    gc_sink s = sink_open(out, n, accumulate);
    size_t groups = n / (16 * GC_MX_BLOCK);
    for (size_t g = 0; g < groups; g++) {
        float sc[16];
        _mm512_storeu_ps(sc, v_e8m0_value(_mm_loadu_si128(
                                 (const __m128i *)(const void *)(scales + 16 * g))));
        for (size_t j = 0; j < 16; j++) {
            size_t k = 16 * g + j;
            __m512 scale = _mm512_set1_ps(sc[j]), v[2];
            v_mx_values(fmt, codes + bytes * k, table, v);
            sink_value(&s, 2 * k, accumulate, _mm512_mul_ps(v[0], scale));
            sink_value(&s, 2 * k + 1, accumulate, _mm512_mul_ps(v[1], scale));
        }
    }
    sink_close(&s, 32 * groups);
    for (size_t k = 16 * groups; k < ceil_div(n, GC_MX_BLOCK); k++) {
        size_t start = k * GC_MX_BLOCK;
        size_t len = n - start < GC_MX_BLOCK ? n - start : GC_MX_BLOCK;
        decode_mx_block(fmt, accumulate, codes + bytes * k, len, gc_e8m0_value(scales[k]),
                        out + start);
    }
}

/* ---- AVX-512 BF16 ---- */

/* gc_bf16_code of 16 values, as dwords (finite values past the largest bfloat16
 * saturate to it). */
GC_AVX512 static inline __m512i v_bf16_code(__m512 v)
{
    __m512i b = _mm512_castps_si512(v), hi = _mm512_srli_epi32(b, 16);
    __m512i lsb = _mm512_and_si512(hi, v_u32(1));
    __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, v_u32(0x7fffu)), lsb), 16);
    __mmask16 finite =
        _mm512_cmplt_epi32_mask(_mm512_and_si512(b, v_u32(0x7fffffffu)), v_u32(0x7f800000u));
    __mmask16 over =
        finite & _mm512_cmpeq_epi32_mask(_mm512_and_si512(rounded, v_u32(0x7fffu)),
                                         v_u32(0x7f80u));
    __m512i top = _mm512_ternarylogic_epi32(hi, v_u32(0x8000u), v_u32(0x7f7fu), 0xea);
    rounded = _mm512_mask_blend_epi32(over, rounded, top);
    __m512i nan = _mm512_ternarylogic_epi32(hi, v_u32(0x8000u), v_u32(0x7fc0u), 0xea);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, nan);
}

/* 32 values at a time: one saturating pack (the codes fit 16 bits) and a
 * permute of its lane order, the input prefetched as the encoders above.
 * The 64 code bytes go through a sink, as 16 floats: a large output is
 * streamed (its 2 bytes a value are half the traffic of a copy's writes). */
GC_AVX512 static inline void encode_bf16_v(const float *restrict x, size_t n, uint8_t *restrict wire)
{
    const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    size_t vecs = n / 32;
    gc_sink s = sink_open((float *)(void *)wire, 16 * vecs, 0);
    for (size_t m = 0; m < vecs; m++) {
        v_prefetch(x + 32 * m, 32, n - 32 * m);
        __m512i c = _mm512_packus_epi32(v_bf16_code(_mm512_loadu_ps(x + 32 * m)),
                                        v_bf16_code(_mm512_loadu_ps(x + 32 * m + 16)));
        sink_put(&s, m, _mm512_castsi512_ps(_mm512_permutexvar_epi64(order, c)));
    }
    sink_close(&s, vecs);
    encode_bf16(0, x + 32 * vecs, n % 32, wire + 64 * vecs, 0, 0);
}

GC_AVX512 static inline void decode_bf16_v(int accumulate, const uint8_t *restrict wire, size_t n,
                                           float *restrict out)
{
    gc_sink s = sink_open(out, n, accumulate);
    size_t nvec = n / 16;
    for (size_t m = 0; m < nvec; m++) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(wire + 32 * m));
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16));
        sink_value(&s, m, accumulate, v);
    }
    sink_close(&s, nvec);
    size_t start = 16 * nvec;
    for (size_t i = start; i < n; i++) {
        gc_u16 c;
        memcpy(&c, wire + 2 * i, sizeof c);
        float v = gc_bf16_value(c);
        out[i] = accumulate ? add_as_gpu(out[i], v) : v;
    }
}
#endif /* GC_HAVE_AVX512 */


/* ---- dispatch ----------------------------------------------------------- */

/* The vector path in use (gc_codec_simd): -1 until first asked. */
static int gc_simd = -1;
/* Threads per call (gc_codec_threads). */
static int gc_threads = 1;

static int simd_supported(void)
{
#if GC_HAVE_AVX512
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

int gc_codec_simd(int level)
{
    if (level >= 0)
        __atomic_store_n(&gc_simd, level > 0 && simd_supported() ? 1 : 0, __ATOMIC_RELAXED);
    else if (level == GC_SIMD_AUTO || __atomic_load_n(&gc_simd, __ATOMIC_RELAXED) < 0)
        __atomic_store_n(&gc_simd, simd_supported(), __ATOMIC_RELAXED);
    return __atomic_load_n(&gc_simd, __ATOMIC_RELAXED);
}

int gc_codec_threads(int count)
{
    if (count > 0)
        __atomic_store_n(&gc_threads, count > GC_MAX_THREADS ? GC_MAX_THREADS : count,
                         __ATOMIC_RELAXED);
    return __atomic_load_n(&gc_threads, __ATOMIC_RELAXED);
}

/* The split map around a call (gc_geo_encode, gc_geo_decode): the call's
 * values are the elements [lo, lo + n) of a matrix of `cols` columns, mapped
 * with gc_geo_expand by coef (the range's rows) and the basis vt (packed). */
typedef struct {
    size_t lo, cols, k;
    const float *coef, *vt, *packed;
} gc_split;

/* One encode or decode call: its arguments, and the range [lo, hi) of
 * values a thread does. */
typedef struct {
    int fmt, decode, accumulate, sr, rceil, simd;
    size_t n, block; /* block: fp8's values per scale (n for one scale) */
    const float *x;
    const float *base; /* gc_decode_onto's base (NULL: a plain or accumulating decode) */
    float *out;
    uint8_t *wire;
    gc_u64 key, offset;
    const gc_split *split; /* NULL: the values as they are */
    float *tile;           /* split calls: this thread's GC_SPLIT_TILE floats */
    size_t lo, hi;
} gc_call;

/* The scale and code sections of value `a` (a whole number of blocks into
 * the body): fp8 and MX scales at *s, NVFP4's superblock scales at *s and
 * block scales at *b, codes at *c. */
static void sections(const gc_call *k, size_t a, uint8_t **s, uint8_t **b, uint8_t **c)
{
    uint8_t *w = k->wire;
    size_t n = k->n;
    *b = NULL;
    switch (k->fmt) {
    case GC_E4M3:
    case GC_E5M2:
        *s = w + 4 * (a / k->block);
        *c = w + 4 * ceil_div(n, k->block) + a;
        return;
    case GC_NVFP4: {
        size_t nsuper = ceil_div(n, GC_NVFP4_SUPERBLOCK);
        *s = w + 4 * (a / GC_NVFP4_SUPERBLOCK);
        *b = w + 4 * nsuper + a / GC_NVFP4_BLOCK;
        *c = w + 4 * nsuper + ceil_div(n, GC_NVFP4_BLOCK) + a / 2;
        return;
    }
    case GC_BF16:
        *s = NULL;
        *c = w + 2 * a;
        return;
    default:
        *s = w + a / GC_MX_BLOCK;
        *c = w + ceil_div(n, GC_MX_BLOCK) + (k->fmt == GC_MXFP4 ? a / 2 : a);
        return;
    }
}

#if GC_HAVE_AVX512
/* The AVX-512 loops, one compiled function per format (flatten: the
 * portable per-block code of their edges inlines with AVX-512 too). */
GC_AVX512_FLAT static void encode_v(const gc_call *k, const float *x, size_t n, uint8_t *s,
                                    uint8_t *b, uint8_t *c)
{
    switch (k->fmt) {
    case GC_E4M3:
        encode_fp8_128_v(0, x, n, s, c);
        return;
    case GC_E5M2:
        encode_fp8_128_v(1, x, n, s, c);
        return;
    case GC_NVFP4:
        encode_nvfp4_v(x, n, s, b, c);
        return;
    case GC_BF16:
        encode_bf16_v(x, n, c);
        return;
    case GC_MXFP8_E4M3:
        encode_mx_v(GC_MXFP8_E4M3, k->rceil, x, n, s, c);
        return;
    case GC_MXFP8_E5M2:
        encode_mx_v(GC_MXFP8_E5M2, k->rceil, x, n, s, c);
        return;
    default:
        encode_mx_v(GC_MXFP4, k->rceil, x, n, s, c);
        return;
    }
}

#define GC_V_DECODER(name, acc)                                                               \
    GC_AVX512_FLAT static void name(int fmt, size_t block, const uint8_t *s, const uint8_t *b, \
                                    const uint8_t *c, size_t n, float *o)                     \
    {                                                                                         \
        switch (fmt) {                                                                        \
        case GC_E4M3:                                                                         \
            decode_fp8_v(0, acc, s, c, n, block, o);                                          \
            return;                                                                           \
        case GC_E5M2:                                                                         \
            decode_fp8_v(1, acc, s, c, n, block, o);                                          \
            return;                                                                           \
        case GC_NVFP4:                                                                        \
            decode_nvfp4_v(acc, s, b, c, n, o);                                               \
            return;                                                                           \
        case GC_BF16:                                                                         \
            decode_bf16_v(acc, c, n, o);                                                      \
            return;                                                                           \
        case GC_MXFP8_E4M3:                                                                   \
            decode_mx_v(GC_MXFP8_E4M3, acc, s, c, n, o);                                      \
            return;                                                                           \
        case GC_MXFP8_E5M2:                                                                   \
            decode_mx_v(GC_MXFP8_E5M2, acc, s, c, n, o);                                      \
            return;                                                                           \
        default:                                                                              \
            decode_mx_v(GC_MXFP4, acc, s, c, n, o);                                           \
            return;                                                                           \
        }                                                                                     \
    }
GC_V_DECODER(decode_v, 0)
GC_V_DECODER(accumulate_v, 1)
#endif

/* Whether the call's values go through the AVX-512 loops: nearest rounding
 * (encode; fp8 with blocks of 128), fp8 blocks of a multiple of 16 values
 * (decode). */
static int vector_call(const gc_call *k)
{
    if (!k->simd)
        return 0;
    int fp8 = k->fmt == GC_E4M3 || k->fmt == GC_E5M2;
    if (k->decode)
        return !fp8 || k->block % 16 == 0;
    return !k->sr && (!fp8 || k->block == 128);
}

/* Encode the values x (those of [lo, hi) of the call's body). */
static void encode_values(const gc_call *k, const float *x, size_t lo, size_t hi)
{
    uint8_t *s, *b, *c;
    sections(k, lo, &s, &b, &c);
    size_t n = hi - lo;
    gc_u64 key = k->key, off = k->offset + lo;
    int sr = k->sr;
#if GC_HAVE_AVX512
    if (vector_call(k)) {
        encode_v(k, x, n, s, b, c);
        return;
    }
#endif
    switch (k->fmt) {
    case GC_E4M3:
        (sr ? encode_e4m3_sr : encode_e4m3)(x, n, k->block, s, c, key, off);
        return;
    case GC_E5M2:
        (sr ? encode_e5m2_sr : encode_e5m2)(x, n, k->block, s, c, key, off);
        return;
    case GC_NVFP4:
        (sr ? encode_nvfp4_sr : encode_nvfp4_rn)(x, n, s, b, c, key, off);
        return;
    case GC_BF16:
        (sr ? encode_bf16_sr : encode_bf16_rn)(x, n, c, key, off);
        return;
    case GC_MXFP8_E4M3:
        (sr ? encode_mxfp8_e4m3_sr : encode_mxfp8_e4m3)(k->rceil, x, n, s, c, key, off);
        return;
    case GC_MXFP8_E5M2:
        (sr ? encode_mxfp8_e5m2_sr : encode_mxfp8_e5m2)(k->rceil, x, n, s, c, key, off);
        return;
    default:
        (sr ? encode_mxfp4_sr : encode_mxfp4)(k->rceil, x, n, s, c, key, off);
        return;
    }
}

/* Decode (or accumulate) the values of [lo, hi) of the call's body into o. */
static void decode_range(const gc_call *k, size_t lo, size_t hi, float *o)
{
    uint8_t *s, *b, *c;
    sections(k, lo, &s, &b, &c);
    size_t n = hi - lo;
    int acc = k->accumulate;
#if GC_HAVE_AVX512
    if (vector_call(k)) {
        (acc ? accumulate_v : decode_v)(k->fmt, k->block, s, b, c, n, o);
        return;
    }
#endif
    switch (k->fmt) {
    case GC_E4M3:
        (acc ? accumulate_e4m3 : decode_e4m3)(s, c, n, k->block, o);
        return;
    case GC_E5M2:
        (acc ? accumulate_e5m2 : decode_e5m2)(s, c, n, k->block, o);
        return;
    case GC_NVFP4:
        decode_nvfp4(acc, s, b, c, n, o);
        return;
    case GC_BF16:
        decode_bf16(acc, c, n, o);
        return;
    case GC_MXFP8_E4M3:
        decode_mxfp8_e4m3(acc, s, c, n, o);
        return;
    case GC_MXFP8_E5M2:
        decode_mxfp8_e5m2(acc, s, c, n, o);
        return;
    default:
        decode_mxfp4(acc, s, c, n, o);
        return;
    }
}

/* Values per thread piece: whole fp8 blocks (groups of GC_FP8_GROUP for
 * block 128), whole NVFP4 superblocks, whole MX groups. */
static size_t split_unit(int fmt, size_t block)
{
    if ((fmt == GC_E4M3 || fmt == GC_E5M2) && block != 128)
        return block;
    return GC_NVFP4_SUPERBLOCK;
}

/* Values per tile of a split call: whole split units (split_unit) of at
 * most this many values when they fit (128 KiB, eight rows of 4096 for the
 * streaming expansion's blocks of eight rows: the tile stays in L2 between
 * the map and the codec). */
#define GC_SPLIT_TILE ((size_t)32768)

/* Values per tile of the split call k (0: its unit does not fit a tile). */
static size_t split_tile(const gc_call *k)
{
    size_t unit = split_unit(k->fmt, k->block);
    return GC_SPLIT_TILE / unit * unit;
}

/* The coefficients of the row that holds the call's value a. */
static const float *split_coef(const gc_split *m, size_t a)
{
    return m->coef + ((m->lo + a) / m->cols - m->lo / m->cols) * m->k;
}

/* The split's expansion of the call's values [a, a + n): gc_geo_expand, or
 * gc_geo_expand_stream when `stream`. */
static int split_expand(const gc_split *m, const float *x, size_t a, size_t n, float sign,
                        float *out, int stream)
{
    return (stream ? gc_geo_expand_stream : gc_geo_expand)(
        x, m->lo + a, n, m->cols, split_coef(m, a), m->vt, m->packed, m->k, sign, out);
}

/* Decode [a, b) of an fp8 body and add coef vt in one pass, the sums written
 * around the cache (gc_geo_decode_fp8_stream); 0 where that does not apply. */
static int split_decode_fp8(const gc_call *k, size_t a, size_t b)
{
    if ((k->fmt != GC_E4M3 && k->fmt != GC_E5M2) || !vector_call(k))
        return 0;
    const gc_split *m = k->split;
    uint8_t *s, *bs, *c;
    sections(k, a, &s, &bs, &c);
    return gc_geo_decode_fp8_stream(k->fmt == GC_E5M2, s, c, k->block, m->lo + a, b - a, m->cols,
                                    split_coef(m, a), m->packed, m->k, 1.0f, k->out + a)
           == 0;
}

/* [lo, hi) tile by tile: encode x - coef vt, or decode and add coef vt (the
 * sums written around the cache when the call's output is large). */
static void split_range(const gc_call *k, size_t lo, size_t hi, size_t tile)
{
    float *buf = k->tile;
    int stream = k->n * sizeof(float) >= GC_STREAM_BYTES;
    for (size_t a = lo; a < hi; a += tile) {
        size_t b = hi - a < tile ? hi : a + tile;
        if (k->decode) {
            if (stream && split_decode_fp8(k, a, b))
                continue;
            decode_range(k, a, b, buf);
            split_expand(k->split, buf, a, b - a, 1.0f, k->out + a, stream);
        } else {
            split_expand(k->split, k->x + a, a, b - a, -1.0f, buf, 0);
            encode_values(k, buf, a, b);
        }
    }
}

/* Values per tile of the vector loop of a decode onto a base (16 KiB, in L1
 * beside its stretch of base; whole units of the call, so a multiple of 16 on
 * the vector path). */
#define GC_ONTO_TILE ((size_t)4096)

#if GC_HAVE_AVX512
/* decode_onto_range's vector loop (a call of the vector path, base apart from
 * out): each tile decoded into a buffer in L1, then added to base vector by
 * vector and written through one sink for the whole range, which streams
 * when it is large (out is never read). Each value is base + its decoded
 * value, one fp32 addition: the bits of the accumulating decode. */
GC_AVX512 static void decode_onto_v(const gc_call *k, size_t lo, size_t hi, size_t tile)
{
    float buf[GC_ONTO_TILE] __attribute__((aligned(64)));
    gc_call plain = *k;
    plain.accumulate = 0;
    size_t n = hi - lo, nvec = n / 16, a = 0;
    const float *base = k->base + lo;
    float *out = k->out + lo;
    gc_sink s = sink_open(out, n, 0);
    for (;;) {
        size_t b = n - a < tile ? n : a + tile;
        decode_range(&plain, lo + a, lo + b, buf);
        for (size_t m = a / 16; m < b / 16; m++)
            sink_put(&s, m, v_add_as_gpu(_mm512_loadu_ps(base + 16 * m),
                                         _mm512_load_ps(buf + 16 * m - a)));
        if (b == n)
            break;
        a = b;
    }
    sink_close(&s, nvec);
    for (size_t i = 16 * nvec; i < n; i++) /* the last tile's values past the last vector */
        out[i] = add_as_gpu(base[i], buf[i - a]);
}
#endif

/* [lo, hi) decoded onto the call's base: the vector loop (decode_onto_v), or
 * tile by tile each tile of base copied into out and the tile's values added
 * to it while it is in cache (accumulate: the bits of the copy and the
 * accumulating decode of the whole range, since each value is added on its
 * own). A unit larger than a tile is a tile of its own. */
static void decode_onto_range(const gc_call *k, size_t lo, size_t hi)
{
    size_t unit = split_unit(k->fmt, k->block);
#if GC_HAVE_AVX512
    if (vector_call(k) && k->base != k->out && unit <= GC_ONTO_TILE) {
        decode_onto_v(k, lo, hi, GC_ONTO_TILE / unit * unit);
        return;
    }
#endif
    size_t tile = GC_SPLIT_TILE > unit ? GC_SPLIT_TILE / unit * unit : unit;
    for (size_t a = lo; a < hi; a += tile) {
        size_t b = hi - a < tile ? hi : a + tile;
        if (k->base != k->out)
            memcpy(k->out + a, k->base + a, (b - a) * sizeof(float));
        decode_range(k, a, b, k->out + a);
    }
}

static void *run_range(void *arg)
{
    const gc_call *k = arg;
    if (k->split)
        split_range(k, k->lo, k->hi, split_tile(k));
    else if (k->base)
        decode_onto_range(k, k->lo, k->hi);
    else if (k->decode)
        decode_range(k, k->lo, k->hi, k->out + k->lo);
    else
        encode_values(k, k->x + k->lo, k->lo, k->hi);
    return NULL;
}

/* Values a thread gets at least: below, a call runs on fewer threads. */
#define GC_THREAD_MIN_VALUES ((size_t)1 << 19)

/* Run the call on up to gc_codec_threads threads, each on a range of whole
 * pieces of `unit` values (so every byte is what one thread writes; the
 * calling thread does the first range). A thread that cannot start leaves
 * its range to the calling thread. */
/* Threads the call k runs on (run_call). */
static size_t call_threads(const gc_call *k, size_t unit)
{
    size_t units = ceil_div(k->n, unit);
    size_t t = (size_t)gc_codec_threads(0);
    size_t most = k->n / GC_THREAD_MIN_VALUES;
    t = t < most ? t : most;
    t = t < units ? t : units;
    return t ? t : 1;
}

static void run_call(gc_call *k, size_t unit)
{
    size_t units = ceil_div(k->n, unit);
    size_t t = call_threads(k, unit);
    if (t <= 1) {
        k->lo = 0;
        k->hi = k->n;
        run_range(k);
        return;
    }
    gc_call part[GC_MAX_THREADS];
    pthread_t tid[GC_MAX_THREADS];
    int started[GC_MAX_THREADS] = {0};
    for (size_t i = 0; i < t; i++) {
        part[i] = *k;
        part[i].tile = k->tile ? k->tile + i * GC_SPLIT_TILE : NULL;
        part[i].lo = units * i / t * unit;
        part[i].hi = i + 1 < t ? units * (i + 1) / t * unit : k->n;
    }
    for (size_t i = 1; i < t; i++)
        started[i] = pthread_create(&tid[i], NULL, run_range, &part[i]) == 0;
    run_range(&part[0]);
    for (size_t i = 1; i < t; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            run_range(&part[i]);
    }
}

/* The encode call of gc_encode_ex's arguments (fmt and flags checked). */
static gc_call encode_call(int fmt, const float *x, size_t n, size_t block, uint8_t *wire,
                           unsigned flags, uint64_t seed, uint64_t stream, uint64_t offset)
{
    gc_call k = {0};
    k.fmt = fmt;
    k.sr = (flags & GC_STOCHASTIC) != 0;
    k.rceil = (flags & GC_RCEIL) != 0;
    k.simd = gc_codec_simd(GC_SIMD_CURRENT);
    k.n = n;
    k.block = fp8_block(n, block);
    k.x = x;
    k.wire = wire;
    k.key = k.sr ? gc_sr_key(seed, stream) : 0;
    k.offset = offset;
    return k;
}

static int flags_ok(int fmt, unsigned flags)
{
    return known_format(fmt) && !(flags & ~(unsigned)(GC_STOCHASTIC | GC_RCEIL))
           && (!(flags & GC_RCEIL) || is_mx(fmt));
}

static GC_NOINLINE int encode_ex(int fmt, const float *x, size_t n, size_t block, uint8_t *wire,
                                 unsigned flags, uint64_t seed, uint64_t stream, uint64_t offset)
{
    if (!flags_ok(fmt, flags))
        return GC_EINVAL;
    if (n == 0)
        return 0;
    gc_call k = encode_call(fmt, x, n, block, wire, flags, seed, stream, offset);
    run_call(&k, split_unit(fmt, k.block));
    return 0;
}

int gc_encode_ex(int fmt, const float *x, size_t n, size_t block, uint8_t *wire, unsigned flags,
                 uint64_t seed, uint64_t stream, uint64_t offset)
{
    int result;
    GC_IEEE(result, encode_ex(fmt, x, n, block, wire, flags, seed, stream, offset));
    return result;
}

int gc_encode(int fmt, const float *x, size_t n, size_t block, uint8_t *wire)
{
    return gc_encode_ex(fmt, x, n, block, wire, 0, 0, 0, 0);
}

/* The decode call of gc_decode's arguments, onto base (NULL: none). */
static GC_NOINLINE int decode_call(int fmt, const uint8_t *wire, size_t n, size_t block,
                                   const float *base, float *out, int accumulate)
{
    if (!known_format(fmt))
        return GC_EINVAL;
    if (n == 0)
        return 0;
    gc_call k = {0};
    k.fmt = fmt;
    k.decode = 1;
    k.accumulate = accumulate != 0;
    k.simd = gc_codec_simd(GC_SIMD_CURRENT);
    k.n = n;
    k.block = fp8_block(n, block);
    k.base = base;
    k.out = out;
    k.wire = (uint8_t *)(uintptr_t)wire; /* read only: decode_range writes to out */
    run_call(&k, split_unit(fmt, k.block));
    return 0;
}

int gc_decode(int fmt, const uint8_t *wire, size_t n, size_t block, float *out, int accumulate)
{
    int result;
    GC_IEEE(result, decode_call(fmt, wire, n, block, NULL, out, accumulate));
    return result;
}

int gc_decode_onto(int fmt, const uint8_t *wire, size_t n, size_t block, const float *base,
                   float *out)
{
    if (n && !base)
        return GC_EINVAL;
    int result;
    GC_IEEE(result, decode_call(fmt, wire, n, block, base, out, 1));
    return result;
}

/* ---- split calls: the map and the codec in one pass ----------------------- */

/* Run the split call k with a tile on cache lines for each of its threads
 * (on the heap: threads' stacks may be small). */
static int run_split(gc_call *k)
{
    size_t unit = split_unit(k->fmt, k->block);
    void *tiles = NULL;
    if (posix_memalign(&tiles, 64, call_threads(k, unit) * GC_SPLIT_TILE * sizeof(float)))
        return GC_ENOMEM;
    k->tile = tiles;
    run_call(k, unit);
    free(tiles);
    return 0;
}

static GC_NOINLINE int geo_encode(int fmt, const float *x, size_t lo, size_t len, size_t n,
                                  const float *coef, const float *vt, const float *packed,
                                  size_t k, size_t block, uint8_t *wire, unsigned flags,
                                  uint64_t seed, uint64_t stream, uint64_t offset)
{
    if (!flags_ok(fmt, flags) || n == 0 || k == 0 || (len && !(x && coef && vt && packed && wire)))
        return GC_EINVAL;
    if (len == 0)
        return 0;
    gc_split map = {lo, n, k, coef, vt, packed};
    gc_call call = encode_call(fmt, x, len, block, wire, flags, seed, stream, offset);
    if (split_tile(&call)) {
        call.split = &map;
        return run_split(&call);
    }
    /* a unit larger than a tile (one scale for all, long fp8 blocks): map, then encode */
    float *mapped = malloc(len * sizeof(float));
    if (!mapped)
        return GC_ENOMEM;
    split_expand(&map, x, 0, len, -1.0f, mapped, 0);
    call.x = mapped;
    run_call(&call, split_unit(fmt, call.block));
    free(mapped);
    return 0;
}

static GC_NOINLINE int geo_decode(int fmt, const uint8_t *wire, size_t lo, size_t len,
                                  size_t n, const float *coef, const float *vt,
                                  const float *packed, size_t k, size_t block, float *out)
{
    if (!known_format(fmt) || n == 0 || k == 0 || (len && !(wire && coef && vt && packed && out)))
        return GC_EINVAL;
    if (len == 0)
        return 0;
    gc_split map = {lo, n, k, coef, vt, packed};
    gc_call call = {0};
    call.fmt = fmt;
    call.decode = 1;
    call.simd = gc_codec_simd(GC_SIMD_CURRENT);
    call.n = len;
    call.block = fp8_block(len, block);
    call.out = out;
    call.wire = (uint8_t *)(uintptr_t)wire; /* read only */
    if (split_tile(&call)) {
        call.split = &map;
        return run_split(&call);
    }
    run_call(&call, split_unit(fmt, call.block)); /* a unit larger than a tile: */
    split_expand(&map, out, 0, len, 1.0f, out, 0); /* decode whole, then map back */
    return 0;
}

int gc_geo_encode(int fmt, const float *x, size_t lo, size_t len, size_t n, const float *coef,
                  const float *vt, const float *packed, size_t k, size_t block, uint8_t *wire,
                  unsigned flags, uint64_t seed, uint64_t stream, uint64_t offset)
{
    int result;
    GC_IEEE(result, geo_encode(fmt, x, lo, len, n, coef, vt, packed, k, block, wire, flags, seed,
                               stream, offset));
    return result;
}

int gc_geo_decode(int fmt, const uint8_t *wire, size_t lo, size_t len, size_t n,
                  const float *coef, const float *vt, const float *packed, size_t k, size_t block,
                  float *out)
{
    int result;
    GC_IEEE(result, geo_decode(fmt, wire, lo, len, n, coef, vt, packed, k, block, out));
    return result;
}
