/*
 * C unit tests of the native codec, independent of Python: decode of every
 * code against a second, ldexp-based definition of the formats; encode of
 * every representable value back to its code; every E2M1 code through the
 * NVFP4 decoder; every E8M0 scale through the MX decoders; wire sizes;
 * NVFP4 superblocks (their scales, and a body cut at multiples of 4096);
 * non-finite rules; bfloat16's saturation; gc_encode_ex's flags and its stochastic rounding staying
 * between the two neighbours; accumulate; and encoding random values and
 * decoding random bytes in every format (run under -Db_sanitize=address,
 * undefined, that catches any out-of-bounds access); the AVX-512 loops and
 * threads against the portable loops on one thread. Prints
 * "N passed, M failed" and exits non-zero on failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "geocomm.h"
#include "gc_check.h"


/* value of a minifloat code: ebits exponent bits, mbits mantissa bits */
static float minifloat(unsigned code, int ebits, int mbits, int ieee_specials)
{
    unsigned sign = code >> (ebits + mbits);
    unsigned e = (code >> mbits) & ((1u << ebits) - 1);
    unsigned m = code & ((1u << mbits) - 1);
    int bias = (1 << (ebits - 1)) - 1;
    float v;
    if (ieee_specials && e == (1u << ebits) - 1)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexpf((float)m, 1 - bias - mbits);
    else
        v = ldexpf(1.0f + ldexpf((float)m, -mbits), (int)e - bias);
    return sign ? -v : v;
}

static float e4m3(unsigned c) { return (c & 0x7f) == 0x7f ? NAN : minifloat(c, 4, 3, 0); }
static float e5m2(unsigned c) { return minifloat(c, 5, 2, 1); }

static int same(float a, float b) { return (isnan(a) && isnan(b)) || a == b; }

static void test_fp8_codes(int fmt, float (*ref)(unsigned), float fmax)
{
    /* a wire of 256 values with one scale of 1.0 holds every code */
    uint8_t wire[4 + 256];
    float one = 1.0f, out[256];
    memcpy(wire, &one, 4);
    for (int c = 0; c < 256; c++)
        wire[4 + c] = (uint8_t)c;
    CHECK(gc_decode(fmt, wire, 256, 0, out, 0) == 0, "decode fmt %d", fmt);
    for (int c = 0; c < 256; c++)
        CHECK(same(out[c], ref((unsigned)c)), "fmt %d code %d: %g vs %g", fmt, c, out[c],
              ref((unsigned)c));
    /* encoding a finite value together with fmax (scale factor exactly 1)
     * gives its code back; -0 keeps its sign */
    for (int c = 0; c < 256; c++) {
        float v = ref((unsigned)c), x[2] = {v, fmax}, back[2];
        uint8_t w[4 + 2];
        if (!isfinite(v))
            continue;
        gc_encode(fmt, x, 2, 0, w);
        CHECK(w[4] == c, "fmt %d: encode(%g) = %d, expected %d", fmt, v, w[4], c);
        gc_decode(fmt, w, 2, 0, back, 0);
        CHECK(back[0] == v && signbit(back[0]) == signbit(v), "fmt %d round trip %g", fmt, v);
    }
}

/* Every E2M1 code through the NVFP4 decoder (global and block scale 1) against
 * the ldexp definition: the decoder's lookup table must match the format. */
static void test_e2m1_codes(void)
{
    uint8_t wire[4 + 1 + 8];
    float one = 1.0f, out[16];
    memcpy(wire, &one, 4);
    wire[4] = 0x38; /* E4M3 code of 1.0 */
    for (int i = 0; i < 8; i++)
        wire[5 + i] = (uint8_t)((2 * i) | ((2 * i + 1) << 4));
    CHECK(gc_decode(GC_NVFP4, wire, 16, 0, out, 0) == 0, "decode nvfp4 codes");
    for (int c = 0; c < 16; c++) {
        float ref = minifloat((unsigned)c, 2, 1, 0);
        CHECK(out[c] == ref && signbit(out[c]) == signbit(ref), "e2m1 code %d: %g vs %g", c,
              out[c], ref);
    }
}

/* Every E8M0 scale code through the MXFP8 (E4M3) decoder with element 1.0:
 * 2^(c - 127), NaN for 0xff. */
static void test_e8m0_scales(void)
{
    uint8_t wire[256 + 256 * 32];
    float out[256 * 32];
    for (int c = 0; c < 256; c++) {
        wire[c] = (uint8_t)c;
        memset(wire + 256 + 32 * c, 0x38, 32); /* E4M3 code of 1.0 */
    }
    CHECK(gc_decode(GC_MXFP8_E4M3, wire, 256 * 32, 0, out, 0) == 0, "decode mxfp8");
    for (int c = 0; c < 256; c++) {
        float ref = c == 255 ? NAN : ldexpf(1.0f, c - 127);
        CHECK(same(out[32 * c + 31], ref), "e8m0 code %d: %g vs %g", c, out[32 * c + 31], ref);
    }
}

static void test_wire_sizes(void)
{
    CHECK(gc_wire_size(GC_E4M3, 0, 128) == 0, "empty");
    CHECK(gc_wire_size(GC_E4M3, 129, 128) == 2 * 4 + 129, "e4m3 129");
    CHECK(gc_wire_size(GC_E5M2, 100, 0) == 4 + 100, "e5m2 per tensor");
    CHECK(gc_wire_size(GC_NVFP4, 33, 0) == 4 + 3 + 17, "nvfp4 33");
    CHECK(gc_wire_size(GC_NVFP4, 4096, 0) == 4 + 256 + 2048, "nvfp4 one superblock");
    CHECK(gc_wire_size(GC_NVFP4, 4097, 0) == 8 + 257 + 2049, "nvfp4 4097: two superblocks");
    CHECK(gc_wire_size(GC_BF16, 7, 0) == 14, "bf16 7");
    CHECK(gc_wire_size(GC_MXFP8_E4M3, 65, 128) == 3 + 65, "mxfp8 65");
    CHECK(gc_wire_size(GC_MXFP8_E5M2, 64, 0) == 2 + 64, "mxfp8 e5m2 64");
    CHECK(gc_wire_size(GC_MXFP4, 33, 0) == 2 + 17, "mxfp4 33");
    CHECK(gc_wire_size(99, 7, 0) == 0, "unknown format has no size");
    float x = 1.0f;
    uint8_t w[16];
    CHECK(gc_encode(99, &x, 1, 0, w) == GC_EINVAL, "unknown format rejected");
    CHECK(gc_decode(99, w, 1, 0, &x, 0) == GC_EINVAL, "unknown format rejected");
    CHECK(gc_encode_ex(GC_E4M3, &x, 1, 0, w, 4, 0, 0, 0) == GC_EINVAL, "unknown flag rejected");
    CHECK(gc_encode_ex(GC_E4M3, &x, 1, 0, w, GC_RCEIL, 0, 0, 0) == GC_EINVAL,
          "rceil needs an MX format");
    CHECK(gc_encode_ex(GC_MXFP4, &x, 1, 0, w, GC_RCEIL | GC_STOCHASTIC, 1, 2, 3) == 0,
          "mxfp4 with both flags");
}

/* Stochastic rounding lands on one of the two neighbours of x, and nearest
 * rounding picks one of the same two: with the same scales, the codes have
 * the same sign and differ by at most one step. */
static void test_stochastic_neighbours(void)
{
    enum { N = 4096 };
    static float x[N];
    static uint8_t rn[4 * N + N], sr[4 * N + N];
    for (int i = 0; i < N; i++)
        x[i] = sinf((float)i * 0.37f) * ldexpf(1.0f, i % 40 - 20);
    int fmts[] = {GC_E4M3, GC_E5M2, GC_MXFP8_E4M3, GC_MXFP8_E5M2};
    for (int f = 0; f < 4; f++) {
        unsigned rceil = fmts[f] >= GC_MXFP8_E4M3 ? GC_RCEIL : 0u;
        size_t head = gc_wire_size(fmts[f], N, 128) - N;
        gc_encode_ex(fmts[f], x, N, 128, rn, rceil, 0, 0, 0);
        gc_encode_ex(fmts[f], x, N, 128, sr, rceil | GC_STOCHASTIC, 9, 8, 7);
        int ok = memcmp(rn, sr, head) == 0, moved = 0;
        for (int i = 0; i < N; i++) {
            int a = rn[head + i] & 0x7f, b = sr[head + i] & 0x7f;
            ok &= (rn[head + i] & 0x80) == (sr[head + i] & 0x80) && abs(a - b) <= 1;
            moved += a != b;
        }
        CHECK(ok && moved > 0, "fmt %d: stochastic codes are nearest's neighbours (%d moved)",
              fmts[f], moved);
    }
}

/* NVFP4: superblock k's fp32 scale is the amax of values [4096 k, 4096 k +
 * 4096) over 6 * 448, and a body is the section-wise concatenation of the
 * bodies of pieces cut at multiples of 4096 (with matching offsets for
 * stochastic rounding), so a collective's pieces give the bytes of one call. */
static void test_nvfp4_superblocks(void)
{
    enum { SB = GC_NVFP4_SUPERBLOCK, N = 3 * SB + 1001, NSUPER = 4 };
    static float x[N];
    static uint8_t whole[4 * NSUPER + N], piece[4 * NSUPER + N];
    CHECK(SB == 4096 && SB % GC_NVFP4_BLOCK == 0, "superblock of 4096 values");
    for (int i = 0; i < N; i++)
        x[i] = sinf((float)i * 0.61f) * ldexpf(1.0f, (i / 700) % 30 - 15);
    x[SB + 5] = NAN; /* ignored by its superblock's amax */
    size_t cuts[] = {0, SB, 3 * SB, N};
    for (unsigned flags = 0; flags <= GC_STOCHASTIC; flags += GC_STOCHASTIC) {
        CHECK(gc_encode_ex(GC_NVFP4, x, N, 0, whole, flags, 3, 4, 5) == 0, "encode nvfp4");
        const uint8_t *wb = whole + 4 * NSUPER, *wc = wb + (N + 15) / 16;
        for (int k = 0; k < NSUPER; k++) {
            float amax = 0.0f, scale;
            for (int i = k * SB; i < N && i < (k + 1) * SB; i++)
                amax = isfinite(x[i]) && fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            memcpy(&scale, whole + 4 * k, 4);
            CHECK(scale == amax / (6.0f * 448.0f), "superblock %d scale %g", k, scale);
        }
        int same = 1;
        for (int c = 0; c < 3; c++) {
            size_t a = cuts[c], n = cuts[c + 1] - a;
            size_t ns = (n + SB - 1) / SB, nb = (n + 15) / 16;
            gc_encode_ex(GC_NVFP4, x + a, n, 0, piece, flags, 3, 4, 5 + a);
            same &= memcmp(piece, whole + 4 * (a / SB), 4 * ns) == 0;
            same &= memcmp(piece + 4 * ns, wb + a / 16, nb) == 0;
            same &= memcmp(piece + 4 * ns + nb, wc + a / 2, (n + 1) / 2) == 0;
        }
        CHECK(same, "nvfp4 (flags %u): pieces at multiples of 4096 give the body's bytes", flags);
    }
}

static void test_nonfinite(void)
{
    float x[40], y[40];
    for (int i = 0; i < 40; i++)
        x[i] = (float)(i + 1) / 8.0f;
    x[3] = NAN;
    x[20] = INFINITY;
    uint8_t w[4 * 40 + 40];
    gc_encode(GC_E4M3, x, 40, 16, w);
    gc_decode(GC_E4M3, w, 40, 16, y, 0);
    for (int i = 0; i < 40; i++)
        CHECK(isfinite(y[i]) == (i != 3 && i != 20), "e4m3 non-finite at %d", i);
    gc_encode(GC_E5M2, x, 40, 16, w);
    gc_decode(GC_E5M2, w, 40, 16, y, 0);
    CHECK(isnan(y[3]) && isinf(y[20]) && y[20] > 0, "e5m2 keeps NaN and +inf");
    gc_encode(GC_NVFP4, x, 40, 0, w);
    gc_decode(GC_NVFP4, w, 40, 0, y, 0);
    for (int i = 0; i < 40; i++)
        CHECK(isfinite(y[i]) == (i >= 32), "nvfp4: blocks 0 and 1 non-finite, 2 finite (%d)", i);
}

/* bfloat16 saturates a finite value that rounds past its largest finite value
 * (0x7f7f) and keeps inf and NaN, on the vector path (32 values a step) and
 * the portable one, with both roundings. */
static void test_bf16_saturates(void)
{
    uint32_t bits[8] = {0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu,
                        0x7f800000u, 0xff800000u, 0x7fc00000u, 0x3f800000u};
    uint16_t want[8] = {0x7f7f, 0xff7f, 0x7f7f, 0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x3f80};
    float x[48];
    for (int i = 0; i < 48; i++)
        memcpy(&x[i], &bits[i % 8], sizeof x[i]);
    for (int level = 0; level < 2; level++)
        for (unsigned flags = 0; flags < 2; flags++) {
            uint16_t w[48];
            gc_codec_simd(level ? GC_SIMD_AUTO : GC_SIMD_PORTABLE);
            CHECK(gc_encode_ex(GC_BF16, x, 48, 0, (uint8_t *)w, flags, 1, 2, 3) == 0, "bf16");
            /* above 0x7f7f both neighbours of a finite value code as 0x7f7f, so
             * stochastic rounding gives the same codes */
            for (int i = 0; i < 48; i++)
                CHECK(w[i] == want[i % 8], "bf16 code of %08x: %04x, want %04x (simd %d flags %u)",
                      bits[i % 8], w[i], want[i % 8], level, flags);
        }
    gc_codec_simd(GC_SIMD_AUTO);
}

/* NVFP4 blocks whose decoded scale is 0 write codes 0 (gc_nvfp4_keeps_codes),
 * on the vector and the portable path: a superblock of amax 3.4e38 whose
 * blocks 1-3 are small against it (scale code 0), among them values above
 * 2^64 (once coded from 0 * inf = NaN) and negative values and zeros, and a
 * second superblock of fp32 subnormals (superblock scale 0). Each such block
 * decodes to +0 exactly; the others keep their codes. */
static void test_nvfp4_zero_scale(void)
{
    enum { SB = GC_NVFP4_SUPERBLOCK, N = SB + 40, NB = (N + 15) / 16 };
    static float x[N], y[N];
    static uint8_t w[8 + NB + (N + 1) / 2], w1[sizeof w];
    for (int i = 0; i < N; i++)
        x[i] = i < SB ? sinf((float)i) * 1e37f : ldexpf(i % 2 ? -1.0f : 1.0f, -149 + i % 3);
    x[0] = 3.4e38f;
    const float small[] = {1e25f, -465.0f, 57344.0f, -1e21f, -0.0f, 1.0f, -1e30f, 0.0f};
    for (int i = 16; i < 64; i++)
        x[i] = i < 32 ? small[i % 8] : i < 48 ? ldexpf(i % 2 ? -1.0f : 1.0f, 66 + i % 34) : -0.0f;
    for (int level = 0; level < 2; level++) {
        gc_codec_simd(level ? GC_SIMD_AUTO : GC_SIMD_PORTABLE);
        CHECK(gc_encode(GC_NVFP4, x, N, 0, level ? w1 : w) == 0, "encode nvfp4");
    }
    CHECK(!memcmp(w, w1, sizeof w), "nvfp4 zero scales: the vector path's bytes");
    const uint8_t *bscales = w + 8, *codes = bscales + NB;
    CHECK(bscales[1] == 0 && bscales[2] == 0 && bscales[3] == 0, "blocks 1-3 have scale code 0");
    gc_decode(GC_NVFP4, w, N, 0, y, 0);
    for (int j = 0; j < NB; j++) {
        int zero = (j >= 1 && j <= 3) || j >= SB / 16; /* its decoded scale is 0 */
        int clear = 1;
        for (int i = 16 * j; i < 16 * j + 16 && i < N; i++) {
            uint32_t bits;
            memcpy(&bits, &y[i], sizeof bits);
            clear &= ((codes[i / 2] >> (4 * (i % 2))) & 0xfu) == 0 && bits == 0;
        }
        CHECK(clear == zero, "nvfp4 block %d: codes 0 and values +0 iff its scale is 0", j);
    }
    gc_codec_simd(GC_SIMD_AUTO);
}

static void test_accumulate(void)
{
    float x[300], acc[300], once[300];
    for (int i = 0; i < 300; i++)
        x[i] = sinf((float)i);
    uint8_t w[2 * 300 + 4 * 300];
    int fmts[] = {GC_E4M3, GC_E5M2, GC_NVFP4, GC_BF16, GC_MXFP8_E4M3, GC_MXFP8_E5M2, GC_MXFP4};
    for (int f = 0; f < 7; f++) {
        gc_encode(fmts[f], x, 300, 128, w);
        gc_decode(fmts[f], w, 300, 128, once, 0);
        for (int i = 0; i < 300; i++)
            acc[i] = 1.5f;
        gc_decode(fmts[f], w, 300, 128, acc, 1);
        int ok = 1;
        for (int i = 0; i < 300; i++)
            ok &= acc[i] == 1.5f + once[i];
        CHECK(ok, "accumulate fmt %d adds the decoded values", fmts[f]);
    }
}

/* gc_decode_onto writes base + the decoded values, the bits of a copy and an
 * accumulating decode, on both loops, one and three threads, a length that
 * ends inside a vector and an output past a cache line's start (streamed). */
static void test_decode_onto(void)
{
    enum { N = 3 * (1 << 19) + 4103 };
    float *x = malloc(N * sizeof(float)), *base = malloc(N * sizeof(float));
    float *want = malloc(N * sizeof(float)), *space = malloc((N + 16) * sizeof(float));
    uint8_t *w = malloc(4 * N + 4 * N / 16 + 64);
    CHECK(x && base && want && space && w, "decode onto: memory");
    if (!(x && base && want && space && w))
        goto done;
    for (size_t i = 0; i < N; i++) {
        x[i] = sinf((float)i) * (float)(1 + i % 7);
        base[i] = cosf((float)i);
    }
    int fmts[] = {GC_E4M3, GC_E5M2, GC_NVFP4, GC_BF16, GC_MXFP8_E4M3, GC_MXFP8_E5M2, GC_MXFP4};
    for (int f = 0; f < 7; f++) {
        gc_encode(fmts[f], x, N, 128, w);
        memcpy(want, base, N * sizeof(float));
        gc_decode(fmts[f], w, N, 128, want, 1);
        for (int simd = 0; simd < 2; simd++) {
            for (int threads = 1; threads <= 3; threads += 2) {
                gc_codec_simd(simd ? GC_SIMD_AUTO : GC_SIMD_PORTABLE);
                gc_codec_threads(threads);
                float *out = space + 3;
                CHECK(gc_decode_onto(fmts[f], w, N, 128, base, out) == 0, "decode onto runs");
                CHECK(memcmp(out, want, N * sizeof(float)) == 0,
                      "decode onto fmt %d (simd %d, %d threads) is copy + accumulate", fmts[f],
                      simd, threads);
                memcpy(out, base, N * sizeof(float));
                gc_decode_onto(fmts[f], w, N, 128, out, out);
                CHECK(memcmp(out, want, N * sizeof(float)) == 0,
                      "decode onto itself fmt %d is the accumulating decode", fmts[f]);
            }
        }
    }
    CHECK(gc_decode_onto(GC_E4M3, w, 4, 0, NULL, want) == GC_EINVAL, "a NULL base is refused");
    CHECK(gc_decode_onto(99, w, 4, 0, base, want) == GC_EINVAL, "unknown format refused");
done:
    gc_codec_simd(GC_SIMD_AUTO);
    gc_codec_threads(1);
    free(x);
    free(base);
    free(want);
    free(space);
    free(w);
}

static void test_random_wires(void)
{
    /* any bytes decode without touching memory beyond the body */
    srand(1234);
    for (int trial = 0; trial < 2000; trial++) {
        size_t n = (size_t)(rand() % 700);
        size_t block = (size_t)(rand() % 200);
        int fmt = 1 + rand() % 7;
        size_t size = gc_wire_size(fmt, n, block);
        uint8_t *wire = malloc(size ? size : 1);
        float *out = malloc((n ? n : 1) * sizeof(float));
        for (size_t i = 0; i < size; i++)
            wire[i] = (uint8_t)rand();
        CHECK(gc_decode(fmt, wire, n, block, out, 0) == 0, "decode random wire");
        /* and encode the decoded values (NaN, inf, anything) with every option */
        unsigned flags = (unsigned)(rand() % 2) | (fmt >= GC_MXFP8_E4M3 ? (rand() % 2) * 2u : 0u);
        CHECK(gc_encode_ex(fmt, out, n, block, wire, flags, (uint64_t)rand(), (uint64_t)rand(),
                           (uint64_t)0 - (uint64_t)rand()) == 0, "encode random values");
        free(wire);
        free(out);
    }
}

/* One input of n values for test_paths: normal values, with runs of zeros,
 * tiny values, fp32 subnormals, huge values and any bit patterns. */
static void path_input(float *x, size_t n, int kind)
{
    for (size_t i = 0; i < n; i++) {
        float v = (float)(rand() % 20001 - 10000) * 1e-4f;
        int run = (int)((i / 700) % 6);
        if (kind && run == 1)
            v = 0.0f;
        else if (kind && run == 2)
            v *= 1e-37f;
        else if (kind && run == 3)
            v *= 1e-42f;
        else if (kind && run == 4)
            v *= 1e35f;
        else if (kind && run == 5 && rand() % 40 == 0) {
            uint32_t u = (uint32_t)rand() << 16 ^ (uint32_t)rand();
            memcpy(&v, &u, sizeof v);
        }
        x[i] = v;
    }
}

static int same_bits(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof *a) && !(isnan(a[i]) && isnan(b[i])))
            return 0;
    return 1;
}

/* Every vector path and thread count writes the bytes and values of the
 * portable loops on one thread: encode with each flag, decode and
 * accumulate of the encoded body and of random bytes (NaN payloads may
 * differ: any NaN matches any NaN), over lengths that end inside blocks. */
static void test_paths(void)
{
    static const size_t sizes[] = {1, 17, 128, 4095, 4096, 4097, 9000, 3u << 19, (3u << 19) + 4099};
    static const size_t blocks[] = {128, 64, 0};
    srand(99);
    int simd = gc_codec_simd(GC_SIMD_AUTO);
    for (int fmt = GC_E4M3; fmt <= GC_MXFP4; fmt++)
        for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
            for (size_t bi = 0; bi < (fmt <= GC_E5M2 ? 3u : 1u); bi++)
                for (int kind = 0; kind < 2; kind++) {
                    size_t n = sizes[si], block = fmt <= GC_E5M2 ? blocks[bi] : 0;
                    size_t size = gc_wire_size(fmt, n, block);
                    float *x = malloc(n * sizeof *x), *want = malloc(n * sizeof *x);
                    float *got = malloc(n * sizeof *x);
                    uint8_t *w0 = malloc(size), *w1 = malloc(size);
                    path_input(x, n, kind);
                    for (unsigned flags = 0; flags < (fmt >= GC_MXFP8_E4M3 ? 4u : 2u); flags++) {
                        gc_codec_simd(GC_SIMD_PORTABLE);
                        gc_codec_threads(1);
                        gc_encode_ex(fmt, x, n, block, w0, flags, 3, 4, 5);
                        for (int level = 0; level < 2; level++)
                            for (int threads = 1; threads <= 3; threads += 2) {
                                gc_codec_simd(level ? GC_SIMD_AUTO : GC_SIMD_PORTABLE);
                                gc_codec_threads(threads);
                                gc_encode_ex(fmt, x, n, block, w1, flags, 3, 4, 5);
                                CHECK(!memcmp(w0, w1, size), "encode fmt %d n %zu block %zu "
                                      "flags %u simd %d threads %d", fmt, n, block, flags,
                                      level, threads);
                            }
                    }
                    for (int garbage = 0; garbage < 2; garbage++) {
                        if (garbage)
                            for (size_t i = 0; i < size; i++)
                                w0[i] = (uint8_t)rand();
                        for (int acc = 0; acc < 2; acc++) {
                            gc_codec_simd(GC_SIMD_PORTABLE);
                            gc_codec_threads(1);
                            memcpy(want, x, n * sizeof *x);
                            gc_decode(fmt, w0, n, block, want, acc);
                            for (int threads = 1; threads <= 3; threads += 2) {
                                gc_codec_simd(GC_SIMD_AUTO);
                                gc_codec_threads(threads);
                                memcpy(got, x, n * sizeof *x);
                                gc_decode(fmt, w0, n, block, got, acc);
                                CHECK(same_bits(want, got, n), "decode fmt %d n %zu block %zu "
                                      "acc %d garbage %d threads %d", fmt, n, block, acc,
                                      garbage, threads);
                            }
                        }
                    }
                    free(x);
                    free(want);
                    free(got);
                    free(w0);
                    free(w1);
                }
    gc_codec_simd(GC_SIMD_AUTO);
    gc_codec_threads(1);
    printf("vector path tested: %s\n", simd ? "AVX-512" : "none on this CPU (portable only)");
}

int main(void)
{
    test_fp8_codes(GC_E4M3, e4m3, 448.0f);
    test_fp8_codes(GC_E5M2, e5m2, 57344.0f);
    test_e2m1_codes();
    test_e8m0_scales();
    test_wire_sizes();
    test_stochastic_neighbours();
    test_nvfp4_superblocks();
    test_nonfinite();
    test_bf16_saturates();
    test_nvfp4_zero_scale();
    test_accumulate();
    test_decode_onto();
    test_random_wires();
    test_paths();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
