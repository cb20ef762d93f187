"""The CUDA kernels' own outputs == the C core's, byte for byte, over ragged sizes.

Both compile the arithmetic of native/gc_scalar.h (and gc_linalg.h), so every
wire byte and every decoded value must agree (NaN payloads aside: only NaN
positions must). Arrays are allocated at their exact sizes, so on the twin a
kernel that writes one element past its data (a bound check loosened from
``<`` to ``<=``) hits a red zone and fails the test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import ON_TWIN, inputs

from geocomm.codecs.geo import kernels as geo
from geocomm.engine import device as gp
from geocomm.engine import device_tables as gpl
from geocomm.kernels import cuda, native

#: ragged counts: not multiples of any block (16, 32, 128, 256 threads, 4096)
COUNTS = (1, 2, 15, 17, 33, 127, 255, 257, 1025, 4097, 12_301)
FORMATS = (
    [("e4m3", b) for b in (0, 1, 16, 33, 128, 1024, 1025, 5000)]
    + [("e5m2", b) for b in (0, 128, 4097)]
    + [("nvfp4", 0), ("bf16", 0), ("mxfp8_e4m3", 0), ("mxfp8_e5m2", 0), ("mxfp4", 0)]
)


def special(n: int) -> np.ndarray:
    x = inputs(n, n, tag=1)
    edges = np.array([448.0, -465.0, 57344.0, 1e-45, -3e-39, 0.0, -0.0, np.inf, np.nan], np.float32)
    x[: min(n, edges.size)] = edges[: min(n, edges.size)] if n > 20 else x[: min(n, edges.size)]
    return x


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(a)
    return bool(
        np.array_equal(nan, np.isnan(b))
        and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))
    )


@pytest.mark.parametrize("fmt,block", FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_encode_decode_match_the_c_core(cp, fmt, block, stochastic):
    flags = native.STOCHASTIC if stochastic else 0
    for n in COUNTS:
        x = special(n)
        size = native.wire_size(fmt, n, block)
        want = np.zeros(size, np.uint8)
        native.encode(fmt, x, block, want, flags=flags, seed=9, rounding_stream=4, offset=1000)
        wire = cp.empty(size, cp.uint8)
        cuda.encode(
            fmt, cp.asarray(x), block, wire, flags=flags, seed=9, rounding_stream=4, offset=1000
        )
        assert np.array_equal(wire.get(), want), f"{fmt}/{block} n={n}: encoded bytes differ"
        for accumulate in (False, True):
            start = inputs(n, n, tag=2)
            ref = start.copy()
            native.decode(fmt, want, block, ref, accumulate)
            out = cp.asarray(start)
            cuda.decode(fmt, cp.asarray(want), block, out, accumulate)
            assert same_values(out.get(), ref), f"{fmt}/{block} n={n} accumulate={accumulate}"


def _shifted(cp, host: np.ndarray, by: int):
    """A device copy of ``host`` that starts ``by`` elements into its allocation, so it
    is contiguous but not aligned as an allocation is."""
    room = cp.empty(host.size + by, host.dtype)
    view = room[by:]
    view[...] = cp.asarray(host)
    return view


@pytest.mark.parametrize(
    "fmt,block",
    [("e4m3", b) for b in (4, 16, 33, 128, 1000, 1024, 1025, 0)]
    + [("nvfp4", 0), ("mxfp4", 0), ("bf16", 0), ("mxfp8_e4m3", 0), ("mxfp8_e5m2", 0)],
)
@pytest.mark.parametrize("shift", [(1, 0), (0, 1), (2, 3)], ids=["x+4B", "wire+1B", "both"])
def test_kernels_give_the_same_bytes_from_unaligned_arrays(cp, fmt, block, shift):
    """The fp8 team and tile kernels, MXFP8, bf16 and the E2M1 decoders move four values
    per load or store where the values (16 bytes) and codes (4 bytes) are aligned, one at a time
    elsewhere: values, wire bodies and decoded outputs that start off those boundaries
    give the C core's bytes too."""
    x_shift, wire_shift = shift
    for n in (4097, 12_301):
        x = special(n)
        size = native.wire_size(fmt, n, block)
        want = np.zeros(size, np.uint8)
        native.encode(fmt, x, block, want)
        x_dev = _shifted(cp, x, x_shift)
        wire = _shifted(cp, np.zeros(size, np.uint8), wire_shift)
        assert (x_dev.data.ptr % 16 != 0) == bool(x_shift)
        assert (wire.data.ptr % 4 != 0) == bool(wire_shift)
        cuda.encode(fmt, x_dev, block, wire)
        assert np.array_equal(wire.get(), want), f"{fmt}/{block} n={n}: encoded bytes differ"
        for accumulate in (False, True):
            start = inputs(n, n, tag=2)
            ref = start.copy()
            native.decode(fmt, want, block, ref, accumulate)
            out = _shifted(cp, start, x_shift)
            cuda.decode(fmt, wire, block, out, accumulate)
            assert same_values(out.get(), ref), f"{fmt}/{block} n={n} accumulate={accumulate}"


@pytest.mark.parametrize(
    ("block", "error"), [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_a_bad_block_is_refused_alike_by_the_c_core_and_the_kernels(cp, block, error):
    """The low-level faces check ``block`` in one place (native.check_block): the C
    core's raised OverflowError for -1 and 2^64, and the kernels took 1.5 as 1."""
    x = np.ones(256, np.float32)
    wire = np.zeros(4096, np.uint8)
    with pytest.raises(error, match="block"):
        native.encode("e4m3", x, block, wire)
    with pytest.raises(error, match="block"):
        native.decode("e4m3", wire, block, x)
    with pytest.raises(error, match="block"):
        cuda.encode("e4m3", cp.asarray(x), block, cp.asarray(wire))
    with pytest.raises(error, match="block"):
        cuda.wire_size("e4m3", x.size, block)


def test_divide_keeps_subnormal_quotients(cp):
    x = np.array([2.0**-120, 3.0, -(2.0**-125), 1e-38], np.float32)
    out = cp.asarray(x)
    cuda.divide(out, 3)
    assert np.array_equal(out.get().view(np.uint32), (x / np.float32(3)).view(np.uint32))


def test_host_and_device_sums_write_the_same_nan(cp):
    """add_into (error feedback's values + residual, the exact sums) and the lossless
    codec's accumulating decodes: NumPy's NaN sums are written as the GPU's, so what is
    encoded next has the same bits (x86 gave 0xffc00000 for inf - inf and kept a NaN
    operand's sign, the kernels 0x7fffffff)."""
    from geocomm.codecs.formats import NoneCodec
    from geocomm.engine.arithmetic import add_into

    a = np.array([np.inf, -np.nan, 1.0, np.nan, 2.0], np.float32)
    b = np.array([-np.inf, 1.0, -np.nan, -np.nan, 3.0], np.float32)
    host, device = a.copy(), cp.asarray(a)
    with np.errstate(invalid="ignore"):
        add_into(host, b)
    add_into(device, cp.asarray(b))
    assert np.array_equal(host.view(np.uint32), device.get().view(np.uint32))
    assert (host[:4].view(np.uint32) == 0x7FFFFFFF).all()
    codec, wire = NoneCodec(), b.view(np.uint8).copy()
    summed, onto = a.copy(), np.empty_like(a)
    with np.errstate(invalid="ignore"):
        codec.decode_wire(wire, summed, accumulate=True)
        codec.decode_wire_onto(wire, a, onto)
    assert np.array_equal(summed.view(np.uint32), host.view(np.uint32))
    assert np.array_equal(onto.view(np.uint32), host.view(np.uint32))


@pytest.mark.parametrize("shift", [0, 1, 3], ids=["aligned", "+4B", "+12B"])
def test_divide_add_and_subtract_give_numpys_bits_at_any_alignment(cp, shift):
    """The fp32 divide, add and residual kernels take four values per thread, in one
    16-byte access where aligned and one at a time elsewhere (a start off the boundary,
    a tail of 1-3 values): both give NumPy's bits, in place and with operands that
    are the output itself."""
    for n in (1, 3, 5, 4097):
        a, b = special(n), inputs(n, n, tag=7)
        got = _shifted(cp, a, shift)
        assert (got.data.ptr % 16 != 0) == bool(shift)
        cuda.divide(got, 3)
        assert same_values(got.get(), a / np.float32(3)), ("divide", n)
        acc, v = _shifted(cp, a, shift), _shifted(cp, b, shift)
        cuda.add(acc, v)
        assert same_values(acc.get(), a + b), ("add", n)
        cuda.add(acc, acc)
        assert same_values(acc.get(), (a + b) + (a + b)), ("add to itself", n)
        with np.errstate(all="ignore"):
            difference = a - b
        difference[~np.isfinite(difference)] = 0  # error feedback's residual
        x, y, out = _shifted(cp, a, shift), _shifted(cp, b, shift), _shifted(cp, a, 0)
        cuda.residual(out, x, y)
        assert same_values(out.get(), difference), ("residual", n)
        cuda.residual(y, x, y)  # into its second operand
        assert same_values(y.get(), difference), ("residual into b", n)


CONFIGS = {
    "fp8-team": {"id": "fp8", "fmt": "e4m3", "block": 128},
    # team widths 1, 16 and 32 (8 steps), blocks that 4 does not divide among them
    "fp8-team-4": {"id": "fp8", "fmt": "e4m3", "block": 4},
    "fp8-team-33": {"id": "fp8", "fmt": "e4m3", "block": 33},
    "fp8-team-1000": {"id": "fp8", "fmt": "e5m2", "block": 1000},
    "fp8-tile": {"id": "fp8", "fmt": "e5m2", "block": 0},
    "nvfp4": "nvfp4",
    "bf16": "bf16",
    "mxfp8": {"id": "mxfp8", "fmt": "e4m3"},
    "mxfp4": {"id": "mxfp4", "scale_rule": "rceil"},
    "none": "none",
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("stochastic", [False, True])
def test_batched_kernels_match_their_host_contract(cp, name, stochastic):
    """One launch over ragged pieces (one empty, one shorter than a block, several
    superblocks) == the same segment table run piece by piece by the C core."""
    import geocomm

    config = CONFIGS[name]
    if stochastic and name != "none":
        config = {
            **(config if isinstance(config, dict) else {"id": config}),
            "rounding": "stochastic",
            "seed": 3,
        }
    fmt = gpl.wire_format(geocomm.get_codec(config))
    counts = (5000, 0, 7, 4096 * 3 + 11, 129)
    x = inputs(7, sum(counts), tag=5)
    got, want, host_seg, dev_seg = batched_encode(cp, fmt, x, counts)
    assert np.array_equal(got, want), f"{name}: batched encode"
    ref = inputs(8, x.size, tag=6)
    out = cp.asarray(ref)
    gp.HostKernels().decode(fmt, want, host_seg, ref)
    gp.CudaKernels().decode(fmt, cp.asarray(want), dev_seg, out)
    assert same_values(out.get(), ref), f"{name}: batched decode"


@pytest.mark.parametrize("name", ["fp8-team", "fp8-tile", "mxfp8", "bf16", "none"])
def test_a_nan_sum_is_encoded_again_as_the_kernels_do(cp, name):
    """The encoder of a collective's second phase adds the incoming bodies to its own
    values and encodes the sum, a NaN's sign into the codes. x86 keeps a NaN operand's
    sign and sets it for inf - inf, a GPU's add writes 0x7fffffff: the C core wrote
    0xff where the kernels wrote 0x7f (E4M3; E5M2 0xfe / 0x7e, bf16 0xffc0 / 0x7fc0).
    Its sums now write the GPU's NaN: the same bytes."""
    import geocomm

    fmt = gpl.wire_format(geocomm.get_codec(CONFIGS[name]))
    own, other = np.ones(64, np.float32), np.ones(64, np.float32)
    own[:5] = [np.inf, -np.inf, np.nan, 1.0, -np.nan]
    other[:5] = [-np.inf, np.inf, 1.0, -np.nan, 2.0]
    size = fmt.wire_size(own.size)
    body = np.zeros(size, np.uint8)
    if fmt.family == gp.RAW:
        body[:] = other.view(np.uint8)
    else:
        native.encode(fmt.native_id, other, fmt.block, body)
    rows, slots = gpl.segment_rows(fmt, [gpl.Piece(0, own.size, 0, 0)])
    want = np.zeros(size, np.uint8)
    gp.HostKernels().encode(
        fmt, own, gp.Segments(rows, rows), want, None, gp.Incoming(body, 1, size)
    )
    wire = cp.zeros(size, cp.uint8)
    gp.CudaKernels().encode(fmt, cp.asarray(own), gp.Segments(rows, cp.asarray(rows)), wire,
                            cp.zeros(max(slots, 1), cp.uint32),
                            gp.Incoming(cp.asarray(body), 1, size))  # fmt: skip
    assert np.array_equal(wire.get(), want), name


def test_the_c_cores_sums_write_a_gpus_nan():
    """native.decode(accumulate=True) and decode_onto, both loops: every NaN sum is
    0x7fffffff, whatever the operands' NaNs (x86 gave -NaN for inf - inf)."""
    x = np.array([np.inf, -np.nan, 1.0, 3.0] * 64, np.float32)
    base = np.array([-np.inf, 1.0, -np.nan, np.nan] * 64, np.float32)
    wire = np.zeros(native.wire_size("bf16", x.size), np.uint8)
    native.encode("bf16", x, 0, wire)
    previous = native.simd()
    try:
        for level in sorted(set(native.SIMD_LEVELS) & {"portable", "avx512"}):
            if native.set_simd(level) != level:
                continue
            acc = base.copy()
            native.decode("bf16", wire, 0, acc, accumulate=True)
            onto = np.empty_like(base)
            native.decode_onto("bf16", wire, 0, base, onto)
            for got in (acc, onto):
                assert (got.view(np.uint32) == 0x7FFFFFFF).all(), (level, got[:4])
    finally:
        native.set_simd(previous)


def batched_encode(cp, fmt, x: np.ndarray, counts: tuple[int, ...]) -> tuple:
    """x cut into pieces of ``counts`` values, encoded in one launch of the batched
    kernels and by the C core running their contract: (device bytes, host bytes,
    host segments, device segments)."""
    pieces, at, wire_at = [], 0, 0
    for i, n in enumerate(counts):
        pieces.append(gpl.Piece(at, n, wire_at, 10_000 * i + 3))
        at, wire_at = at + n, wire_at + fmt.wire_size(n)
    rows, amax_slots = gpl.segment_rows(fmt, pieces)
    host_seg = gp.Segments(rows, rows)
    dev_seg = gp.Segments(rows, cp.asarray(rows))
    want = np.zeros(wire_at, np.uint8)
    gp.HostKernels().encode(fmt, x, host_seg, want, None, rounding_stream=11)
    wire = cp.zeros(wire_at, cp.uint8)
    scratch = cp.zeros(max(amax_slots, 1), cp.uint32)
    gp.CudaKernels().encode(fmt, cp.asarray(x), dev_seg, wire, scratch, rounding_stream=11)
    return wire.get(), want, host_seg, dev_seg


#: the golden inputs with NVFP4 blocks of decoded scale 0 (tests/codecs/golden/make_golden.py)
GOLDEN = Path(__file__).resolve().parents[1] / "codecs" / "golden"


@pytest.mark.parametrize("stochastic", [False, True])
def test_nvfp4_zero_scale_blocks_match_the_c_core(cp, stochastic):
    """Blocks whose decoded scale is 0 (a superblock of amax 3.4e38, values above
    2^64 among them; a superblock of subnormals) write codes 0 in the codec kernel
    and the batched one alike, the C core's bytes exactly. On the twin, as on a GPU,
    the old rule's (x * 2^64) * 0 was the canonical NaN and gave +6, not the C
    core's -6 (issue 39)."""
    import geocomm

    config = {"id": "nvfp4", **({"rounding": "stochastic", "seed": 3} if stochastic else {})}
    x = np.concatenate(
        [
            np.resize(np.load(GOLDEN / "nvfp4_zero_scale.npy").ravel(), 3 * 4096 + 5),
            np.load(GOLDEN / "nvfp4_zero_superscale.npy").ravel(),
        ]
    )
    flags = native.STOCHASTIC if stochastic else 0
    want = np.zeros(native.wire_size("nvfp4", x.size, 0), np.uint8)
    native.encode("nvfp4", x, 0, want, flags=flags, seed=3, rounding_stream=4)
    wire = cp.empty(want.size, cp.uint8)
    cuda.encode("nvfp4", cp.asarray(x), 0, wire, flags=flags, seed=3, rounding_stream=4)
    assert np.array_equal(wire.get(), want)
    fmt = gpl.wire_format(geocomm.get_codec(config))
    got, want, _, _ = batched_encode(cp, fmt, x, (4096 + 5, 2 * 4096, x.size - 3 * 4096 - 5))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("lo,length", [(0, 96 * 40), (37, 1000), (40 * 3 - 1, 2), (5, 0)])
def test_geometry_kernels_match_the_c_core(cp, lo, length):
    n, k = 40, 5
    x = inputs(1, length, tag=7)
    if length > 10:
        x[3], x[9] = np.inf, np.nan
    vt = inputs(2, k * n, tag=8).reshape(k, n)
    coef_h = geo.project(x, lo, n, vt)
    coef_d = geo.project(cp.asarray(x), lo, n, cp.asarray(vt))
    assert np.array_equal(coef_d.get().view(np.uint32), np.asarray(coef_h).view(np.uint32))
    out_h = np.empty_like(x)
    geo.expand(x, lo, n, coef_h, vt, -1.0, out_h)
    out_d = cp.empty(x.size, cp.float32)
    geo.expand(cp.asarray(x), lo, n, cp.asarray(coef_h), cp.asarray(vt), -1.0, out_d)
    assert same_values(out_d.get(), out_h)
    acc_h = np.zeros((k, n), np.float32)
    geo.accumulate(x, lo, n, coef_h, acc_h)
    acc_d = cp.zeros((k, n), cp.float32)
    geo.accumulate(cp.asarray(x), lo, n, cp.asarray(coef_h), acc_d)
    assert same_values(acc_d.get(), acc_h)


@pytest.mark.parametrize(
    "rows,length",
    [(1, 0), (3, 1), (1, 2048), (3, 2049), (5, 40), (2, 2048 * 2048 + 3 * 2048 + 7)],
)
def test_sum_of_squares_matches_the_c_core(cp, rows, length):
    """The device's levels of the "sumsq" order (one launch per level, chunk totals
    in fp64) give the C core's one-pass bits for every row: one chunk, a chunk edge,
    two levels and three (2052 chunk totals, whose order a plain chain would change),
    an inf in the first row (the others finite), an empty row; nothing is copied to
    the host but the totals. Rounded to fp32, a subnormal total stays subnormal."""
    x = (inputs(1, rows * length, tag=9) * 50).reshape(rows, length)
    if length > 10 and rows > 1:
        x[0, 7] = np.inf
    want = [geo.sumsq(r) for r in x]
    assert rows == 1 or length <= 10 or all(np.isfinite(want[1:]))
    got = geo.row_sumsq(cp.asarray(x))
    assert got.dtype == cp.float64 and got.shape == (rows,)
    assert np.array_equal(got.get(), np.array(want, np.float64), equal_nan=True)
    assert geo.sumsq(cp.asarray(x[-1])) == want[-1]
    assert geo.column_sumsq(cp.asarray(np.ascontiguousarray(x.T))) == want
    tiny = np.full((2, 3), 1e-20, np.float32)  # each square 1e-40: an fp32 subnormal sum
    got32 = geo.row_sumsq_f32(cp.asarray(tiny)).get()
    assert np.array_equal(got32, geo.row_sumsq_f32(tiny)) and 0 < got32[0] < 1.2e-38


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 85), (32, 4096)])
def test_basis_hash_matches_the_host(cp, shape):
    """A basis's hash, one block of one launch on the device (its threads' sums added
    in shared memory), gives the host's bits: integer sums mod 2^64 do not depend on
    their order. Shapes below, at and far above the block's 256 threads; non-finite
    values by their bits."""
    x = inputs(4, int(np.prod(shape)), tag=11).reshape(shape)
    if x.size > 2:
        x.reshape(-1)[:3] = [np.nan, -np.inf, -0.0]
    got = geo.basis_hash(cp.asarray(x))
    assert got.dtype == cp.uint64 and got.shape == (1,)
    assert np.array_equal(got.get(), geo.basis_hash(x))


def test_side_channel_rounding_matches_the_c_core(cp):
    """GeoFP8's bfloat16 rounding of its side values, one kernel on the device, gives
    the host's bits (the bf16 codec's round trip): ties, overflow to inf, subnormals,
    NaNs with either sign, in place on a 2-D array."""
    x = inputs(3, 64 * 33, tag=10) * np.float32(1e30)
    x[:7] = [np.inf, -np.inf, np.nan, -np.nan, 3.4e38, 1e-40, 1.0 + 2.0**-8]
    want = geo.round_bf16(x.copy())
    d = cp.asarray(x.reshape(64, 33))
    assert geo.round_bf16(d) is d
    assert np.array_equal(d.get().reshape(-1).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", ["fp8-team", "fp8-team-4", "fp8-team-33", "fp8-team-1000"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize(
    ("n", "t0", "k"), [(257, 1000, 5), (64, 0, 5), (4096, 3 * 4096 + 17, 5), (3, 5, 1)]
)
def test_split_kernels_match_their_host_contract(cp, name, stochastic, n, t0, k):
    """The fp8 team kernels with a split map (GeoFP8's x - A V^T on the way out, its
    value + (sum A) V^T on the way back) == the map into a buffer then the plain
    C core, for a piece that starts anywhere in a row of its tensor (rows of 257,
    64 and 4096 columns): alone, and as an owner's piece with two received bodies
    added after the map; one-step and wide teams, both roundings; rows shorter than
    a lane's four values, and a basis of one row. An inf and NaNs of either sign in
    the piece come back non-finite at their places, with the same bytes on the way:
    the map writes a NaN as a GPU's arithmetic does (x86's kept the NaN's sign, which
    an encoder puts in its code: 0xff where the kernels wrote 0x7f)."""
    import geocomm
    from geocomm.codecs.formats import Split

    config = CONFIGS[name]
    if stochastic:
        config = {**config, "rounding": "stochastic", "seed": 3}
    fmt = gpl.wire_format(geocomm.get_codec(config))
    count = 6000
    x = inputs(9, count, tag=11)
    x[count // 3] = np.inf
    x[count // 3 + 1], x[count // 2] = -np.nan, np.nan
    rows = geo.rows(t0, count, n)
    rng = np.random.default_rng([n, t0])
    vt = geo.orthonormalize(rng.standard_normal((k, n)).astype(np.float32), 4)
    coef = geo.round_bf16(rng.standard_normal((rows, k)).astype(np.float32) * 8)
    host_split = Split(t0, n, coef, vt, None)
    dev_split = Split(t0, n, cp.asarray(coef), cp.asarray(vt), None)
    rows_table, _ = gpl.segment_rows(fmt, [gpl.Piece(0, count, 0, 5 + t0)])
    host_seg, dev_seg = (
        gp.Segments(rows_table, rows_table),
        gp.Segments(rows_table, cp.asarray(rows_table)),
    )
    size = fmt.wire_size(count)
    bodies = np.zeros(2 * size, np.uint8)
    for r in range(2):
        native.encode(
            fmt.native_id, inputs(r, count, tag=12), fmt.block, bodies[r * size : (r + 1) * size]
        )
    for incoming in (None, 2):
        inc_h = None if incoming is None else gp.Incoming(bodies, 2, size)
        inc_d = None if incoming is None else gp.Incoming(cp.asarray(bodies), 2, size)
        want = np.zeros(size, np.uint8)
        gp.HostKernels().encode(
            fmt, x, host_seg, want, None, inc_h, rounding_stream=7, split=host_split
        )
        mapped = np.empty_like(x)
        geo.expand(x, t0, n, coef, vt, -1.0, mapped)
        plain = np.zeros(size, np.uint8)
        gp.HostKernels().encode(fmt, mapped, host_seg, plain, None, inc_h, rounding_stream=7)
        assert np.array_equal(want, plain), "the host contract is the map, then the plain encode"
        wire = cp.zeros(size, cp.uint8)
        gp.CudaKernels().encode(
            fmt, cp.asarray(x), dev_seg, wire, None, inc_d, rounding_stream=7, split=dev_split
        )
        assert np.array_equal(wire.get(), want), f"{name}: split encode, incoming {incoming}"
    back = np.full(count, np.nan, np.float32)
    gp.HostKernels().decode(fmt, want, host_seg, back, split=host_split)
    out = cp.full(count, np.nan, cp.float32)
    gp.CudaKernels().decode(fmt, cp.asarray(want), dev_seg, out, split=dev_split)
    assert same_values(out.get(), back), f"{name}: split decode"
    assert not np.isfinite(back[[count // 3, count // 3 + 1, count // 2]]).any()


@pytest.mark.skipif(not ON_TWIN, reason="holds the twin's device")
def test_a_dropped_later_copy_keeps_its_pinned_memory_until_it_lands(cp):
    """CuPy's pinned pool hands a freed block out again at once; a copy still queued
    into it would then land in its next owner's bytes. A LaterCopy nobody holds any
    more (a GeoFP8 state reset drops its pending ones) stays alive until its event
    passed: the next LaterCopy made after that lets it go."""
    import gc
    import weakref

    from cupy import _device

    x = cp.asarray(np.arange(5, dtype=np.float32))
    with _device.hold():  # the device lags: the copy has not landed
        copy = weakref.ref(geo.LaterCopy(x))
        gc.collect()
        assert copy() is not None
    cp.cuda.get_current_stream().synchronize()
    geo.LaterCopy(x)  # sees the first one landed
    gc.collect()
    assert copy() is None


def test_a_later_copy_holds_the_values_of_its_point_in_the_stream(cp):
    """``LaterCopy`` queues copies to pinned host memory behind one event and returns at
    once; ``result`` gives what the arrays held at that point of the stream, though the
    stream changed them since, and waits for the device when the copies have not landed
    yet (on the twin the stream is held until after ``result`` is called). A host array
    is copied at once."""
    import threading

    x = cp.asarray(np.arange(5, dtype=np.float32))
    y = cp.asarray(np.arange(4, dtype=np.float64).reshape(2, 2))
    copy = geo.LaterCopy(x, y)
    x += 1  # queued after the copies
    y *= 2
    got = copy.result()
    assert np.array_equal(got[0], np.arange(5, dtype=np.float32))
    assert got[1].dtype == np.float64 and np.array_equal(got[1], [[0, 1], [2, 3]])
    host = np.arange(3, dtype=np.float32)
    early = geo.LaterCopy(host)
    host += 1
    assert np.array_equal(early.result()[0], np.arange(3, dtype=np.float32))
    if ON_TWIN:  # hold the stream: result() must wait for the copy
        gate = threading.Event()
        cp.cuda.get_current_stream().enqueue(lambda: gate.wait(), "a held kernel")
        held = geo.LaterCopy(x)
        threading.Timer(0.2, gate.set).start()
        assert np.array_equal(held.result()[0], np.arange(1, 6, dtype=np.float32))
