"""GeoFP8: the kernels' fixed order, the split map, its state, and the error it saves.

Runs without MPI over NumPy and over array-api-strict (the geometry is
written against the array API, so it must not lean on NumPy-only behaviour),
with ranks simulated by :mod:`geocomm.testing`; under ``mpiexec -n N python
-P -m mpi4py -m pytest --with-mpi`` the tests marked ``mpi`` check that the
real collectives give the simulation's bits.

Bounds and why they hold:
* kernels: the C core follows the order of native/gc_linalg.h, which the
  NumPy transcription below follows too, with fp32 ops rounded one by one:
  the bits must be equal;
* split map: the residual and the exact coefficients are subtracted and
  added with one fp32 rounding each, so without quantization the map gives
  x back to within a few fp32 ulps of the largest values (1e-6 relative);
* spiked matrices: four directions hold ~99.99% of the energy; once the
  basis has them, only the weak residual is quantized, so the error falls to
  a small fraction of plain FP8's (< 0.2x);
* Gaussian matrices: no direction stands out; after the first measurement
  the codec leaves them plain, so the error equals plain FP8's.
* whitening: it scales directions of the residual down by at most 64x and
  back up after, so without quantization it gives x back to within 64 times
  the split's rounding (1e-5 relative); on gradients of a stable input-side
  geometry (a fixed activation covariance with a decaying spectrum) it cuts
  the split's error at the same bytes (to below 0.75x; measured about 0.65x).
"""

from __future__ import annotations

import hashlib
import json
import math

import array_api_strict
import ml_dtypes
import numpy as np
import pytest

from geocomm.codecs import decode, get_codec
from geocomm.codecs.bounds import transformed_bound
from geocomm.codecs.formats import Split
from geocomm.codecs.geo import DEFAULTS, GeoCodec, kernels
from geocomm.codecs.geo.maps import WhitenPlan
from geocomm.codecs.geo.policy import (
    DEVICE_GEOMETRY,
    WHITEN_FLOOR,
    MapShape,
    map_shape,
    rank_for_budget,
    whiten_rows,
    whiten_scale,
)
from geocomm.engine.layout import shard_bounds
from geocomm.engine.transforming import run_rounds
from geocomm.kernels import native
from geocomm.testing import simulate_allreduce, simulate_reduce_scatter

NAMESPACES = [np, array_api_strict]


def spiked(m: int, n: int, seed: int, noise: float = 0.01) -> np.ndarray:
    """Four strong singular directions (40, 20, 10, 5) plus weak Gaussian noise."""
    rng = np.random.default_rng([seed, m, n, 7])
    u = np.linalg.qr(rng.standard_normal((m, 4)))[0]
    v = np.linalg.qr(rng.standard_normal((n, 4)))[0]
    return ((u * [40.0, 20.0, 10.0, 5.0]) @ v.T + noise * rng.standard_normal((m, n))).astype(
        np.float32
    )


def gaussian(m: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, m, n, 11]).standard_normal((m, n)).astype(np.float32)


def rank_inputs(size: int, m: int, n: int, step: int, noise: float = 0.01) -> list[np.ndarray]:
    """Every rank's gradient at ``step``: a shared spiked matrix plus its own noise."""
    return [spiked(m, n, seed=1) + noise * gaussian(m, n, seed=100 * step + r) for r in range(size)]


def rel(a, b) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(b64))


def exact_sum(xs) -> np.ndarray:
    return np.sum([np.asarray(x, np.float64) for x in xs], axis=0)


def geo(size: int = 2, **knobs):
    """One geofp8 codec per simulated rank; small test matrices are eligible, and
    (unless a test sets it) no model-wide side budget: every key gets its cap, so
    these tests see the map itself (tests/codecs/test_geo_budget.py: the budget)."""
    config = {"min_dim": 8, "min_numel": 0, "side_budget": math.inf, **knobs}
    return [get_codec("geofp8", **config) for _ in range(size)]


# ---------------------------------------------------------------------------
# kernels: the fixed order, transcribed in NumPy fp32


def ref_project(x: np.ndarray, lo: int, n: int, vt: np.ndarray) -> np.ndarray:
    k = vt.shape[0]
    rows = kernels.rows(lo, x.size, n)
    coef = np.zeros((rows, k), np.float32)
    for r in range(rows):
        row = lo // n + r
        a, b = max(row * n, lo), min((row + 1) * n, lo + x.size)
        vals = np.where(np.isfinite(x[a - lo : b - lo]), x[a - lo : b - lo], np.float32(0))
        for c in range(0, b - a, DOT_CHUNK):  # each chunk's lanes, then the chunks' chain
            lanes = np.zeros((k, 8), np.float32)
            for t in range(c, min(c + DOT_CHUNK, b - a)):
                lanes[:, (t - c) % 8] = lanes[:, (t - c) % 8] + vals[t] * vt[:, (a + t) % n]
            s4 = lanes[:, :4] + lanes[:, 4:]
            total = (s4[:, 0] + s4[:, 2]) + (s4[:, 1] + s4[:, 3])
            coef[r] = total if c == 0 else coef[r] + total
    return coef


def ref_expand(x, lo, n, coef, vt, sign):
    out = np.empty_like(x)
    for e in range(x.size):
        r, j = (lo + e) // n - lo // n, (lo + e) % n
        t = np.float32(0)
        for c, b in zip(coef[r], vt[:, j], strict=True):
            t = np.float32(t + c * b)
        out[e] = x[e] + np.float32(sign) * t
    return out


ACC_ROWS = 128  # GC_ACC_ROWS of native/gc_linalg.h
DOT_CHUNK = 512  # GC_DOT_CHUNK of native/gc_linalg.h


def ref_accumulate(x, lo, n, coef, acc):
    """gc_linalg.h's "accumulate": each tile of ACC_ROWS rows chains from +0, then acc
    adds the tiles' partials in order."""
    acc = acc.copy()
    tiles = np.zeros((-(-coef.shape[0] // ACC_ROWS), *acc.shape), np.float32)
    for e in range(x.size):
        r, j = (lo + e) // n - lo // n, (lo + e) % n
        tiles[r // ACC_ROWS, :, j] = tiles[r // ACC_ROWS, :, j] + coef[r] * x[e]
    for partial in tiles:
        acc = acc + partial
    return acc


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize(
    ("m", "n", "k", "lo", "length"),
    [
        (5, 19, 3, 0, 95),
        (6, 23, 4, 7, 100),
        (4, 40, 5, 45, 30),
        (3, 9, 2, 4, 3),
        (300, 5, 3, 2, 1490),  # three tiles of accumulation, partial rows at both ends
        (3, 1100, 4, 600, 2000),  # dot products of three chunks, partial rows at both ends
    ],
)
def test_kernels_follow_the_fixed_order(xp, m, n, k, lo, length):
    rng = np.random.default_rng([m, n, k])
    x = rng.standard_normal(length).astype(np.float32) * 100
    x[length // 3] = np.nan
    vt = rng.standard_normal((k, n)).astype(np.float32)
    coef = np.asarray(kernels.project(xp.asarray(x), lo, n, xp.asarray(vt)))
    assert np.array_equal(coef, ref_project(x, lo, n, vt))
    x[length // 3] = 1.5
    out = xp.asarray(np.empty_like(x))
    kernels.expand(xp.asarray(x), lo, n, xp.asarray(coef), xp.asarray(vt), -1.0, out)
    assert np.array_equal(np.asarray(out), ref_expand(x, lo, n, coef, vt, -1.0))
    acc0 = rng.standard_normal((k, n)).astype(np.float32)
    acc = xp.asarray(acc0.copy())
    kernels.accumulate(xp.asarray(x), lo, n, xp.asarray(coef), acc)
    assert np.array_equal(np.asarray(acc), ref_accumulate(x, lo, n, coef, acc0))


@pytest.fixture
def restore_native():
    """The native core's loop path and thread count as they were before the test."""
    level, count = native.simd(), native.threads()
    yield
    native.set_simd(level)
    native.set_threads(count)


@pytest.mark.parametrize(
    ("m", "n", "k", "lo", "length"),
    [
        (37, 203, 5, 0, 37 * 203),  # whole rows, odd k, tail columns
        (37, 203, 6, 150, 30 * 203 + 7),  # partial first and last rows
        (64, 256, 10, 0, 64 * 256),  # two pairs of pairs, one pair left
        (9, 64, 2, 64, 8 * 64),  # one pair
        (12, 33, 1, 5, 300),  # no pair: the narrow loops only
        (6, 8, 4, 0, 48),  # one chunk per row
        (20, 300, 4, 1000, 15 * 300 + 17),  # a first row from inside a panel
    ],
)
def test_wide_loops_give_the_portable_bits(m, n, k, lo, length, restore_native):
    """The AVX-512 loops (on a CPU that has them; otherwise both runs take the
    portable loops) hold the same chains, so every kernel's bits are equal,
    with a non-finite value in the range, with the fused residual, and for the
    accumulation and the sum of squares (once with the inf, once without)."""
    rng = np.random.default_rng([m, n, k, lo])
    x = (rng.standard_normal(length) * 10).astype(np.float32)
    x[length // 5] = np.inf
    vt = rng.standard_normal((k, n)).astype(np.float32)
    runs = []
    for level in ("portable", "auto"):
        native.set_simd(level)
        coef = kernels.project(x, lo, n, vt)
        out = np.empty_like(x)
        kernels.expand(x, lo, n, coef, vt, -1.0, out)
        back = np.empty_like(x)
        kernels.expand(x, lo, n, coef, vt, 1.0, back, kernels.pack(vt))
        acc = np.tile(np.linspace(-1, 1, n, dtype=np.float32), (k, 1))
        kernels.accumulate(x, lo, n, coef, acc)
        finite = np.nan_to_num(x, posinf=3.0)
        acc_finite = np.zeros((k, n), np.float32)
        kernels.accumulate(finite, lo, n, coef, acc_finite)
        sums = np.array([kernels.sumsq(x), kernels.sumsq(finite)])
        runs.append([coef, out, back, acc, acc_finite, sums])
        if lo == 0 and length == m * n:
            fused = np.empty_like(x)
            runs[-1] += [kernels.residual(x, n, vt, fused), fused]
    for want, got in zip(*runs, strict=True):
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
    assert np.isinf(runs[1][5][0])
    if length <= 8000:
        assert np.array_equal(runs[1][0], ref_project(x, lo, n, vt))
        assert runs[1][5][1] == ref_sumsq(np.nan_to_num(x, posinf=3.0))


@pytest.mark.parametrize(
    "config",
    [
        {"id": "fp8"},
        {"id": "fp8", "fmt": "e5m2", "block": 32, "rounding": "stochastic", "seed": 3},
        {"id": "fp8", "block": 0},  # one scale for the range: mapped whole, then encoded
        {"id": "fp8", "block": 1024},  # a block longer than eight rows of 64
        {"id": "nvfp4", "rounding": "stochastic", "seed": 5},
        {"id": "mxfp8", "scale_rule": "rceil"},
        {"id": "bf16"},
    ],
)
@pytest.mark.parametrize(
    ("m", "n", "lo", "length"),
    [
        (300, 257, 1000, 40_000),  # partial rows, three tiles
        (70, 4096, 3 * 4096 + 17, 60 * 4096),  # a long partial first row
        (1100, 1024, 0, 1100 * 1024),  # whole rows, two threads' share
        (4096, 64, 0, 4096 * 64),  # whole rows of 64 (1 MiB: decoded inside the expansion)
    ],
)
def test_split_calls_give_the_bits_of_map_then_code(config, m, n, lo, length, restore_native):
    """gc_geo_encode (the map and the encode of a range in one pass, tile by tile)
    writes the bytes of expand(sign -1) into a scratch followed by encode_wire, with
    any rounding, on both loop paths and two threads; gc_geo_decode gives the bits
    of decode_wire followed by expand(sign 1) in place (whole rows: written around
    the cache). Every element's map is its own chain and every tile holds whole
    scaling blocks, so nothing can differ."""
    codec = get_codec(config)
    rng = np.random.default_rng([m, n, lo])
    x = rng.standard_normal(m * n).astype(np.float32)
    x[lo + length // 3] = np.inf
    values = x[lo : lo + length]
    vt = kernels.orthonormalize(rng.standard_normal((6, n)).astype(np.float32), 2)
    coef = kernels.round_bf16(kernels.project(values, lo, n, vt))
    mapped = np.empty_like(values)
    kernels.expand(values, lo, n, coef, vt, -1.0, mapped)
    want = np.empty(codec.wire_size(length), np.uint8)
    codec.encode_wire(mapped, want, rounding_stream=9, offset=lo)
    back = np.empty_like(values)
    codec.decode_wire(want, back)
    kernels.expand(back, lo, n, coef, vt, 1.0, back)
    split = Split(lo, n, coef, vt, kernels.pack(vt))
    for level, threads in (("portable", 1), ("auto", 1), ("auto", 2)):
        native.set_simd(level)
        native.set_threads(threads)
        got = np.zeros_like(want)
        codec.encode_split_wire(values, split, got, rounding_stream=9, offset=lo)
        assert np.array_equal(got, want), (level, threads)
        out = np.full_like(values, np.nan)
        codec.decode_split_wire(want, split, out)
        assert np.array_equal(out.view(np.uint32), back.view(np.uint32)), (level, threads)


def test_split_calls_refuse_bad_arguments():
    """The split calls check what the C core cannot: dtypes, contiguity, the
    coefficients' rows, the packed basis's size and the wire's; nothing is
    written when they refuse."""
    n, k = 64, 3
    x = np.ones(10 * n, np.float32)
    vt = kernels.orthonormalize(np.eye(k, n, dtype=np.float32), 1)
    coef, packed = np.ones((10, k), np.float32), kernels.pack(vt)
    wire = np.zeros(native.wire_size("e4m3", x.size, 128), np.uint8)
    ok = (x, 0, n, coef, vt, packed, 128, wire)
    native.geo_encode("e4m3", *ok)
    bad = {
        "x float64": (x.astype(np.float64), *ok[1:]),
        "x strided": (np.ones(20 * n, np.float32)[::2], *ok[1:]),
        "coef rows": (x, 0, n, coef[:9], vt, packed, 128, wire),
        "packed size": (x, 0, n, coef, vt, packed[:-1], 128, wire),
        "wire short": (x, 0, n, coef, vt, packed, 128, wire[:-1]),
    }
    for name, args in bad.items():
        wire[:] = 7
        with pytest.raises((TypeError, ValueError)):
            native.geo_encode("e4m3", *args)
        assert np.all(wire == 7), name
    out = np.full(x.size, np.nan, np.float32)
    with pytest.raises(ValueError):
        native.geo_decode("e4m3", wire[:-1], 0, n, coef, vt, packed, 128, out)
    with pytest.raises(ValueError):
        native.geo_decode("e4m3", wire, 0, n, coef, vt, packed[:-1], 128, out)
    assert np.all(np.isnan(out))


def ref_sumsq(x: np.ndarray, chunk: int = 2048) -> float:
    """gc_linalg.h's "sumsq" order: level 0 sums the squares of each chunk of 2048
    values in eight fp64 lanes (lane q adds elements q, q + 8, ... in order), then
    ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)); each level above sums the
    totals below the same way, without squaring, until one is left."""

    def lanes(values: list[float]) -> float:
        p = [0.0] * 8
        for i, v in enumerate(values):
            p[i % 8] += v
        return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))

    level = [v * v for v in x.astype(np.float64).tolist()]
    while True:
        level = [lanes(level[a : a + chunk]) for a in range(0, max(len(level), 1), chunk)]
        if len(level) == 1:
            return level[0]


def test_sumsq_follows_its_order_across_levels():
    """The C core's one-pass sum of squares (each level's open chunk only) gives the
    reference's bits at chunk and level edges, and with a small chunk (16) the
    reference's levels differ from one long lane sum, so the test can tell."""
    rng = np.random.default_rng(7)
    for length in (0, 1, 2047, 2048, 2049, 2048 * 3 + 5, 2048 * 2048, 2048 * 2048 + 2049):
        x = (rng.standard_normal(length) * np.exp(rng.standard_normal(length) * 4)).astype(
            np.float32
        )
        want = ref_sumsq(x)
        assert kernels.sumsq(x) == want, length
    x = (rng.standard_normal(5000) * np.exp(rng.standard_normal(5000) * 4)).astype(np.float32)
    assert ref_sumsq(x, chunk=16) != ref_sumsq(x, chunk=10**9)


def test_residual_is_project_round_then_expand():
    """The fused residual gives the three steps' bits: the projection rounded to
    bfloat16 as ml_dtypes rounds (the side channel's values), then the expansion
    with the rounded coefficients."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(37 * 70).astype(np.float32)
    vt = kernels.orthonormalize(rng.standard_normal((6, 70)).astype(np.float32), 0)
    out = np.empty_like(x)
    coef = kernels.residual(x, 70, vt, out)
    projected = kernels.project(x, 0, 70, vt)
    rounded = projected.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert not np.array_equal(rounded, projected)  # the rounding is not a no-op here
    assert np.array_equal(coef, rounded)
    again = np.empty_like(x)
    kernels.expand(x, 0, 70, rounded, vt, -1.0, again)
    assert np.array_equal(out, again)


def test_round_bf16_is_ml_dtypes_nearest_even():
    """kernels.round_bf16 rounds in place as ml_dtypes' bfloat16 cast does, ties,
    subnormals and non-finite values included, except that a finite value the cast
    takes to inf gets the largest finite bfloat16 (the bf16 codec's saturation)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(4099) * np.exp(rng.uniform(-100, 88, 4099))).astype(np.float32)
    x[:6] = [np.inf, -np.inf, np.nan, 3.4e38, 1e-40, 1.0 + 2.0**-8]  # 1 + 2^-8: a tie
    with np.errstate(over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    want[3] = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # 3.4e38: inf by the cast
    got = kernels.round_bf16(x)
    assert got is x
    assert np.array_equal(got.view(np.uint32)[3:], want.view(np.uint32)[3:])
    assert np.isnan(got[2]) and np.array_equal(got[:2], want[:2])


def test_basis_hash_is_its_weighted_sum_and_sees_every_element():
    """kernels.basis_hash is sum_i bits(a[i]) * ((i + 1) * GC_HASH_STEP | 1) mod 2^64
    (Python's exact integers here), non-finite values and -0.0 by their bits; changing
    any one element's bits changes it (each weight is odd, so it is invertible mod
    2^64), and so do a swap of two rows and a change of shape's order."""
    step = 0x9E3779B97F4A7C15
    rng = np.random.default_rng(8)
    a = rng.standard_normal((7, 301)).astype(np.float32)
    a[0, :4] = [np.nan, np.inf, -0.0, 1e-40]
    words = [int(w) for w in a.reshape(-1).view(np.uint32)]
    want = sum(w * ((((i + 1) * step) % 2**64) | 1) for i, w in enumerate(words)) % 2**64
    got = kernels.basis_hash(a)
    assert got.dtype == np.uint64 and got.shape == (1,) and int(got[0]) == want
    assert int(kernels.basis_hash(np.zeros(0, np.float32))[0]) == 0
    for i in (0, 5, a.size - 1):
        b = a.copy().reshape(-1)
        b.view(np.uint32)[i] ^= np.uint32(1 << 31)  # one bit: 0.0 against -0.0, say
        assert kernels.basis_hash(b)[0] != got[0]
    assert kernels.basis_hash(a[[1, 0, *range(2, 7)]])[0] != got[0]


def test_orthonormalize_is_orthonormal_and_deterministic():
    a = np.zeros((5, 40), np.float32)
    a[0, :] = 1.0
    a[1, :] = 2.0  # parallel to row 0: replaced by a seeded random direction
    q = kernels.orthonormalize(a, seed=4)
    # fp64 Gram-Schmidt twice, rounded to fp32: orthonormal to ~n 2^-24
    assert np.abs(q @ q.T - np.eye(5)).max() < 1e-5
    assert np.array_equal(q, kernels.orthonormalize(a, seed=4))


# ---------------------------------------------------------------------------
# policy


def test_rank_follows_budget_bytes_and_shape():
    config = dict(DEFAULTS)
    fp8_payload = lambda m, n: m * n + 4 * -(-m * n // 128)  # noqa: E731
    # the cap: a split of rank k costs (3 + 2 / refresh) k multiply-adds per value
    assert rank_for_budget(40, 4) == 11 and rank_for_budget(40, 1) == 8
    cap = rank_for_budget(DEFAULTS["budget"], DEFAULTS["refresh"])
    assert map_shape((4096, 4096), config, fp8_payload(4096, 4096)) == MapShape(4096, 4096, cap)
    # 256 columns: the side channel ((m + n) k bfloat16 a call: coefficients and
    # step sums) must fit in a quarter of the payload; with no compute cap that
    # quarter binds
    dims = map_shape((688, 256), config, fp8_payload(688, 256))
    assert dims.k == cap and 2 * (688 + 256) * dims.k <= 0.25 * fp8_payload(688, 256)
    narrow = map_shape((4096, 64), {**config, "budget": 1000.0}, fp8_payload(4096, 64))
    assert narrow.k == int(0.25 * fp8_payload(4096, 64) // (2 * (4096 + 64))) == 8
    # a frame also stores the fp32 basis: n more floats per direction
    framed = map_shape((4096, 64), config, fp8_payload(4096, 64), framed=True)
    assert framed.k == int(0.25 * fp8_payload(4096, 64) // (2 * 4096 + 4 * 64))
    assert map_shape((4096,), config, 4096) is None
    assert map_shape((32, 1024), config, fp8_payload(32, 1024)) is None  # min_dim
    assert map_shape((64, 200), config, fp8_payload(64, 200)) is None  # min_numel
    assert map_shape((256, 256), {**config, "budget": 2.0}, fp8_payload(256, 256)) is None
    assert (
        map_shape(
            (4, 8, 32), {**config, "min_dim": 1, "min_numel": 0, "max_side": 1}, fp8_payload(4, 256)
        ).n
        == 256
    )  # N-d: (shape[0], prod(rest))


def test_config_round_trip_and_validation():
    codec = get_codec("geofp8", k=16, budget=80.0, refresh=2)
    again = get_codec(json.loads(json.dumps(codec.get_config())))
    assert again == codec and again.get_config()["refresh"] == 2
    assert get_codec("hadamard").get_config() == {
        "id": "hadamard",
        "fmt": "e4m3",
        "block": 128,
        "seed": 0,
        "min_dim": 64,
        "min_numel": 16384,
    }
    for bad in (
        {"transform": "rotate"},
        {"device": "tpu"},
        {"alpha": 0.3},  # not a power of one half: no chain of square roots
        {"whiten": -1},
        {"k": 0},
        {"refresh": 0},
        {"budget": -1.0},
        {"min_share": 2.0},
    ):
        with pytest.raises(ValueError):
            get_codec("geofp8", **bad)
    with pytest.raises(TypeError, match="unknown GeoFP8 parameters"):
        get_codec("geofp8", sides="left")


# ---------------------------------------------------------------------------
# the map in the collective (simulated ranks)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_first_call_is_plain_then_the_map_cuts_the_error(xp):
    size, m, n = 2, 256, 200
    codecs, plain = geo(size), [get_codec("fp8") for _ in range(size)]
    ratios = []
    for step in range(5):
        xs = rank_inputs(size, m, n, step)
        got = simulate_allreduce(codecs, [xp.asarray(x) for x in xs], key="w")
        want = simulate_allreduce(plain, xs)
        ratios.append(rel(np.asarray(got), exact_sum(xs)) / rel(want, exact_sum(xs)))
    assert ratios[0] == 1.0  # no basis yet: plain FP8, bit for bit
    assert max(ratios[1:]) < 0.2, ratios
    assert codecs[0].state_checksum() == codecs[1].state_checksum()


def test_array_api_strict_gives_numpy_bits():
    xs = rank_inputs(3, 90, 70, 0)
    a, b = geo(3), geo(3)
    for step in range(3):
        xs = rank_inputs(3, 90, 70, step)
        got = simulate_allreduce(a, [array_api_strict.asarray(x) for x in xs], key="k")
        assert np.array_equal(np.asarray(got), simulate_allreduce(b, xs, key="k"))
    assert a[0].state_checksum() == b[0].state_checksum()


def test_map_inverts_without_quantization():
    x = spiked(300, 130, seed=5)
    codec = geo(1)[0]
    simulate_allreduce([codec], [x], key="w")  # measure: the basis
    plan = codec.plan(x.reshape(-1), x.shape, "w", [0, x.size])
    out = np.empty(x.size, np.float32)
    plan.forward(x.reshape(-1), out)
    # the four spikes hold all but ~1e-4 of the energy: the residual is the noise
    assert np.linalg.norm(out) < 0.05 * np.linalg.norm(x), "the residual kept the spikes"
    plan.inverse(out, 0, plan.side)
    assert rel(out, x.reshape(-1)) < 1e-6


def test_gaussian_goes_plain_after_measuring():
    codecs, plain = geo(2), [get_codec("fp8") for _ in range(2)]
    for step in range(3):
        xs = [gaussian(128, 128, seed=10 * step + r) for r in range(2)]
        got = simulate_allreduce(codecs, xs, key="g")
        assert np.array_equal(got, simulate_allreduce(plain, xs))
    info = codecs[0].state_info("g")
    assert info["share"] is not None and info["share"] < 0.2 + 12 / 128


def test_refresh_period_and_state_are_shared():
    codecs = geo(3, refresh=3)
    for step in range(7):
        simulate_allreduce(codecs, rank_inputs(3, 64, 96, step), key="w")
    infos = [c.state_info("w") for c in codecs]
    # refreshes at calls 1 (cold), 4 and 7
    assert infos[0]["calls"] == 7 and infos[0]["refreshed"] == 7
    assert all(np.array_equal(i["vt"], infos[0]["vt"]) for i in infos)


def test_the_basis_steps_onto_each_calls_own_gradients():
    """A geometry that turns at every call: a new random rank-4 signal each call,
    shared by both ranks, over weak per-rank noise. The power step on the call's
    own sum_i X_i^T X_i V finds the new signal before the map, so from call 2 on
    the residual is the noise: the error is below 0.05x FP8's (measured about
    0.01x), where a basis from the last result (a random 4 of 96 directions for
    this signal) would leave about FP8's. The state's energies come from the
    summed side: the mapped directions hold nearly all of every rank's energy."""
    rng = np.random.default_rng(7)
    codecs, plain = geo(2, k=4), [get_codec("fp8") for _ in range(2)]
    for call in range(6):
        signal = rng.standard_normal((128, 4)) @ rng.standard_normal((4, 96))
        xs = [(signal + 0.01 * rng.standard_normal((128, 96))).astype(np.float32) for _ in (0, 1)]
        want = exact_sum(xs)
        ratio = rel(simulate_allreduce(codecs, xs, key="w"), want) / rel(
            simulate_allreduce(plain, xs), want
        )
        info = codecs[0].state_info("w")
        if call > 0:
            assert ratio < 0.05, (call, ratio)
            assert info["use"] == 4 and info["refreshed"] == call + 1
            assert info["share"] > 0.99, info["share"]
    assert codecs[0].state_checksum() == codecs[1].state_checksum()


def test_reduce_scatter_keeps_the_gain():
    size, m, n = 3, 200, 160
    codecs, plain = geo(size), [get_codec("fp8") for _ in range(size)]
    for step in range(4):
        xs = rank_inputs(size, m, n, step)
        got = np.concatenate([np.asarray(s) for s in simulate_reduce_scatter(codecs, xs, "w")])
        want = np.concatenate(simulate_reduce_scatter(plain, xs))
        ratio = rel(got, exact_sum(xs).reshape(-1)) / rel(want, exact_sum(xs).reshape(-1))
    assert ratio < 0.2, ratio  # one quantization; the basis tracks from shards alone
    assert codecs[0].state_checksum() == codecs[2].state_checksum()


def test_nonfinite_stays_put_and_leaves_the_state_alone():
    size, m, n = 2, 96, 80
    codecs = geo(size)
    simulate_allreduce(codecs, rank_inputs(size, m, n, 0), key="w")
    before = codecs[0].state_checksum("w")
    for refresh_step in range(4):  # the 4th call (calls = 5) would refresh
        xs = rank_inputs(size, m, n, refresh_step + 1)
        xs[1][7, 11] = np.inf
        xs[0][50, 3] = np.nan
        got = simulate_allreduce(codecs, xs, key="w")
        bad = ~np.isfinite(got)
        assert bad[7, 11] and bad[50, 3]
        assert bad.sum() == 2, "inf/NaN must not spread along rows or columns"
    assert codecs[0].state_info("w")["refreshed"] == 1  # result non-finite: no update
    assert codecs[0].state_checksum("w") != before  # the call count moved on
    assert codecs[0].state_checksum() == codecs[1].state_checksum()


def test_zero_gradient_stays_zero():
    codecs = geo(2)
    for _ in range(3):
        got = simulate_allreduce(codecs, [np.zeros((64, 64), np.float32)] * 2, key="z")
        assert not got.any()
    assert codecs[0].state_info("z")["vt"] is None


def test_state_dict_round_trip_continues_bit_for_bit():
    a, b = geo(2), geo(2)
    for step in range(5):
        simulate_allreduce(a, rank_inputs(2, 80, 72, step), key="w")
    for src, dst in zip(a, b, strict=True):
        dst.load_state_dict(json.loads(json.dumps(src.state_dict(), default=_jsonable)))
    for step in range(5, 8):
        xs = rank_inputs(2, 80, 72, step)
        assert np.array_equal(
            simulate_allreduce(a, xs, key="w"), simulate_allreduce(b, xs, key="w")
        )
    with pytest.raises(ValueError, match="saved by"):
        get_codec("geofp8", k=5).load_state_dict(a[0].state_dict())


def test_a_state_load_that_fails_changes_nothing():
    """A malformed or non-finite state raises (ValueError, TypeError for no dict) before
    anything changes: the codec goes on bit for bit with its twin (a failed load once
    dropped the basis updates still on their way, and kept nothing of the old state)."""
    a, twin = geo(2), geo(2)
    for step in range(4):
        for codecs in (a, twin):
            simulate_allreduce(codecs, rank_inputs(2, 80, 72, step), key="w")
    saved = a[0].state_dict()
    (key, good), *_ = saved["keys"]
    nan_basis = np.array(good["vt"], np.float32)
    nan_basis[0, 0] = np.nan
    bad_states = [
        ({**saved, "keys": [(key, {k: v for k, v in good.items() if k != "calls"})]}, "calls"),
        ({**saved, "keys": [(key, {**good, "vt": nan_basis})]}, "non-finite"),
        ({**saved, "keys": [(key, {**good, "vt": nan_basis[:, :5]})]}, "does not fit"),
        ({k: v for k, v in saved.items() if k != "keys"}, "keys"),
        ({**saved, "keys": 3}, "malformed"),
    ]
    for bad, match in bad_states:
        with pytest.raises(ValueError, match=match):
            a[0].load_state_dict(bad)
    with pytest.raises(TypeError, match="dict"):
        a[0].load_state_dict([saved])
    for step in range(4, 6):
        xs = rank_inputs(2, 80, 72, step)
        assert np.array_equal(
            simulate_allreduce(a, xs, key="w"), simulate_allreduce(twin, xs, key="w")
        )


def test_an_infinite_budget_or_side_cap_is_no_cap():
    """``budget`` and ``max_side`` of inf are accepted (as ``side_budget`` of inf is)
    and mean no cap: the rank is ``k``'s and half the smaller side's only (they once
    failed every call with a NaN-to-integer conversion)."""
    from geocomm.codecs.geo.policy import map_shape

    config = {**get_codec("geofp8").get_config(), "k": 12, "min_dim": 8, "min_numel": 0}
    free = {**config, "budget": math.inf, "max_side": math.inf}
    assert map_shape((80, 72), free, payload_bytes=1).k == 12
    assert map_shape((20, 72), free, payload_bytes=1).k == 10
    assert map_shape((80, 72), config, payload_bytes=1) is None  # 1 byte buys no side
    codecs = geo(2, budget=math.inf, max_side=math.inf, k=12)
    xs = rank_inputs(2, 80, 72, 0)
    for _ in range(2):
        got = simulate_allreduce(codecs, xs, key="w")
    assert codecs[0].state_info("w")["k"] == 12
    assert rel(got, exact_sum(xs)) < 0.05


def _jsonable(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_shape_change_resets_the_key():
    codecs = geo(2)
    simulate_allreduce(codecs, rank_inputs(2, 64, 64, 0), key="w")
    simulate_allreduce(codecs, rank_inputs(2, 64, 96, 0), key="w")
    assert codecs[0].state_info("w")["shape"] == (64, 96)


def test_geonvfp4_gain():
    codecs, plain = (
        [get_codec("geonvfp4", min_dim=8, min_numel=0, side_budget=math.inf) for _ in range(2)],
        [get_codec("nvfp4") for _ in range(2)],
    )
    for step in range(3):
        xs = rank_inputs(2, 256, 192, step)
        ratio = rel(simulate_allreduce(codecs, xs, key="w"), exact_sum(xs)) / rel(
            simulate_allreduce(plain, xs), exact_sum(xs)
        )
    assert ratio < 0.2, ratio


# ---------------------------------------------------------------------------
# whitening


def activation_gradients(size: int, m: int, n: int, call: int, tokens: int = 256):
    """Every rank's weight gradient d^T a over ``tokens`` tokens: fresh output
    gradients d each call, inputs a whose covariance is fixed (a random basis,
    the j-th direction's scale 1 / (j + 1)), as a layer's activations are."""
    basis = np.linalg.qr(np.random.default_rng(3).standard_normal((n, n)))[0]
    scale = 1.0 / (1.0 + np.arange(n))
    out = []
    for r in range(size):
        rng = np.random.default_rng([call, r, 17])
        a = (rng.standard_normal((tokens, n)) * scale) @ basis.T
        out.append((rng.standard_normal((tokens, m)).T @ a).astype(np.float32))
    return out


def test_whitening_cuts_the_splits_error_at_the_same_bytes():
    size, m, n = 2, 160, 128
    knobs = {"min_dim": 8, "min_numel": 0, "k": 4}
    split = [get_codec("geofp8", transform="split", **knobs) for _ in range(size)]
    white = [get_codec("geofp8", transform="whiten", whiten=16, **knobs) for _ in range(size)]
    plain = [get_codec("fp8") for _ in range(size)]
    for call in range(6):
        xs = activation_gradients(size, m, n, call)
        want = exact_sum(xs)
        base = rel(simulate_allreduce(plain, xs), want)
        ratio_split = rel(simulate_allreduce(split, xs, key="w"), want) / base
        ratio_white = rel(simulate_allreduce(white, xs, key="w"), want) / base
        if call == 0:  # the cold start: plain, bit for bit
            assert ratio_white == ratio_split == 1.0
        else:
            assert ratio_white < 0.75 * ratio_split, (call, ratio_white, ratio_split)
        # the same split: the same coefficients on the side channel, no more bytes
        assert white[0].state_info("w")["use"] == split[0].state_info("w")["use"]
    info = white[0].state_info("w")
    assert info["wt"].shape == (whiten_rows(MapShape(m, n, 4), 16)[1], n)
    assert white[0].state_checksum() == white[1].state_checksum()


def test_whitening_inverts_without_quantization():
    """forward then inverse on one rank (its own side as the sum): x back to
    within 1e-5, though the map scaled some directions down by up to 64x."""
    xs = activation_gradients(1, 96, 80, 0)
    codec = get_codec("geofp8", transform="whiten", whiten=16, min_dim=8, min_numel=0)
    simulate_allreduce([codec], xs, key="w")  # the cold start measures both bases
    x = activation_gradients(1, 96, 80, 1)[0].reshape(-1)
    plan = codec.plan(x, (96, 80), "w", [0, x.size])
    assert isinstance(plan, WhitenPlan) and plan.steps
    with pytest.raises(RuntimeError, match="before its step"):
        plan.side  # noqa: B018  (the basis may still turn: no side yet)
    run_rounds(None, codec, [codec.step(plan, x)])  # one rank: its sums are the totals
    assert plan.whitened() is not None
    out = np.empty_like(x)
    plan.forward(x, out)
    plan.inverse(out, 0, plan.side)
    assert rel(out, x) < 1e-5


def test_the_geometry_follows_the_transform_and_the_device_kind():
    """``transform="auto"`` takes each device kind's geometry from DEVICE_GEOMETRY
    (the split on both, for their cost); ``whiten`` whitens on either."""
    for device in ("cpu", "gpu"):
        assert get_codec("geofp8", device=device).geometry(False) == DEVICE_GEOMETRY[device]
    host = get_codec("geofp8")
    assert host.geometry(False) == DEVICE_GEOMETRY["cpu"]
    assert host.geometry(True) == DEVICE_GEOMETRY["gpu"]
    assert get_codec("geofp8", transform="whiten").geometry(False) == "whiten"
    auto, white = geo(2), geo(2, transform="whiten")
    for call in range(3):
        xs = activation_gradients(2, 96, 80, call)
        simulate_allreduce(auto, xs, key="w")
        simulate_allreduce(white, xs, key="w")
    assert auto[0].state_info("w")["wt"] is None  # the split never measures a whitening
    assert white[0].state_info("w")["wt"] is not None


def test_a_reduce_scatter_measures_no_whitening():
    """The whitening's basis comes from the whole result, which a reduce-scatter
    does not leave: there the codec stays a split (and sends no more bytes)."""
    codecs = geo(3, transform="whiten")
    for call in range(3):
        simulate_reduce_scatter(codecs, activation_gradients(3, 96, 80, call), "w")
    assert codecs[0].state_info("w")["wt"] is None
    assert codecs[0].state_checksum() == codecs[2].state_checksum()


def test_whiten_scale_is_a_chain_of_square_roots():
    assert whiten_scale(16.0, 1.0, 0.25) == 0.5
    assert whiten_scale(16.0, 1.0, 0.5) == 0.25
    assert whiten_scale(0.5, 1.0, 0.25) == 1.0  # weaker than the bulk: left alone
    assert whiten_scale(1e30, 1.0, 0.5) == WHITEN_FLOOR
    assert whiten_scale(math.inf, 1.0, 0.25) == 1.0 and whiten_scale(4.0, 0.0, 0.25) == 1.0


# ---------------------------------------------------------------------------
# hadamard and frames


def test_hadamard_reduce_scatter_inverts_every_row():
    """A row across two shards is rotated by neither owner (its owner could not
    rotate it back): every shard's error stays within the norm bound."""
    codecs = [get_codec("hadamard", min_dim=8, min_numel=0) for _ in range(2)]
    xs = [gaussian(129, 128, seed=r) for r in range(2)]  # row 64 spans both shards
    got = np.concatenate(simulate_reduce_scatter(codecs, xs)).reshape(129, 128)
    err = np.linalg.norm(got - exact_sum(xs))
    assert err <= transformed_bound(xs, codecs[0], gather=False)


def test_hadamard_is_orthogonal_and_rank_consistent():
    codecs = [get_codec("hadamard", min_dim=8, min_numel=0) for _ in range(3)]
    xs = [gaussian(24, 40, seed=r) for r in range(3)]  # 40 columns: two rotations of 32
    got = simulate_allreduce(codecs, xs)
    assert rel(got, exact_sum(xs)) < 0.1  # E4M3: ~3% per quantization


@pytest.mark.parametrize("n", [128, 256, 200])  # log2(p) odd, even; two rotations
def test_hadamard_keeps_rows_whose_rotation_fits_finite(n):
    """Rows of +-1e37 (norm up to 1.6e38, under fp32's largest): their rotation fits
    fp32's range, and so does every butterfly on the way (1 / sqrt(p) is applied as a
    power of two before them, the rest after). Unscaled butterflies overflowed to inf
    from |x| above FLT_MAX / p. Both ways, frames and collectives, within the bound."""
    rng = np.random.default_rng(n)
    xs = [(np.sign(rng.standard_normal((16, n))) * 1e37).astype(np.float32) for _ in range(2)]
    xs[1] *= np.float32(0.5)  # the sum stays finite too
    codec = get_codec("hadamard", min_dim=8, min_numel=0)
    y = decode(codec.encode(xs[0]))
    assert np.isfinite(y).all()
    assert np.linalg.norm(y.astype(np.float64) - xs[0]) <= transformed_bound([xs[0]], codec)
    codecs = [get_codec("hadamard", min_dim=8, min_numel=0) for _ in range(2)]
    got = simulate_allreduce(codecs, xs)
    assert np.isfinite(got).all()
    want = xs[0].astype(np.float64) + xs[1]
    assert np.linalg.norm(got - want) <= transformed_bound(xs, codecs[0])


@pytest.mark.parametrize("codec_id", ["geofp8", "geonvfp4", "hadamard"])
@pytest.mark.parametrize("shape", [(300, 200), (64, 4, 50), (100,), (7, 9)])
def test_frame_round_trip(codec_id, shape):
    codec = get_codec(codec_id, min_dim=8, min_numel=0)
    m = shape[0] if len(shape) > 1 else 10
    x = spiked(m, math.prod(shape) // m, seed=3).reshape(shape)
    frame = codec.encode(x)
    y = decode(frame)
    base = get_codec("nvfp4" if codec_id == "geonvfp4" else "fp8")
    # the map may only help: within the base quantizer's error (plus fp32 rounding)
    assert rel(y, x) <= rel(base.decode(base.encode(x)), x) * 1.05 + 1e-6
    assert y.shape == x.shape


def test_frame_rejects_a_corrupt_side_channel():
    codec = get_codec("geofp8", min_dim=8, min_numel=0)
    frame = codec.encode(spiked(64, 64, seed=1))
    info_len = frame.size - codec.frame_body_size((64, 64)) - 4
    bad = frame.copy()
    bad[info_len + 4 : info_len + 8] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    import zlib

    from geocomm.codecs.frames import CRC as _CRC  # re-seal the frame: the side channel is checked

    bad[-4:] = np.frombuffer(_CRC.pack(zlib.crc32(bad[:-4])), np.uint8)
    with pytest.raises(ValueError, match="non-finite"):
        decode(bad)


# ---------------------------------------------------------------------------
# real ranks: the collectives give the simulation's bits


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    ("codec_id", "extra"),
    [("geofp8", {}), ("geofp8", {"transform": "whiten"}), ("geonvfp4", {}), ("hadamard", {})],
)
def test_collectives_match_the_simulation(comm, codec_id, extra):
    import geocomm

    size, rank = comm.size, comm.rank
    knobs = {"min_dim": 8, "min_numel": 0, **extra}
    mine, mine_rs = get_codec(codec_id, **knobs), get_codec(codec_id, **knobs)
    sim = [get_codec(codec_id, **knobs) for _ in range(size)]
    sim_rs = [get_codec(codec_id, **knobs) for _ in range(size)]
    # many stages: results do not depend on the stage size (block and superblock
    # scales start at multiples of 4096 within a shard), so the simulation,
    # which quantizes whole shards, still gives the same bits
    chunks = (999, 512)
    for step in range(6):
        xs = rank_inputs(size, 67, 45, step, noise=0.05)
        got = geocomm.allreduce(xs[rank], codec=mine, key="w", stage_size=chunks[0])
        assert np.array_equal(got, simulate_allreduce(sim, xs, key="w"))
        shard = geocomm.reduce_scatter(xs[rank], codec=mine_rs, key="w", stage_size=chunks[1])
        assert np.array_equal(shard, simulate_reduce_scatter(sim_rs, xs, "w")[rank])
    assert mine.state_checksum() == sim[0].state_checksum()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("route", ["chosen", "gathered", "sharded"])
@pytest.mark.parametrize("count", [3, 1000, 50_000])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_exact_sum_adds_in_rank_order_on_either_route(comm, monkeypatch, fmt, count, route):
    """The side channel's sum: every rank's values as the wire carries them (bf16:
    ml_dtypes' nearest even), added in fp32 in rank order, the same bits on every
    rank and on either route; each route sends the bytes it promises (route_bytes),
    and the chosen one is never more than GATHER_SLACK_BYTES above the other."""
    from geocomm.engine import exact
    from geocomm.testing import MeteredComm

    size, rank = comm.size, comm.rank
    if route != "chosen":
        monkeypatch.setattr(exact, "gathers", lambda *args: route == "gathered")
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(count).astype(np.float32) for _ in range(size)]
    if fmt == "bf16":
        xs_sent = [x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in xs]
    else:
        xs_sent = xs
    metered = MeteredComm(comm)
    before = xs[rank].copy()
    got = exact.exact_sum(metered, xs[rank], fmt)
    assert np.array_equal(xs[rank], before)  # the input is kept
    want = xs_sent[0].copy()
    for x in xs_sent[1:]:
        want += x
    assert np.array_equal(got, want)
    digest = np.frombuffer(hashlib.sha256(got.tobytes()).digest()[:8], np.int64)
    assert len(set(comm.allgather_int64(digest).reshape(-1).tolist())) == 1
    wire = 2 if fmt == "bf16" else 4
    gathered, sharded = exact.route_bytes(size, count, wire)
    taken = route
    if route == "chosen":
        taken = "gathered" if gathered - sharded <= exact.GATHER_SLACK_BYTES else "sharded"
        assert min(gathered, sharded) + exact.GATHER_SLACK_BYTES >= metered.sent
    if size == 1:
        assert metered.sent == 0
    elif taken == "gathered":
        assert metered.sent == gathered  # one all-gather: wire bytes a value to N - 1
    else:  # the others' shards to their owners, then this shard's sum to the others
        bounds = shard_bounds(count, size)
        mine = int(bounds[rank + 1] - bounds[rank])
        assert metered.sent == wire * (count - mine) + 4 * mine * (size - 1)
    with pytest.raises(ValueError, match="travels as one of"):
        exact.exact_sum(comm, xs[rank], "fp8")


def test_exact_sums_gather_while_it_sends_no_more():
    """bf16 (2 bytes a value) gathers on up to 3 ranks whatever the size (the
    sharded route's fp32 sums cost as much as the all-gather saves), and shards
    from 4 ranks on once the all-gather's extra bytes pass the slack; at 64 ranks
    the all-gather would send 2 * 63 bytes a value against about 6."""
    from geocomm.engine.exact import GATHER_SLACK_BYTES, gathers, route_bytes

    assert all(gathers(n, 1 << 24, 2) for n in (2, 3))
    assert gathers(2, 1 << 24, 4) and not gathers(3, 1 << 24, 4)
    limit = GATHER_SLACK_BYTES / 1.5  # N = 4: 2 * 3 - 6 * 3 / 4 = 1.5 bytes a value
    assert gathers(4, int(limit), 2) and not gathers(4, int(limit) + 1, 2)
    gathered, sharded = route_bytes(64, 10_000, 2)
    assert (gathered, sharded) == (2 * 63 * 10_000, 6 * 63 * 10_000 / 64)
    assert not gathers(64, 10_000, 2)


@pytest.mark.mpi(min_size=1)
def test_parts_map_each_tensor_on_its_own(comm):
    import geocomm

    rank = comm.rank
    knobs = {"min_dim": 8, "min_numel": 0}
    bucket, single = get_codec("geofp8", **knobs), get_codec("geofp8", **knobs)
    parts = [("a", (40, 30)), ("bias", (30,)), ("b", (20, 50))]
    for step in range(5):
        tensors = [
            spiked(40, 30, seed=step + rank),
            np.full(30, rank, np.float32),
            spiked(20, 50, seed=7 + step + rank),
        ]
        flat = np.concatenate([t.reshape(-1) for t in tensors])
        got = geocomm.allreduce(flat, codec=bucket, parts=parts)
        # one tensor at a time through its own key: same map, but other pieces
        # and other block boundaries of the quantizer, so compare errors
        exact = comm_sum(comm, flat)
        alone = np.concatenate(
            [
                geocomm.allreduce(t, codec=single, key=name).reshape(-1)
                for t, (name, _) in zip(tensors, parts, strict=True)
            ]
        )
        assert rel(got, exact) < 1.5 * rel(alone, exact) + 1e-7
    for name in ("a", "b"):  # each tensor of the bucket kept its own state
        info = bucket.state_info(name)
        assert info["calls"] == 5 and info["vt"] is not None
    assert bucket.state_info("bias") is None  # 1-D: plain, no state


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("config", [{"id": "hadamard"}, {"id": "geofp8", "transform": "whiten"}])
def test_whole_tensor_maps_in_a_bucket(comm, config):
    """Hadamard and the whitening map each tensor of a bucket up front (into the
    result when it holds the whole buffer, else into a buffer of the tensor's
    size), so a piece may take a map's values, a copy, or both: the bits do not
    depend on the stage size or on the call being in place, the input is left
    as it was, and the error is the quantizer's (E4M3: ~3% per quantization);
    rows that span two shards stay unmapped, so every shard of a reduce-scatter
    inverts what it holds (its error within the norm bound)."""
    import geocomm

    # pieces of 4096 values: five inside a tensor, one across all three
    parts = [("a", (128, 64)), ("bias", (30,)), ("b", (96, 128))]
    tensors = [spiked(128, 64, seed=comm.rank), np.full(30, comm.rank, np.float32)]
    tensors.append(spiked(96, 128, seed=5 + comm.rank))
    flat = np.concatenate([t.reshape(-1) for t in tensors])
    before = flat.copy()

    def primed():
        """A fresh codec after one all-reduce of the bucket (the whitening measures
        its basis from that whole result): every call below starts from one state."""
        codec = get_codec(config, min_dim=8, min_numel=0)
        geocomm.allreduce(flat, codec=codec, parts=parts)
        return codec

    got = geocomm.allreduce(flat, codec=primed(), parts=parts, stage_size=4096)
    assert np.array_equal(flat, before)
    in_place = flat.copy()
    again = geocomm.allreduce(in_place, codec=primed(), parts=parts, out=in_place, stage_size=8192)
    assert again is in_place or np.shares_memory(again, in_place)
    assert np.array_equal(again, got)
    assert np.array_equal(geocomm.allreduce(flat, codec=primed(), parts=parts), got)
    assert rel(got, comm_sum(comm, flat)) < 0.1
    codec = primed()
    if config["id"] == "geofp8":
        assert codec.state_info("a")["wt"] is not None
    shard = geocomm.reduce_scatter(flat, codec=codec, parts=parts, stage_size=4096)
    assert np.array_equal(geocomm.reduce_scatter(flat, codec=primed(), parts=parts), shard)
    assert np.array_equal(flat, before)
    lo, hi = (int(b) for b in shard_bounds(flat.size, comm.size)[comm.rank : comm.rank + 2])
    exact = comm_sum(comm, flat)[lo:hi]
    inputs = [geocomm.allreduce(flat * (r == comm.rank), codec="none") for r in range(comm.size)]
    bound = sum(
        transformed_bound([x[part_lo:part_hi].reshape(shape) for x in inputs], codec, gather=False)
        for part_lo, part_hi, shape in _extents(parts)
    )
    assert np.linalg.norm(np.asarray(shard, np.float64) - exact) <= bound


class _Lossless(GeoCodec):
    """A geometry map over fp32 (no quantization): what comes back is the map's
    own arithmetic, so a row mapped but not mapped back shows at once."""

    codec_id = "test-lossless-geo"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transform", ["hadamard", "whiten"])
def test_maps_of_a_bucket_invert_on_every_shard(comm, transform):
    """Tensors at offsets in a bucket, shards that cut rows: each plan sees the
    shard bounds from its own first value, maps only rows inside one shard,
    and every shard (and the all-reduce) gets the exact sum back to within fp32
    rounding, amplified at most 64x by the whitening's inverse (1e-4 relative)."""
    import geocomm

    parts = [("a", (96, 80)), ("bias", (30,)), ("b", (160, 128))]
    a = activation_gradients(comm.size, 96, 80, 0)[comm.rank]
    b = activation_gradients(comm.size, 160, 128, 1)[comm.rank]
    flat = np.concatenate([a.reshape(-1), np.full(30, comm.rank, np.float32), b.reshape(-1)])
    codec = _Lossless(get_codec("none"), transform=transform, min_dim=8, min_numel=0)
    exact = comm_sum(comm, flat)
    scale = float(np.abs(exact).max())
    for _ in range(3):  # the whitening measures its basis from the first whole result
        got = geocomm.allreduce(flat, codec=codec, parts=parts, stage_size=4096)
        assert float(np.abs(got - exact).max()) <= 1e-4 * scale
    if transform == "whiten":
        assert codec.state_info("b")["wt"] is not None
    lo, hi = (int(b) for b in shard_bounds(flat.size, comm.size)[comm.rank : comm.rank + 2])
    shard = geocomm.reduce_scatter(flat, codec=codec, parts=parts, stage_size=4096)
    assert float(np.abs(shard - exact[lo:hi]).max()) <= 1e-4 * scale


def _extents(parts):
    at = 0
    for _, shape in parts:
        size = math.prod(shape)
        yield at, at + size, shape
        at += size


def comm_sum(comm, flat):
    import geocomm

    return geocomm.allreduce(flat.astype(np.float64), codec="none")


@pytest.mark.mpi(min_size=2)
def test_diverged_state_is_caught(comm):
    import geocomm
    from geocomm import CollectiveMismatchError

    codec = get_codec("geofp8", min_dim=8, min_numel=0)
    x = spiked(64, 64, seed=comm.rank)
    geocomm.allreduce(x, codec=codec, key="w")
    if comm.rank == 1:
        codec.reset_state()
    with pytest.raises(CollectiveMismatchError, match="codec state"):
        geocomm.allreduce(x, codec=codec, key="w")
