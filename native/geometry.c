/*
 * CPU loops of the GeoFP8 geometry kernels (native/geocomm.h). The order of
 * every sum is fixed by gc_linalg.h; these loops only choose how to walk the
 * data. Vectors of GC_LANES floats (GCC vector extensions) hold either the
 * lanes of a dot product or GC_LANES independent columns, so the vector code
 * computes exactly the scalar chains, whatever instruction set a clone uses.
 *
 * A range [lo, lo + len) of a row-major m x n matrix is walked as segments:
 * a partial first row, whole rows, a partial last row. Projections and
 * accumulations of a segment start their column lanes at the segment's first
 * column, so partial rows give partial dot products that the caller sums.
 *
 * Where gc_codec_simd has picked the AVX-512 loops, projections and
 * expansions of whole rows, and accumulations, run on vectors of 2 GC_LANES
 * floats (section "AVX-512 loops"): a projection's vector holds the lanes of
 * two basis rows' dot products, the others' 16 independent columns. The
 * chains are the same ones, and so are the bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "geocomm.h"
#include "gc_linalg.h"
#include "gc_simd.h"
#include "gc_internal.h"

#if defined(GC_USE_CLONES) && defined(__x86_64__) && defined(__GNUC__)
#define GC_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define GC_CLONES
#endif

/* the kernels below are written for constant arguments: inlining specializes them */
#define GC_INLINE static inline __attribute__((always_inline))

typedef float gc_vec __attribute__((vector_size(4 * GC_LANES)));
typedef int32_t gc_ivec __attribute__((vector_size(4 * GC_LANES)));


GC_INLINE gc_vec load(const float *p)
{
    gc_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

GC_INLINE void store(float *p, gc_vec v) { memcpy(p, &v, sizeof v); }

/* An expansion's values x + sign t are written with gc_gpu_nan (GeoFP8 encodes
 * them next: x86's NaN signs gave other codes than the kernels'); gpu_nans is
 * gc_gpu_nan of a vector. */
GC_INLINE gc_vec gpu_nans(gc_vec v)
{
    gc_ivec bits, nan = v != v; /* all ones where v is NaN */
    memcpy(&bits, &v, sizeof bits);
    bits = (bits & ~nan) | (nan & 0x7fffffff);
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* v with its non-finite lanes replaced by +0 (gc_finite_or_zero per lane). */
GC_INLINE gc_vec finite_or_zero(gc_vec v)
{
    gc_ivec bits;
    memcpy(&bits, &v, sizeof bits);
    gc_ivec ok = (bits & 0x7fffffff) < 0x7f800000;
    bits &= ok;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float lane_sum(gc_vec v)
{
    float p[GC_LANES];
    memcpy(p, &v, sizeof p);
    return gc_lane_sum(p);
}

/* The dot product of a row segment with one basis row, lanes held in `acc`
 * for the full chunks; the tail columns go into their lanes, then the tree. */
static inline float finish_dot(gc_vec acc, const float *x, const float *v, size_t done,
                               size_t cols, int masked)
{
    float p[GC_LANES];
    memcpy(p, &acc, sizeof p);
    for (size_t j = done; j < cols; j++) {
        float xj = masked ? gc_finite_or_zero(x[j]) : x[j];
        p[j - done] = gc_mad(p[j - done], xj, v[j]);
    }
    return gc_lane_sum(p);
}

/* ---- projection: coef[r][l] = dot(x[r][0 .. cols), vt[l][0 .. cols)) ----------
 *
 * gc_linalg.h's "dot": each chunk of GC_DOT_CHUNK columns sums its own lanes, and
 * the chunks' totals chain in order. The loops stream a row once: where a chunk
 * ends before the row does, its lanes close into the coefficient (chain_total)
 * and start again from zero; the last chunk closes with the tail columns. */

/* Where the vector loop's pass over the chunk from column j0 ends (`full`: the
 * columns of whole lane vectors). */
static inline size_t chunk_end(size_t j0, size_t full)
{
    return full - j0 < GC_DOT_CHUNK ? full : j0 + GC_DOT_CHUNK;
}

/* Whether the chunk of columns that ends at column `end` (a multiple of GC_LANES)
 * closes there, before the row's `cols` columns do. */
static inline int chunk_closes(size_t end, size_t cols)
{
    return end % GC_DOT_CHUNK == 0 && end < cols;
}

/* *c = t for the first chunk of a row (the one ending at `end`), *c + t after it. */
static inline void chain_total(float *c, float t, size_t end)
{
    *c = end <= GC_DOT_CHUNK ? t : *c + t;
}

/* Four rows and two basis rows at a time: eight lane vectors in flight. */
GC_INLINE void project_rows4(const float *x, size_t ldx, size_t cols, const float *vt,
                                 size_t ldv, size_t k, float *coef, size_t ldc, int masked)
{
    size_t full = cols - cols % GC_LANES;
    size_t l = 0;
    for (; l + 2 <= k; l += 2) {
        const float *v0 = vt + l * ldv, *v1 = v0 + ldv;
        gc_vec a[4][2] = {{{0}}};
        for (size_t j0 = 0; j0 < full; j0 += GC_DOT_CHUNK) {
            size_t end = chunk_end(j0, full);
            for (size_t j = j0; j < end; j += GC_LANES) {
                gc_vec b0 = load(v0 + j), b1 = load(v1 + j);
                for (int r = 0; r < 4; r++) {
                    gc_vec xr = load(x + r * ldx + j);
                    if (masked)
                        xr = finite_or_zero(xr);
                    a[r][0] += xr * b0;
                    a[r][1] += xr * b1;
                }
            }
            if (chunk_closes(end, cols))
                for (int r = 0; r < 4; r++)
                    for (int h = 0; h < 2; h++) {
                        chain_total(coef + r * ldc + l + h, lane_sum(a[r][h]), end);
                        a[r][h] = (gc_vec){0};
                    }
        }
        for (int r = 0; r < 4; r++) {
            float *c = coef + r * ldc + l;
            chain_total(c, finish_dot(a[r][0], x + r * ldx, v0, full, cols, masked), cols);
            chain_total(c + 1, finish_dot(a[r][1], x + r * ldx, v1, full, cols, masked), cols);
        }
    }
    for (; l < k; l++) {
        const float *v0 = vt + l * ldv;
        gc_vec a[4] = {{0}};
        for (size_t j0 = 0; j0 < full; j0 += GC_DOT_CHUNK) {
            size_t end = chunk_end(j0, full);
            for (size_t j = j0; j < end; j += GC_LANES) {
                gc_vec b0 = load(v0 + j);
                for (int r = 0; r < 4; r++) {
                    gc_vec xr = load(x + r * ldx + j);
                    a[r] += (masked ? finite_or_zero(xr) : xr) * b0;
                }
            }
            if (chunk_closes(end, cols))
                for (int r = 0; r < 4; r++) {
                    chain_total(coef + r * ldc + l, lane_sum(a[r]), end);
                    a[r] = (gc_vec){0};
                }
        }
        for (int r = 0; r < 4; r++)
            chain_total(coef + r * ldc + l,
                        finish_dot(a[r], x + r * ldx, v0, full, cols, masked), cols);
    }
}

GC_INLINE void project_row(const float *x, size_t cols, const float *vt, size_t ldv,
                               size_t k, float *coef, int masked)
{
    size_t full = cols - cols % GC_LANES;
    for (size_t l = 0; l < k; l++) {
        const float *v0 = vt + l * ldv;
        gc_vec a = {0};
        for (size_t j0 = 0; j0 < full; j0 += GC_DOT_CHUNK) {
            size_t end = chunk_end(j0, full);
            for (size_t j = j0; j < end; j += GC_LANES) {
                gc_vec xr = load(x + j);
                a += (masked ? finite_or_zero(xr) : xr) * load(v0 + j);
            }
            if (chunk_closes(end, cols)) {
                chain_total(coef + l, lane_sum(a), end);
                a = (gc_vec){0};
            }
        }
        chain_total(coef + l, finish_dot(a, x, v0, full, cols, masked), cols);
    }
}

static int row_finite(const float *c, size_t k)
{
    for (size_t l = 0; l < k; l++)
        if (!gc_finite(c[l]))
            return 0;
    return 1;
}

/* Rows are computed unmasked (the fast path); project_segment then redoes
 * every row whose coefficients came out non-finite with its non-finite
 * inputs read as 0, which is what the masked definition gives for every row. */
GC_CLONES static void project_rows(const float *x, size_t ldx, size_t rows, size_t cols,
                                   const float *vt, size_t ldv, size_t k, float *coef)
{
    size_t r = 0;
    for (; r + 4 <= rows; r += 4)
        project_rows4(x + r * ldx, ldx, cols, vt, ldv, k, coef + r * k, k, 0);
    for (; r < rows; r++)
        project_row(x + r * ldx, cols, vt, ldv, k, coef + r * k, 0);
}

GC_CLONES static size_t redo_nonfinite(const float *x, size_t ldx, size_t rows, size_t cols,
                                       const float *vt, size_t ldv, size_t k, float *coef)
{
    size_t redone = 0;
    for (size_t r = 0; r < rows; r++) {
        if (!row_finite(coef + r * k, k)) {
            project_row(x + r * ldx, cols, vt, ldv, k, coef + r * k, 1);
            redone++;
        }
    }
    return redone;
}

#if GC_HAVE_AVX512
static void project_rows_wide(const float *x, size_t ldx, size_t rows, size_t cols,
                              const float *vt, size_t ldv, size_t k, const float *wp,
                              float *coef);
#endif

/* wp: NULL, or vt paired for the wide loops (pair_basis; the segment then
 * starts at column 0). */
static size_t project_segment(const float *x, size_t ldx, size_t rows, size_t cols,
                              const float *vt, size_t ldv, size_t k, float *coef,
                              const float *wp)
{
#if GC_HAVE_AVX512
    if (wp && rows >= 4)
        project_rows_wide(x, ldx, rows, cols, vt, ldv, k, wp, coef);
    else
#else
    (void)wp;
#endif
        project_rows(x, ldx, rows, cols, vt, ldv, k, coef);
    return redo_nonfinite(x, ldx, rows, cols, vt, ldv, k, coef);
}

/* ---- expansion: out[r][j] = x[r][j] + sign * chain_l coef[r][l] * vt[l][j] ----- */

/* Columns per panel of a packed basis: panel p holds vt[l][PANEL p .. + PANEL)
 * for every l, contiguous, so the k basis rows of a column tile stream from
 * one place (rows of vt lie n floats apart and would share cache sets). */
#define GC_PANEL (4 * GC_LANES)

size_t gc_geo_packed_size(size_t k, size_t n)
{
    return (n + GC_PANEL - 1) / GC_PANEL * k * GC_PANEL;
}

int gc_geo_pack(const float *vt, size_t k, size_t n, float *vp)
{
    if (!vt || !vp || k == 0 || n == 0)
        return GC_EINVAL;
    memset(vp, 0, gc_geo_packed_size(k, n) * sizeof(float));
    for (size_t l = 0; l < k; l++)
        for (size_t j = 0; j < n; j++)
            vp[((j / GC_PANEL) * k + l) * GC_PANEL + j % GC_PANEL] = vt[l * n + j];
    return 0;
}

/* A packed copy of vt on whole cache lines (freed by the caller), or NULL
 * when out of memory. */
static float *pack_basis(const float *vt, size_t k, size_t n)
{
    void *vp = NULL;
    if (posix_memalign(&vp, 64, gc_geo_packed_size(k, n) * sizeof(float)))
        return NULL;
    gc_geo_pack(vt, k, n, vp);
    return vp;
}

/* One column of `nrows` rows, the chain in scalar form (tails and partial rows). */
GC_INLINE void expand_column(const float *x, size_t ldx, size_t j, const float *coef,
                             const float *vt, size_t ldv, size_t k, float sign, float *out,
                             size_t nrows)
{
    for (size_t r = 0; r < nrows; r++) {
        float t = 0.0f;
        for (size_t l = 0; l < k; l++)
            t = gc_mad(t, coef[r * k + l], vt[l * ldv + j]);
        out[r * ldx + j] = gc_gpu_nan(x[r * ldx + j] + sign * t);
    }
}

/* Rows r0, r0 + 1 (nrows of them) over whole panels, from the packed basis. */
GC_INLINE void expand_panels(const float *x, size_t ldx, size_t panels, const float *coef,
                             const float *vp, size_t k, float sign, float *out, size_t nrows)
{
    for (size_t p = 0; p < panels; p++) {
        const float *b = vp + p * k * GC_PANEL;
        gc_vec t[2][4] = {{{0}}};
        for (size_t l = 0; l < k; l++, b += GC_PANEL) {
            gc_vec b0 = load(b), b1 = load(b + GC_LANES), b2 = load(b + 2 * GC_LANES),
                   b3 = load(b + 3 * GC_LANES);
            for (size_t r = 0; r < nrows; r++) {
                float c = coef[r * k + l]; /* vector op scalar: the scalar is broadcast */
                t[r][0] += c * b0;
                t[r][1] += c * b1;
                t[r][2] += c * b2;
                t[r][3] += c * b3;
            }
        }
        for (size_t r = 0; r < nrows; r++)
            for (int q = 0; q < 4; q++) {
                size_t at = r * ldx + p * GC_PANEL + q * GC_LANES;
                store(out + at, gpu_nans(load(x + at) + sign * t[r][q]));
            }
    }
}

/* Whole rows (from column 0) with the packed basis; a partial last panel and
 * rows that do not start at column 0 take the scalar chain. */
GC_CLONES static void expand_rows(const float *x, size_t ldx, size_t rows, size_t col,
                                  size_t cols, const float *coef, const float *vt,
                                  const float *vp, size_t k, float sign, float *out)
{
    size_t panels = col == 0 ? cols / GC_PANEL : 0;
    size_t r = 0;
    for (; r + 2 <= rows; r += 2)
        expand_panels(x + r * ldx, ldx, panels, coef + r * k, vp, k, sign, out + r * ldx, 2);
    if (r < rows)
        expand_panels(x + r * ldx, ldx, panels, coef + r * k, vp, k, sign, out + r * ldx, 1);
    for (size_t j = panels * GC_PANEL; j < cols; j++)
        expand_column(x, ldx, j, coef, vt + col, ldx, k, sign, out, rows);
}

#if GC_HAVE_AVX512
static void expand_rows_wide(const float *x, size_t ldx, size_t rows, size_t col, size_t cols,
                             const float *coef, const float *vt, const float *vp, size_t k,
                             float sign, float *out);
#endif

/* wide: the AVX-512 loops run (any segment). */
static void expand_segment(const float *x, size_t ldx, size_t rows, size_t col, size_t cols,
                           const float *coef, const float *vt, const float *vp, size_t k,
                           float sign, float *out, int wide)
{
#if GC_HAVE_AVX512
    if (wide) {
        expand_rows_wide(x, ldx, rows, col, cols, coef, vt, vp, k, sign, out);
        return;
    }
#else
    (void)wide;
#endif
    expand_rows(x, ldx, rows, col, cols, coef, vt, vp, k, sign, out);
}

/* ---- accumulation: acc[l][j] = chain over rows r of coef[r][l] * x[r][j] ------- */

/* Rows per pass over the accumulator, and columns per packed panel of them:
 * a pass copies GC_ROW_BLOCK rows into panels of GC_ACC_PANEL columns (so
 * the rows of a column tile are contiguous, not n floats apart), then every
 * (coefficient, column) tile of acc runs its chain down those rows. */
#define GC_ROW_BLOCK 32
#define GC_ACC_PANEL (2 * GC_LANES)

/* nl (<= 4) coefficients and one panel of columns over `rows` packed rows. */
GC_INLINE void accumulate_tile(const float *xp, size_t rows, const float *coef, size_t k,
                               size_t l, size_t nl, float *acc, size_t lda)
{
    gc_vec a[4][2];
    for (size_t q = 0; q < nl; q++) {
        a[q][0] = load(acc + (l + q) * lda);
        a[q][1] = load(acc + (l + q) * lda + GC_LANES);
    }
    for (size_t r = 0; r < rows; r++, xp += GC_ACC_PANEL) {
        gc_vec x0 = load(xp), x1 = load(xp + GC_LANES);
        for (size_t q = 0; q < nl; q++) {
            float c = coef[r * k + l + q];
            a[q][0] += c * x0;
            a[q][1] += c * x1;
        }
    }
    for (size_t q = 0; q < nl; q++) {
        store(acc + (l + q) * lda, a[q][0]);
        store(acc + (l + q) * lda + GC_LANES, a[q][1]);
    }
}

GC_CLONES static void accumulate_rows(const float *x, size_t ldx, size_t rows, size_t cols,
                                      const float *coef, size_t k, float *acc, size_t lda,
                                      float *scratch)
{
    size_t panels = cols / GC_ACC_PANEL;
    for (size_t r0 = 0; r0 < rows; r0 += GC_ROW_BLOCK) {
        size_t nr = rows - r0 < GC_ROW_BLOCK ? rows - r0 : GC_ROW_BLOCK;
        const float *xb = x + r0 * ldx;
        const float *cb = coef + r0 * k;
        for (size_t r = 0; r < nr; r++)
            for (size_t p = 0; p < panels; p++)
                memcpy(scratch + (p * nr + r) * GC_ACC_PANEL, xb + r * ldx + p * GC_ACC_PANEL,
                       GC_ACC_PANEL * sizeof(float));
        for (size_t p = 0; p < panels; p++) {
            size_t l = 0;
            for (; l + 4 <= k; l += 4)
                accumulate_tile(scratch + p * nr * GC_ACC_PANEL, nr, cb, k, l, 4,
                                acc + p * GC_ACC_PANEL, lda);
            if (l < k)
                accumulate_tile(scratch + p * nr * GC_ACC_PANEL, nr, cb, k, l, k - l,
                                acc + p * GC_ACC_PANEL, lda);
        }
        for (size_t j = panels * GC_ACC_PANEL; j < cols; j++)
            for (size_t l = 0; l < k; l++) {
                float t = acc[l * lda + j];
                for (size_t r = 0; r < nr; r++)
                    t = gc_mad(t, cb[r * k + l], xb[r * ldx + j]);
                acc[l * lda + j] = t;
            }
    }
}

#if GC_HAVE_AVX512
static void accumulate_rows_wide(const float *x, size_t ldx, size_t rows, size_t cols,
                                 const float *coef, size_t k, float *acc, size_t lda);
#endif

/* wide: the AVX-512 loops may run (they need no scratch). */
static void accumulate_segment(const float *x, size_t ldx, size_t rows, size_t cols,
                               const float *coef, size_t k, float *acc, size_t lda,
                               float *scratch, int wide)
{
#if GC_HAVE_AVX512
    if (wide) {
        accumulate_rows_wide(x, ldx, rows, cols, coef, k, acc, lda);
        return;
    }
#else
    (void)wide;
#endif
    accumulate_rows(x, ldx, rows, cols, coef, k, acc, lda, scratch);
}

/* ---- AVX-512 loops -------------------------------------------------------------
 *
 * The same chains on vectors of 2 GC_LANES floats, for CPUs with AVX-512
 * (gc_codec_simd). A projection vector holds the GC_LANES lanes of one row's
 * dot products with two basis rows (the row's values in both halves, the two
 * basis rows side by side), so each lane still takes its columns in order;
 * an expansion's or an accumulation's vector holds 16 columns, each its own
 * chain. Partial rows, the last basis row of an odd k and the tail columns
 * run the scalar chains. */
#if GC_HAVE_AVX512
#include <immintrin.h>

typedef float gc_wvec __attribute__((vector_size(8 * GC_LANES)));

GC_INLINE gc_wvec wload(const float *p)
{
    gc_wvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

GC_INLINE void wstore(float *p, gc_wvec v) { memcpy(p, &v, sizeof v); }

/* The GC_LANES floats at p, in both halves (one broadcast load). */
GC_AVX512 GC_INLINE gc_wvec wdup(const float *p)
{
    return (gc_wvec)_mm512_broadcast_f32x8(_mm256_loadu_ps(p));
}

/* The pairs layout of vt (k x n) over its whole chunks of GC_LANES columns:
 * chunk c of pair p holds vt[2p][8c .. 8c + 8) then vt[2p + 1][8c .. 8c + 8). */
static size_t paired_size(size_t k, size_t n) { return k / 2 * (n / GC_LANES) * 2 * GC_LANES; }

static void pair_basis(const float *vt, size_t k, size_t n, float *wp)
{
    size_t chunks = n / GC_LANES;
    for (size_t p = 0; p < k / 2; p++)
        for (size_t c = 0; c < chunks; c++)
            for (size_t h = 0; h < 2; h++)
                memcpy(wp + ((p * chunks + c) * 2 + h) * GC_LANES,
                       vt + (2 * p + h) * n + c * GC_LANES, GC_LANES * sizeof(float));
}

typedef int32_t gc_wivec __attribute__((vector_size(8 * GC_LANES)));

/* gc_gpu_nan of 16 lanes (generic vectors, as gpu_nans: callers inline it in
 * AVX-512 loops). */
GC_INLINE gc_wvec wgpu_nans(gc_wvec v)
{
    gc_wivec bits, nan = v != v;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits & ~nan) | (nan & 0x7fffffff);
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The chunk ending at column `end` of coef[l], coef[l + 1] from a wide lane vector
 * (low half: basis row l), with no tail columns: the lanes combine in the vector,
 * lane 0 of each half becoming (p0 + p4 + ...) in gc_lane_sum's tree, step by step
 * (a0 = p0 + p4, then a0 + a2, then (a0 + a2) + (a1 + a3)); then chain_total. */
GC_INLINE void close_pair(gc_wvec acc, float *coef, size_t l, size_t end)
{
    const gc_wivec by4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const gc_wivec by2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const gc_wivec by1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    gc_wvec a = acc + __builtin_shuffle(acc, by4);
    gc_wvec b = a + __builtin_shuffle(a, by2);
    gc_wvec c = b + __builtin_shuffle(b, by1);
    chain_total(coef + l, c[0], end);
    chain_total(coef + l + 1, c[GC_LANES], end);
}

/* The last chunk of a row: its tail columns into their lanes first (chain_total). */
GC_INLINE void finish_pair(gc_wvec acc, const float *x, const float *vt, size_t ldv, size_t l,
                           size_t full, size_t cols, float *coef)
{
    if (full == cols) {
        close_pair(acc, coef, l, cols);
        return;
    }
    gc_vec half[2];
    memcpy(half, &acc, sizeof half);
    for (int h = 0; h < 2; h++)
        chain_total(coef + l + h, finish_dot(half[h], x, vt + (l + h) * ldv, full, cols, 0), cols);
}

/* Pairs of basis rows a pass over four rows takes at most: 4 x 5 lane
 * vectors in flight, 5 of the basis and one of x fill 26 of the 32
 * registers; a k = 10 projection reads each row once (three pairs a pass
 * read it twice and took 4.3 ms over 4096^2 values in cache, five 2.3 ms). */
#define GC_PAIRS 5

/* Four rows and np (<= GC_PAIRS) pairs of basis rows from pair p0 (4 np
 * vectors in flight). The first pass over the rows asks for the next four
 * rows' lines as it goes (4.9 ms instead of 5.4-6.2 for 4096^2 values from
 * memory; a prefetch past the matrix is a hint that cannot fault). */
GC_AVX512 GC_INLINE void project_pairs(const float *x, size_t ldx, size_t cols, const float *vt,
                             size_t ldv, const float *wp, size_t p0, size_t np, float *coef,
                             size_t ldc)
{
    size_t chunks = cols / GC_LANES, full = chunks * GC_LANES, stride = chunks * 2 * GC_LANES;
    const float *w = wp + p0 * stride;
    gc_wvec a[4][GC_PAIRS] = {{{0}}};
    for (size_t j0 = 0; j0 < full; j0 += GC_DOT_CHUNK) { /* the dot product's chunks */
        size_t end = chunk_end(j0, full);
        for (size_t c = j0 / GC_LANES; c < end / GC_LANES; c++) {
            gc_wvec b[GC_PAIRS];
            for (size_t q = 0; q < np; q++)
                b[q] = wload(w + q * stride + c * 2 * GC_LANES);
            if (p0 == 0 && c % 2 == 0) /* a line holds two chunks */
                for (int r = 0; r < 4; r++)
                    GC_PREFETCH(x, ((4 + r) * ldx + c * GC_LANES) * sizeof(float));
            for (int r = 0; r < 4; r++) {
                gc_wvec xr = wdup(x + r * ldx + c * GC_LANES);
                for (size_t q = 0; q < np; q++)
                    a[r][q] += xr * b[q];
            }
        }
        if (chunk_closes(end, cols))
            for (int r = 0; r < 4; r++)
                for (size_t q = 0; q < np; q++) {
                    close_pair(a[r][q], coef + r * ldc, 2 * (p0 + q), end);
                    a[r][q] = (gc_wvec){0};
                }
    }
    for (int r = 0; r < 4; r++)
        for (size_t q = 0; q < np; q++)
            finish_pair(a[r][q], x + r * ldx, vt, ldv, 2 * (p0 + q), full, cols,
                        coef + r * ldc);
}

/* Four rows: the pairs GC_PAIRS at a time, then the rest (each count its own
 * inlined copy, so the vectors stay in registers), then an odd last basis row. */
GC_AVX512 static void project_rows4_wide(const float *x, size_t ldx, size_t cols,
                                         const float *vt, size_t ldv, size_t k,
                                         const float *wp, float *coef, size_t ldc)
{
    size_t pairs = k / 2, p = 0;
    for (; p + GC_PAIRS <= pairs; p += GC_PAIRS)
        project_pairs(x, ldx, cols, vt, ldv, wp, p, GC_PAIRS, coef, ldc);
    switch (pairs - p) {
    case 4:
        project_pairs(x, ldx, cols, vt, ldv, wp, p, 4, coef, ldc);
        break;
    case 3:
        project_pairs(x, ldx, cols, vt, ldv, wp, p, 3, coef, ldc);
        break;
    case 2:
        project_pairs(x, ldx, cols, vt, ldv, wp, p, 2, coef, ldc);
        break;
    case 1:
        project_pairs(x, ldx, cols, vt, ldv, wp, p, 1, coef, ldc);
        break;
    default:
        break;
    }
    if (k % 2)
        project_rows4(x, ldx, cols, vt + (k - 1) * ldv, ldv, 1, coef + k - 1, ldc, 0);
}

GC_AVX512 static void project_rows_wide(const float *x, size_t ldx, size_t rows, size_t cols,
                                        const float *vt, size_t ldv, size_t k,
                                        const float *wp, float *coef)
{
    size_t r = 0;
    for (; r + 4 <= rows; r += 4)
        project_rows4_wide(x + r * ldx, ldx, cols, vt, ldv, k, wp, coef + r * k, k);
    for (; r < rows; r++)
        project_row(x + r * ldx, cols, vt, ldv, k, coef + r * k, 0);
}

/* The chains of nrows rows over one panel b of the packed basis: t[r][q] for
 * row r and the panel's 16 columns q. */
GC_INLINE void panel_chains(const float *b, const float *coef, size_t k, size_t nrows,
                            gc_wvec (*t)[2])
{
    for (size_t r = 0; r < nrows; r++)
        t[r][0] = t[r][1] = (gc_wvec){0};
    for (size_t l = 0; l < k; l++, b += GC_PANEL) {
        gc_wvec b0 = wload(b), b1 = wload(b + 2 * GC_LANES);
        for (size_t r = 0; r < nrows; r++) {
            float c = coef[r * k + l];
            t[r][0] += c * b0;
            t[r][1] += c * b1;
        }
    }
}

/* Up to four rows over whole panels of the packed basis, 16 columns a vector. */
GC_INLINE void expand_panels_wide(const float *x, size_t ldx, size_t panels, const float *coef,
                                  const float *vp, size_t k, float sign, float *out,
                                  size_t nrows)
{
    for (size_t p = 0; p < panels; p++) {
        gc_wvec t[4][2];
        panel_chains(vp + p * k * GC_PANEL, coef, k, nrows, t);
        for (size_t r = 0; r < nrows; r++)
            for (int q = 0; q < 2; q++) {
                size_t at = r * ldx + p * GC_PANEL + q * 2 * GC_LANES;
                wstore(out + at, wgpu_nans(wload(x + at) + sign * t[r][q]));
            }
    }
}

/* Rows a streaming expansion takes at a time: eight rows' sixteen chains
 * share each basis vector loaded (4096^2 values at k = 10 streamed in 4.2
 * ms, four rows at a time 5.2). */
#define GC_STREAM_ROWS 8

/* Where a streaming expansion's values come from: element e (counted from
 * the first row's first value) is x[e], or, for fp8 rows, the code codes[e]
 * (E5M2 if e5m2, else E4M3) times the fp32 scale at scales + 4 (e >> shift),
 * decoded as codec.c's decoders do (2^shift >= 16 values a scale, so a
 * vector never straddles two blocks; the first row starts a block). The
 * loops below take it by value, so its fields stay in registers, and `fp8`
 * as a constant, so each caller gets its own copy (through a pointer, every
 * field reloaded after each store, and a test per vector, it cost 0.9 ms
 * more over 4096^2 values). */
typedef struct {
    const float *x;
    const uint8_t *codes, *scales;
    unsigned shift;
    int e5m2;
} gc_rows;

/* Values e .. e + 16 of the rows. */
GC_AVX512 GC_INLINE gc_wvec rows_vector(gc_rows src, int fp8, size_t e)
{
    if (!fp8)
        return wload(src.x + e);
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(src.codes + e)));
    float scale;
    memcpy(&scale, src.scales + 4 * (e >> src.shift), sizeof scale);
    return (gc_wvec)_mm512_mul_ps(v_fp8_value(src.e5m2, c), _mm512_set1_ps(scale));
}

/* Up to GC_STREAM_ROWS rows (the first at element base, ldx apart) over whole
 * panels into out through one streaming sink per row (vector 2 p + q of a row
 * holds its panel p's columns q). */
GC_AVX512 GC_INLINE void stream_panels_wide(gc_rows src, int fp8, size_t base,
                                            size_t ldx, size_t panels, const float *coef,
                                            const float *vp, size_t k, float sign, gc_sink *sink,
                                            size_t nrows)
{
    for (size_t p = 0; p < panels; p++) {
        gc_wvec t[GC_STREAM_ROWS][2];
        panel_chains(vp + p * k * GC_PANEL, coef, k, nrows, t);
        for (size_t r = 0; r < nrows; r++)
            for (int q = 0; q < 2; q++) {
                size_t e = base + r * ldx + p * GC_PANEL + q * 2 * GC_LANES;
                gc_wvec v = rows_vector(src, fp8, e);
                sink_put(&sink[r], 2 * p + q, (__m512)wgpu_nans(v + sign * t[r][q]));
            }
    }
}

/* Whole rows of cols columns from column 0 into out (not the rows' own
 * memory), the panels written around the cache (gc_sink), GC_STREAM_ROWS
 * rows at a time; the tail columns (fp32 rows only) take the scalar chain.
 * Same values as expand_rows_wide. */
GC_AVX512 GC_INLINE void stream_rows_wide(const gc_rows *src, int fp8, size_t rows, size_t cols,
                                          const float *coef, const float *vt, const float *vp,
                                          size_t k, float sign, float *out)
{
    size_t panels = cols / GC_PANEL;
    for (size_t r = 0; r < rows && panels; r += GC_STREAM_ROWS) {
        size_t nr = rows - r < GC_STREAM_ROWS ? rows - r : GC_STREAM_ROWS;
        gc_sink sink[GC_STREAM_ROWS] = {{0}}; /* opened below: the first nr */
        for (size_t i = 0; i < nr; i++)
            sink[i] = sink_open_as(out + (r + i) * cols, 1);
        if (nr == GC_STREAM_ROWS)
            stream_panels_wide(*src, fp8, r * cols, cols, panels, coef + r * k, vp, k, sign, sink,
                               GC_STREAM_ROWS);
        else
            stream_panels_wide(*src, fp8, r * cols, cols, panels, coef + r * k, vp, k, sign, sink,
                               nr);
        for (size_t i = 0; i < nr; i++)
            sink_finish(&sink[i], 2 * panels);
    }
    _mm_sfence();
    for (size_t j = panels * GC_PANEL; !fp8 && j < cols; j++)
        expand_column(src->x, cols, j, coef, vt, cols, k, sign, out, rows);
}

/* stream_rows_wide of fp32 rows, and of fp8 rows: one compiled copy each. */
GC_AVX512 static void stream_f32_rows_wide(const gc_rows *src, size_t rows, size_t cols,
                                           const float *coef, const float *vt, const float *vp,
                                           size_t k, float sign, float *out)
{
    stream_rows_wide(src, 0, rows, cols, coef, vt, vp, k, sign, out);
}

GC_AVX512 static void stream_fp8_rows_wide(const gc_rows *src, size_t rows, size_t cols,
                                           const float *coef, const float *vp, size_t k,
                                           float sign, float *out)
{
    stream_rows_wide(src, 1, rows, cols, coef, NULL, vp, k, sign, out);
}

/* Rows of cols columns from column col (one row when col > 0): the columns up
 * to the next panel boundary and after the last whole panel take the scalar
 * chain, the whole panels between run four rows at a time. */
GC_AVX512 static void expand_rows_wide(const float *x, size_t ldx, size_t rows, size_t col,
                                       size_t cols, const float *coef, const float *vt,
                                       const float *vp, size_t k, float sign, float *out)
{
    size_t head = (GC_PANEL - col % GC_PANEL) % GC_PANEL;
    head = head < cols ? head : cols;
    size_t panels = (cols - head) / GC_PANEL, r = 0;
    const float *vb = vp + (col + head) / GC_PANEL * k * GC_PANEL;
    x += head;
    out += head;
    for (; r + 4 <= rows; r += 4)
        expand_panels_wide(x + r * ldx, ldx, panels, coef + r * k, vb, k, sign, out + r * ldx, 4);
    if (r < rows)
        expand_panels_wide(x + r * ldx, ldx, panels, coef + r * k, vb, k, sign, out + r * ldx,
                           rows - r);
    x -= head;
    out -= head;
    for (size_t j = 0; j < head; j++)
        expand_column(x, ldx, j, coef, vt + col, ldx, k, sign, out, rows);
    for (size_t j = head + panels * GC_PANEL; j < cols; j++)
        expand_column(x, ldx, j, coef, vt + col, ldx, k, sign, out, rows);
}

/* acc[l][j .. j + 16) += the chain over `nr` (<= 8) rows of coef[r][l] x[r][j ..]
 * for every l; the rows' values stay in registers while every l passes. */
GC_INLINE void accumulate_chunk_wide(const float *x, size_t ldx, size_t nr, size_t j,
                                     const float *coef, size_t k, float *acc, size_t lda)
{
    gc_wvec xr[8];
    for (size_t r = 0; r < nr; r++)
        xr[r] = wload(x + r * ldx + j);
    for (size_t l = 0; l < k; l++) {
        gc_wvec t = wload(acc + l * lda + j);
        for (size_t r = 0; r < nr; r++)
            t += coef[r * k + l] * xr[r];
        wstore(acc + l * lda + j, t);
    }
}

/* The accumulation of a segment straight from its rows, eight at a time, in
 * row order: each chunk of 16 columns of acc is read and written once per
 * eight rows (acc, k x n, stays in the L2 cache), so no packed copy is needed. */
GC_AVX512 static void accumulate_rows_wide(const float *x, size_t ldx, size_t rows,
                                           size_t cols, const float *coef, size_t k,
                                           float *acc, size_t lda)
{
    size_t full = cols - cols % (2 * GC_LANES);
    for (size_t r0 = 0; r0 < rows; r0 += 8) {
        size_t nr = rows - r0 < 8 ? rows - r0 : 8;
        const float *xb = x + r0 * ldx, *cb = coef + r0 * k;
        if (nr == 8)
            for (size_t j = 0; j < full; j += 2 * GC_LANES)
                accumulate_chunk_wide(xb, ldx, 8, j, cb, k, acc, lda);
        else
            for (size_t r = 0; r < nr; r++)
                for (size_t j = 0; j < full; j += 2 * GC_LANES)
                    accumulate_chunk_wide(xb + r * ldx, ldx, 1, j, cb + r * k, k, acc, lda);
        for (size_t j = full; j < cols; j++)
            for (size_t l = 0; l < k; l++) {
                float t = acc[l * lda + j];
                for (size_t r = 0; r < nr; r++)
                    t = gc_mad(t, cb[r * k + l], xb[r * ldx + j]);
                acc[l * lda + j] = t;
            }
    }
}

/* gc_geo_sumsq's GC_LANES fp64 lanes as one vector over the whole chunks:
 * lane q still adds x[q], x[q + 8], ... in order. A float's square is exact
 * in fp64, so the fused multiply-add rounds once, as the scalar sum does. */
GC_AVX512 static void sumsq_lanes_wide(const float *x, size_t full, double *p)
{
    _Static_assert(GC_LANES == 8, "one __m512d holds the GC_LANES lanes");
    __m512d acc = _mm512_loadu_pd(p);
    for (size_t i = 0; i < full; i += GC_LANES) {
        __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        acc = _mm512_fmadd_pd(v, v, acc);
    }
    _mm512_storeu_pd(p, acc);
}

#endif /* GC_HAVE_AVX512 */

/* Whether the AVX-512 loops run (the codec's choice, gc_codec_simd). */
static int wide_loops(void) { return GC_HAVE_AVX512 && gc_codec_simd(GC_SIMD_CURRENT) == 1; }

/* The pairs layout of vt for the wide projection on whole cache lines, or
 * NULL: not wide, nothing to pair, or out of memory (then the narrow loops
 * run: same bits). */
static float *paired_basis(const float *vt, size_t k, size_t n)
{
#if GC_HAVE_AVX512
    void *wp = NULL; /* on whole cache lines: a vector load never spans two */
    if (!wide_loops() || k < 2 || n < GC_LANES
        || posix_memalign(&wp, 64, paired_size(k, n) * sizeof(float)))
        return NULL;
    pair_basis(vt, k, n, wp);
    return wp;
#else
    (void)vt, (void)k, (void)n;
    return NULL;
#endif
}

/* ---- ranges ------------------------------------------------------------------ */

/* One piece of a flat range: `rows` rows of `cols` columns from column `col`,
 * starting at x + offset, coefficients of relative row `row`. */
typedef struct {
    size_t offset, row, col, rows, cols;
} segment;

/* Split [lo, lo + len) of an n-column matrix into at most three segments. */
static int segments(size_t lo, size_t len, size_t n, segment *seg)
{
    int count = 0;
    size_t pos = lo, end = lo + len, row = 0;
    while (pos < end) {
        size_t col = pos % n;
        size_t left = end - pos;
        segment s = {pos - lo, row, col, 1, n - col};
        if (col != 0 || left < n) {
            s.cols = left < n - col ? left : n - col;
        } else {
            s.rows = left / n;
        }
        seg[count++] = s;
        pos += s.rows * s.cols;
        row += s.rows;
    }
    return count;
}

static int geo_args_ok(const void *x, size_t len, size_t n, const void *basis, size_t k,
                       const void *out)
{
    return n > 0 && k > 0 && (len == 0 || (x && basis && out));
}

size_t gc_geo_rows(size_t lo, size_t len, size_t n)
{
    if (len == 0 || n == 0)
        return 0;
    return (lo + len - 1) / n - lo / n + 1;
}

static GC_NOINLINE int64_t geo_project(const float *x, size_t lo, size_t len, size_t n,
                                       const float *vt, size_t k, float *coef)
{
    if (!geo_args_ok(x, len, n, vt, k, coef))
        return GC_EINVAL;
    segment seg[3];
    int count = segments(lo, len, n, seg);
    float *wp = len >= 4 * n ? paired_basis(vt, k, n) : NULL;
    int64_t redone = 0;
    for (int s = 0; s < count; s++) {
        int whole = seg[s].col == 0 && seg[s].cols == n;
        redone += (int64_t)project_segment(x + seg[s].offset, n, seg[s].rows, seg[s].cols,
                                           vt + seg[s].col, n, k, coef + seg[s].row * k,
                                           whole ? wp : NULL);
    }
    free(wp);
    return redone;
}

static GC_NOINLINE int geo_expand(const float *x, size_t lo, size_t len, size_t n,
                                  const float *coef, const float *vt, const float *packed,
                                  size_t k, float sign, float *out)
{
    if (!geo_args_ok(x, len, n, vt, k, out) || (len && !coef) || (sign != 1.0f && sign != -1.0f))
        return GC_EINVAL;
    if (len == 0)
        return 0;
    float *vp = packed ? NULL : pack_basis(vt, k, n);
    if (!packed && !vp)
        return GC_ENOMEM;
    segment seg[3];
    int count = segments(lo, len, n, seg);
    int wide = wide_loops();
    for (int s = 0; s < count; s++)
        expand_segment(x + seg[s].offset, n, seg[s].rows, seg[s].col, seg[s].cols,
                       coef + seg[s].row * k, vt, packed ? packed : vp, k, sign,
                       out + seg[s].offset, wide);
    free(vp);
    return 0;
}

int gc_geo_expand_stream(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                         const float *vt, const float *packed, size_t k, float sign, float *out)
{
#if GC_HAVE_AVX512
    if (wide_loops() && packed && x != out && len && lo % n == 0 && len % n == 0) {
        gc_rows src = {x, NULL, NULL, 0, 0};
        stream_f32_rows_wide(&src, len / n, n, coef, vt, packed, k, sign, out);
        return 0;
    }
#endif
    return geo_expand(x, lo, len, n, coef, vt, packed, k, sign, out);
}

int gc_geo_decode_fp8_stream(int e5m2, const uint8_t *scales, const uint8_t *codes, size_t block,
                             size_t lo, size_t len, size_t n, const float *coef,
                             const float *packed, size_t k, float sign, float *out)
{
#if GC_HAVE_AVX512
    unsigned shift = 4;
    while (shift < 40 && ((size_t)1 << shift) < block)
        shift++;
    if (wide_loops() && packed && len && lo % n == 0 && len % n == 0 && n % GC_PANEL == 0
        && ((size_t)1 << shift) == block && (sign == 1.0f || sign == -1.0f)) {
        gc_rows src = {NULL, codes, scales, shift, e5m2};
        stream_fp8_rows_wide(&src, len / n, n, coef, packed, k, sign, out);
        return 0;
    }
#else
    (void)e5m2, (void)scales, (void)codes, (void)block, (void)lo, (void)len, (void)n;
    (void)coef, (void)packed, (void)k, (void)sign, (void)out;
#endif
    return 1;
}

static GC_NOINLINE int geo_accumulate(const float *x, size_t lo, size_t len, size_t n,
                                      const float *coef, size_t k, float *acc)
{
    if (!geo_args_ok(x, len, n, coef, k, acc))
        return GC_EINVAL;
    if (len == 0)
        return 0;
    int wide = wide_loops();
    float *part = malloc(sizeof(float) * k * n);
    float *scratch = wide ? NULL : malloc(sizeof(float) * GC_ROW_BLOCK * n);
    if (!part || (!wide && !scratch)) {
        free(part), free(scratch);
        return GC_ENOMEM;
    }
    size_t rows = gc_geo_rows(lo, len, n), first = lo / n;
    for (size_t t0 = 0; t0 < rows; t0 += GC_ACC_ROWS) {
        /* the tile's part of the range: its rows' chains from +0 */
        size_t from = (first + t0) * n, to = (first + t0 + GC_ACC_ROWS) * n;
        size_t start = from > lo ? from : lo, end = to < lo + len ? to : lo + len;
        memset(part, 0, sizeof(float) * k * n);
        segment seg[3];
        int count = segments(start, end - start, n, seg);
        for (int s = 0; s < count; s++)
            accumulate_segment(x + (start - lo) + seg[s].offset, n, seg[s].rows, seg[s].cols,
                               coef + (t0 + seg[s].row) * k, k, part + seg[s].col, n, scratch,
                               wide);
        for (size_t i = 0; i < k * n; i++)
            acc[i] += part[i];
    }
    free(part), free(scratch);
    return 0;
}

/* Rows per block of the fused residual: projected, then expanded while in cache. */
#define GC_RESIDUAL_ROWS 8

static size_t residual_rows(const float *x, size_t rows, size_t n, const float *vt,
                            const float *vp, const float *wp, size_t k, float *coef, float *out)
{
    size_t redone = 0;
    int wide = wide_loops();
    for (size_t r = 0; r < rows; r += GC_RESIDUAL_ROWS) {
        size_t nr = rows - r < GC_RESIDUAL_ROWS ? rows - r : GC_RESIDUAL_ROWS;
        redone += project_segment(x + r * n, n, nr, n, vt, n, k, coef + r * k, wp);
        for (size_t i = r * k; i < (r + nr) * k; i++) /* the side channel's bfloat16 */
            coef[i] = gc_bf16_value(gc_bf16_code(coef[i], 0, 0));
        expand_segment(x + r * n, n, nr, 0, n, coef + r * k, vt, vp, k, -1.0f, out + r * n, wide);
    }
    return redone;
}

static GC_NOINLINE int64_t geo_residual(const float *x, size_t m, size_t n, const float *vt,
                                        size_t k, float *coef, float *out)
{
    if (!geo_args_ok(x, m * n, n, vt, k, out) || (m && !coef))
        return GC_EINVAL;
    if (m == 0)
        return 0;
    float *vp = pack_basis(vt, k, n);
    if (!vp)
        return GC_ENOMEM;
    float *wp = m >= 4 ? paired_basis(vt, k, n) : NULL;
    size_t redone = residual_rows(x, m, n, vt, vp, wp, k, coef, out);
    free(wp);
    free(vp);
    return (int64_t)redone;
}

/* ---- small dense work (host only, fp64) ---------------------------------------- */

/* The fixed combination of GC_LANES fp64 lane sums (gc_lane_sum's tree). */
static double lanes_total(const double *p)
{
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

/* Level 0 of gc_geo_sumsq's order: the sum of the squares of one chunk. */
static double sumsq_chunk(const float *x, size_t len)
{
    double p[GC_LANES] = {0};
    size_t full = len - len % GC_LANES;
#if GC_HAVE_AVX512
    if (wide_loops())
        sumsq_lanes_wide(x, full, p);
    else
#endif
        for (size_t i = 0; i < full; i += GC_LANES)
            for (int q = 0; q < GC_LANES; q++)
                p[q] += (double)x[i + q] * (double)x[i + q];
    for (size_t i = full; i < len; i++)
        p[i - full] += (double)x[i] * (double)x[i];
    return lanes_total(p);
}

/* The open chunk of one level above level 0 in gc_geo_sumsq's order. */
typedef struct {
    double p[GC_LANES];
    size_t n;
} sum_chunk;

/* Total t joins level l's open chunk; a full chunk closes into level l + 1. */
static void sum_push(sum_chunk *level, size_t l, double t)
{
    for (;; l++) {
        sum_chunk *c = &level[l];
        c->p[c->n % GC_LANES] += t;
        if (++c->n < GC_SUMSQ_CHUNK)
            return;
        t = lanes_total(c->p);
        memset(c, 0, sizeof *c);
    }
}

/* gc_linalg.h's "sumsq" order in one pass: each level above 0 keeps only its
 * open chunk; at the end the open chunks close bottom up (the last chunk of
 * each level, then its total as the last value of the level above). Levels
 * above the last one that had two totals pass their one total on unchanged. */
static GC_NOINLINE double geo_sumsq(const float *x, size_t len)
{
    enum { LEVELS = 7 }; /* GC_SUMSQ_CHUNK^6 = 2^66 values: more than a size_t counts */
    if (len <= GC_SUMSQ_CHUNK)
        return sumsq_chunk(x, len);
    sum_chunk level[LEVELS + 1];
    memset(level, 0, sizeof level);
    for (size_t a = 0; a < len; a += GC_SUMSQ_CHUNK)
        sum_push(level, 1, sumsq_chunk(x + a, len - a < GC_SUMSQ_CHUNK ? len - a : GC_SUMSQ_CHUNK));
    for (size_t l = 1; l < LEVELS; l++)
        if (level[l].n)
            sum_push(level, l + 1, lanes_total(level[l].p));
    return lanes_total(level[LEVELS].p);
}

/* dots[d] for d < count: the dot product of `a` with row d of `b` (n columns), each
 * in gc_linalg.h's "ortho" order; `lanes` holds GC_ORTHO_LANES doubles. */
static void ortho_dots(const double *b, size_t count, const double *a, size_t n, double *dots,
                       double *restrict lanes)
{
    for (size_t d = 0; d < count; d++) {
        const double *restrict bd = b + d * n;
        memset(lanes, 0, sizeof(double) * GC_ORTHO_LANES);
        for (size_t j0 = 0; j0 < n; j0 += GC_ORTHO_LANES) {
            size_t width = n - j0 < GC_ORTHO_LANES ? n - j0 : GC_ORTHO_LANES;
            for (size_t t = 0; t < width; t++)
                lanes[t] = gc_mad64(lanes[t], bd[j0 + t], a[j0 + t]);
        }
        for (size_t w = GC_ORTHO_LANES / 2; w >= 1; w /= 2)
            for (size_t t = 0; t < w; t++)
                lanes[t] += lanes[t + w];
        dots[d] = lanes[0];
    }
}

/* a -= sum_p r[p] q[p] for the `count` rows of q, a chain over p per element (row by
 * row, so each pass streams one row of q). */
static void ortho_subtract(const double *q, size_t count, const double *r, double *restrict a,
                           size_t n)
{
    for (size_t p = 0; p < count; p++) {
        const double *restrict qp = q + p * n;
        for (size_t j = 0; j < n; j++)
            a[j] = gc_msub64(a[j], r[p], qp[j]);
    }
}

/* Classical Gram-Schmidt twice (CGS2: each pass projects out every earlier row at
 * once), so a GPU block runs each pass's dot products side by side (gc_geometry.cu
 * follows this function step by step). */
static GC_NOINLINE int geo_orthonormalize(float *rows, size_t k, size_t n, uint64_t seed)
{
    if (k == 0 || n < k || !rows)
        return GC_EINVAL;
    double *q = malloc(sizeof(double) * (k * n + k + GC_ORTHO_LANES));
    if (!q)
        return GC_ENOMEM;
    double *r = q + k * n, *lanes = r + k;
    for (size_t i = 0; i < k; i++) {
        double *a = q + i * n;
        for (size_t j = 0; j < n; j++)
            a[j] = gc_finite(rows[i * n + j]) ? (double)rows[i * n + j] : 0.0;
        for (int attempt = 0;; attempt++) {
            int last = attempt == GC_ORTHO_ATTEMPTS - 1;
            double self;
            ortho_dots(a, 1, a, n, &self, lanes);
            double before = sqrt(self);
            for (int pass = 0; pass < 2; pass++) {
                ortho_dots(q, i, a, n, r, lanes);
                ortho_subtract(q, i, r, a, n);
            }
            ortho_dots(a, 1, a, n, &self, lanes);
            double after = sqrt(self);
            /* a direction lost to the ones before it (or never there) is
             * replaced by a fixed pseudo-random one, orthogonalized alike; the
             * last draw is kept if anything of it is left, and as drawn if not
             * (neither happens for k <= n: the rows stay finite either way) */
            if (after > 1e-300 && (after > 1e-6 * before || last)) {
                for (size_t j = 0; j < n; j++)
                    a[j] /= after;
                break;
            }
            for (size_t j = 0; j < n; j++)
                a[j] = gc_ortho_random(seed, i, attempt, j);
            if (last)
                break;
        }
    }
    for (size_t e = 0; e < k * n; e++)
        rows[e] = (float)q[e];
    free(q);
    return 0;
}

/* ---- the entry points of geocomm.h: each body in the default floating-point
 * mode (gc_internal.h, GC_IEEE) ------------------------------------------- */

int64_t gc_geo_project(const float *x, size_t lo, size_t len, size_t n, const float *vt,
                       size_t k, float *coef)
{
    int64_t result;
    GC_IEEE(result, geo_project(x, lo, len, n, vt, k, coef));
    return result;
}

int gc_geo_expand(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                  const float *vt, const float *packed, size_t k, float sign, float *out)
{
    int result;
    GC_IEEE(result, geo_expand(x, lo, len, n, coef, vt, packed, k, sign, out));
    return result;
}

int gc_geo_accumulate(const float *x, size_t lo, size_t len, size_t n, const float *coef,
                      size_t k, float *acc)
{
    int result;
    GC_IEEE(result, geo_accumulate(x, lo, len, n, coef, k, acc));
    return result;
}

int64_t gc_geo_residual(const float *x, size_t m, size_t n, const float *vt, size_t k,
                        float *coef, float *out)
{
    int64_t result;
    GC_IEEE(result, geo_residual(x, m, n, vt, k, coef, out));
    return result;
}

double gc_geo_sumsq(const float *x, size_t len)
{
    double result;
    GC_IEEE(result, geo_sumsq(x, len));
    return result;
}

int gc_geo_orthonormalize(float *rows, size_t k, size_t n, uint64_t seed)
{
    int result;
    GC_IEEE(result, geo_orthonormalize(rows, k, n, seed));
    return result;
}
