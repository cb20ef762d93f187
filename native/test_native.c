/*
 * C unit tests of the native codec, independent of Python: decode of every
 * code against a second, ldexp-based definition of the formats; encode of
 * every representable value back to its code; every E2M1 code through the
 * NVFP4 decoder; wire sizes; non-finite rules;
 * accumulate; and decoding random bytes (run under -Db_sanitize=address,
 * undefined, that catches any out-of-bounds access). Prints
 * "N passed, M failed" and exits non-zero on failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "geocomm.h"

static int passed, failed;

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (cond) {                                                                       \
            passed++;                                                                     \
        } else {                                                                          \
            failed++;                                                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                          \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fputc('\n', stderr);                                                          \
        }                                                                                 \
    } while (0)

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

static void test_wire_sizes(void)
{
    CHECK(gc_wire_size(GC_E4M3, 0, 128) == 0, "empty");
    CHECK(gc_wire_size(GC_E4M3, 129, 128) == 2 * 4 + 129, "e4m3 129");
    CHECK(gc_wire_size(GC_E5M2, 100, 0) == 4 + 100, "e5m2 per tensor");
    CHECK(gc_wire_size(GC_NVFP4, 33, 0) == 4 + 3 + 17, "nvfp4 33");
    CHECK(gc_wire_size(GC_BF16, 7, 0) == 14, "bf16 7");
    CHECK(gc_wire_size(99, 7, 0) == 0, "unknown format has no size");
    float x = 1.0f;
    uint8_t w[16];
    CHECK(gc_encode(99, &x, 1, 0, w) == GC_EINVAL, "unknown format rejected");
    CHECK(gc_decode(99, w, 1, 0, &x, 0) == GC_EINVAL, "unknown format rejected");
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

static void test_accumulate(void)
{
    float x[300], acc[300], once[300];
    for (int i = 0; i < 300; i++)
        x[i] = sinf((float)i);
    uint8_t w[2 * 300 + 4 * 300];
    int fmts[] = {GC_E4M3, GC_E5M2, GC_NVFP4, GC_BF16};
    for (int f = 0; f < 4; f++) {
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

static void test_random_wires(void)
{
    /* any bytes decode without touching memory beyond the body */
    srand(1234);
    for (int trial = 0; trial < 2000; trial++) {
        size_t n = (size_t)(rand() % 700);
        size_t block = (size_t)(rand() % 200);
        int fmt = 1 + rand() % 4;
        size_t size = gc_wire_size(fmt, n, block);
        uint8_t *wire = malloc(size ? size : 1);
        float *out = malloc((n ? n : 1) * sizeof(float));
        for (size_t i = 0; i < size; i++)
            wire[i] = (uint8_t)rand();
        CHECK(gc_decode(fmt, wire, n, block, out, 0) == 0, "decode random wire");
        free(wire);
        free(out);
    }
}

int main(void)
{
    test_fp8_codes(GC_E4M3, e4m3, 448.0f);
    test_fp8_codes(GC_E5M2, e5m2, 57344.0f);
    test_e2m1_codes();
    test_wire_sizes();
    test_nonfinite();
    test_accumulate();
    test_random_wires();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
