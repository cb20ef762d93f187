/*
 * CPU loops of the geocomm codec. All arithmetic lives in gc_scalar.h; this
 * file only walks blocks and stores results. Hot loops are branch-free per
 * element so the compiler vectorizes them; GC_CLONES builds an AVX2 variant
 * beside the portable one and picks at load time.
 */
#include "geocomm.h"
#include "gc_scalar.h"

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

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

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

/* fp8 codes of (x * pre) * factor for one block (fp8 and MXFP8); element i
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
                              uint8_t *restrict wire, gc_u64 key, gc_u64 offset)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    const size_t glen_max = GC_FP8_GROUP * 128;
    size_t nblocks = ceil_div(n, 128);
    uint8_t *codes = wire + 4 * nblocks;
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
            store_f32(wire + 4 * (g + j), a / fmax);
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
                              uint8_t *restrict wire, gc_u64 key, gc_u64 offset)
{
    if (block == 128) {
        encode_fp8_128(e5m2, sr, x, n, wire, key, offset);
        return;
    }
    size_t nblocks = ceil_div(n, block);
    uint8_t *codes = wire + 4 * nblocks;
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * block;
        size_t len = n - start < block ? n - start : block;
        encode_fp8_block(e5m2, sr, x + start, len, wire + 4 * k, codes + start, key,
                         offset + start);
    }
}

/* Values code * scale of one block (fp8 and MXFP8), stored or accumulated. */
static inline void fp8_block_values(int e5m2, int accumulate, const uint8_t *restrict cb,
                                    size_t len, float scale, float *restrict ob)
{
    for (size_t i = 0; i < len; i++) {
        float v = (e5m2 ? gc_e5m2_value(cb[i]) : gc_e4m3_value(cb[i])) * scale;
        ob[i] = accumulate ? ob[i] + v : v;
    }
}

static inline void decode_fp8(int e5m2, int accumulate, const uint8_t *restrict wire, size_t n,
                              size_t block, float *restrict out)
{
    size_t nblocks = ceil_div(n, block);
    const uint8_t *codes = wire + 4 * nblocks;
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * block;
        size_t len = n - start < block ? n - start : block;
        fp8_block_values(e5m2, accumulate, codes + start, len, load_f32(wire + 4 * k),
                         out + start);
    }
}

/* One compiled function per format and rounding: sr is a constant in each,
 * so the nearest path stays free of the hash. */
GC_CLONES static void encode_e4m3(const float *x, size_t n, size_t b, uint8_t *w, gc_u64 key, gc_u64 off) { encode_fp8(0, 0, x, n, b, w, key, off); }
GC_CLONES static void encode_e5m2(const float *x, size_t n, size_t b, uint8_t *w, gc_u64 key, gc_u64 off) { encode_fp8(1, 0, x, n, b, w, key, off); }
GC_CLONES static void encode_e4m3_sr(const float *x, size_t n, size_t b, uint8_t *w, gc_u64 key, gc_u64 off) { encode_fp8(0, 1, x, n, b, w, key, off); }
GC_CLONES static void encode_e5m2_sr(const float *x, size_t n, size_t b, uint8_t *w, gc_u64 key, gc_u64 off) { encode_fp8(1, 1, x, n, b, w, key, off); }
GC_CLONES static void decode_e4m3(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(0, 0, w, n, b, o); }
GC_CLONES static void decode_e5m2(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(1, 0, w, n, b, o); }
GC_CLONES static void accumulate_e4m3(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(0, 1, w, n, b, o); }
GC_CLONES static void accumulate_e5m2(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(1, 1, w, n, b, o); }

/* ---- E2M1 (NVFP4, MXFP4) ------------------------------------------------- */

/* Packed E2M1 codes of (x * pre) * factor for one block of len <= 32 values
 * starting at an even index (element 2i in the low nibble); all codes 0 when
 * the block is not finite. */
static inline void e2m1_block_codes(int sr, const float *restrict xb, size_t len, float pre,
                                    float factor, int finite, uint8_t *restrict cb, gc_u64 key,
                                    gc_u64 index)
{
    gc_u8 c[GC_MX_BLOCK] = {0};
    for (size_t i = 0; i < len; i++)
        c[i] = finite ? gc_e2m1_code((xb[i] * pre) * factor, sr, gc_rnd_at(sr, key, index + i)) : 0;
    for (size_t i = 0; i < (len + 1) / 2; i++)
        cb[i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
}

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
        ob[i] = accumulate ? ob[i] + v : v;
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
    int finite[GC_NVFP4_BLOCKS];
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
        factor[j] = gc_quant_factor(gc_e4m3_value(sc) * scale, 1.0f, &pre[j]);
    }
    /* codes in groups of blocks, with pre and factor spread to one per value
     * so that the code loop runs flat over the group (no per-block
     * overhead); codes of non-finite blocks are cleared afterwards */
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
    int all_finite = 1;
    for (size_t j = 0; j < nblocks; j++)
        all_finite &= finite[j];
    if (!all_finite)
        for (size_t j = 0; j < nblocks; j++)
            if (!finite[j])
                memset(c + j * GC_NVFP4_BLOCK, 0,
                       j + 1 < nblocks ? GC_NVFP4_BLOCK : last);
    c[len] = 0; /* the high nibble of an odd length's last byte */
    if (len == GC_NVFP4_SUPERBLOCK)
        pack_nibbles(c, GC_NVFP4_SUPERBLOCK / 2, codes);
    else
        pack_nibbles(c, (len + 1) / 2, codes);
}

/* Superblock by superblock (geocomm.h: the layout). */
GC_INLINE void encode_nvfp4(int sr, const float *x, size_t n, uint8_t *wire, gc_u64 key,
                            gc_u64 offset)
{
    size_t nsuper = ceil_div(n, GC_NVFP4_SUPERBLOCK);
    uint8_t *bscales = wire + 4 * nsuper;
    uint8_t *codes = bscales + ceil_div(n, GC_NVFP4_BLOCK);
    for (size_t k = 0; k < nsuper; k++) {
        size_t start = k * GC_NVFP4_SUPERBLOCK;
        size_t len = n - start < GC_NVFP4_SUPERBLOCK ? n - start : GC_NVFP4_SUPERBLOCK;
        encode_nvfp4_super(sr, x + start, len, wire + 4 * k, bscales + start / GC_NVFP4_BLOCK,
                           codes + start / 2, key, offset + start);
    }
}

GC_CLONES static void encode_nvfp4_rn(const float *x, size_t n, uint8_t *w, gc_u64 key, gc_u64 off) { encode_nvfp4(0, x, n, w, key, off); }
GC_CLONES static void encode_nvfp4_sr(const float *x, size_t n, uint8_t *w, gc_u64 key, gc_u64 off) { encode_nvfp4(1, x, n, w, key, off); }

GC_CLONES static void decode_nvfp4(int accumulate, const uint8_t *wire, size_t n, float *out)
{
    size_t nblocks = ceil_div(n, GC_NVFP4_BLOCK);
    const uint8_t *bscales = wire + 4 * ceil_div(n, GC_NVFP4_SUPERBLOCK);
    const uint8_t *codes = bscales + nblocks;
    for (size_t g = 0; g < nblocks; g += GC_NVFP4_GROUP) {
        size_t count = nblocks - g < GC_NVFP4_GROUP ? nblocks - g : GC_NVFP4_GROUP;
        /* a group lies inside one superblock */
        float scale = load_f32(wire + 4 * (g * GC_NVFP4_BLOCK / GC_NVFP4_SUPERBLOCK));
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

/* One block of an MX format: its E8M0 scale (gc_mx_exponent) and the codes
 * of x * 2^-X, one byte each (MXFP8) or packed E2M1 (MXFP4; cb at the
 * block's first code byte). An MXFP4 block holding a non-finite value gets
 * the NaN scale 0xff and codes 0 (E2M1 has no NaN); MXFP8 keeps non-finite
 * values per element, like fp8. Called with a literal length for full
 * blocks so the compiler drops the loop tails. */
static inline void encode_mx_block(int fmt, int sr, int rceil, const float *restrict xb,
                                   size_t len, uint8_t *restrict scale, uint8_t *restrict cb,
                                   gc_u64 key, gc_u64 index)
{
    const int e5m2 = fmt == GC_MXFP8_E5M2;
    const int emax = fmt == GC_MXFP4 ? 2 : e5m2 ? 15 : 8;
    const float fmax = fmt == GC_MXFP4 ? GC_E2M1_MAX : e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    float amax;
    int finite;
    block_stats(xb, len, &amax, &finite);
    int e = gc_mx_exponent(amax, emax, fmax, rceil);
    float factor = gc_mx_factor(e);
    if (fmt == GC_MXFP4) {
        *scale = finite ? (uint8_t)(e + 127) : 0xffu;
        e2m1_block_codes(sr, xb, len, 1.0f, factor, finite, cb, key, index);
    } else {
        *scale = (uint8_t)(e + 127);
        fp8_block_codes(e5m2, sr, xb, len, 1.0f, factor, cb, key, index);
    }
}

/* Blocks per group of the MX encoders. */
#define GC_MX_GROUP 32

/* Group by group: the amaxes (and finiteness) of the group's blocks, their
 * E8M0 scales and factors (one loop across blocks), then the codes of the
 * whole group in one flat loop: encode_mx_block's arithmetic, value by value
 * (its pre is 1). MXFP4 codes of non-finite blocks are cleared afterwards. */
GC_INLINE void encode_mx(int fmt, int sr, int rceil, const float *restrict x, size_t n,
                         uint8_t *restrict wire, gc_u64 key, gc_u64 offset)
{
    const int e5m2 = fmt == GC_MXFP8_E5M2;
    const int emax = fmt == GC_MXFP4 ? 2 : e5m2 ? 15 : 8;
    const float fmax = fmt == GC_MXFP4 ? GC_E2M1_MAX : e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    const size_t glen_max = GC_MX_GROUP * GC_MX_BLOCK;
    size_t nblocks = ceil_div(n, GC_MX_BLOCK);
    uint8_t *codes = wire + nblocks;
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
            wire[g + j] = fmt != GC_MXFP4 || finite[j] ? (uint8_t)(e + 127) : 0xffu;
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
    GC_CLONES static void name(int rceil, const float *x, size_t n, uint8_t *w, gc_u64 key,  \
                               gc_u64 off)                                                   \
    {                                                                                        \
        encode_mx(fmt, sr, rceil, x, n, w, key, off);                                        \
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

GC_INLINE void decode_mx(int fmt, int accumulate, const uint8_t *restrict wire, size_t n,
                         float *restrict out)
{
    size_t nblocks = ceil_div(n, GC_MX_BLOCK);
    const uint8_t *codes = wire + nblocks;
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * GC_MX_BLOCK;
        size_t len = n - start < GC_MX_BLOCK ? n - start : GC_MX_BLOCK;
        const uint8_t *cb = codes + (fmt == GC_MXFP4 ? start / 2 : start);
        float scale = gc_e8m0_value(wire[k]);
        if (len == GC_MX_BLOCK)
            decode_mx_block(fmt, accumulate, cb, GC_MX_BLOCK, scale, out + start);
        else
            decode_mx_block(fmt, accumulate, cb, len, scale, out + start);
    }
}

GC_CLONES static void decode_mxfp8_e4m3(int acc, const uint8_t *w, size_t n, float *o) { decode_mx(GC_MXFP8_E4M3, acc, w, n, o); }
GC_CLONES static void decode_mxfp8_e5m2(int acc, const uint8_t *w, size_t n, float *o) { decode_mx(GC_MXFP8_E5M2, acc, w, n, o); }
GC_CLONES static void decode_mxfp4(int acc, const uint8_t *w, size_t n, float *o) { decode_mx(GC_MXFP4, acc, w, n, o); }

/* ---- BF16 --------------------------------------------------------------- */

GC_INLINE void encode_bf16(int sr, const float *x, size_t n, uint8_t *wire, gc_u64 key,
                               gc_u64 offset)
{
    for (size_t i = 0; i < n; i++) {
        gc_u16 c = gc_bf16_code(x[i], sr, gc_rnd_at(sr, key, offset + i));
        memcpy(wire + 2 * i, &c, sizeof c);
    }
}

GC_CLONES static void encode_bf16_rn(const float *x, size_t n, uint8_t *w, gc_u64 key, gc_u64 off) { encode_bf16(0, x, n, w, key, off); }
GC_CLONES static void encode_bf16_sr(const float *x, size_t n, uint8_t *w, gc_u64 key, gc_u64 off) { encode_bf16(1, x, n, w, key, off); }

GC_CLONES static void decode_bf16(int accumulate, const uint8_t *wire, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++) {
        gc_u16 c;
        memcpy(&c, wire + 2 * i, sizeof c);
        float v = gc_bf16_value(c);
        out[i] = accumulate ? out[i] + v : v;
    }
}

/* ---- dispatch ----------------------------------------------------------- */

int gc_encode_ex(int fmt, const float *x, size_t n, size_t block, uint8_t *wire, unsigned flags,
                 uint64_t seed, uint64_t stream, uint64_t offset)
{
    if (!known_format(fmt) || (flags & ~(unsigned)(GC_STOCHASTIC | GC_RCEIL))
        || ((flags & GC_RCEIL) && !is_mx(fmt)))
        return GC_EINVAL;
    if (n == 0)
        return 0;
    int sr = (flags & GC_STOCHASTIC) != 0, rceil = (flags & GC_RCEIL) != 0;
    gc_u64 key = sr ? gc_sr_key(seed, stream) : 0;
    switch (fmt) {
    case GC_E4M3:
        (sr ? encode_e4m3_sr : encode_e4m3)(x, n, fp8_block(n, block), wire, key, offset);
        return 0;
    case GC_E5M2:
        (sr ? encode_e5m2_sr : encode_e5m2)(x, n, fp8_block(n, block), wire, key, offset);
        return 0;
    case GC_NVFP4:
        (sr ? encode_nvfp4_sr : encode_nvfp4_rn)(x, n, wire, key, offset);
        return 0;
    case GC_BF16:
        (sr ? encode_bf16_sr : encode_bf16_rn)(x, n, wire, key, offset);
        return 0;
    case GC_MXFP8_E4M3:
        (sr ? encode_mxfp8_e4m3_sr : encode_mxfp8_e4m3)(rceil, x, n, wire, key, offset);
        return 0;
    case GC_MXFP8_E5M2:
        (sr ? encode_mxfp8_e5m2_sr : encode_mxfp8_e5m2)(rceil, x, n, wire, key, offset);
        return 0;
    default:
        (sr ? encode_mxfp4_sr : encode_mxfp4)(rceil, x, n, wire, key, offset);
        return 0;
    }
}

int gc_encode(int fmt, const float *x, size_t n, size_t block, uint8_t *wire)
{
    return gc_encode_ex(fmt, x, n, block, wire, 0, 0, 0, 0);
}

/* Decoders of the formats without a block length, by format id. */
static void (*const gc_decoders[])(int, const uint8_t *, size_t, float *) = {
    [GC_NVFP4] = decode_nvfp4,
    [GC_BF16] = decode_bf16,
    [GC_MXFP8_E4M3] = decode_mxfp8_e4m3,
    [GC_MXFP8_E5M2] = decode_mxfp8_e5m2,
    [GC_MXFP4] = decode_mxfp4,
};

int gc_decode(int fmt, const uint8_t *wire, size_t n, size_t block, float *out, int accumulate)
{
    if (!known_format(fmt))
        return GC_EINVAL;
    if (n == 0)
        return 0;
    if (fmt == GC_E4M3)
        (accumulate ? accumulate_e4m3 : decode_e4m3)(wire, n, fp8_block(n, block), out);
    else if (fmt == GC_E5M2)
        (accumulate ? accumulate_e5m2 : decode_e5m2)(wire, n, fp8_block(n, block), out);
    else
        gc_decoders[fmt](accumulate != 0, wire, n, out);
    return 0;
}
