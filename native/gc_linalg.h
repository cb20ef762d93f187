/*
 * Element-level arithmetic of the GeoFP8 geometry kernels (docs/design.md,
 * "Determinism"): the C loops of geometry.c and the CUDA kernels of
 * gc_geometry.cu both follow these definitions, so a projection, an
 * expansion or an accumulation gives the same fp32 bits on any CPU, with any
 * thread count, and on any GPU.
 *
 *   chain     t = +0, then t = fl(t + fl(a * b)) for each term in a fixed
 *             order: two roundings per term, never an FMA;
 *   dot       a dot product over columns j0 .. j0 + c - 1 of one row cuts
 *             them into chunks of GC_DOT_CHUNK from j0 (the last may be
 *             shorter); a chunk from column a keeps GC_LANES chains, lane q
 *             taking columns a + q, a + q + 8, ... in increasing order,
 *             combined by gc_lane_sum's fixed tree; the chunks' totals are
 *             then a chain in order from the first (a row of at most
 *             GC_DOT_CHUNK columns is one chunk; a GPU sums every chunk of
 *             a row at once);
 *   expand    x + chain over the k coefficients, l = 0 .. k - 1;
 *   accumulate  the rows of a range in tiles of GC_ACC_ROWS (counted from
 *             its first row); each tile's partial is a chain over its rows in
 *             increasing order, from +0; then acc + chain over the tiles'
 *             partials in increasing order (a GPU runs every tile at once);
 *   sumsq     fp64: level 0 cuts the values into chunks of GC_SUMSQ_CHUNK
 *             (the last may be shorter) and sums each chunk's squares in
 *             GC_LANES lanes as a dot product does (lane q: elements q,
 *             q + 8, ... of the chunk, in order, each square exact in fp64,
 *             one rounding per add), combined by the same tree; each level
 *             above sums the totals of the level below the same way, without
 *             squaring, until one total is left. The chunks are independent,
 *             so a GPU sums them all at once, and a level of one total is
 *             that total: x + 0 = x for the sums of squares;
 *   ortho     the fp64 dot products of gc_geo_orthonormalize: lane t of
 *             GC_ORTHO_LANES takes elements t, t + GC_ORTHO_LANES, ... in
 *             increasing order (each product and sum rounded on its own);
 *             the lanes then combine by halving: for w = GC_ORTHO_LANES / 2,
 *             ..., 2, 1, lane t < w adds lane t + w. A GPU runs it in one
 *             thread block, a thread per lane.
 *
 * Compiles as C99 (GC_FN = static inline) and as CUDA (__device__), like
 * gc_scalar.h, whose gc_finite it uses.
 */
#ifndef GC_LINALG_H
#define GC_LINALG_H

#include "gc_scalar.h"

#define GC_LANES 8
#define GC_SUMSQ_CHUNK 2048
#define GC_DOT_CHUNK 512
#define GC_ACC_ROWS 128
#define GC_ORTHO_LANES 256
/* draws of a pseudo-random row before gc_geo_orthonormalize keeps the last one
 * however little of it is left (never, for k <= n: a random row does not lie in
 * the span of the rows before it) */
#define GC_ORTHO_ATTEMPTS 16

/* t + a * b with both operations rounded to fp32 on their own. */
GC_FN float gc_mad(float t, float a, float b)
{
#ifdef __CUDACC__
    return __fadd_rn(t, __fmul_rn(a, b));
#else
    return t + a * b; /* built with -ffp-contract=off: never fused */
#endif
}

/* t + a * b and t - a * b in fp64, each operation rounded on its own. */
GC_FN double gc_mad64(double t, double a, double b)
{
#ifdef __CUDACC__
    return __dadd_rn(t, __dmul_rn(a, b));
#else
    return t + a * b;
#endif
}

GC_FN double gc_msub64(double t, double a, double b)
{
#ifdef __CUDACC__
    return __dsub_rn(t, __dmul_rn(a, b));
#else
    return t - a * b;
#endif
}

/* Entry j of row i of the fixed pseudo-random matrix of `seed` (draw `attempt`):
 * uniform in [-1, 1), from splitmix64 of a counter, so entries are independent. */
GC_FN double gc_ortho_random(gc_u64 seed, gc_u64 i, int attempt, gc_u64 j)
{
    gc_u64 z = (seed ^ (0x51ed2701f3a5c7b9ull * (i + 1)) ^ ((gc_u64)attempt << 56)) +
               (j + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-52 - 1.0; /* the product is exact */
}

/* x for finite x, +0 otherwise: how projections read a gradient's inf/NaN. */
GC_FN float gc_finite_or_zero(float x) { return gc_finite(x) ? x : 0.0f; }

/* The fixed combination of the GC_LANES lane sums of a dot product. */
GC_FN float gc_lane_sum(const float *p)
{
    float a0 = p[0] + p[4], a1 = p[1] + p[5], a2 = p[2] + p[6], a3 = p[3] + p[7];
    return (a0 + a2) + (a1 + a3);
}

#endif /* GC_LINALG_H */
