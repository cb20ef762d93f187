"""Worst-case error bounds of the quantizing codecs and of the collectives.

Single quantization, per element:  |Q(v) - v| <= U |v| + C A + D,  where A is
max |x| over the encoded tensor. U is the half-ulp relative error of
round-to-nearest-even with the format's mantissa bits (E4M3: 3 bits -> 2^-4,
E5M2: 2 -> 2^-3, bfloat16: 7 -> 2^-8, E2M1: 1 -> 2^-2). C covers what is not
relative: half the format's subnormal quantum times the largest block scale
A / FMAX (E4M3: 2^-10 / 448, E5M2: 2^-17 / 57344), plus 2^-20 for the fp32
rounding of scale and factor. NVFP4 is derived per superblock (4096
values, aligned to the start of the encoded piece, with its own fp32 scale
g = T / (6 * 448), T the superblock's amax): its E4M3 block scale is rounded
(relative 2^-4), so a value may land at 6 / (1 - 2^-4) ~ 6.4 and be clamped to
6 (error 0.4 block scales) on top of the 0.25-scale subnormal half quantum;
with a block scale <= B / 6 * (1 + 2^-4), B <= T <= A the amaxes of the block
and its superblock, that gives C = 0.65 / 6 * (1 + 2^-4). The NVFP4 bound
holds while block scales are E4M3 normals, i.e. no block's amax is below
~2^-6 / 448 of its superblock's (true for non-degenerate data; superblocks
make it local: a block only competes with the 4095 values around it).

An absolute term D covers data so small that fp32 scales are subnormal:
a scale then carries an absolute error up to 2^-150 and so does the product
code * scale, so |error| gains at most (max code + 1) 2^-150 (E4M3: 449
2^-150 < 2^-141, E5M2: < 2^-134, NVFP4 with its two scale factors: < 2^-137,
bfloat16's own subnormal half quantum: 2^-134).

MX (E8M0 scale 2^X per 32 values, elements x 2^-X computed exactly): with
the OCP floor rule 2^(X + EMAX) <= A, and values in [FMAX, 2^(EMAX + 1)) 2^X
saturate to FMAX 2^X, a relative error below 1 - FMAX / 2^(EMAX + 1) (1/8
for E4M3 and E5M2, 1/4 for E2M1), which replaces U where it is larger
(E4M3: 2^-4 -> 2^-3); the subnormal half quantum q_sub / 2 times 2^X <=
A / 2^EMAX gives C = q_sub / 2^(EMAX + 1) (E4M3 2^-18, E5M2 2^-32, E2M1
2^-4). With rceil nothing saturates (U as for the element format) and
2^X < 2 A / FMAX gives C = q_sub / FMAX (for amax up to FMAX 2^(127 - EMAX),
about 2.5e38 or more: above, X is capped so that FMAX 2^X stays finite, and
values saturate as with floor, so U is floor's: ``error_constants`` takes the
amax). A block whose X is clamped to
E8M0's smallest -127 loses up to q_sub / 2 * 2^-127 absolute, and a decoded
fp32 subnormal 2^-150: D = q_sub 2^-128 + 2^-150 (E4M3 < 2^-136, E5M2 <
2^-143, E2M1 < 2^-128).

Stochastic rounding moves a value to one of its two neighbours, so it errs by
less than the whole gap instead of half of it: U and the subnormal part of C
double (and D, generously). NVFP4 with stochastic rounding rounds its block
scale up instead, so nothing saturates: e = S g <= (1 + 2^-3) B / 6 (plus
g 2^-9 for subnormal scale codes, under 2^-21 T <= 2^-21 A, T the
superblock's amax) and the error is below one
E2M1 gap, |x| / 2 above 1 e and 0.5 e below: U = 1/2 and
C = 0.5 (1 + 2^-3) / 6 + 2^-21 + 2^-20 < 0.1. MX with stochastic rounding
uses rceil (the codec insists): U = 2^-m, C = 2 q_sub / FMAX.
"""

from __future__ import annotations

import numpy as np

from geocomm.codecs.base import Codec, TransformingCodec
from geocomm.codecs.geo.codec import GeoCodec
from geocomm.codecs.geo.policy import WHITEN_FLOOR, whiten_rows

_E4M3 = (2.0**-4, 2.0**-10 / 448 + 2.0**-20, 2.0**-141)
_E5M2 = (2.0**-3, 2.0**-17 / 57344 + 2.0**-20, 2.0**-134)
_BF16 = (2.0**-8, 0.0, 2.0**-134)
_NVFP4 = (2.0**-2, 0.65 / 6 * (1 + 2.0**-4), 2.0**-137)
_NVFP4_SR = (2.0**-1, 0.1, 2.0**-136)
# MX: (m mantissa bits, EMAX, FMAX, subnormal quantum q_sub) of the element format
_MX_ELEMENT = {
    "e4m3": (3, 8, 448.0, 2.0**-9),
    "e5m2": (2, 15, 57344.0, 2.0**-16),
    "e2m1": (1, 2, 6.0, 0.5),
}
FP32_UNIT = 2.0**-24


def _mx_constants(element: str, scale_rule: str, amax: float | None) -> tuple[float, float, float]:
    m, emax, fmax, q_sub = _MX_ELEMENT[element]
    d = q_sub * 2.0**-128 + 2.0**-150
    saturating = max(2.0 ** -(m + 1), 1 - fmax / 2.0 ** (emax + 1))
    if scale_rule == "rceil":  # nothing saturates below the cap on X
        capped = amax is None or amax > fmax * 2.0 ** (127 - emax)
        return saturating if capped else 2.0 ** -(m + 1), q_sub / fmax, d
    return saturating, q_sub / 2.0 ** (emax + 1), d


def error_constants(codec: Codec, amax: float | None = None) -> tuple[float, float, float]:
    """(U, C, D) of the single-quantization bound |Q(v) - v| <= U|v| + C A + D, for
    values whose amax is ``amax`` (None: any; only MX with rceil depends on it, which
    saturates as floor does above FMAX 2^(127 - EMAX))."""
    if isinstance(codec, TransformingCodec):
        codec = codec.quantizer
    config = codec.get_config()
    kind = config["id"]
    stochastic = config.get("rounding") == "stochastic"
    if kind == "none":
        return 0.0, 0.0, 0.0
    if kind == "nvfp4":
        return _NVFP4_SR if stochastic else _NVFP4
    if kind == "bf16":
        u, c, d = _BF16
    elif kind == "fp8":
        u, c, d = _E5M2 if config["fmt"] == "e5m2" else _E4M3
    elif kind in ("mxfp8", "mxfp4"):
        element = config["fmt"] if kind == "mxfp8" else "e2m1"
        u, c, d = _mx_constants(element, config["scale_rule"], amax)
    else:
        raise ValueError(f"no error bound is derived for codec {kind!r}")
    return (2 * u, 2 * c, 2 * d) if stochastic else (u, c, d)


def single_bound(values: np.ndarray, codec: Codec, amax: float | None = None) -> np.ndarray:
    """Per-element bound of |Q(v) - v| for one encode/decode of ``values``.

    ``amax``: max |v| over the whole encoded tensor when ``values`` is only a
    slice of it (the bound's C A term uses the tensor's largest value).
    """
    v = np.abs(np.asarray(values, np.float64))
    if amax is None:
        amax = float(v.max()) if v.size else 0.0
    u, c, d = error_constants(codec, amax)
    return u * v + c * amax + (d if v.size else 0.0)


def allreduce_bound(
    inputs: list[np.ndarray],
    codec: Codec,
    amaxes: list[float] | None = None,
    a_prime: float | None = None,
) -> np.ndarray:
    """Per-element bound of |Y - sum_i x_i| for the compressed all-reduce.

    Stage 1 errors e1_i obey single_bound(x_i) (the owner's own piece is not
    quantized, so its term is 0 in fact; the bound keeps it, since it does not
    know which rank owns an element); the owner's fp32 sum is
    S' = S + sum e1_i, so |S'| <= |S| + E1; stage 2 quantizes S' (bounded
    with |S'| and max |S'|). The fp32 additions of N terms add at most
    2 N 2^-24 (sum |x_i| + E1). For slices of the tensors (memory-bounded
    checks) pass the whole tensors' ``amaxes`` (max |x_i|) and ``a_prime``
    (max over elements of |S| + E1, :func:`stage_two_amax`).
    """
    known: list[float | None] = list(amaxes) if amaxes else [None] * len(inputs)
    abs_sum = np.sum([np.abs(np.asarray(x, np.float64)) for x in inputs], axis=0)
    e1 = np.sum([single_bound(x, codec, a) for x, a in zip(inputs, known, strict=True)], axis=0)
    s_prime = np.abs(np.sum([np.asarray(x, np.float64) for x in inputs], axis=0)) + e1
    if a_prime is None:
        a_prime = float(s_prime.max()) if s_prime.size else 0.0
    u, c, d = error_constants(codec, a_prime)  # the second quantization's
    fp32 = 2 * len(inputs) * FP32_UNIT * (abs_sum + e1)
    result: np.ndarray = e1 + u * s_prime + c * a_prime + d + fp32
    return result


def stage_two_amax(inputs: list[np.ndarray], codec: Codec, amaxes: list[float]) -> float:
    """max over elements of |sum_i x_i| + sum_i single_bound(x_i): the largest value
    the all-reduce's second quantization can meet (for :func:`allreduce_bound`)."""
    e1 = np.sum([single_bound(x, codec, a) for x, a in zip(inputs, amaxes, strict=True)], axis=0)
    s = np.abs(np.sum([np.asarray(x, np.float64) for x in inputs], axis=0)) + e1
    return float(s.max()) if s.size else 0.0


def reduce_scatter_bound(
    inputs: list[np.ndarray], codec: Codec, amaxes: list[float] | None = None
) -> np.ndarray:
    """Per-element bound for the reduce-scatter (one quantization, fp32 sum);
    ``amaxes`` as in :func:`allreduce_bound`."""
    known: list[float | None] = list(amaxes) if amaxes else [None] * len(inputs)
    abs_sum = np.sum([np.abs(np.asarray(x, np.float64)) for x in inputs], axis=0)
    e1 = np.sum([single_bound(x, codec, a) for x, a in zip(inputs, known, strict=True)], axis=0)
    result: np.ndarray = e1 + 2 * len(inputs) * FP32_UNIT * (abs_sum + e1)
    return result


def transformed_bound(inputs: list[np.ndarray], codec: Codec, gather: bool = True) -> float:
    """Bound of ||Y - sum_i x_i||_F for a transforming codec (GeoFP8, Hadamard).

    No element-wise bound exists: what is quantized is each rank's mapped
    matrix R_i, not x_i. Norm-wise it is bounded by the inputs alone. Both
    maps move a row x of X_i to a row r with ||r|| <= ||x|| (the split
    residual x (I - V V^T) is an orthogonal projection, the Hadamard rotation
    is orthogonal), up to the fp32 rounding of k-term chains, well inside the
    factor 1 + 2^-10 used below; so ||R_i||_F <= ||X_i||_F and every |R_i|
    element is at most the largest row norm rho_i. One quantization then
    errs by at most U ||R_i||_F + (C rho_i + D) sqrt(count) (the element
    bound, summed in quadrature); the owner's sum S' is bounded by
    sum_i ||R_i|| + E1 and, with ``gather``, quantized again; the fp32 sums
    add 2 N 2^-24 of what they add; and what the map subtracts on each rank
    and adds back once for the sum differ by the rounding of k-term chains,
    at most 2 (k + 2) 2^-24 sqrt(n) sum_i ||X_i||_F (for the Hadamard
    rotation k is its depth, log2 n additions per value). The bound also holds
    for tensors the codec leaves plain (rho_i >= max |x|). A codec that
    whitens (r directions, scales d_j in [WHITEN_FLOOR, 1]) maps each residual
    row by I + U diag(d - 1) U^T, whose norm is at most 1, so the above holds
    for what it quantizes; its inverse multiplies the quantization error (and
    the sums' and its own 2r-term chains' rounding, counted in k) by at most
    1 / WHITEN_FLOOR.
    """
    u, c, d = error_constants(codec)
    slack = 1 + 2.0**-10
    count = int(np.asarray(inputs[0]).size)
    if count == 0:
        return 0.0
    shape = np.shape(inputs[0])
    cols = int(np.prod(shape[1:])) if len(shape) > 1 else count
    norms, rhos = [], []
    for x in inputs:  # one input at a time in fp64
        rows = np.asarray(x, np.float64).reshape(-1, cols)
        row_norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
        norms.append(slack * float(np.sqrt(np.sum(row_norms * row_norms))))
        rhos.append(slack * float(row_norms.max()))
    root = np.sqrt(count)
    e1 = sum(u * nrm + (c * rho + d) * root for nrm, rho in zip(norms, rhos, strict=True))
    s_norm = sum(norms) + e1
    e2 = (u * s_norm + (c * (sum(rhos) + e1) + d) * root) if gather else 0.0
    sums = 2 * len(inputs) * FP32_UNIT * s_norm
    n = cols
    dims = codec.map_shape(shape) if isinstance(codec, GeoCodec) else None
    k = 0 if dims is None else (dims.k or int(np.log2(n)) + 1)
    amplified = 1.0
    if (
        dims is not None
        and dims.k
        and isinstance(codec, GeoCodec)
        and codec.geometry(False) == "whiten"
    ):
        k += 2 * whiten_rows(dims, codec.whiten)[0]
        amplified = 1.0 / WHITEN_FLOOR
    mapped = 2 * (k + 2) * FP32_UNIT * np.sqrt(n) * sum(norms)
    result: float = amplified * (e1 + e2 + sums + mapped)
    return result
