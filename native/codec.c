/*
 * CPU loops of the geocomm codec. All arithmetic lives in gc_scalar.h; this
 * file only walks blocks and stores results. Hot loops are branch-free per
 * element so the compiler vectorizes them; GC_CLONES builds an AVX2 variant
 * beside the portable one and picks at load time.
 */
#include "geocomm.h"
#include "gc_scalar.h"

#if defined(GC_USE_CLONES) && defined(__x86_64__) && defined(__GNUC__)
#define GC_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
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

GC_INLINE void encode_fp8(int e5m2, int sr, const float *restrict x, size_t n, size_t block,
                              uint8_t *restrict wire, gc_u64 key, gc_u64 offset)
{
    size_t nblocks = ceil_div(n, block);
    uint8_t *codes = wire + 4 * nblocks;
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * block;
        size_t len = n - start < block ? n - start : block;
        if (len == 128)
            encode_fp8_block(e5m2, sr, x + start, 128, wire + 4 * k, codes + start, key,
                             offset + start);
        else
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

/* Blocks per pass of the NVFP4 encoder: amaxes first, then the scale codes of
 * all those blocks in one loop (vectorized across blocks, where the scalar
 * scale arithmetic of one 16-value block used to dominate), then the codes.
 * A superblock holds a whole number of groups. */
#define GC_NVFP4_GROUP 64
#if GC_NVFP4_SUPERBLOCK % (GC_NVFP4_GROUP * GC_NVFP4_BLOCK) != 0
#error "an NVFP4 superblock must hold whole groups of blocks"
#endif

/* One superblock of len <= GC_NVFP4_SUPERBLOCK values: its fp32 scale at
 * *sscale, its block scales at bscales, its codes at codes; element i has the
 * global index `index` + i. Its amax is read first, then the values again
 * (from cache: a superblock is 16 KiB). */
GC_INLINE void encode_nvfp4_super(int sr, const float *x, size_t len, uint8_t *sscale,
                                  uint8_t *bscales, uint8_t *codes, gc_u64 key, gc_u64 index)
{
    const float smax = GC_E2M1_MAX * GC_E4M3_MAX;
    size_t nblocks = ceil_div(len, GC_NVFP4_BLOCK);
    float samax = block_amax(x, len);
    float spre;
    float sfactor = gc_quant_factor(samax, smax, &spre);
    float scale = samax / smax;
    store_f32(sscale, scale);
    for (size_t g = 0; g < nblocks; g += GC_NVFP4_GROUP) {
        size_t count = nblocks - g < GC_NVFP4_GROUP ? nblocks - g : GC_NVFP4_GROUP;
        float bamax[GC_NVFP4_GROUP], pre[GC_NVFP4_GROUP], factor[GC_NVFP4_GROUP];
        int finite[GC_NVFP4_GROUP];
        for (size_t j = 0; j < count; j++) {
            size_t start = (g + j) * GC_NVFP4_BLOCK;
            size_t blen = len - start < GC_NVFP4_BLOCK ? len - start : GC_NVFP4_BLOCK;
            if (blen == GC_NVFP4_BLOCK)
                block_stats(x + start, GC_NVFP4_BLOCK, &bamax[j], &finite[j]);
            else
                block_stats(x + start, blen, &bamax[j], &finite[j]);
        }
        for (size_t j = 0; j < count; j++) {
            gc_u8 sc = gc_nvfp4_scale_code(bamax[j], spre, sfactor, finite[j], sr);
            bscales[g + j] = sc;
            factor[j] = gc_quant_factor(gc_e4m3_value(sc) * scale, 1.0f, &pre[j]);
        }
        for (size_t j = 0; j < count; j++) {
            size_t start = (g + j) * GC_NVFP4_BLOCK;
            size_t blen = len - start < GC_NVFP4_BLOCK ? len - start : GC_NVFP4_BLOCK;
            uint8_t *cb = codes + start / 2;
            if (blen == GC_NVFP4_BLOCK)
                e2m1_block_codes(sr, x + start, GC_NVFP4_BLOCK, pre[j], factor[j], finite[j], cb,
                                 key, index + start);
            else
                e2m1_block_codes(sr, x + start, blen, pre[j], factor[j], finite[j], cb, key,
                                 index + start);
        }
    }
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

GC_INLINE void encode_mx(int fmt, int sr, int rceil, const float *restrict x, size_t n,
                         uint8_t *restrict wire, gc_u64 key, gc_u64 offset)
{
    size_t nblocks = ceil_div(n, GC_MX_BLOCK);
    uint8_t *codes = wire + nblocks;
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * GC_MX_BLOCK;
        size_t len = n - start < GC_MX_BLOCK ? n - start : GC_MX_BLOCK;
        uint8_t *cb = codes + (fmt == GC_MXFP4 ? start / 2 : start);
        if (len == GC_MX_BLOCK)
            encode_mx_block(fmt, sr, rceil, x + start, GC_MX_BLOCK, wire + k, cb, key,
                            offset + start);
        else
            encode_mx_block(fmt, sr, rceil, x + start, len, wire + k, cb, key, offset + start);
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
