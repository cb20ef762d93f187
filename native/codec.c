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

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

static size_t fp8_block(size_t n, size_t block) { return block ? block : n; }

size_t gc_wire_size(int fmt, size_t n, size_t block)
{
    if (n == 0)
        return 0;
    switch (fmt) {
    case GC_E4M3:
    case GC_E5M2:
        return 4 * ceil_div(n, fp8_block(n, block)) + n;
    case GC_NVFP4:
        return 4 + ceil_div(n, GC_NVFP4_BLOCK) + ceil_div(n, 2);
    case GC_BF16:
        return 2 * n;
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

/* One block: amax, scale, codes. Called with a literal length for full
 * 128-value blocks so the compiler drops the loop tails. */
static inline void encode_fp8_block(int e5m2, const float *restrict xb, size_t len,
                                    uint8_t *restrict scale, uint8_t *restrict cb)
{
    const float fmax = e5m2 ? GC_E5M2_MAX : GC_E4M3_MAX;
    float amax = block_amax(xb, len);
    float pre;
    float factor = gc_quant_factor(amax, fmax, &pre);
    store_f32(scale, amax / fmax);
    if (e5m2)
        for (size_t i = 0; i < len; i++)
            cb[i] = gc_e5m2_code((xb[i] * pre) * factor, xb[i]);
    else
        for (size_t i = 0; i < len; i++)
            cb[i] = gc_e4m3_code((xb[i] * pre) * factor, xb[i]);
}

static inline void encode_fp8(int e5m2, const float *restrict x, size_t n, size_t block,
                              uint8_t *restrict wire)
{
    size_t nblocks = ceil_div(n, block);
    uint8_t *codes = wire + 4 * nblocks;
    for (size_t k = 0; k < nblocks; k++) {
        size_t start = k * block;
        size_t len = n - start < block ? n - start : block;
        if (len == 128)
            encode_fp8_block(e5m2, x + start, 128, wire + 4 * k, codes + start);
        else
            encode_fp8_block(e5m2, x + start, len, wire + 4 * k, codes + start);
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
        float scale = load_f32(wire + 4 * k);
        const uint8_t *restrict cb = codes + start;
        float *restrict ob = out + start;
        for (size_t i = 0; i < len; i++) {
            float v = (e5m2 ? gc_e5m2_value(cb[i]) : gc_e4m3_value(cb[i])) * scale;
            ob[i] = accumulate ? ob[i] + v : v;
        }
    }
}

GC_CLONES static void encode_e4m3(const float *x, size_t n, size_t b, uint8_t *w) { encode_fp8(0, x, n, b, w); }
GC_CLONES static void encode_e5m2(const float *x, size_t n, size_t b, uint8_t *w) { encode_fp8(1, x, n, b, w); }
GC_CLONES static void decode_e4m3(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(0, 0, w, n, b, o); }
GC_CLONES static void decode_e5m2(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(1, 0, w, n, b, o); }
GC_CLONES static void accumulate_e4m3(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(0, 1, w, n, b, o); }
GC_CLONES static void accumulate_e5m2(const uint8_t *w, size_t n, size_t b, float *o) { decode_fp8(1, 1, w, n, b, o); }

/* ---- NVFP4 -------------------------------------------------------------- */

/* Blocks per pass of the NVFP4 encoder: amaxes first, then the scale codes of
 * all those blocks in one loop (vectorized across blocks, where the scalar
 * scale arithmetic of one 16-value block used to dominate), then the codes. */
#define GC_NVFP4_GROUP 64

static inline void nvfp4_block_codes(const float *restrict xb, size_t len, float pre,
                                     float factor, int finite, uint8_t *restrict cb)
{
    gc_u8 c[GC_NVFP4_BLOCK] = {0};
    for (size_t i = 0; i < len; i++)
        c[i] = finite ? gc_e2m1_code((xb[i] * pre) * factor) : 0;
    for (size_t i = 0; i < (len + 1) / 2; i++)
        cb[i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
}

GC_CLONES static void encode_nvfp4(const float *x, size_t n, uint8_t *wire)
{
    const float tmax = GC_E2M1_MAX * GC_E4M3_MAX;
    size_t nblocks = ceil_div(n, GC_NVFP4_BLOCK);
    uint8_t *bscales = wire + 4;
    uint8_t *codes = bscales + nblocks;
    float tamax = block_amax(x, n);
    float tpre;
    float tfactor = gc_quant_factor(tamax, tmax, &tpre);
    float gscale = tamax / tmax;
    store_f32(wire, gscale);
    for (size_t g = 0; g < nblocks; g += GC_NVFP4_GROUP) {
        size_t count = nblocks - g < GC_NVFP4_GROUP ? nblocks - g : GC_NVFP4_GROUP;
        float bamax[GC_NVFP4_GROUP], pre[GC_NVFP4_GROUP], factor[GC_NVFP4_GROUP];
        int finite[GC_NVFP4_GROUP];
        for (size_t j = 0; j < count; j++) {
            size_t start = (g + j) * GC_NVFP4_BLOCK;
            size_t len = n - start < GC_NVFP4_BLOCK ? n - start : GC_NVFP4_BLOCK;
            if (len == GC_NVFP4_BLOCK)
                block_stats(x + start, GC_NVFP4_BLOCK, &bamax[j], &finite[j]);
            else
                block_stats(x + start, len, &bamax[j], &finite[j]);
        }
        for (size_t j = 0; j < count; j++) {
            gc_u8 sc = gc_nvfp4_scale_code(bamax[j], tpre, tfactor, finite[j]);
            bscales[g + j] = sc;
            factor[j] = gc_quant_factor(gc_e4m3_value(sc) * gscale, 1.0f, &pre[j]);
        }
        for (size_t j = 0; j < count; j++) {
            size_t start = (g + j) * GC_NVFP4_BLOCK;
            size_t len = n - start < GC_NVFP4_BLOCK ? n - start : GC_NVFP4_BLOCK;
            uint8_t *cb = codes + start / 2;
            if (len == GC_NVFP4_BLOCK)
                nvfp4_block_codes(x + start, GC_NVFP4_BLOCK, pre[j], factor[j], finite[j], cb);
            else
                nvfp4_block_codes(x + start, len, pre[j], factor[j], finite[j], cb);
        }
    }
}

/* gc_e2m1_value of every 4-bit code, as a table the vectorizer turns into an
 * in-register permute (test_native.c checks it against gc_e2m1_value). */
static const float gc_e2m1_table[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline void nvfp4_block_values(const uint8_t *restrict cb, size_t len, float eff,
                                      int accumulate, float *restrict ob)
{
    for (size_t i = 0; i < len; i++) {
        float v = gc_e2m1_table[(cb[i >> 1] >> ((i & 1) * 4)) & 0xfu] * eff;
        ob[i] = accumulate ? ob[i] + v : v;
    }
}

GC_CLONES static void decode_nvfp4(int accumulate, const uint8_t *wire, size_t n, float *out)
{
    size_t nblocks = ceil_div(n, GC_NVFP4_BLOCK);
    const uint8_t *bscales = wire + 4;
    const uint8_t *codes = bscales + nblocks;
    float gscale = load_f32(wire);
    for (size_t g = 0; g < nblocks; g += GC_NVFP4_GROUP) {
        size_t count = nblocks - g < GC_NVFP4_GROUP ? nblocks - g : GC_NVFP4_GROUP;
        float eff[GC_NVFP4_GROUP];
        for (size_t j = 0; j < count; j++)
            eff[j] = gc_e4m3_value(bscales[g + j]) * gscale;
        for (size_t j = 0; j < count; j++) {
            size_t start = (g + j) * GC_NVFP4_BLOCK;
            size_t len = n - start < GC_NVFP4_BLOCK ? n - start : GC_NVFP4_BLOCK;
            const uint8_t *cb = codes + start / 2;
            if (len == GC_NVFP4_BLOCK)
                nvfp4_block_values(cb, GC_NVFP4_BLOCK, eff[j], accumulate, out + start);
            else
                nvfp4_block_values(cb, len, eff[j], accumulate, out + start);
        }
    }
}

/* ---- BF16 --------------------------------------------------------------- */

GC_CLONES static void encode_bf16(const float *x, size_t n, uint8_t *wire)
{
    for (size_t i = 0; i < n; i++) {
        gc_u16 c = gc_bf16_code(x[i]);
        memcpy(wire + 2 * i, &c, sizeof c);
    }
}

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

int gc_encode(int fmt, const float *x, size_t n, size_t block, uint8_t *wire)
{
    if (n == 0)
        return fmt >= GC_E4M3 && fmt <= GC_BF16 ? 0 : GC_EINVAL;
    switch (fmt) {
    case GC_E4M3:
        encode_e4m3(x, n, fp8_block(n, block), wire);
        return 0;
    case GC_E5M2:
        encode_e5m2(x, n, fp8_block(n, block), wire);
        return 0;
    case GC_NVFP4:
        encode_nvfp4(x, n, wire);
        return 0;
    case GC_BF16:
        encode_bf16(x, n, wire);
        return 0;
    default:
        return GC_EINVAL;
    }
}

int gc_decode(int fmt, const uint8_t *wire, size_t n, size_t block, float *out, int accumulate)
{
    if (n == 0)
        return fmt >= GC_E4M3 && fmt <= GC_BF16 ? 0 : GC_EINVAL;
    switch (fmt) {
    case GC_E4M3:
        (accumulate ? accumulate_e4m3 : decode_e4m3)(wire, n, fp8_block(n, block), out);
        return 0;
    case GC_E5M2:
        (accumulate ? accumulate_e5m2 : decode_e5m2)(wire, n, fp8_block(n, block), out);
        return 0;
    case GC_NVFP4:
        decode_nvfp4(accumulate != 0, wire, n, out);
        return 0;
    case GC_BF16:
        decode_bf16(accumulate != 0, wire, n, out);
        return 0;
    default:
        return GC_EINVAL;
    }
}
