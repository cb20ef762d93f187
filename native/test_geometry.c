/*
 * C unit tests of the geometry kernels: gc_geo_project, gc_geo_expand and
 * gc_geo_accumulate against a literal, element-by-element transcription of
 * the order that gc_linalg.h defines (bit for bit), over random shapes and
 * ranges that start and end inside rows, with inf and NaN inputs; and the
 * orthonormality of gc_geo_orthonormalize, also for deficient inputs; and
 * gc_geo_encode and gc_geo_decode against the expansion and the codec's
 * calls one after the other. The
 * kernels run on the portable loops and on the AVX-512 ones (where the CPU
 * has them), which must both give the definition's bits. Run
 * under -Db_sanitize=address,undefined it also checks every access.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "geocomm.h"
#include "gc_check.h"
#include "gc_linalg.h"

static float uniform(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

/* ---- the definitions, one element at a time --------------------------------- */

static void ref_project(const float *x, size_t lo, size_t len, size_t n, const float *vt,
                        size_t k, float *coef)
{
    size_t rows = gc_geo_rows(lo, len, n);
    for (size_t r = 0; r < rows; r++) {
        size_t row = lo / n + r;
        size_t a = row * n > lo ? row * n : lo;
        size_t b = (row + 1) * n < lo + len ? (row + 1) * n : lo + len;
        for (size_t l = 0; l < k; l++) {
            float total = 0.0f;
            for (size_t c = a; c < b; c += GC_DOT_CHUNK) { /* the chunks, then their chain */
                size_t end = b - c < GC_DOT_CHUNK ? b : c + GC_DOT_CHUNK;
                float p[GC_LANES] = {0};
                for (size_t e = c; e < end; e++) {
                    size_t q = (e - c) % GC_LANES;
                    p[q] = gc_mad(p[q], gc_finite_or_zero(x[e - lo]), vt[l * n + e % n]);
                }
                total = c == a ? gc_lane_sum(p) : total + gc_lane_sum(p);
            }
            coef[r * k + l] = total;
        }
    }
}

static void ref_expand(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                       const float *vt, size_t k, float sign, float *out)
{
    for (size_t e = lo; e < lo + len; e++) {
        size_t r = e / n - lo / n, j = e % n;
        float t = 0.0f;
        for (size_t l = 0; l < k; l++)
            t = gc_mad(t, coef[r * k + l], vt[l * n + j]);
        out[e - lo] = x[e - lo] + sign * t;
    }
}

static void ref_accumulate(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                           size_t k, float *acc)
{
    size_t rows = gc_geo_rows(lo, len, n);
    for (size_t l = 0; l < k; l++)
        for (size_t j = 0; j < n; j++)
            for (size_t t0 = 0; t0 < rows; t0 += GC_ACC_ROWS) {
                float p = 0.0f;
                for (size_t e = lo; e < lo + len; e++) {
                    size_t r = e / n - lo / n;
                    if (e % n == j && r >= t0 && r < t0 + GC_ACC_ROWS)
                        p = gc_mad(p, coef[r * k + l], x[e - lo]);
                }
                acc[l * n + j] += p;
            }
}

/* ---- tests ---------------------------------------------------------------------- */

static void test_kernels_match_definition(void)
{
    unsigned s = 7;
    for (int trial = 0; trial < 400; trial++) {
        /* every 8th trial is tall and narrow (accumulations of several tiles), every
         * 8th from the 4th short and wide (dot products of several chunks) */
        int tall = trial % 8 == 0, wide = trial % 8 == 4;
        size_t m = 1 + (size_t)(rand() % (tall ? 3 * GC_ACC_ROWS : wide ? 6 : 9));
        size_t n = 1 + (size_t)(rand() % (tall ? 12 : wide ? 3 * GC_DOT_CHUNK : 90));
        size_t k = 1 + (size_t)(rand() % 9), total = m * n;
        size_t lo = (size_t)rand() % total, len = 1 + (size_t)rand() % (total - lo);
        size_t rows = gc_geo_rows(lo, len, n);
        float *x = malloc(sizeof(float) * len), *vt = malloc(sizeof(float) * k * n);
        float *c1 = malloc(sizeof(float) * k * rows), *c2 = malloc(sizeof(float) * k * rows);
        float *o1 = malloc(sizeof(float) * len), *o2 = malloc(sizeof(float) * len);
        float *a1 = malloc(sizeof(float) * k * n), *a2 = malloc(sizeof(float) * k * n);
        for (size_t i = 0; i < len; i++) {
            x[i] = uniform(&s) * 100.0f;
            if (rand() % 40 == 0)
                x[i] = rand() % 2 ? INFINITY : NAN;
        }
        for (size_t i = 0; i < k * n; i++) {
            vt[i] = uniform(&s);
            a1[i] = a2[i] = uniform(&s);
        }
        CHECK(gc_geo_project(x, lo, len, n, vt, k, c1) >= 0, "project returns a count");
        ref_project(x, lo, len, n, vt, k, c2);
        CHECK(!memcmp(c1, c2, sizeof(float) * k * rows), "project m=%zu n=%zu k=%zu lo=%zu "
              "len=%zu", m, n, k, lo, len);
        float sign = rand() % 2 ? 1.0f : -1.0f;
        CHECK(gc_geo_expand(x, lo, len, n, c1, vt, NULL, k, sign, o1) == 0, "expand returns 0");
        ref_expand(x, lo, len, n, c1, vt, k, sign, o2);
        float *packed = malloc(sizeof(float) * gc_geo_packed_size(k, n));
        float *o3 = malloc(sizeof(float) * len);
        gc_geo_pack(vt, k, n, packed);
        gc_geo_expand(x, lo, len, n, c1, vt, packed, k, sign, o3);
        CHECK(!memcmp(o1, o3, sizeof(float) * len), "a packed basis gives the same bits");
        free(packed), free(o3);
        int same = 1;
        for (size_t i = 0; i < len; i++)
            same &= isnan(o1[i]) ? isnan(o2[i]) : !memcmp(o1 + i, o2 + i, sizeof(float));
        CHECK(same, "expand m=%zu n=%zu k=%zu lo=%zu len=%zu", m, n, k, lo, len);
        for (size_t i = 0; i < len; i++) /* accumulation is defined for finite x */
            if (!isfinite(x[i]))
                x[i] = 0.5f;
        CHECK(gc_geo_accumulate(x, lo, len, n, c1, k, a1) == 0, "accumulate returns 0");
        ref_accumulate(x, lo, len, n, c1, k, a2);
        CHECK(!memcmp(a1, a2, sizeof(float) * k * n), "accumulate m=%zu n=%zu k=%zu lo=%zu "
              "len=%zu", m, n, k, lo, len);
        free(x), free(vt), free(c1), free(c2), free(o1), free(o2), free(a1), free(a2);
    }
}

/* gc_geo_encode writes the bytes of gc_geo_expand (sign -1) followed by
 * gc_encode_ex, for ranges of several tiles that start and end inside rows,
 * with stochastic rounding, and with one scale for the whole range (mapped
 * whole, then encoded); gc_geo_decode the values of gc_decode followed by
 * gc_geo_expand (sign 1); bad arguments are refused. */
static void test_split_calls(void)
{
    unsigned s = 11;
    const int fmts[] = {GC_E4M3, GC_E5M2, GC_NVFP4, GC_MXFP8_E4M3, GC_MXFP4, GC_BF16};
    const size_t blocks[] = {128, 32, 0};
    size_t n = 301, k = 5, lo = 1234, len = 40000, rows = gc_geo_rows(lo, len, n);
    float *x = malloc(sizeof(float) * len), *vt = malloc(sizeof(float) * k * n);
    float *coef = malloc(sizeof(float) * k * rows), *mapped = malloc(sizeof(float) * len);
    float *packed = malloc(sizeof(float) * gc_geo_packed_size(k, n));
    float *back = malloc(sizeof(float) * len), *sums = malloc(sizeof(float) * len);
    for (size_t i = 0; i < len; i++)
        x[i] = uniform(&s) * 8.0f;
    x[len / 3] = INFINITY;
    for (size_t i = 0; i < k * n; i++)
        vt[i] = uniform(&s);
    gc_geo_pack(vt, k, n, packed);
    gc_geo_project(x, lo, len, n, vt, k, coef);
    gc_geo_expand(x, lo, len, n, coef, vt, packed, k, -1.0f, mapped);
    for (size_t f = 0; f < sizeof fmts / sizeof fmts[0]; f++)
        for (size_t b = 0; b < 3; b++)
            for (unsigned flags = 0; flags <= GC_STOCHASTIC; flags++) {
                size_t bytes = gc_wire_size(fmts[f], len, blocks[b]);
                uint8_t *want = malloc(bytes), *got = malloc(bytes);
                gc_encode_ex(fmts[f], mapped, len, blocks[b], want, flags, 3, 4, lo);
                CHECK(gc_geo_encode(fmts[f], x, lo, len, n, coef, vt, packed, k, blocks[b], got,
                                    flags, 3, 4, lo) == 0, "split encode returns 0");
                CHECK(!memcmp(want, got, bytes), "split encode fmt=%d block=%zu flags=%u",
                      fmts[f], blocks[b], flags);
                gc_decode(fmts[f], want, len, blocks[b], back, 0);
                gc_geo_expand(back, lo, len, n, coef, vt, packed, k, 1.0f, back);
                CHECK(gc_geo_decode(fmts[f], want, lo, len, n, coef, vt, packed, k, blocks[b],
                                    sums) == 0, "split decode returns 0");
                int same = 1;
                for (size_t i = 0; i < len; i++)
                    same &= isnan(back[i]) ? isnan(sums[i]) : !memcmp(back + i, sums + i, 4);
                CHECK(same, "split decode fmt=%d block=%zu", fmts[f], blocks[b]);
                free(want), free(got);
            }
    uint8_t wire[64];
    CHECK(gc_geo_encode(GC_E4M3, x, lo, 16, n, coef, vt, NULL, k, 128, wire, 0, 0, 0, 0)
              == GC_EINVAL, "a split encode needs the packed basis");
    CHECK(gc_geo_encode(99, x, lo, 16, n, coef, vt, packed, k, 128, wire, 0, 0, 0, 0)
              == GC_EINVAL, "an unknown format is refused");
    CHECK(gc_geo_encode(GC_E4M3, x, lo, 0, n, coef, vt, packed, k, 128, wire, 0, 0, 0, 0) == 0,
          "an empty range encodes as nothing");
    CHECK(gc_geo_decode(GC_E4M3, wire, lo, 16, n, coef, vt, NULL, k, 128, sums) == GC_EINVAL,
          "a split decode needs the packed basis");
    free(x), free(vt), free(coef), free(mapped), free(packed), free(back), free(sums);
}

static void test_nonfinite_rows(void)
{
    /* a NaN in one row leaves the other rows' projections untouched and its
     * own row equal to the projection with the NaN read as 0 */
    float x[2 * 16], vt[16], coef[2], clean[2];
    for (int j = 0; j < 16; j++) {
        x[j] = (float)j;
        x[16 + j] = (float)(j * j);
        vt[j] = 1.0f / (float)(j + 1);
    }
    gc_geo_project(x, 0, 32, 16, vt, 1, clean);
    float keep = x[3];
    x[3] = 0.0f;
    gc_geo_project(x, 0, 32, 16, vt, 1, clean);
    x[3] = NAN;
    CHECK(gc_geo_project(x, 0, 32, 16, vt, 1, coef) == 1, "one row had a NaN");
    CHECK(coef[0] == clean[0] && coef[1] == clean[1], "NaN reads as 0 in its row only");
    x[3] = keep;
    float out[32];
    x[5] = INFINITY;
    gc_geo_expand(x, 0, 32, 16, coef, vt, NULL, 1, -1.0f, out);
    CHECK(isinf(out[5]) && isfinite(out[4]), "expand keeps inf at its position");
}

static void test_orthonormalize(void)
{
    size_t k = 6, n = 50;
    float a[6 * 50];
    unsigned s = 3;
    for (size_t i = 0; i < k * n; i++)
        a[i] = uniform(&s);
    memcpy(a + 2 * n, a, sizeof(float) * n);  /* row 2 repeats row 0 */
    memset(a + 4 * n, 0, sizeof(float) * n);  /* row 4 is zero */
    a[5 * n + 7] = NAN;                       /* row 5 holds a NaN (read as 0) */
    CHECK(gc_geo_orthonormalize(a, k, n, 99) == 0, "orthonormalize returns 0");
    double worst = 0.0;
    for (size_t i = 0; i < k; i++)
        for (size_t j = 0; j < k; j++) {
            double d = 0.0;
            for (size_t c = 0; c < n; c++)
                d += (double)a[i * n + c] * a[j * n + c];
            worst = fmax(worst, fabs(d - (i == j)));
        }
    /* fp64 Gram-Schmidt twice, rounded to fp32: orthonormal to ~n * 2^-24 */
    CHECK(worst < 1e-5, "rows orthonormal (worst deviation %g)", worst);
    float b[6 * 50];
    memset(b, 0, sizeof b);
    gc_geo_orthonormalize(b, k, n, 99);
    float c[6 * 50];
    memset(c, 0, sizeof c);
    gc_geo_orthonormalize(c, k, n, 99);
    CHECK(!memcmp(b, c, sizeof b), "the random fill depends on the seed only");
    CHECK(gc_geo_orthonormalize(a, 51, 50, 1) == GC_EINVAL, "k > n is refused");
}

int main(void)
{
    /* the portable loops, then the AVX-512 ones where the CPU has them */
    for (int level = GC_SIMD_PORTABLE; level <= GC_SIMD_AVX512; level++) {
        srand(2026);
        if (gc_codec_simd(level) == level) {
            test_kernels_match_definition();
            test_split_calls();
        }
    }
    gc_codec_simd(GC_SIMD_AUTO);
    test_nonfinite_rows();
    test_orthonormalize();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
