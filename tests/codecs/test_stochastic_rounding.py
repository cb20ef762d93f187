"""Seeded stochastic rounding (``rounding="stochastic"``) of every lossy format.

The contract (native/gc_scalar.h, geocomm.codecs.reference):

* a magnitude r between neighbouring representable values lo <= r < hi rounds
  up iff its 32-bit random word is below t = floor(2^32 (r - lo) / (hi - lo)),
  so E[Q] = r (exactly when r - lo is a multiple of 2^-32 (hi - lo));
* the word of element i is the upper half of SplitMix64's output number
  offset + i from key = mix64(mix64(seed) ^ stream), so it depends on the
  element's global index, not on how the data is cut into calls;
* nothing saturates: fp8's scale maps the block max onto FMAX (representable),
  NVFP4 rounds its block scales up, MX uses the rceil scale rule;
* native C core == NumPy reference, byte for byte.

Each test states why its bound holds. Helpers come from test_codec_formats.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from test_codec_formats import (
    FP32_SUBNORMALS,
    LANDMARKS,
    N_RANDOM,
    SPECIALS,
    assert_same_bytes,
    check_bound,
    check_native_matches_reference,
    native_decode,
    native_encode,
    random_bit_patterns,
    random_wide,
    ties_and_neighbours,
)

import geocomm
from geocomm.codecs import bounds
from geocomm.codecs import reference as ref

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

F32 = np.float32
SR = {"rounding": "stochastic"}
# (format, block, extra encode options) of every lossy format
CASES = [
    ("e4m3", 128, {}),
    ("e5m2", 128, {}),
    ("e4m3", 0, {}),
    ("e5m2", 1, {}),
    ("nvfp4", 0, {}),
    ("bf16", 0, {}),
    ("mxfp8_e4m3", 0, {"scale_rule": "rceil"}),
    ("mxfp8_e5m2", 0, {"scale_rule": "rceil"}),
    ("mxfp4", 0, {"scale_rule": "rceil"}),
]
CASE_IDS = [f"{fmt}-b{block}" for fmt, block, _ in CASES]
ELEMENT = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "nvfp4": ml_dtypes.float4_e2m1fn,
    "bf16": ml_dtypes.bfloat16,
    "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
    "mxfp8_e5m2": ml_dtypes.float8_e5m2,
    "mxfp4": ml_dtypes.float4_e2m1fn,
}
# the code of 1.0 in each element format (see unit_scales)
ONE = {
    ml_dtypes.float8_e4m3fn: 0x38,
    ml_dtypes.float8_e5m2: 0x3C,
    ml_dtypes.float4_e2m1fn: 0x2,
    ml_dtypes.bfloat16: 0x3F80,
}


def codec_for(fmt: str, block: int, **params):
    if fmt in ("e4m3", "e5m2"):
        return geocomm.get_codec("fp8", fmt=fmt, block=block, **params)
    if fmt.startswith("mxfp8"):
        return geocomm.get_codec("mxfp8", fmt=fmt[-4:], **params)
    return geocomm.get_codec(fmt, **params)


# ---- the random bits ----------------------------------------------------------------

MASK = 2**64 - 1


def splitmix64(state: int, count: int) -> list[int]:
    """The textbook SplitMix64 generator in Python integers: ``count`` outputs from ``state``."""
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_random_words_are_splitmix64():
    # key(seed, stream) = mix64(mix64(seed) ^ stream), where mix64(z) is the
    # first SplitMix64 output from state z - gamma; element i's word is the
    # upper half of output i from state key. Known answer: SplitMix64 from 0
    # starts 0xe220a8397b1dcdaf.
    assert ref.sr_bits(0, 0, 0, 1)[0] == 0xE220A839
    gamma = 0x9E3779B97F4A7C15

    def mix64(z: int) -> int:
        return splitmix64((z - gamma) & MASK, 1)[0]

    for seed, stream, offset in [
        (0, 0, 0),
        (1, 2, 3),
        (2**64 - 1, 12345, 2**64 - 2),
        (42, 2**63, 10**12),
    ]:
        key = mix64(mix64(seed) ^ stream)
        assert ref.sr_key(seed, stream) == key
        words = splitmix64((key + offset * gamma) & MASK, 5)  # outputs offset .. offset + 4
        assert ref.sr_bits(seed, stream, offset, 5).tolist() == [w >> 32 for w in words]


def test_words_are_uniform_and_independent_of_neighbours():
    # 2^20 words: each of the 32 bits is set with frequency 1/2 within 6 standard
    # errors (sd of a frequency: 0.5 / 2^10), and neighbouring words are uncorrelated
    # (correlation of uniform words: sd 2^-10, within 6 sd).
    w = ref.sr_bits(7, 3, 0, 1 << 20).astype(np.int64)
    freq = ((w[:, None] >> np.arange(32)) & 1).mean(axis=0)
    assert np.all(np.abs(freq - 0.5) < 6 * 0.5 / 2**10)
    assert abs(np.corrcoef(w[:-1], w[1:])[0, 1]) < 6 * 2.0**-10


# ---- the rounding decision is the exact distance --------------------------------------


def positive_values(dtype) -> np.ndarray:
    """The non-negative finite values of dtype in ascending order (float64), by ml_dtypes."""
    nbits = 16 if dtype == ml_dtypes.bfloat16 else 8
    codes = np.arange(2 ** (nbits - 1), dtype=np.uint16 if nbits == 16 else np.uint8)
    with np.errstate(invalid="ignore"):  # NaN codes
        values = codes.view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def neighbours(r: float, dtype) -> tuple[Fraction, Fraction]:
    """lo <= r < hi among the values of dtype (bfloat16 goes on to 2^128 = inf; r <= max)."""
    values = positive_values(dtype).tolist() + ([2.0**128] if dtype == ml_dtypes.bfloat16 else [])
    i = int(np.searchsorted(values, r, side="right")) - 1  # exact: float64 comparisons
    return Fraction(values[i]), Fraction(values[min(i + 1, len(values) - 1)])


@pytest.mark.parametrize(
    "dtype",
    [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn, ml_dtypes.bfloat16],
    ids=["e4m3", "e5m2", "e2m1", "bf16"],
)
def test_threshold_is_the_exact_distance(dtype):
    # For magnitudes r across the normal and subnormal ranges and below the
    # smallest subnormal, the reference rounds up for the word t - 1 and down
    # for t, with t = floor(2^32 (r - lo) / (hi - lo)) computed here with exact
    # fractions: P(up) = t / 2^32, so E[Q] = lo + (hi - lo) t / 2^32 = r when
    # 2^32 (r - lo) / (hi - lo) is an integer (checked for r >= 2^-9 (hi - lo)),
    # and E[Q] is at most 2^-32 (hi - lo) below r otherwise. The native core
    # gives the reference's bytes (the tests below), so it inherits this.
    rng = np.random.default_rng(3)
    top = float(ml_dtypes.finfo(dtype).max)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    r = np.concatenate(
        [rng.uniform(0, top, 200), np.exp2(rng.uniform(np.log2(tiny) - 40, np.log2(top), 600))]
    )
    r = np.unique(r.astype(F32))
    r = r[r <= top]
    exact = 0
    for value in r:
        fr = Fraction(float(value))
        lo, hi = neighbours(float(value), dtype)
        t = int((fr - lo) * 2**32 / (hi - lo)) if hi > lo else 0
        codes = [
            ref._round_stochastic(np.array([value]), dtype, np.array([w], np.uint32))[0]
            for w in (max(t - 1, 0), t)
            if w < 2**32
        ]
        down = ref._round_stochastic(np.array([value]), dtype, np.array([2**32 - 1], np.uint32))
        lo_value = (
            np.array([down[0]])
            .view(np.uint16 if dtype == ml_dtypes.bfloat16 else np.uint8)
            .view(dtype)
            .astype(np.float64)[0]
        )
        assert Fraction(float(lo_value)) == lo  # the largest word always rounds down
        if t > 0:
            assert codes[0] != down[0], "word t - 1 must round up"
        if t < 2**32:
            assert codes[-1] == down[0], "word t must round down"
        expectation = lo + (hi - lo) * Fraction(t, 2**32)
        if hi > lo and fr - lo >= (hi - lo) / 2**9:
            assert expectation == fr
            exact += 1
        assert 0 <= fr - expectation < (hi - lo) / 2**32 + (0 if hi > lo else 1)
    assert exact > 200  # the exact case is well exercised


# ---- native == reference, byte for byte ------------------------------------------------


@pytest.mark.parametrize(("fmt", "block", "options"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", ["wide", "bits"])
def test_random_inputs_match_reference(fmt, block, options, kind):
    # 1M values per format; a different (seed, stream, offset) per case
    make = random_wide if kind == "wide" else random_bit_patterns
    i = CASE_IDS.index(f"{fmt}-b{block}") + (50 if kind == "bits" else 0)
    x = make(N_RANDOM, seed=1000 + i)
    check_native_matches_reference(
        fmt, x, block, **SR, **options, seed=i, rounding_stream=3 * i, offset=2**40 * i
    )


@pytest.mark.parametrize(("fmt", "block", "options"), CASES, ids=CASE_IDS)
def test_edge_inputs_and_offsets_match_reference(fmt, block, options):
    # specials, fp32 subnormals, landmarks and the element format's ties; seeds,
    # streams and offsets at the ends of their range (the index wraps modulo 2^64)
    general = np.concatenate(
        [SPECIALS, FP32_SUBNORMALS, LANDMARKS, -LANDMARKS, ties_and_neighbours(ELEMENT[fmt])]
    )
    rng = np.random.default_rng(2)
    tensors = [
        general,
        rng.permutation(np.tile(general, 3)),
        np.zeros(70, F32),
        np.ldexp(general, -100),
        np.ldexp(general, 60),
    ]
    keys = [(0, 0, 0), (2**64 - 1, 2**64 - 1, 2**64 - 5), (1, 0, 2**63), (5, 17, 12345)]
    for i, x in enumerate(tensors):
        for seed, stream, offset in keys:
            check_native_matches_reference(
                fmt,
                x.astype(F32),
                block,
                onto_seed=i,
                **SR,
                **options,
                seed=seed,
                rounding_stream=stream,
                offset=offset,
            )


@pytest.mark.parametrize(("fmt", "block", "options"), CASES, ids=CASE_IDS)
def test_every_small_length_matches_reference(fmt, block, options):
    rng = np.random.default_rng(6)
    for n in [*range(0, 41), 63, 64, 65, 127, 128, 129, 257]:
        x = (rng.standard_normal(n) * 3).astype(F32)
        check_native_matches_reference(
            fmt, x, block, onto_seed=n, **SR, **options, seed=n, offset=n * n
        )


# ---- unbiased: mean error over 1,000 seeds ---------------------------------------------

SEEDS = 1000


def unit_scales(fmt: str, block: int, wire: np.ndarray, n: int) -> np.ndarray:
    """The element scale e of every value (decoded = code value * e): the wire
    with every element code replaced by the code of 1.0, decoded."""
    dtype = ELEMENT[fmt]
    unit = wire.copy()
    if fmt == "bf16":
        return np.ones(n, np.float64)
    head = unit.size - (-(-n // 2) if dtype == ml_dtypes.float4_e2m1fn else n)
    unit[head:] = ONE[dtype] * (0x11 if dtype == ml_dtypes.float4_e2m1fn else 1)
    return native_decode(fmt, unit, n, block).astype(np.float64)


def classed_input(fmt: str, block: int, options: dict, rng) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of one block maximum, mid-range values and tiny values; returns (x, class).

    Every non-maximal value sits at lo + p (hi - lo) in units of its element
    scale e, lo and hi neighbouring values of the element format and p in
    [0.1, 0.9], so 1000 draws round up between 100 and 900 times: the sample
    mean is close to normal and its sample standard error is reliable.
    Classes: 0 block maximum, 1 mid-range (normal codes), 2 tiny (the
    subnormal codes' range and below the smallest subnormal). The maxima are
    chosen so that the scale arithmetic is not exact: fp8 scales amax / FMAX
    with awkward amax, NVFP4 block scales just above an E4M3 value (rounding to
    nearest would saturate the maximum at 6; rounding up keeps it below), MX
    maxima inside the top binade (rceil).
    """
    b = {"nvfp4": 16, "bf16": 64}.get(fmt, 32 if fmt.startswith("mx") else block)
    nblocks = 4
    dtype = ELEMENT[fmt]
    grid = positive_values(dtype)
    min_normal = float(ml_dtypes.finfo(dtype).smallest_normal)
    x = np.zeros(nblocks * b, np.float64)
    cls = np.full(x.size, 1)
    cls[::b] = 0
    if fmt == "nvfp4":  # block 0 holds the superblock max (factor 1, scale 448)
        ks, ds = rng.integers(-4, 7, nblocks - 1), rng.uniform(0.01, 0.06, nblocks - 1)
        scales = [448.0] + [2.0 ** int(k) * (1 + d) for k, d in zip(ks, ds, strict=True)]
        x[::b] = 6.0 * np.array(scales)
    elif fmt.startswith("mx"):
        top = grid[-2] + rng.uniform(0.1, 0.9, nblocks) * (grid[-1] - grid[-2])
        x[::b] = top * np.exp2(rng.integers(-20, 20, nblocks))
    elif fmt != "bf16":
        x[::b] = rng.uniform(1, 2, nblocks) * np.exp2(rng.integers(-20, 20, nblocks))
    else:
        cls[::b] = 1
    x = x.astype(F32).astype(np.float64)
    # the element scales come from the maxima alone: the other values stay below them
    probe = native_encode(fmt, x.astype(F32), block, **SR, **options)
    e = unit_scales(fmt, block, probe, x.size)
    tiny = rng.random(x.size) < 0.4
    cls[(cls == 1) & tiny] = 2
    for j in np.flatnonzero(cls > 0):
        pool = (
            grid[grid < min_normal]
            if cls[j] == 2
            else grid[(grid >= min_normal) & (grid < grid[-2])]
        )
        lo = rng.choice(pool)
        hi = grid[np.searchsorted(grid, lo) + 1]
        q = lo + rng.uniform(0.1, 0.9) * (hi - lo)
        if fmt == "bf16" and cls[j] == 2:
            e[j] = 1.0
        x[j] = rng.choice([-1.0, 1.0]) * q * e[j]
    x = x.astype(F32)
    assert np.all(np.isfinite(x))
    return x, cls


def mean_error_check(fmt: str, block: int, options: dict, rounding: str):
    """(x, class, mean of Q(x) - x over the seeds, its standard error, allowed slack)."""
    rng = np.random.default_rng(17)
    x, cls = classed_input(fmt, block, options, rng)
    seeds = range(SEEDS) if rounding == "stochastic" else range(2)
    opts = {**options, "rounding": rounding}
    ys = np.stack(
        [
            native_decode(
                fmt, native_encode(fmt, x, block, **opts, seed=s, rounding_stream=99), x.size, block
            )
            for s in seeds
        ]
    ).astype(np.float64)
    err = ys - x.astype(np.float64)
    mean = err.mean(axis=0)
    se = err.std(axis=0, ddof=1) / np.sqrt(len(seeds))
    # fp32 scale arithmetic (factor, products, decode: a few 2^-24 relative) and
    # a clamp of the maximum by a few ulps bias E[Q] by under 2^-20 |x|; words
    # truncated to 32 bits add under 2^-32 quanta (far below that here)
    slack = 2.0**-20 * np.abs(x.astype(np.float64))
    return x, cls, mean, se, slack


def cases_where(keep) -> dict:
    """parametrize arguments for the CASES that ``keep(fmt, block)`` accepts."""
    chosen = [(c, i) for c, i in zip(CASES, CASE_IDS, strict=True) if keep(c[0], c[1])]
    return {
        "argnames": ("fmt", "block", "options"),
        "argvalues": [c for c, _ in chosen],
        "ids": [i for _, i in chosen],
    }


@pytest.mark.parametrize(
    **cases_where(lambda fmt, block: block not in (0, 1) or fmt not in ("e4m3", "e5m2"))
)
def test_mean_error_over_1000_seeds_is_zero(fmt, block, options):
    # Per element and class: |mean over 1000 seeds of Q(x) - x| <= 4 standard
    # errors + the fp32 slack. Under unbiasedness the mean is normal around 0
    # (100..900 ups of 1000, see classed_input), so 4 standard errors fail
    # with probability 6e-5 per element; the seeds are fixed, so the test is
    # deterministic. The same check must fail for rounding to nearest, whose
    # error is a fixed bias: that shows the test can see a bias.
    x, cls, mean, se, slack = mean_error_check(fmt, block, options, "stochastic")
    ok = np.abs(mean) <= 4 * se + slack
    for c, name in enumerate(["block maximum", "mid-range", "tiny/subnormal"]):
        members = cls == c
        if not members.any():
            continue
        bad = np.flatnonzero(members & ~ok)
        assert bad.size == 0, (
            f"{name}: x={x[bad[:3]]} mean error {mean[bad[:3]]} > 4 se {4 * se[bad[:3]]}"
        )
    assert {1, 2} <= set(cls.tolist())
    x, cls, mean, se, slack = mean_error_check(fmt, block, options, "nearest")
    assert (np.abs(mean) > 4 * se + slack)[cls == 1].mean() > 0.9


def test_nvfp4_maximum_is_unbiased_where_nearest_saturates():
    # Block maxima B = 6 s with s just above an E4M3 value: the nearest block
    # scale is below s, so B / scale > 6 saturates at 6 (a bias of about
    # -(s / scale - 1) 6 scales); stochastic rounding takes the next E4M3
    # value up as the scale, B lands strictly inside [4, 6] and rounds without bias.
    x, cls, mean, se, slack = mean_error_check("nvfp4", 0, {}, "stochastic")
    maxima = np.flatnonzero(cls == 0)[1:]  # block 0 holds the superblock max (scale 448)
    assert np.all(np.abs(mean[maxima]) <= 4 * se[maxima] + slack[maxima])
    _, _, nearest, _, _ = mean_error_check("nvfp4", 0, {}, "nearest")
    assert np.all(nearest[maxima] / x[maxima] < -0.009)  # saturated: B rounded down by >= 1%


# ---- independence of the cut -------------------------------------------------------------


def pieces_wire(fmt: str, block: int, options: dict, x: np.ndarray, cuts: list[int]) -> list:
    """Encode x[cuts[k]:cuts[k+1]] with offset cuts[k], each piece separately."""
    return [
        native_encode(fmt, x[a:b], block, **SR, **options, seed=4, rounding_stream=8, offset=a)
        for a, b in itertools.pairwise(cuts)
    ]


def split_body(fmt: str, block: int, wire: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale bytes, code bytes) of a wire body."""
    if fmt in ("e4m3", "e5m2"):
        head = 4 * -(-n // (block or n))
    elif fmt == "nvfp4":
        head = 4 * -(-n // 4096) + -(-n // 16)
    elif fmt == "bf16":
        head = 0
    else:
        head = -(-n // 32)
    return wire[:head], wire[head:]


@pytest.mark.parametrize(
    **cases_where(lambda fmt, block: block != 0 or fmt not in ("e4m3", "e5m2"))
)
def test_one_call_and_pieces_give_the_same_bytes(fmt, block, options):
    # Element i draws the word of index offset + i, so encoding pieces with
    # their global offsets gives every element the bits of the one-call encode.
    # The pieces start at scaling-block boundaries (scales are per block; the
    # NVFP4 superblock scale is per 4096 values, so here, with pieces inside one
    # superblock, every piece holds the superblock max; test_codec_formats
    # cuts 4096-aligned pieces).
    b = {"nvfp4": 16, "bf16": 1}.get(fmt, 32 if fmt.startswith("mx") else block)
    n = 9 * b + 5 if b > 1 else 1189  # a partial last block
    x = random_wide(n, seed=5)
    x = np.where(np.isfinite(x), x, 0).astype(F32)
    cuts = [0, b, 2 * b, 7 * b, n] if b > 1 else [0, 1, 1000, 1001, n]
    if fmt == "nvfp4":
        x[0] = 1e30
        x[cuts[1:-1]] = 1e30
    whole = native_encode(fmt, x, block, **SR, **options, seed=4, rounding_stream=8, offset=0)
    scales, codes = split_body(fmt, block, whole, n)
    parts = [
        split_body(fmt, block, w, b - a)
        for w, (a, b) in zip(
            pieces_wire(fmt, block, options, x, cuts), itertools.pairwise(cuts), strict=True
        )
    ]
    if fmt == "nvfp4":  # one fp32 superblock scale per piece, then the block scales
        assert all(np.array_equal(p[0][:4], scales[:4]) for p in parts)
        assert_same_bytes(np.concatenate([p[0][4:] for p in parts]), scales[4:])
    else:
        assert_same_bytes(np.concatenate([p[0] for p in parts]), scales)
    assert_same_bytes(np.concatenate([p[1] for p in parts]), codes)


@pytest.mark.parametrize(**cases_where(lambda fmt, block: block != 1))
def test_seed_stream_and_offset_select_the_bits(fmt, block, options):
    # same key: same bytes; another seed, stream or offset: other bytes (for
    # 4096 values of random fractions, equal bytes would need ~1000 coin flips
    # to agree); the scales never depend on the bits. (fp8 block 1 has nothing
    # to round: every value is its block's maximum and maps onto FMAX.)
    x = random_wide(4096, seed=9)
    x = np.where(np.isfinite(x), x, 1).astype(F32)

    def enc(**key):
        return native_encode(
            fmt, x, block, **SR, **options, **{"seed": 1, "rounding_stream": 2, "offset": 3, **key}
        )

    base = enc()
    assert_same_bytes(enc(), base)
    scales = split_body(fmt, block, base, x.size)[0]
    for key in ({"seed": 2}, {"rounding_stream": 3}, {"offset": 4}):
        other = enc(**key)
        assert not np.array_equal(other, base), key
        assert_same_bytes(split_body(fmt, block, other, x.size)[0], scales)


# ---- saturation, non-finite values, the NVFP4 scale -------------------------------------


@pytest.mark.parametrize(("fmt", "block", "options"), CASES, ids=CASE_IDS)
def test_nonfinite_positions_as_with_nearest(fmt, block, options):
    # Stochastic rounding changes finite codes only: non-finite values decode
    # non-finite where rounding to nearest puts them (NVFP4/MXFP4: their
    # whole block), and no finite input decodes non-finite (fp8 clamps to FMAX
    # first, and FMAX never rounds up). bf16 is the exception by design: above
    # its largest finite value it may round to inf, as to nearest.
    x = random_bit_patterns(1 << 16, seed=12)
    if fmt == "bf16":
        x = np.where(np.abs(x) < 3.38e38, x, np.where(np.isnan(x), x, 0)).astype(F32)
    y_sr = native_decode(fmt, native_encode(fmt, x, block, **SR, **options, seed=3), x.size, block)
    y_rn = native_decode(
        fmt,
        native_encode(fmt, x, block, scale_rule=options.get("scale_rule", "floor")),
        x.size,
        block,
    )
    np.testing.assert_array_equal(np.isfinite(y_sr), np.isfinite(y_rn))
    np.testing.assert_array_equal(np.isnan(y_sr), np.isnan(y_rn))


def test_nvfp4_block_scales_round_up():
    # Every block scale is the smallest E4M3 value >= the ideal s = (B / 6) *
    # superblock factor, so B <= 6 block scales (up to the fp32 rounding of the
    # product, 2^-21 relative) and no value saturates.
    x = random_wide(1 << 16, seed=14)
    x = np.where(np.isfinite(x), x, 0).astype(F32)
    for part in np.array_split(x, 16):
        wire = native_encode("nvfp4", part, **SR)
        e = unit_scales("nvfp4", 0, wire, part.size)
        bamax = np.repeat(np.abs(np.pad(part, (0, -part.size % 16))).reshape(-1, 16).max(1), 16)[
            : part.size
        ]
        assert np.all(bamax <= 6 * e * (1 + 2.0**-21) + 2.0**-140)
        nearest = unit_scales("nvfp4", 0, native_encode("nvfp4", part), part.size)
        assert np.all(e >= nearest)  # never a smaller scale than nearest rounding's


@pytest.mark.parametrize(("fmt", "block", "options"), CASES, ids=CASE_IDS)
def test_error_bound(fmt, block, options):
    # |Q(x) - x| <= U |x| + C A + D with the stochastic constants of
    # geocomm.codecs.bounds (a whole gap instead of half of one), A the amax
    # of x's scaling block; the derivation is per block, so the block's A
    # may replace the tensor's. Tight: some element comes within 4x of it.
    x = random_wide(1 << 18, seed=41)
    x = x[np.isfinite(x)]
    codec = codec_for(fmt, block, rounding="stochastic")
    u, c, d = bounds.error_constants(codec, float(np.abs(x).max()))
    # NVFP4: C is relative to the superblock amax there (64 superblocks)
    b = {"nvfp4": 4096, "bf16": 1}.get(fmt, 32 if fmt.startswith("mx") else block or x.size)
    padded = np.zeros(-(-x.size // b) * b)
    padded[: x.size] = np.abs(x)
    amax = np.repeat(padded.reshape(-1, b).max(axis=1), b)[: x.size]
    y = native_decode(fmt, native_encode(fmt, x, block, **SR, **options, seed=1), x.size, block)
    check_bound(
        x, y, u * np.abs(x.astype(np.float64)) + c * amax + d, tight=fmt != "e5m2" or block != 1
    )


def test_codec_wire_api_passes_stream_and_offset():
    # encode_wire(x, wire, rounding_stream=, offset=) reaches the core: the codec's bytes
    # equal the core's for the same (seed, stream, offset), and frames use 0, 0
    x = random_wide(1000, seed=2)
    for fmt, block, options in CASES:
        codec = codec_for(fmt, block, rounding="stochastic", seed=11)
        wire = np.empty(codec.wire_size(x.size), np.uint8)
        codec.encode_wire(x, wire, rounding_stream=5, offset=77)
        assert_same_bytes(
            wire,
            native_encode(fmt, x, block, **SR, **options, seed=11, rounding_stream=5, offset=77),
        )
        frame = codec.encode(x)
        body = frame[-4 - wire.size : -4]
        assert_same_bytes(body, native_encode(fmt, x, block, **SR, **options, seed=11))
