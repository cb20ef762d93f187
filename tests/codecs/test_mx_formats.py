"""Bit-level tests of the OCP Microscaling formats MXFP8 (E4M3, E5M2) and MXFP4.

Wire body (native/geocomm.h): ceil(n / 32) E8M0 scale bytes (2^(c - 127),
0xff NaN), then the element codes (MXFP4: two per byte, element 2i in the
low nibble). The shared exponent X of a block with finite maximum A is
floor(log2 A) - EMAX (OCP "floor" rule; E4M3 EMAX 8, E5M2 15, E2M1 2) or,
with rceil, the smallest X with A <= FMAX 2^X; clamped below to -127, and -127
for an all-zero block. Elements are x * 2^-X cast to the element format with
saturation at FMAX, like ml_dtypes after the clamp.

As for the other formats (tests/codecs/test_codec_formats.py, whose helpers this
file uses), three definitions must agree: the C core, the NumPy reference and
ml_dtypes (float8_e8m0fnu, float8_e4m3fn, float8_e5m2, float4_e2m1fn).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_codec_formats import (
    FP32_SUBNORMALS,
    LANDMARKS,
    N_RANDOM,
    SPECIALS,
    assert_same_bytes,
    assert_same_floats,
    check_bound,
    check_native_matches_reference,
    code_values,
    native_decode,
    native_encode,
    random_bit_patterns,
    random_wide,
    ties_and_neighbours,
    with_block_max,
)

import geocomm
from geocomm.codecs import bounds
from geocomm.codecs import reference as ref
from geocomm.kernels import native

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

F32 = np.float32
MX = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"]
RULES = ["floor", "rceil"]
ELEMENT = {
    "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
    "mxfp8_e5m2": ml_dtypes.float8_e5m2,
    "mxfp4": ml_dtypes.float4_e2m1fn,
}
EMAX = {"mxfp8_e4m3": 8, "mxfp8_e5m2": 15, "mxfp4": 2}
FMAX = {"mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0, "mxfp4": 6.0}
BLOCK = 32


def codec_of(fmt: str, rule: str, **params) -> geocomm.codecs.Codec:
    if fmt == "mxfp4":
        return geocomm.get_codec("mxfp4", scale_rule=rule, **params)
    return geocomm.get_codec("mxfp8", fmt=fmt[-4:], scale_rule=rule, **params)


def scale_bytes(fmt: str, wire: np.ndarray, n: int) -> np.ndarray:
    return wire[: -(-n // BLOCK)]


def body(fmt: str, scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """A wire body from per-block scale codes and per-value element codes."""
    payload = codes if fmt != "mxfp4" else (codes[0::2] | (codes[1::2] << 4))
    return np.concatenate([scales, payload]).astype(np.uint8)


def e8m0(code: int) -> float:
    """The E8M0 value by the OCP definition: 2^(code - 127), NaN for 0xff."""
    return math.nan if code == 0xFF else math.ldexp(1.0, code - 127)


# ---- every code decodes like ml_dtypes -----------------------------------------------


def test_e8m0_is_the_ocp_exponent_format():
    # ml_dtypes' float8_e8m0fnu is the reference for scales; it must be 2^(c - 127)
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    expected = np.array([e8m0(c) for c in range(256)])
    assert_same_floats(values.astype(F32), expected.astype(F32))
    assert values[0] == 2.0**-127 and values[254] == 2.0**127


@pytest.mark.parametrize("fmt", MX)
def test_every_scale_and_element_code_decodes_like_ml_dtypes(fmt):
    # Every E8M0 scale code times every element code, as fp32 products of the
    # ml_dtypes values (one IEEE multiply each: 2^127 * 448 overflows to inf,
    # 2^-127 * subnormals underflow and round, 0xff gives NaN).
    ncodes = 16 if fmt == "mxfp4" else 256
    per_scale = max(ncodes, BLOCK)  # whole blocks of one scale each
    element = np.tile(np.arange(ncodes, dtype=np.uint8), per_scale // ncodes)
    codes = np.tile(element, 256)
    scales = np.repeat(np.arange(256, dtype=np.uint8), per_scale // BLOCK)
    wire = body(fmt, scales, codes)
    n = codes.size
    with np.errstate(over="ignore", invalid="ignore"):
        expected = codes.view(ELEMENT[fmt]).astype(F32) * np.repeat(
            scales.view(ml_dtypes.float8_e8m0fnu).astype(F32), BLOCK
        )
        assert_same_floats(native_decode(fmt, wire, n), expected)
        assert_same_floats(ref.decode(fmt, wire, n), expected)
        # accumulating onto zeros: the same values, except that -0 + 0 is +0
        assert_same_floats(native_decode(fmt, wire, n, onto=np.zeros(n, F32)), expected + F32(0))


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_every_element_value_encodes_back_to_its_code(fmt, rule):
    # A block holding +-FMAX has X = 0 under both rules (FMAX = 1.m 2^EMAX, and
    # rceil finds FMAX <= FMAX 2^0), so the factor is 1 and every finite
    # element value must map back to its own code.
    values = code_values(ELEMENT[fmt])
    values = np.concatenate([values, -values])
    x = with_block_max(values, BLOCK, FMAX[fmt])
    wire = native_encode(fmt, x, scale_rule=rule)
    assert np.all(scale_bytes(fmt, wire, x.size) == 127)
    assert_same_floats(native_decode(fmt, wire, x.size), x)
    assert_same_bytes(wire, ref.encode(fmt, x, scale_rule=rule))


# ---- the shared exponent -------------------------------------------------------------


def expected_exponent(amax: float, fmt: str, rule: str) -> int:
    """X by the definition, in exact Python arithmetic (math.frexp: amax = m 2^e, m in [.5, 1))."""
    if amax == 0:
        return -127
    x = math.frexp(amax)[1] - 1 - EMAX[fmt]
    if rule == "rceil" and amax > math.ldexp(FMAX[fmt], x):
        x += 1
    return min(max(x, -127), 127 - EMAX[fmt])


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_shared_exponent_at_the_edges(fmt, rule):
    # The amax that decide X: powers of two, FMAX and its fp32 neighbours, the
    # top of FMAX's binade, E8M0's lower limit (fp32 subnormal amax, clamped
    # to 2^-127) and fp32's largest value (X <= 127 - EMAX: FMAX 2^X stays finite,
    # and rceil saturates like floor there).
    fmax = FMAX[fmt]
    below, above = np.nextafter(F32(fmax), F32(0)), np.nextafter(F32(fmax), F32(np.inf))
    top = np.nextafter(F32(2.0 ** (EMAX[fmt] + 1)), F32(0))
    amaxes = [
        0.0,
        1.0,
        0.75,
        fmax,
        below,
        above,
        top,
        2.0**-149,
        2.0**-127,
        2.0**-126,
        2.0 ** (-127 + EMAX[fmt]),
        3 * 2.0**-140,
        3.4028235e38,
        2.0**127,
        1e-30,
        12345.0,
    ]
    x = np.zeros(BLOCK * len(amaxes), F32)
    x[::BLOCK] = amaxes
    x[1::BLOCK] = -np.array(amaxes, F32) / 3  # a smaller value of the other sign
    wire = native_encode(fmt, x, scale_rule=rule)
    expected = [expected_exponent(float(F32(a)), fmt, rule) + 127 for a in amaxes]
    assert scale_bytes(fmt, wire, x.size).tolist() == expected
    assert_same_bytes(wire, ref.encode(fmt, x, scale_rule=rule))
    assert max(expected) <= 127 + 127 - EMAX[fmt]  # never the NaN code
    y = native_decode(fmt, wire, x.size)
    assert np.all(np.isfinite(y))  # not even for fp32's largest values


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_scale_rule_invariants(fmt, rule):
    # floor (OCP): 2^EMAX <= A / 2^X < 2^(EMAX+1), so values above FMAX 2^X
    # saturate; rceil: A / 2^X <= FMAX (nothing saturates) and X is the
    # smallest such, A / 2^(X-1) > FMAX. Blocks clamped at X = -127 excepted.
    x = random_wide(1 << 16, seed=11)
    wire = native_encode(fmt, x, scale_rule=rule)
    rows = np.zeros(-(-x.size // BLOCK) * BLOCK, np.float64)
    rows[: x.size] = np.abs(x)
    amax = rows.reshape(-1, BLOCK).max(axis=1)
    exps = scale_bytes(fmt, wire, x.size).astype(np.int64) - 127
    ratio = np.ldexp(amax, -exps)
    live = (exps > -127) & (amax > 0)
    assert live.mean() > 0.5  # the data reach most of E8M0's range
    if rule == "floor":
        top = 2.0 ** EMAX[fmt]
        assert np.all(ratio[live] >= top) and np.all(ratio[live] < 2 * top)
    else:
        assert np.all(ratio <= FMAX[fmt]) and np.all(ratio[live] * 2 > FMAX[fmt])


def test_saturation_under_floor_only():
    # 500 in a block: floor gives X = 0 and 500 saturates to 448; rceil gives X = 1
    # and 500 / 2 = 250 rounds to 256 (E4M3 spacing 16 there): decoded 512.
    x = np.array([500.0] + [1.0] * 31, F32)
    floor = native_decode("mxfp8_e4m3", native_encode("mxfp8_e4m3", x), 32)
    rceil = native_decode("mxfp8_e4m3", native_encode("mxfp8_e4m3", x, scale_rule="rceil"), 32)
    assert floor[0] == 448.0 and rceil[0] == 512.0
    assert floor[1] == 1.0 and rceil[1] == 1.0


# ---- native == reference, byte for byte ------------------------------------------------


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["wide", "bits"])
def test_random_inputs_match_reference(fmt, rule, kind):
    # 1M values: blocks of every scale (fp32 subnormal amax included) and, for
    # "bits", every fp32 pattern with inf and NaN sprinkled in
    make = random_wide if kind == "wide" else random_bit_patterns
    x = make(N_RANDOM, seed=MX.index(fmt) + 10 * RULES.index(rule) + (100 if kind == "bits" else 0))
    check_native_matches_reference(fmt, x, 0, scale_rule=rule)


def mx_edge_tensors(fmt: str) -> list[np.ndarray]:
    """Specials, subnormal-range and all-zero blocks, E8M0's limits, and ties of
    the element format at exact power-of-two scales."""
    rng = np.random.default_rng(8)
    general = np.concatenate([SPECIALS, FP32_SUBNORMALS, LANDMARKS, -LANDMARKS])
    tensors = [
        general,
        np.zeros(100, F32),
        np.full(33, -0.0, F32),
        FP32_SUBNORMALS,
        np.concatenate([np.zeros(40, F32), FP32_SUBNORMALS, np.zeros(40, F32)]),
        np.array([np.nan] * 20 + [np.inf] * 40, F32),
        np.array([np.nan], F32),
        np.array([3.4028235e38, -3.4028235e38, 1.0, 2.0**-149], F32),
    ]
    tensors.extend(rng.permutation(np.tile(general, 5)) for _ in range(4))
    ties = ties_and_neighbours(ELEMENT[fmt])
    ties = ties[np.abs(ties) <= FMAX[fmt]]
    for k in (-150, -140, -127, -100, -20, 0, 3, 90, 127 - EMAX[fmt]):
        tensors.append(np.ldexp(with_block_max(ties, BLOCK, FMAX[fmt]), k).astype(F32))
    return tensors


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_edge_inputs_match_reference(fmt, rule):
    for i, x in enumerate(mx_edge_tensors(fmt)):
        check_native_matches_reference(fmt, x, 0, onto_seed=i, scale_rule=rule)


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_every_small_length_matches_reference(fmt, rule):
    # partial last blocks, odd MXFP4 lengths (half-filled last byte), n = 0
    rng = np.random.default_rng(5)
    for n in [*range(0, 41), 63, 64, 65, 95, 97, 257]:
        x = (rng.standard_normal(n) * 3).astype(F32)
        check_native_matches_reference(fmt, x, 0, onto_seed=n, scale_rule=rule)
        assert native.wire_size(native.FORMATS[fmt], n, 0) == ref.wire_size(fmt, n)


@pytest.mark.parametrize("fmt", MX)
def test_arbitrary_wire_bytes_decode_like_reference(fmt):
    n = 4099
    size = native.wire_size(native.FORMATS[fmt], n, 0)
    wire = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = ref.decode(fmt, wire, n)
        assert_same_floats(native_decode(fmt, wire, n), expected)
        onto = np.random.default_rng(1).standard_normal(n).astype(F32)
        assert_same_floats(native_decode(fmt, wire, n, onto=onto), onto + expected)


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("k", [-140, -120, -8, 0, 40, 127 - 16])
def test_payload_is_ml_dtypes_cast(fmt, k):
    # Blocks whose amax is FMAX * 2^k have X = k under both rules, so the codes
    # must be ml_dtypes' cast of x * 2^-k (exact), clamped to FMAX first.
    # k = -140 is below E8M0's range: X clamps to -127 and the codes are the
    # cast of x * 2^127 instead.
    rng = np.random.default_rng(k % 13)
    fmax = FMAX[fmt]
    values = np.concatenate([rng.uniform(-fmax, fmax, 2000), ties_and_neighbours(ELEMENT[fmt])])
    values = values[np.abs(values) <= fmax].astype(F32)
    x = np.ldexp(with_block_max(values, BLOCK, fmax), k).astype(F32)
    wire = native_encode(fmt, x)
    kx = max(k, -127)
    assert np.all(scale_bytes(fmt, wire, x.size) == kx + 127)
    expected = np.clip(np.ldexp(x, -kx), -fmax, fmax).astype(F32).astype(ELEMENT[fmt])
    codes = wire[-(-x.size // BLOCK) :]
    if fmt == "mxfp4":
        codes = np.stack([codes & 0xF, codes >> 4], axis=1).reshape(-1)[: x.size]
    assert_same_bytes(codes, expected.view(np.uint8))


def test_wire_bytes_per_value():
    # mxfp8: 1 + 1/32 bytes per value; mxfp4: 0.5 + 1/32 (n a multiple of 32)
    for n in (32, 4096, 32 * 1001):
        assert geocomm.get_codec("mxfp8").wire_size(n) == n + n // 32
        assert geocomm.get_codec("mxfp8", fmt="e5m2").wire_size(n) == n + n // 32
        assert geocomm.get_codec("mxfp4").wire_size(n) == n // 2 + n // 32


# ---- non-finite inputs ------------------------------------------------------------------

BAD = {3: np.inf, 200: -np.inf, 517: np.nan, 518: -np.nan}


def with_nonfinite(n: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal(n).astype(F32)
    clean = x.copy()
    for i, v in BAD.items():
        x[i], clean[i] = v, 0.0  # 0 changes no block amax
    return x, clean


@pytest.mark.parametrize("rule", RULES)
def test_mxfp8_nonfinite_stays_at_its_position(rule):
    # The block amax ignores non-finite values (like fp8): they keep their own
    # code (E4M3: NaN, E5M2: inf / NaN) and nothing else in the block changes.
    x, clean = with_nonfinite()
    bad = np.array(sorted(BAD))
    good = np.setdiff1d(np.arange(x.size), bad)
    for fmt in ("e4m3", "e5m2"):
        codec = geocomm.get_codec("mxfp8", fmt=fmt, scale_rule=rule)
        y, y_clean = codec.decode(codec.encode(x)), codec.decode(codec.encode(clean))
        assert np.all(np.isfinite(y[good]))
        assert_same_floats(y[good], y_clean[good])
        if fmt == "e4m3":
            assert np.all(np.isnan(y[bad]))
        else:
            assert y[3] == np.inf and y[200] == -np.inf and np.isnan(y[517]) and np.isnan(y[518])


@pytest.mark.parametrize("rule", RULES)
def test_mxfp4_nonfinite_poisons_exactly_its_block(rule):
    # E2M1 has no NaN: the block gets E8M0's NaN scale 0xff, all its 32 values are NaN
    x, clean = with_nonfinite()
    codec = geocomm.get_codec("mxfp4", scale_rule=rule)
    y, y_clean = codec.decode(codec.encode(x)), codec.decode(codec.encode(clean))
    poisoned = np.zeros(x.size, bool)
    for i in BAD:
        poisoned[i // BLOCK * BLOCK : i // BLOCK * BLOCK + BLOCK] = True
    np.testing.assert_array_equal(np.isnan(y), poisoned)
    assert_same_floats(y[~poisoned], y_clean[~poisoned])


# ---- error bounds ----------------------------------------------------------------------


def mx_bound(x: np.ndarray, codec) -> np.ndarray:
    """U |x| + C A + D with bounds.error_constants and A the amax of x's block of 32.

    The derivation (geocomm.codecs.bounds) holds per block, so the block's A
    may replace the tensor's: floor saturates values up to 1 - FMAX / 2^(EMAX+1)
    of themselves and leaves half a subnormal quantum of 2^X <= A / 2^EMAX;
    rceil does not saturate and 2^X < 2 A / FMAX; clamped blocks lose D.
    """
    u, c, d = bounds.error_constants(codec, float(np.abs(x).max()))
    rows = np.zeros(-(-x.size // BLOCK) * BLOCK, np.float64)
    rows[: x.size] = np.abs(x)
    amax = np.repeat(rows.reshape(-1, BLOCK).max(axis=1), BLOCK)[: x.size]
    return u * np.abs(x.astype(np.float64)) + c * amax + d


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_the_bound_holds_where_the_scale_is_capped(fmt, rule):
    """Blocks whose amax passes FMAX 2^(127 - EMAX) (E4M3: 2.98e38): rceil's scale is
    capped there and values saturate as with floor, so the bound takes floor's U for
    such an amax (it kept rceil's 2^-(m+1): 3.4e38 erred 4.2e37 against 2.1e37)."""
    x = np.array([3.4e38, -3.0e38, 2.9e38, 1e38] * 8, np.float32)
    codec = codec_of(fmt, rule)
    y = native_decode(fmt, native_encode(fmt, x, scale_rule=rule), x.size)
    assert np.isfinite(y).all()
    check_bound(x, y, bounds.single_bound(x, codec))


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("rule", RULES)
def test_error_bound(fmt, rule):
    x = random_wide(1 << 18, seed=31)
    codec = codec_of(fmt, rule)
    y = native_decode(fmt, native_encode(fmt, x, scale_rule=rule), x.size)
    check_bound(x, y, mx_bound(x, codec))
