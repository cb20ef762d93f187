"""Bit-level tests of the fp8 (E4M3FN, E5M2), NVFP4 and BF16 wire bodies.

Three implementations must agree (docs/design.md, "Formats"): the native C core
(``geocomm.kernels.native``), the NumPy reference (``geocomm.codecs.reference``)
and ml_dtypes' casts once the documented scaling and clamp are applied. The
tests below check, in that order: every code decodes like ml_dtypes; native
and reference give the same bytes for random and edge inputs; the payload is
exactly an ml_dtypes cast when the scale factor is a power of two; non-finite
inputs stay visible; and the round-trip error obeys a derived bound.

Every test is deterministic (fixed seeds) and runs on every MPI rank alike.
"""

from __future__ import annotations

import itertools
import pathlib

import ml_dtypes
import numpy as np
import pytest

import geocomm
from geocomm.codecs import reference as ref
from geocomm.kernels import native

# Non-finite and overflowing inputs are the point of many tests here; NumPy's
# "invalid value / overflow encountered" warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

F32 = np.float32
FP8_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
E2M1_MAX = 6.0
NVFP4_SUPER_MAX = 6.0 * 448.0  # E2M1 max times the largest E4M3 block scale
NVFP4_SUPERBLOCK = 4096  # values per fp32 superblock scale (native/geocomm.h)
FP8_BLOCKS = (0, 1, 7, 16, 128)
# (format, block) pairs that the bit-identity tests cover
CASES = [(fmt, b) for fmt in ("e4m3", "e5m2") for b in FP8_BLOCKS] + [("nvfp4", 0), ("bf16", 0)]
CASE_IDS = [f"{fmt}-b{b}" for fmt, b in CASES]


# ---- helpers ---------------------------------------------------------------


def native_encode(fmt: str, x: np.ndarray, block: int = 0, **options) -> np.ndarray:
    """Native wire body of x (flattened, as float32).

    ``options`` are those of the reference's ``encode`` (rounding, scale_rule,
    seed, rounding_stream, offset), passed to the C core as gc_encode_ex flags and values.
    """
    flat = np.ascontiguousarray(x, F32).reshape(-1)
    code = native.FORMATS[fmt]
    wire = np.empty(native.wire_size(code, flat.size, block), np.uint8)
    flags = (native.STOCHASTIC if options.get("rounding") == "stochastic" else 0) | (
        native.RCEIL if options.get("scale_rule") == "rceil" else 0
    )
    native.encode(
        code,
        flat,
        block,
        wire,
        flags=flags,
        seed=options.get("seed", 0),
        rounding_stream=options.get("rounding_stream", 0),
        offset=options.get("offset", 0),
    )
    return wire


def native_decode(
    fmt: str, wire: np.ndarray, n: int, block: int = 0, onto: np.ndarray | None = None
) -> np.ndarray:
    """Native decode of n values; with ``onto`` they are accumulated onto a copy of it."""
    out = np.empty(n, F32) if onto is None else np.array(onto, F32)
    native.decode(native.FORMATS[fmt], wire, block, out, accumulate=onto is not None)
    return out


def roundtrip(fmt: str, x: np.ndarray, block: int = 0) -> np.ndarray:
    return native_decode(fmt, native_encode(fmt, x, block), x.size, block)


def assert_same_floats(actual: np.ndarray, expected: np.ndarray) -> None:
    """Bitwise equal float32 arrays, except that any NaN matches any NaN."""
    actual = np.asarray(actual, F32).reshape(-1)
    expected = np.asarray(expected, F32).reshape(-1)
    assert actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan, err_msg="NaN positions differ")
    bad = np.flatnonzero((actual.view(np.uint32) != expected.view(np.uint32)) & ~nan)
    assert bad.size == 0, (
        f"{bad.size} values differ; first at {bad[:4]}: {actual[bad[:4]]} != {expected[bad[:4]]}"
    )


def assert_same_bytes(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype == np.uint8
    assert actual.size == expected.size, f"{actual.size} bytes != {expected.size} bytes"
    bad = np.flatnonzero(actual != expected)
    assert bad.size == 0, (
        f"{bad.size} bytes differ; first at {bad[:4]}: {actual[bad[:4]]} != {expected[bad[:4]]}"
    )


def check_native_matches_reference(
    fmt: str, x: np.ndarray, block: int, onto_seed: int = 0, **options
) -> None:
    """Same bytes from encode (with the reference's encode ``options``); same values
    from decode, decode-accumulate and decode onto a base."""
    x = np.ascontiguousarray(x, F32).reshape(-1)
    wire = native_encode(fmt, x, block, **options)
    assert_same_bytes(wire, ref.encode(fmt, x, block, **options))
    expected = ref.decode(fmt, wire, x.size, block)
    assert_same_floats(native_decode(fmt, wire, x.size, block), expected)
    onto = np.random.default_rng(onto_seed).standard_normal(x.size).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        assert_same_floats(native_decode(fmt, wire, x.size, block, onto=onto), onto + expected)
        out = np.empty(x.size, F32)
        native.decode_onto(native.FORMATS[fmt], wire, block, onto, out)
        assert_same_floats(out, onto + expected)


def bits(*patterns: int) -> np.ndarray:
    return np.array(patterns, np.uint32).view(F32)


def code_values(dtype) -> np.ndarray:
    """Sorted non-negative finite values of a small float format (all its codes)."""
    values = np.arange(256 if dtype != ml_dtypes.float4_e2m1fn else 16, dtype=np.uint8)
    values = values.view(dtype).astype(F32)
    return np.unique(values[np.isfinite(values) & (values >= 0)])


def ties_and_neighbours(dtype) -> np.ndarray:
    """Exact midpoints between consecutive codes of dtype and the fp32 values beside them.

    Midpoints of neighbouring codes are exact in fp32 (at most 5 significant
    bits), so these are the inputs where round-to-nearest-even decides.
    """
    values = code_values(dtype)
    mid = values[:-1] + (values[1:] - values[:-1]) / F32(2)  # no overflow at the top
    around = np.concatenate([mid, np.nextafter(mid, F32(0)), np.nextafter(mid, F32(np.inf))])
    return np.concatenate([values, around, -values, -around]).astype(F32)


def with_block_max(values: np.ndarray, block: int, vmax: float) -> np.ndarray:
    """values laid out so that every block starts with +-vmax (so each block's amax is vmax).

    With block 1 every element is its own block; then values are returned as is.
    """
    if block == 1:
        return values.astype(F32)
    if block == 0:
        return np.concatenate([[vmax], values]).astype(F32)
    per = block - 1
    nblocks = -(-values.size // per)
    rows = np.zeros((nblocks, block), F32)
    rows[:, 0] = vmax * np.where(np.arange(nblocks) % 2, -1, 1)
    rows[:, 1:].reshape(-1)[: values.size] = values
    return rows.reshape(-1)


def block_amax(x: np.ndarray, block: int) -> np.ndarray:
    """For each element, max |x| over the finite values of its block."""
    b = block or x.size
    padded = np.zeros(-(-x.size // b) * b, F32)
    padded[: x.size] = x
    rows = padded.reshape(-1, b)
    amax = np.where(np.isfinite(rows), np.abs(rows), F32(0)).max(axis=1)
    return np.repeat(amax, b)[: x.size]


# ---- inputs ----------------------------------------------------------------

N_RANDOM = 1 << 20


def random_wide(n: int, seed: int) -> np.ndarray:
    """Gaussians times 2^e, e uniform per 128-block in [-140, 100] and per element
    in [-24, 0]: blocks of every scale (fp32 subnormal amax included) and values
    spread over many binades inside a block."""
    rng = np.random.default_rng(seed)
    block_exp = np.repeat(rng.integers(-140, 101, -(-n // 128)), 128)[:n]
    elem_exp = rng.integers(-24, 1, n)
    return (rng.standard_normal(n) * np.exp2(block_exp + elem_exp)).astype(F32)


def random_bit_patterns(n: int, seed: int) -> np.ndarray:
    """Uniform random 32-bit patterns: every exponent, inf and NaN payloads included."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x[::97] = rng.choice(
        bits(0x7F800000, 0xFF800000, 0x7FC00000, 0xFF812345, 0x7F800001).view(np.uint32),
        x[::97].size,
    )
    return x.view(F32)


FP32_SUBNORMALS = bits(
    0x00000001, 0x00000002, 0x00000003, 0x00012345, 0x007FFFFF, 0x80000001, 0x807FFFFF
)
SPECIALS = np.concatenate(
    [
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan], F32),
        bits(0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FFFFFFF),  # -NaN, signalling and max payloads
    ]
)
LANDMARKS = np.array(
    [
        448,
        464,
        465,
        480,
        57344,
        61439,
        61440,
        61441,
        65536,
        6,
        6.5,
        7,
        5,
        2688,
        3.4e38,
        -3.4e38,
        2.0**-126,
        2.0**-6,
        2.0**-9,
        2.0**-10,
        3 * 2.0**-10,
        2.0**-14,
        2.0**-16,
        2.0**-17,
        3 * 2.0**-17,
        0.25,
        0.75,
        1.0625,
        1.125,
        1.1875,
        1 + 2.0**-8,
        1 + 3 * 2.0**-8,
    ],
    F32,
)


def edge_tensors(fmt: str, block: int) -> list[np.ndarray]:
    """Hand-made inputs where rounding, clamping, scaling or specials decide."""
    rng = np.random.default_rng(7)
    general = np.concatenate([SPECIALS, FP32_SUBNORMALS, LANDMARKS, -LANDMARKS])
    tensors = [
        general,
        np.zeros(300, F32),
        np.full(33, -0.0, F32),
        FP32_SUBNORMALS,
        np.concatenate([np.zeros(130, F32), FP32_SUBNORMALS, np.zeros(140, F32)]),
        np.array([np.nan] * 20 + [np.inf] * 20, F32),
        np.array([np.nan], F32),
    ]
    # the specials in every block position
    tensors.extend(rng.permutation(np.tile(general, 5)) for _ in range(4))
    if fmt in FP8_DTYPES:
        ties = ties_and_neighbours(FP8_DTYPES[fmt])
        for k in (-140, -126, -100, -20, 0, 3, 90):  # exact power-of-two scalings
            tensors.append(np.ldexp(with_block_max(ties, block, FP8_MAX[fmt]), k))
    elif fmt == "nvfp4":
        tensors.extend(nvfp4_edge_tensors())
    else:
        tensors.append(ties_and_neighbours(ml_dtypes.bfloat16))
    return tensors


def nvfp4_head_blocks(blocks: np.ndarray) -> np.ndarray:
    """Whole 16-value blocks laid out behind a head block at the start of every
    superblock: the head holds 6 * 448, so every superblock's scale factor is exactly 1."""
    head = np.zeros(16, F32)
    head[0] = NVFP4_SUPER_MAX
    per = NVFP4_SUPERBLOCK - head.size
    return np.concatenate(
        [np.concatenate([head, blocks[i : i + per]]) for i in range(0, blocks.size, per)]
    ).astype(F32)


def nvfp4_edge_tensors() -> list[np.ndarray]:
    """Blocks whose E2M1 payload sits on ties (block scale exactly 1) and blocks
    whose E4M3 block scale sits on ties (over 2 superblocks); the first block of
    every superblock fixes its scale."""
    e2m1_ties = ties_and_neighbours(ml_dtypes.float4_e2m1fn)
    e4m3_mid = ties_and_neighbours(ml_dtypes.float8_e4m3fn)
    e4m3_mid = e4m3_mid[(e4m3_mid > 0) & (e4m3_mid <= 448)]
    payload = with_block_max(e2m1_ties, 16, E2M1_MAX)
    rng = np.random.default_rng(3)
    scale_ties = np.zeros((e4m3_mid.size, 16), F32)
    scale_ties[:, 0] = E2M1_MAX * e4m3_mid  # block scale bamax / 6 = the midpoint
    scale_ties[:, 1:] = rng.uniform(-1, 1, (e4m3_mid.size, 15)) * scale_ties[:, :1]
    assert scale_ties.size > NVFP4_SUPERBLOCK
    out = [nvfp4_head_blocks(payload), nvfp4_head_blocks(scale_ties.reshape(-1))]
    for k in (-140, -120, 40):
        out.append(np.ldexp(out[0], k))
    return out


# ---- every code decodes like ml_dtypes -------------------------------------


def scale_one_body(fmt: str, codes: np.ndarray) -> np.ndarray:
    """A wire body holding ``codes`` with every scale 1.0 (one block)."""
    one = np.array([1.0], "<f4").view(np.uint8)
    if fmt in FP8_DTYPES:
        return np.concatenate([one, codes.astype(np.uint8)])
    assert fmt == "nvfp4" and codes.size % 16 == 0
    block_scales = np.full(codes.size // 16, 0x38, np.uint8)  # E4M3 code of 1.0
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return np.concatenate([one, block_scales, packed])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_code_decodes_like_ml_dtypes(fmt):
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(FP8_DTYPES[fmt]).astype(F32)
    body = scale_one_body(fmt, codes)
    assert_same_floats(native_decode(fmt, body, 256), expected)
    assert_same_floats(ref.decode(fmt, body, 256), expected)
    # accumulating onto zeros: the same values, except that -0 + 0 is +0
    assert_same_floats(native_decode(fmt, body, 256, onto=np.zeros(256, F32)), expected + F32(0))


def test_every_e2m1_code_decodes_like_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)
    body = scale_one_body("nvfp4", codes)
    assert_same_floats(native_decode("nvfp4", body, 16), expected)
    assert_same_floats(ref.decode("nvfp4", body, 16), expected)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_value_encodes_back_to_its_code(fmt):
    # With one value at +-FMAX the scale factor is exactly 1, so each code's
    # value must map back to that code. NaN codes come back as the canonical
    # NaN of the format (E4M3: 0x7f; E5M2: 0x7e, a NaN input keeps "NaN").
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(FP8_DTYPES[fmt]).astype(F32)
    wire = native_encode(fmt, values, 0)
    assert wire[:4].view("<f4")[0] == F32(1.0)
    expected = codes.copy()
    nan_code = 0x7F if fmt == "e4m3" else 0x7E
    expected[np.isnan(values)] = (codes[np.isnan(values)] & 0x80) | nan_code
    assert_same_bytes(wire[4:], expected)


def test_every_e2m1_value_encodes_back_to_its_code():
    codes = np.arange(16, dtype=np.uint8)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)
    head = np.zeros(16, F32)
    head[0] = NVFP4_SUPER_MAX  # superblock factor 1; the second block's amax 6 gives scale 1.0
    wire = native_encode("nvfp4", np.concatenate([head, values]))
    assert wire[:4].view("<f4")[0] == F32(1.0)
    assert wire[4:6].tolist() == [0x7E, 0x38]  # E4M3 codes of 448 and 1.0
    payload = wire[6 + 8 :]
    assert_same_bytes(payload, (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8))


# ---- native == reference, bit for bit --------------------------------------


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", ["wide", "bits"])
def test_random_inputs_match_reference(fmt, block, kind):
    make = random_wide if kind == "wide" else random_bit_patterns
    x = make(N_RANDOM, seed=CASES.index((fmt, block)) + (100 if kind == "bits" else 0))
    check_native_matches_reference(fmt, x, block)


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=CASE_IDS)
def test_edge_inputs_match_reference(fmt, block):
    for i, x in enumerate(edge_tensors(fmt, block)):
        check_native_matches_reference(fmt, x, block, onto_seed=i)


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=CASE_IDS)
def test_every_small_length_matches_reference(fmt, block):
    # partial last blocks, odd NVFP4 lengths (half-filled last byte), n = 0
    rng = np.random.default_rng(5)
    for n in [*range(0, 41), 127, 128, 129, 255, 257]:
        x = (rng.standard_normal(n) * 3).astype(F32)
        check_native_matches_reference(fmt, x, block, onto_seed=n)
        assert native.wire_size(native.FORMATS[fmt], n, block) == ref.wire_size(fmt, n, block)


def test_wire_sizes_agree_in_all_three_implementations():
    # The layout is written once per implementation: gc_wire_size (C core),
    # geocomm.kernels.cuda.wire_size (the CUDA kernels' layout) and the reference's
    # wire_size. Every format, counts around every block, MX block and NVFP4
    # superblock boundary, and blocks that split, equal or exceed n.
    from geocomm.kernels import cuda

    rng = np.random.default_rng(15)
    counts = {0, 1, 2, 3, 10**6 + 3, 2**31 + 5, *rng.integers(1, 10**7, 40).tolist()}
    for base in (16, 32, 128, 4096, 3 * 4096, 256 * 4096):
        counts |= {base - 1, base, base + 1}
    for name in native.FORMAT_NAMES:
        for n in sorted(counts):
            for block in (0, 1, 7, 16, 32, 128, 4096, 5000, 2**40):
                expect = ref.wire_size(name, n, block)
                assert native.wire_size(name, n, block) == expect, (name, n, block)
                assert cuda.wire_size(name, n, block) == expect, (name, n, block)
                assert cuda.wire_size(native.FORMATS[name], n, block) == expect
    assert ref.wire_size("nvfp4", 4097) == 2 * 4 + 257 + 2049  # two superblock scales


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=CASE_IDS)
def test_arbitrary_wire_bytes_decode_like_reference(fmt, block):
    # Random bodies: scales of every bit pattern (NaN, inf, subnormal), every code.
    n = 4099
    size = native.wire_size(native.FORMATS[fmt], n, block)
    wire = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = ref.decode(fmt, wire, n, block)
        assert_same_floats(native_decode(fmt, wire, n, block), expected)
        onto = np.random.default_rng(1).standard_normal(n).astype(F32)
        assert_same_floats(native_decode(fmt, wire, n, block, onto=onto), onto + expected)


# ---- the casts are ml_dtypes' casts after the documented clamp -------------


def fp8_probe_values(fmt: str, n: int, seed: int) -> np.ndarray:
    """Values in [-FMAX, FMAX]: uniform, log-uniform down into the subnormal codes, ties."""
    rng = np.random.default_rng(seed)
    fmax = FP8_MAX[fmt]
    uniform = rng.uniform(-fmax, fmax, n)
    logs = rng.choice([-1, 1], n) * np.exp2(rng.uniform(-20, np.log2(fmax), n))
    return np.concatenate([uniform, logs, ties_and_neighbours(FP8_DTYPES[fmt])]).astype(F32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [0, 1, 16, 128])
@pytest.mark.parametrize("k", [-140, -100, -3, 0, 5, 60])
def test_fp8_payload_is_ml_dtypes_cast(fmt, block, k):
    # Blocks whose amax is FMAX * 2^k have factor FMAX / amax = 2^-k exactly,
    # so the payload must equal ml_dtypes' cast of x * 2^-k, clamped to
    # +-FMAX first (ml_dtypes would turn E4M3 > 464 into NaN, E5M2 >= 61440
    # into inf). For k = -140 the amax is below 2^-100, the pre-scaled path.
    fmax = FP8_MAX[fmt]
    x = with_block_max(fp8_probe_values(fmt, 3000, seed=k % 97), block, fmax)
    x = np.ldexp(x, k)
    if block == 1:  # one value per block: its own amax gives factor 1 for any x != 0
        expected = np.copysign(np.where(x == 0, F32(0), F32(fmax)), x)
    else:
        expected = np.clip(np.ldexp(x, -k), -fmax, fmax)
    wire = native_encode(fmt, x, block)
    nblocks = -(-x.size // (block or x.size))
    codes = wire[4 * nblocks :]
    assert_same_bytes(codes, expected.astype(F32).astype(FP8_DTYPES[fmt]).view(np.uint8))
    if block != 1:
        scales = wire[: 4 * nblocks].view("<f4")
        assert np.all(scales == np.ldexp(F32(1), k))


def test_nvfp4_payload_is_ml_dtypes_cast():
    # A superblock amax of 6 * 448 makes the superblock factor 1; a block with
    # amax 6 then has block scale code 1.0, so its nibbles are ml_dtypes' E2M1
    # cast of x. Two superblocks and a partial third: each has its own scale.
    rng = np.random.default_rng(4)
    values = np.concatenate(
        [
            rng.uniform(-6, 6, 9000),
            ties_and_neighbours(ml_dtypes.float4_e2m1fn),
            rng.choice([-1, 1], 500) * np.exp2(rng.uniform(-4, 2.5, 500)),
        ]
    )
    payload = with_block_max(values.astype(F32), 16, E2M1_MAX)
    x = nvfp4_head_blocks(payload)
    nsuper, nblocks = -(-x.size // NVFP4_SUPERBLOCK), x.size // 16
    assert nsuper == 3 and x.size % NVFP4_SUPERBLOCK
    wire = native_encode("nvfp4", x)
    assert np.all(wire[: 4 * nsuper].view("<f4") == F32(1.0))
    is_head = np.arange(nblocks) % (NVFP4_SUPERBLOCK // 16) == 0
    scales = wire[4 * nsuper : 4 * nsuper + nblocks]
    assert np.all(scales[is_head] == 0x7E) and np.all(scales[~is_head] == 0x38)  # 448 and 1.0
    packed = wire[4 * nsuper + nblocks :]
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1, 16)[~is_head]
    assert_same_bytes(nibbles.reshape(-1), payload.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def nvfp4_sections(wire: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(superblock scales, block scales, codes) of an NVFP4 wire body of n values."""
    a = 4 * -(-n // NVFP4_SUPERBLOCK)
    b = a + -(-n // 16)
    return wire[:a], wire[a:b], wire[b:]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_body_is_the_concatenation_of_aligned_pieces(rounding):
    # A superblock's bytes depend on its own values only, so a body is the
    # section-wise concatenation of the bodies of its pieces when every piece
    # starts at a multiple of 4096 values (the collective cuts its shards so,
    # issue #16); stochastic rounding draws by global index (offset = piece start).
    x = random_wide(N_RANDOM + 1234, seed=16)
    key = (
        {"rounding": rounding, "seed": 5, "rounding_stream": 6} if rounding == "stochastic" else {}
    )
    whole = nvfp4_sections(native_encode("nvfp4", x, **key), x.size)
    cuts = [0, 4096, 3 * 4096, 100 * 4096, 101 * 4096, 200 * 4096, x.size]
    pieces = [
        nvfp4_sections(native_encode("nvfp4", x[a:b], **key, offset=a), b - a)
        for a, b in itertools.pairwise(cuts)
    ]
    for section in range(3):
        assert_same_bytes(np.concatenate([p[section] for p in pieces]), whole[section])
    # and a misaligned cut changes the bytes: the superblocks are what makes them agree
    split = [
        native_encode("nvfp4", x[a:b], **key, offset=a) for a, b in ((0, 5000), (5000, x.size))
    ]
    assert not np.array_equal(nvfp4_sections(split[1], x.size - 5000)[2], whole[2][2500:])


def test_bf16_codes_are_ml_dtypes_cast_saturated():
    """ml_dtypes' cast, except that a finite value the cast takes to inf gets the
    largest finite bfloat16 (0x7f7f) with its sign: the codec never makes a finite
    gradient inf. Both roundings' encoders and the reference agree."""
    x = np.concatenate(
        [
            random_bit_patterns(1 << 16, seed=2),
            SPECIALS,
            LANDMARKS,
            ties_and_neighbours(ml_dtypes.bfloat16),
            np.array([0x7F7F8000, 0xFF7FFFFF, 0x7F7F7FFF], np.uint32).view(np.float32),
        ]
    )
    with np.errstate(invalid="ignore", over="ignore"):
        cast = x.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
    overflowed = np.isfinite(x) & np.isinf(cast.view(ml_dtypes.bfloat16))
    assert overflowed.sum() >= 3  # the inputs reach the case
    cast[overflowed] = (cast[overflowed] & 0x8000) | 0x7F7F
    assert_same_bytes(native_encode("bf16", x), cast.view(np.uint8))
    assert_same_bytes(ref.encode_bf16(x), cast.view(np.uint8))
    stochastic = native_encode("bf16", x, rounding="stochastic", seed=5)
    codes = stochastic.view(np.uint16)
    assert np.all(np.isfinite(codes[np.isfinite(x)].view(ml_dtypes.bfloat16)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_clamp_keeps_finite_inputs_finite(fmt):
    # ml_dtypes alone maps 465 to NaN (E4M3) and 61440 to inf (E5M2); the
    # codec clamps first, so no finite input may produce a non-finite code.
    huge = np.array([465.0, 61440.0], F32).astype(FP8_DTYPES[fmt]).astype(F32)
    assert not np.all(np.isfinite(huge))
    x = random_bit_patterns(N_RANDOM // 4, seed=3)
    x = x[np.isfinite(x)]
    for block in FP8_BLOCKS:
        codes = native_encode(fmt, x, block)[-x.size :]
        decoded = codes.view(FP8_DTYPES[fmt]).astype(F32)
        assert np.all(np.isfinite(decoded)), f"block {block}"


# ---- non-finite inputs (docs/design.md, "Non-finite values") --------------

BAD = {3: np.inf, 200: -np.inf, 517: np.nan, 518: -np.nan}


def with_nonfinite(n: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal(n).astype(F32)
    clean = x.copy()
    for i, v in BAD.items():
        x[i] = v
        clean[i] = 0.0  # 0 does not change any block amax
    return x, clean


@pytest.mark.parametrize("block", FP8_BLOCKS)
def test_e4m3_nonfinite_becomes_nan_in_place(block):
    x, clean = with_nonfinite()
    codec = geocomm.get_codec("fp8", fmt="e4m3", block=block)
    y, y_clean = codec.decode(codec.encode(x)), codec.decode(codec.encode(clean))
    bad = np.array(sorted(BAD))
    assert np.all(np.isnan(y[bad]))  # E4M3FN has no inf: inf turns into NaN
    good = np.setdiff1d(np.arange(x.size), bad)
    assert np.all(np.isfinite(y[good]))
    assert_same_floats(y[good], y_clean[good])  # amax ignored the non-finite values


@pytest.mark.parametrize("block", FP8_BLOCKS)
def test_e5m2_keeps_inf_and_nan(block):
    x, clean = with_nonfinite()
    codec = geocomm.get_codec("fp8", fmt="e5m2", block=block)
    y, y_clean = codec.decode(codec.encode(x)), codec.decode(codec.encode(clean))
    if block != 1:  # a block of only inf has scale 0, and inf * 0 is NaN (still non-finite)
        assert y[3] == np.inf and y[200] == -np.inf
    assert not np.isfinite(y[3]) and not np.isfinite(y[200])
    assert np.isnan(y[517]) and np.isnan(y[518])
    good = np.setdiff1d(np.arange(x.size), list(BAD))
    assert np.all(np.isfinite(y[good]))
    assert_same_floats(y[good], y_clean[good])


def test_nvfp4_nonfinite_poisons_exactly_its_block():
    x, clean = with_nonfinite()
    codec = geocomm.get_codec("nvfp4")
    y, y_clean = codec.decode(codec.encode(x)), codec.decode(codec.encode(clean))
    poisoned = np.zeros(x.size, bool)
    for i in BAD:
        poisoned[i // 16 * 16 : i // 16 * 16 + 16] = True
    np.testing.assert_array_equal(np.isnan(y), poisoned)
    assert np.all(np.isfinite(y[~poisoned]))
    assert_same_floats(y[~poisoned], y_clean[~poisoned])


def test_nvfp4_nonfinite_in_partial_last_block_and_zero_tensor():
    y = roundtrip("nvfp4", np.array([0.0] * 17 + [np.inf, 0.0], F32))
    np.testing.assert_array_equal(np.isnan(y), [False] * 16 + [True] * 3)
    assert np.all(y[:16] == 0)


GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"


def nvfp4_zero_scale_tensor() -> np.ndarray:
    """Whole superblocks (the AVX-512 path's) holding blocks of scale code 0: the
    golden input nvfp4_zero_scale repeated (every 224 values hold its amax 3.4e38),
    then the subnormal superblock of nvfp4_zero_superscale (superblock scale 0)."""
    tiles = np.resize(np.load(GOLDEN / "nvfp4_zero_scale.npy").ravel(), 2 * NVFP4_SUPERBLOCK)
    return np.concatenate([tiles, np.load(GOLDEN / "nvfp4_zero_superscale.npy").ravel()])


@pytest.mark.parametrize("simd", ["portable", "auto"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_zero_scale_blocks_write_codes_0(simd, rounding):
    # A block whose decoded scale (E4M3 scale times superblock scale) is 0 writes
    # every code 0 and decodes to +0 exactly (gc_nvfp4_keeps_codes); its values
    # above 2^64 once came from (x * 2^64) * 0, a NaN whose sign x86 sets.
    assert np.isnan((F32(1e25) * F32(2.0**64)) * F32(0))
    x = nvfp4_zero_scale_tensor()
    key = {"rounding": "stochastic", "seed": 8} if rounding == "stochastic" else {}
    previous = native.simd()
    try:
        native.set_simd(simd)
        check_native_matches_reference("nvfp4", x, 0, **key)
        wire = native_encode("nvfp4", x, **key)
    finally:
        native.set_simd(previous)
    sscales, bscales, packed = nvfp4_sections(wire, x.size)
    owner = np.arange(bscales.size) * 16 // NVFP4_SUPERBLOCK
    scale = bscales.view(ml_dtypes.float8_e4m3fn).astype(F32) * sscales.view("<f4")[owner]
    zero = np.repeat(scale == 0, 16)[: x.size]
    # the input has such blocks: with negative values, and (nearest rounding; the
    # stochastic one rounds a non-zero block's scale up) with values above 2^64
    assert np.any(zero & np.signbit(x))
    assert np.any(zero & (np.abs(x) > 2.0**64)) == (rounding == "nearest")
    codes = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[: x.size]
    assert np.all(codes[zero] == 0)
    y = native_decode("nvfp4", wire, x.size)
    assert np.all(y[zero].view(np.uint32) == 0)  # +0, whatever the input's sign


def test_bf16_keeps_inf_and_nan():
    x, _ = with_nonfinite()
    y = roundtrip("bf16", x)
    assert y[3] == np.inf and y[200] == -np.inf and np.isnan(y[517]) and np.isnan(y[518])


# ---- error bounds ----------------------------------------------------------
#
# Notation: x an input, y = decode(encode(x)), A the finite amax of x's block,
# u = 2^-24 the fp32 unit roundoff. Each bound is derived in the docstring of
# its function; all hold for finite inputs whose rounding does not overflow.


def bound_inputs(seed: int) -> np.ndarray:
    x = random_wide(1 << 18, seed)
    return x[np.isfinite(x)]


def fp8_bound(fmt: str, x: np.ndarray, block: int) -> np.ndarray:
    """|y - x| <= 2^-(m+1) |x| + A * (q_sub / 2 / FMAX + 2^-21) + FMAX * 2^-149.

    The payload is q = x * FMAX / A (fp32: factor and product each round by
    u), rounded to m mantissa bits (E4M3 m = 3, E5M2 m = 2): a normal code is
    off by at most half an ulp, 2^-(m+1) |q|; a subnormal code by half the
    subnormal quantum q_sub (2^-9 for E4M3, 2^-16 for E5M2). Clamping to FMAX
    only removes the few-u excess of q over FMAX. Decoding multiplies by the
    scale A / FMAX (rounded by u) and rounds once more, so in units of x the
    fp32 roundings add at most 4u(1 + 2^-m) A < 2^-21 A. When A / FMAX is an
    fp32 subnormal (A < FMAX * 2^-126) the stored scale is off by up to 2^-150
    absolute, times a code of at most FMAX, plus a subnormal product rounding
    of 2^-150: under FMAX * 2^-149 (about 4e-41 for E5M2: such blocks keep no
    relative precision, as the fp32 scale of docs/design.md, "Formats" implies).
    """
    m = {"e4m3": 3, "e5m2": 2}[fmt]
    q_sub = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}[fmt]
    amax = block_amax(x, block).astype(np.float64)
    fmax = FP8_MAX[fmt]
    return 2.0 ** -(m + 1) * np.abs(x) + amax * (q_sub / 2 / fmax + 2.0**-21) + fmax * 2.0**-149


def nvfp4_bound(x: np.ndarray) -> np.ndarray:
    """|y - x| <= |x| / 4 + B / 16 + T * 2^-18 + 2^-21 B + 2^-136.

    T is the amax of x's superblock (4096 values), B the amax of x's block of
    16, g = T / 2688 the superblock scale, s = B / (6 g) in [0, 448] the
    ideal block scale and S its
    E4M3 code: |S - s| <= max(2^-4 s, 2^-10) (half ulp with 3 mantissa bits,
    or half the subnormal quantum 2^-9). The element scale is e = S g and the
    payload q = x / e is rounded to E2M1 ({0, .5, 1, 1.5, 2, 3, 4, 6}).
    - If |q| <= 6: half an E2M1 ulp is at most max(1/4, |q| / 4), so
      |y - x| <= max(e / 4, |x| / 4), and e / 4 <= B * 17 / 384 + g 2^-12.
    - If |q| > 6: y = 6 e and |y - x| <= 6 g s - 6 g S <= max(B / 16, 6 g 2^-10).
    Both are below |x| / 4 + B / 16 + 6 g 2^-10, and 6 g 2^-10 < T 2^-18. The
    fp32 roundings (block scale, e, q, y) add under 2^-21 B; a subnormal g
    (T < 2688 * 2^-126) adds at most 6 * 448 * 2^-150 absolute: under 2^-136.
    """
    t = block_amax(x, NVFP4_SUPERBLOCK).astype(np.float64)
    b = block_amax(x, 16).astype(np.float64)
    return np.abs(x) / 4 + b / 16 + t * 2.0**-18 + b * 2.0**-21 + 2.0**-136


def bf16_bound(x: np.ndarray) -> np.ndarray:
    """|y - x| <= 2^-8 |x| + 2^-134.

    bfloat16 keeps 8 significant bits: rounding to nearest is off by at most
    half an ulp, 2^-8 times the power of two below |x|, so at most 2^-8 |x|;
    below 2^-126 the spacing is the subnormal quantum 2^-133, half of it 2^-134.
    """
    return 2.0**-8 * np.abs(x) + 2.0**-134


def check_bound(x: np.ndarray, y: np.ndarray, bound: np.ndarray, tight: bool = True) -> None:
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    ratio = err / bound
    worst = int(np.argmax(ratio))
    assert ratio[worst] <= 1.0, f"x={x[worst]!r} y={y[worst]!r} err={err[worst]} > {bound[worst]}"
    if tight:  # the bound is not vacuous: some element comes within a factor 4 of it
        assert ratio[worst] > 0.25, f"bound is loose: worst ratio {ratio[worst]}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", FP8_BLOCKS)
def test_fp8_error_bound(fmt, block):
    x = bound_inputs(seed=block)
    # block 1: every value is its block's amax and encodes as +-FMAX exactly
    check_bound(x, roundtrip(fmt, x, block), fp8_bound(fmt, x, block), tight=block != 1)


def test_e4m3_block128_error_is_within_amax_over_16():
    # The brief's coarse form of the bound above: 2^-4 |x| <= 2^-4 A, and the
    # remaining terms are far below the slack 2^-4 A - 16 / 448 A left by the
    # top binade [256, 448], whose half ulp is 16 = 448 * 2^-4.8.
    x = bound_inputs(seed=21)
    err = np.abs(roundtrip("e4m3", x, 128).astype(np.float64) - x)
    assert np.all(err <= block_amax(x, 128) * 2.0**-4 + 2.0**-140)


def test_nvfp4_error_bound():
    x = bound_inputs(seed=5)  # 64 superblocks of different amax, the last one partial
    check_bound(x, roundtrip("nvfp4", x), nvfp4_bound(x))


def test_bf16_error_bound():
    x = bound_inputs(seed=6)  # up to fp32's largest: saturation keeps them within it
    check_bound(x, roundtrip("bf16", x), bf16_bound(x))
