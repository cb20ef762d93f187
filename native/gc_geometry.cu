/*
 * CUDA kernels of the GeoFP8 geometry: the GPU twins of geometry.c, with the
 * same contract (native/geocomm.h) and the same fixed order of every sum
 * (native/gc_linalg.h), so they give the CPU's bits. Only the walk differs:
 *
 *   gc_geo_project     GC_LANES threads per (row, chunk of GC_DOT_CHUNK columns,
 *                      GC_GEO_COEFS coefficients): thread q runs lane q's chain
 *                      of each, reading each value once for all of them; a
 *                      shuffle tree combines the lanes in gc_lane_sum's order;
 *                      gc_geo_project_chunks chains a row's chunks. Non-finite
 *                      inputs read as 0.
 *   gc_geo_expand      four consecutive elements per thread, each a chain over
 *                      the k coefficients.
 *   gc_geo_accumulate  one thread per (column, tile of GC_ACC_ROWS rows, up to
 *                      GC_GEO_COEFS coefficients): each chain down its tile's
 *                      rows into a partial; gc_geo_accumulate_tiles adds the
 *                      tiles' partials in order, one thread per (coefficient,
 *                      column).
 *   gc_geo_round_bf16  one thread per element: the side channel's rounding.
 *   gc_geo_hash        one block: a basis's 64-bit hash (integer sums, any order).
 *   gc_geo_to_f32      one thread per element: fp64 sums to fp32.
 *   gc_geo_orthonormalize  one block of GC_ORTHO_LANES threads for the whole
 *                      matrix: thread t is lane t of every dot product and owns
 *                      elements t, t + GC_ORTHO_LANES, ... of every row; the
 *                      dot products of a pass are summed side by side,
 *                      GC_ORTHO_BATCH at a time, in shared memory.
 *   gc_geo_sumsq_squares, gc_geo_sumsq_totals
 *                      one level of the "sumsq" order (gc_linalg.h) for each
 *                      row of a matrix: GC_LANES threads per chunk, thread q
 *                      runs lane q, a shuffle tree combines them. The host
 *                      launches the levels until one total per row is left.
 *
 * A range is [lo, lo + len) of a row-major matrix with n columns; coef rows
 * are numbered from row lo / n. Compile with -fmad=false -ftz=false (the
 * chains are written with __fmul_rn/__fadd_rn anyway). 64-bit indices. The
 * kernels that read a caller's values (project, expand, accumulate, the sums of
 * squares) move them by a shift in device memory (gc_moved, gc_scalar.h): a
 * GeoFP8 call's graph serves calls on other arrays.
 */
#include "gc_linalg.h"

typedef unsigned long long gc_u64;

__device__ __forceinline__ gc_u64 gc_geo_id(void)
{
    return (gc_u64)blockIdx.x * blockDim.x + threadIdx.x;
}

/* Columns [*c0, *c1) of relative row r that the range covers. */
__device__ __forceinline__ void gc_geo_row_span(gc_u64 lo, gc_u64 len, gc_u64 n, gc_u64 r,
                                                gc_u64 *c0, gc_u64 *c1)
{
    gc_u64 row = lo / n + r;
    gc_u64 first = row * n > lo ? row * n : lo;
    gc_u64 end = (row + 1) * n < lo + len ? (row + 1) * n : lo + len;
    *c0 = first - row * n;
    *c1 = end > first ? end - row * n : *c0;
}

/* The chunk totals of the dot products of each touched row with the k rows of vt
 * (gc_linalg.h's "dot"): out[(r * chunks + c) * k + l] for chunk c of row r (chunks
 * = ceil(n / GC_DOT_CHUNK); chunk c of a row that has fewer is left alone). One group
 * of GC_LANES threads takes a (row, chunk) and GC_GEO_COEFS coefficients, so each value
 * of x is read once for all of them (k <= GC_GEO_COEFS: once); lane q runs lane q's
 * chain of each. blockDim.x must be a multiple of 32 (groups never straddle a warp);
 * the grid covers rows * chunks * ceil(k / GC_GEO_COEFS) groups. With one chunk, out
 * is the coefficients (rows, k); otherwise gc_geo_project_chunks adds the chunks. */
#define GC_GEO_COEFS 8

extern "C" __global__ void gc_geo_project(const float *x, const gc_u64 *x_moved, gc_u64 lo,
                                          gc_u64 len, gc_u64 n, const float *vt, gc_u64 k,
                                          gc_u64 rows, gc_u64 chunks, float *out)
{
    x = gc_moved(x, x_moved);
    gc_u64 g = gc_geo_id();
    gc_u64 o = g / GC_LANES, blocks = (k + GC_GEO_COEFS - 1) / GC_GEO_COEFS;
    unsigned int q = (unsigned int)(g % GC_LANES);
    gc_u64 r = 0, c = 0, l0 = 0, kb = 0;
    float p[GC_GEO_COEFS];
#pragma unroll
    for (int j = 0; j < GC_GEO_COEFS; j++)
        p[j] = 0.0f;
    if (o < rows * chunks * blocks) {
        gc_u64 c0, c1;
        r = o / blocks / chunks;
        c = o / blocks % chunks;
        l0 = o % blocks * GC_GEO_COEFS;
        gc_geo_row_span(lo, len, n, r, &c0, &c1);
        c0 += c * GC_DOT_CHUNK; /* this group's chunk of the row's columns */
        c1 = c0 + GC_DOT_CHUNK < c1 ? c0 + GC_DOT_CHUNK : c1;
        kb = c0 < c1 ? (k - l0 < GC_GEO_COEFS ? k - l0 : GC_GEO_COEFS) : 0;
        const float *xr = x + (lo / n + r) * n - lo;
        const float *vl = vt + l0 * n;
        for (gc_u64 col = c0 + q; col < c1; col += GC_LANES) {
            float v = gc_finite_or_zero(gc_load_global(xr + col));
#pragma unroll
            for (int j = 0; j < GC_GEO_COEFS; j++)
                if ((gc_u64)j < kb)
                    p[j] = gc_mad(p[j], v, vl[j * n + col]);
        }
    }
    /* gc_lane_sum for each: (p0 + p4, p1 + p5, ...), then (a0 + a2, a1 + a3), then the two */
#pragma unroll
    for (int j = 0; j < GC_GEO_COEFS; j++) {
        float s = p[j];
        s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, 4, GC_LANES));
        s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, 2, GC_LANES));
        s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, 1, GC_LANES));
        if (q == 0 && (gc_u64)j < kb)
            out[(r * chunks + c) * k + l0 + j] = s;
    }
}

/* coef[r][l] = the chain of row r's chunk totals (gc_geo_project's `out`) in order,
 * from the first; one thread per (row, coefficient). */
extern "C" __global__ void gc_geo_project_chunks(const float *partial, gc_u64 lo, gc_u64 len,
                                                 gc_u64 n, gc_u64 k, gc_u64 rows,
                                                 gc_u64 chunks, float *coef)
{
    gc_u64 g = gc_geo_id();
    if (g >= rows * k)
        return;
    gc_u64 r = g / k, l = g % k, c0, c1;
    gc_geo_row_span(lo, len, n, r, &c0, &c1);
    gc_u64 own = (c1 - c0 + GC_DOT_CHUNK - 1) / GC_DOT_CHUNK; /* the row's chunks */
    const float *pr = partial + r * chunks * k + l;
    float t = pr[0];
    for (gc_u64 c = 1; c < own; c++)
        t = __fadd_rn(t, pr[c * k]);
    coef[g] = t;
}

/* Four consecutive elements per thread (16-byte accesses of x and out where aligned;
 * each element's chain unchanged). out may be x itself. */
extern "C" __global__ void gc_geo_expand(const float *x, const gc_u64 *x_moved, gc_u64 lo,
                                         gc_u64 len, gc_u64 n, const float *coef,
                                         const float *vt, gc_u64 k, float sign, float *out,
                                         const gc_u64 *out_moved)
{
    x = gc_moved(x, x_moved);
    out = gc_moved(out, out_moved);
    gc_u64 e0 = 4 * gc_geo_id();
    if (e0 >= len)
        return;
    float v[4];
    gc_load4_f32(x + e0, len - e0, v);
    for (int q = 0; q < 4 && e0 + q < len; ++q) {
        gc_u64 e = e0 + q, r = (lo + e) / n - lo / n, j = (lo + e) % n;
        float t = 0.0f;
        for (gc_u64 l = 0; l < k; l++)
            t = gc_mad(t, coef[r * k + l], vt[l * n + j]);
        v[q] = __fadd_rn(v[q], __fmul_rn(sign, t));
    }
    gc_store4_f32(out + e0, len - e0, v);
}

/* partial[(t * k + l) * n + j]: tile t's chain (from +0) down its GC_ACC_ROWS rows of
 * the range, for GC_GEO_COEFS coefficients per thread, which reads each value once
 * for them; the grid covers n * tiles * ceil(k / GC_GEO_COEFS) threads. */
extern "C" __global__ void gc_geo_accumulate(const float *x, const gc_u64 *x_moved, gc_u64 lo,
                                             gc_u64 len, gc_u64 n, const float *coef, gc_u64 k,
                                             gc_u64 rows, float *partial)
{
    x = gc_moved(x, x_moved);
    gc_u64 g = gc_geo_id();
    gc_u64 tiles = (rows + GC_ACC_ROWS - 1) / GC_ACC_ROWS;
    if (g >= n * tiles * ((k + GC_GEO_COEFS - 1) / GC_GEO_COEFS))
        return;
    gc_u64 j = g % n, t = g / n % tiles, l0 = g / n / tiles * GC_GEO_COEFS;
    gc_u64 kb = k - l0 < GC_GEO_COEFS ? k - l0 : GC_GEO_COEFS;
    gc_u64 end = (t + 1) * GC_ACC_ROWS < rows ? (t + 1) * GC_ACC_ROWS : rows;
    float p[GC_GEO_COEFS];
#pragma unroll
    for (int q = 0; q < GC_GEO_COEFS; q++)
        p[q] = 0.0f;
    for (gc_u64 r = t * GC_ACC_ROWS; r < end; r++) {
        gc_u64 e = (lo / n + r) * n + j;
        if (e < lo || e >= lo + len)
            continue;
        float v = gc_load_global(x + (e - lo));
#pragma unroll
        for (int q = 0; q < GC_GEO_COEFS; q++)
            if ((gc_u64)q < kb)
                p[q] = gc_mad(p[q], coef[r * k + l0 + q], v);
    }
    for (gc_u64 q = 0; q < kb; q++)
        partial[(t * k + l0 + q) * n + j] = p[q];
}

/* acc[l][j] + the chain over the tiles' partials, in tile order (one thread each). */
extern "C" __global__ void gc_geo_accumulate_tiles(const float *partial, gc_u64 tiles,
                                                   gc_u64 kn, float *acc)
{
    gc_u64 g = gc_geo_id();
    if (g >= kn)
        return;
    float a = acc[g];
    for (gc_u64 t = 0; t < tiles; t++)
        a = __fadd_rn(a, partial[t * kn + g]);
    acc[g] = a;
}

/* out[0] = the basis hash of the n 32-bit words w (kernels.basis_hash): the sum of
 * w[i] * ((i + 1) * GC_HASH_STEP | 1) mod 2^64. One block: thread t takes words t,
 * t + blockDim.x, ..., the block adds the threads' sums in shared memory (integer
 * sums mod 2^64: any order gives the same bits). blockDim.x = GC_HASH_THREADS. */
#define GC_HASH_THREADS 256
#define GC_HASH_STEP 0x9e3779b97f4a7c15ull

extern "C" __global__ void gc_geo_hash(const unsigned int *w, gc_u64 n, gc_u64 *out)
{
    __shared__ gc_u64 part[GC_HASH_THREADS];
    gc_u64 h = 0;
    for (gc_u64 i = threadIdx.x; i < n; i += blockDim.x)
        h += (gc_u64)w[i] * (((i + 1) * GC_HASH_STEP) | 1ull);
    part[threadIdx.x] = h;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half)
            part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[0] = part[0];
}

/* x = its bfloat16 value in place (gc_bf16_code, nearest even; NaN stays NaN). */
extern "C" __global__ void gc_geo_round_bf16(float *x, gc_u64 len)
{
    gc_u64 e = gc_geo_id();
    if (e < len)
        x[e] = gc_bf16_value(gc_bf16_code(x[e], 0, 0u));
}

/* Chunk totals of one level of the "sumsq" order: rows of `len` values, each cut
 * into chunks of GC_SUMSQ_CHUNK; out[r * chunks + c] is chunk c of row r, with
 * chunks = ceil(len / GC_SUMSQ_CHUNK). SQUARE: level 0 (squares of floats). */
template <class T, bool SQUARE>
__device__ void gc_geo_sum_level(const T *x, gc_u64 rows, gc_u64 len, double *out)
{
    gc_u64 g = gc_geo_id();
    gc_u64 chunk = g / GC_LANES;
    unsigned int q = (unsigned int)(g % GC_LANES);
    gc_u64 chunks = (len + GC_SUMSQ_CHUNK - 1) / GC_SUMSQ_CHUNK;
    double p = 0.0;
    if (chunk < rows * chunks) {
        gc_u64 r = chunk / chunks, c = chunk % chunks;
        const T *xr = x + r * len;
        gc_u64 end = (c + 1) * GC_SUMSQ_CHUNK < len ? (c + 1) * GC_SUMSQ_CHUNK : len;
        for (gc_u64 i = c * GC_SUMSQ_CHUNK + q; i < end; i += GC_LANES) {
            double v = (double)gc_load_global(xr + i);
            p = __dadd_rn(p, SQUARE ? __dmul_rn(v, v) : v);
        }
    }
    /* the lanes' tree: ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)) */
    p = __dadd_rn(p, __shfl_down_sync(0xffffffffu, p, 4, GC_LANES));
    p = __dadd_rn(p, __shfl_down_sync(0xffffffffu, p, 2, GC_LANES));
    p = __dadd_rn(p, __shfl_down_sync(0xffffffffu, p, 1, GC_LANES));
    if (chunk < rows * chunks && q == 0)
        out[chunk] = p;
}

/* out[i] = x[i] rounded to fp32 (nearest even; a subnormal result stays one: the
 * unit is built with -ftz=false, where CuPy's own casts flush it to zero). */
extern "C" __global__ void gc_geo_to_f32(const double *x, gc_u64 len, float *out)
{
    gc_u64 e = gc_geo_id();
    if (e < len)
        out[e] = (float)x[e];
}

/* Level 0: blockDim.x a multiple of 32, as for gc_geo_project. */
extern "C" __global__ void gc_geo_sumsq_squares(const float *x, const gc_u64 *x_moved,
                                                gc_u64 rows, gc_u64 len, double *out)
{
    gc_geo_sum_level<float, true>(gc_moved(x, x_moved), rows, len, out);
}

/* The levels above 0. */
extern "C" __global__ void gc_geo_sumsq_totals(const double *x, gc_u64 rows, gc_u64 len,
                                               double *out)
{
    gc_geo_sum_level<double, false>(x, rows, len, out);
}

/* The dot products of `a` with rows [0, count) of `b` (n columns) into r, in the
 * "ortho" order: thread t sums lane t, GC_ORTHO_BATCH products at a time, and the
 * block halves the lanes in shared memory. Every thread of the block calls it. */
#define GC_ORTHO_BATCH 8

__device__ void gc_geo_ortho_dots(const double *b, gc_u64 count, const double *a, gc_u64 n,
                                  double *r, double (*part)[GC_ORTHO_LANES])
{
    unsigned int t = threadIdx.x;
    for (gc_u64 d0 = 0; d0 < count; d0 += GC_ORTHO_BATCH) {
        gc_u64 nb = count - d0 < GC_ORTHO_BATCH ? count - d0 : GC_ORTHO_BATCH;
        double p[GC_ORTHO_BATCH];
#pragma unroll
        for (int d = 0; d < GC_ORTHO_BATCH; d++)
            p[d] = 0.0;
        for (gc_u64 j = t; j < n; j += GC_ORTHO_LANES) {
            double aj = a[j];
#pragma unroll
            for (int d = 0; d < GC_ORTHO_BATCH; d++)
                if ((gc_u64)d < nb)
                    p[d] = gc_mad64(p[d], b[(d0 + d) * n + j], aj);
        }
#pragma unroll
        for (int d = 0; d < GC_ORTHO_BATCH; d++)
            part[d][t] = p[d];
        __syncthreads();
        for (unsigned int w = GC_ORTHO_LANES / 2; w >= 1; w /= 2) {
            if (t < w)
                for (gc_u64 d = 0; d < nb; d++)
                    part[d][t] = __dadd_rn(part[d][t], part[d][t + w]);
            __syncthreads();
        }
        if (t == 0)
            for (gc_u64 d = 0; d < nb; d++)
                r[d0 + d] = part[d][0];
        __syncthreads();
    }
}

/* gc_geo_orthonormalize of geometry.c, step by step (same bits): rows (k, n) in
 * place, q (k * n) and r (k + 1) fp64 scratch. Launch one block of GC_ORTHO_LANES
 * threads. */
extern "C" __global__ void gc_geo_orthonormalize(float *rows, gc_u64 k, gc_u64 n, gc_u64 seed,
                                                 double *q, double *r)
{
    __shared__ double part[GC_ORTHO_BATCH][GC_ORTHO_LANES];
    unsigned int t = threadIdx.x;
    for (gc_u64 i = 0; i < k; i++) {
        double *a = q + i * n;
        for (gc_u64 j = t; j < n; j += GC_ORTHO_LANES)
            a[j] = gc_finite(rows[i * n + j]) ? (double)rows[i * n + j] : 0.0;
        for (int attempt = 0;; attempt++) {
            int last = attempt == GC_ORTHO_ATTEMPTS - 1;
            /* thread t reads only its own elements of a and q between the sums */
            gc_geo_ortho_dots(a, 1, a, n, r + k, part);
            double before = __dsqrt_rn(r[k]);
            for (int pass = 0; pass < 2; pass++) {
                gc_geo_ortho_dots(q, i, a, n, r, part);
                for (gc_u64 j = t; j < n; j += GC_ORTHO_LANES) {
                    double v = a[j];
                    for (gc_u64 p = 0; p < i; p++)
                        v = gc_msub64(v, r[p], q[p * n + j]);
                    a[j] = v;
                }
                __syncthreads(); /* r is read before the next pass writes it */
            }
            gc_geo_ortho_dots(a, 1, a, n, r + k, part);
            double after = __dsqrt_rn(r[k]);
            if (after > 1e-300 && (after > __dmul_rn(1e-6, before) || last)) {
                for (gc_u64 j = t; j < n; j += GC_ORTHO_LANES)
                    a[j] = __ddiv_rn(a[j], after);
                break;
            }
            for (gc_u64 j = t; j < n; j += GC_ORTHO_LANES)
                a[j] = gc_ortho_random(seed, i, attempt, j);
            if (last)
                break;
            __syncthreads(); /* r[k] is read before the next attempt writes it */
        }
    }
    for (gc_u64 i = 0; i < k; i++) /* each thread its own columns: no barrier */
        for (gc_u64 j = t; j < n; j += GC_ORTHO_LANES)
            rows[i * n + j] = (float)q[i * n + j];
}
