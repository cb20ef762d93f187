"""The batched GPU pipeline on a CPU (geocomm.engine.device).

Its CUDA kernels need a GPU (perf/gpu_check.py compares them with the C core
byte for byte); everything around them runs here: which codecs it takes,
the segment tables and launch grids, every stage's exchanges, and the whole
pipeline with :class:`~geocomm.engine.device.HostKernels` (the kernels'
contract run by the C core, checking every row it is given) on N ranks in
lockstep, against the host-driven pipeline on the same ranks: the same bits
for every format, both roundings, in place, many stages, reduce-scatter, and
maps (their read/encoded/done per piece, in order, and error feedback's
residuals).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import geocomm
from geocomm.codecs.formats import FP8Codec
from geocomm.codecs.geo import kernels
from geocomm.codecs.geo.maps import SplitPlan
from geocomm.codecs.geo.policy import MapShape
from geocomm.engine import device as gp
from geocomm.engine import device_tables as gpl
from geocomm.engine.call import Part
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import Pieces
from geocomm.engine.transforming import PartsMap
from geocomm.kernels import cuda, cuda_build, native
from geocomm.testing import loopback, run_lockstep

pytestmark = pytest.mark.skipif(not native.available, reason="native core not built")

CODECS = {
    "none": "none",
    "bf16": "bf16",
    "fp8": {"id": "fp8", "fmt": "e4m3", "block": 128},
    "fp8-e5m2-block0": {"id": "fp8", "fmt": "e5m2", "block": 0},
    "fp8-block1": {"id": "fp8", "fmt": "e4m3", "block": 1},
    "fp8-block1000": {"id": "fp8", "fmt": "e4m3", "block": 1000},
    "fp8-block5000": {"id": "fp8", "fmt": "e5m2", "block": 5000},
    "nvfp4": "nvfp4",
    "mxfp8": {"id": "mxfp8", "fmt": "e4m3"},
    "mxfp8-e5m2-rceil": {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
    "mxfp4": "mxfp4",
}
STOCHASTIC = {"rounding": "stochastic", "seed": 7}


def codec_of(name: str, stochastic: bool = False):
    config = CODECS[name]
    config = {"id": config} if isinstance(config, str) else dict(config)
    if stochastic and name != "none":
        config.update(STOCHASTIC)
    return geocomm.get_codec(config)


# ---------------------------------------------------------------------------
# the native source: numbers the Python side mirrors


def _defines(prefix: str, unit: str = "gc_pipeline.cu") -> dict[str, int]:
    import re

    text = (cuda_build.source_dir() / unit).read_text()
    return {m[1]: int(m[2]) for m in re.finditer(rf"^#define ({prefix}\w+) (\d+)", text, re.M)}


def test_fields_and_families_match_the_kernels():
    seg = _defines("GC_SEG_")
    assert seg.pop("GC_SEG_FIELDS") == len(gpl.FIELDS)
    assert seg == {f"GC_SEG_{name.upper()}": i for i, name in enumerate(gpl.FIELDS)}
    families = _defines("GC_PIPE_")
    assert _defines("GC_NVFP4_", "gc_cuda.cu")["GC_NVFP4_THREADS"] == gpl.NVFP4_THREADS
    assert families == {
        "GC_PIPE_RAW": gpl.RAW,
        "GC_PIPE_FP8": gpl.FP8,
        "GC_PIPE_NVFP4": gpl.NVFP4,
        "GC_PIPE_BF16": gpl.BF16,
        "GC_PIPE_MXFP8": gpl.MXFP8,
        "GC_PIPE_MXFP4": gpl.MXFP4,
    }
    # one NVFP4 superblock per thread block, 8 code bytes per thread, within one warp's lanes
    assert gpl.NVFP4_THREADS * 16 == native.NVFP4_SUPERBLOCK and gpl.NVFP4_THREADS % 32 == 0
    assert cuda.THREADS % 32 == 0


def test_kernel_source_is_one_unit():
    text = gp.kernel_source()
    assert '#include "' not in text
    assert text.count("GC_SCALAR_H") >= 2 and "gc_fp8_encode_team" in text
    assert "gc_pipe_nvfp4_encode" in text


# ---------------------------------------------------------------------------
# which codecs the batched pipeline takes


def test_wire_formats_of_the_codecs():
    f = gpl.wire_format
    assert f(geocomm.get_codec("none")) == gpl.WireFormat(gpl.RAW)
    fp8 = f(codec_of("fp8"))
    assert (fp8.family, fp8.fmt, fp8.block, fp8.e5m2, fp8.stochastic) == (
        gpl.FP8,
        native.E4M3,
        128,
        False,
        False,
    )
    e5 = f(codec_of("fp8-e5m2-block0", stochastic=True))
    assert (e5.fmt, e5.e5m2, e5.block, e5.stochastic, e5.seed) == (native.E5M2, True, 0, True, 7)
    assert e5.flags == native.STOCHASTIC and e5.key(3) != 0 and fp8.key(3) == 0
    mx = f(codec_of("mxfp8-e5m2-rceil"))
    assert (mx.family, mx.fmt, mx.e5m2, mx.rceil, mx.flags) == (
        gpl.MXFP8,
        native.MXFP8_E5M2,
        True,
        True,
        native.RCEIL,
    )
    assert f(codec_of("mxfp4", stochastic=True)).rceil  # stochastic MX needs rceil
    assert f(codec_of("nvfp4")).family == gpl.NVFP4 and f(codec_of("bf16")).family == gpl.BF16
    # wrappers send their wire codec's bytes
    assert f(geocomm.get_codec("fp8", error_feedback=True)) == fp8
    assert f(geocomm.get_codec("geofp8")).family == gpl.FP8
    # bytes of their own: the host-driven pipeline
    assert f(geocomm.get_codec("auto")) is None

    class Custom(FP8Codec):
        def encode_wire(self, x, wire, *, rounding_stream=0, offset=0):
            super().encode_wire(x, wire, rounding_stream=rounding_stream, offset=offset)

    assert f(Custom()) is None


# ---------------------------------------------------------------------------
# tables and grids

SIZES = (
    0,
    1,
    2,
    15,
    16,
    17,
    31,
    32,
    33,
    127,
    128,
    129,
    1000,
    1023,
    1024,
    1025,
    4095,
    4096,
    4097,
    8191,
    12_289,
    100_003,
)


@pytest.mark.parametrize("name", list(CODECS))
def test_body_layout_gives_the_wire_size(name):
    """The scales a row names place every part of the body where the C core puts it."""
    fmt = gpl.wire_format(codec_of(name))
    for n in SIZES:
        scales, block, tiles = gpl.body_layout(fmt, n)
        size = {
            gpl.RAW: 4 * n,
            gpl.BF16: 2 * n,
            gpl.FP8: 4 * scales + n,
            gpl.NVFP4: 4 * scales + -(-n // 16) + -(-n // 2),
            gpl.MXFP8: scales + n,
            gpl.MXFP4: scales + -(-n // 2),
        }[fmt.family]
        assert (
            size
            == fmt.wire_size(n)
            == (4 * n if fmt.fmt is None else native.wire_size(fmt.fmt, n, fmt.block))
        ), n
        if fmt.family == gpl.FP8 and n:
            assert block >= 1 and scales == -(-n // block)
            assert (tiles == 0) == gpl.team_walk(fmt)
            if tiles:  # the block the single-body kernels plan (they may walk it by teams)
                plan = cuda.fp8_launch(n, fmt.block)
                assert (scales, block) == (plan.nblocks, plan.block)
                assert tiles == -(-block // cuda.TILE)
        if not n:
            assert (scales, block, tiles) == (0, 0, 0)


def test_segment_rows_and_amax_slots():
    tiles = gpl.wire_format(codec_of("fp8-block5000"))
    pieces = [
        gpl.Piece(0, 12_000, 0, 0),
        gpl.Piece(12_000, 0, 12_024, 12_000),
        gpl.Piece(20_000, 4_999, 12_024, 20_000),
    ]
    rows, end = gpl.segment_rows(tiles, pieces, amax=5)
    assert rows.dtype == np.uint64 and rows.shape == (3, len(gpl.FIELDS))
    assert rows[:, gpl.AMAX].tolist() == [5, 0, 8] and end == 9  # 3 slots, none, 1 slot
    assert rows[:, gpl.SCALES].tolist() == [3, 0, 1]
    assert rows[:, gpl.BLOCK].tolist() == [5000, 0, 4999]  # capped at n: one tile walk
    assert rows[:, gpl.TILES].tolist() == [2, 0, 2]
    team = gpl.wire_format(codec_of("fp8"))
    rows, end = gpl.segment_rows(team, pieces, amax=5)
    assert end == 5 and not rows[:, gpl.AMAX].any() and not rows[:, gpl.TILES].any()
    assert rows[:, gpl.BLOCK].tolist() == [128, 0, 128]


def test_launch_grids():
    def rows_of(fmt, counts):
        return gpl.segment_rows(fmt, [gpl.Piece(0, n, 0, 0) for n in counts])[0]

    value = gpl.wire_format(codec_of("bf16"))  # four values per thread: 1000 -> 250 threads
    assert gpl.launch_grid("quad", rows_of(value, [1000, 257, 0]), value) == (1, 3)
    assert gpl.launch_grid("quad", rows_of(value, [1025, 257, 0]), value) == (2, 3)
    assert gpl.launch_grid("quad", rows_of(value, [0, 0]), value) is None
    assert gpl.launch_grid("quad", rows_of(value, []), value) is None
    mx4 = gpl.wire_format(codec_of("mxfp4"))
    assert gpl.encode_walk(mx4) == "quad"  # 4 values per thread: 1025 -> 257 threads
    assert gpl.launch_grid("quad", rows_of(mx4, [1025, 1]), mx4) == (2, 2)
    team = gpl.wire_format(codec_of("fp8"))  # 32 lanes per 128-value block
    assert gpl.launch_grid("team", rows_of(team, [1000, 10]), team) == (1, 2)
    assert gpl.launch_grid("team", rows_of(team, [1025]), team) == (2, 1)
    nv = gpl.wire_format(codec_of("nvfp4"))
    assert gpl.launch_grid("superblock", rows_of(nv, [4097, 4096]), nv) == (2, 2)
    tiles = gpl.wire_format(codec_of("fp8-block5000"))
    assert gpl.launch_grid("tile", rows_of(tiles, [12_000, 3]), tiles) == (6, 2)
    block0 = gpl.wire_format(codec_of("fp8-e5m2-block0"))
    assert gpl.launch_grid("tile", rows_of(block0, [10_000, 5]), block0) == (3, 2)
    assert gpl.encode_walk(block0) == gpl.decode_walk(block0) == "tile"
    assert gpl.encode_walk(nv) == "superblock" and gpl.decode_walk(nv) == "chunk"
    assert gpl.decode_walk(mx4) == "chunk"  # 16 values per thread: 4097 -> 257 threads
    assert gpl.launch_grid("chunk", rows_of(nv, [4097, 16]), nv) == (2, 2)
    mx8 = gpl.wire_format(codec_of("mxfp8"))  # 8 lanes per 32-value block
    assert gpl.encode_walk(mx8) == "mx" and gpl.decode_walk(mx8) == "quad"
    assert gpl.launch_grid("mx", rows_of(mx8, [1024, 33]), mx8) == (1, 2)
    assert gpl.launch_grid("mx", rows_of(mx8, [1025]), mx8) == (2, 1)
    assert gpl.encode_walk(value) == gpl.decode_walk(value) == "quad"
    with pytest.raises(ValueError, match="pieces"):
        gpl.launch_grid("quad", rows_of(value, [1] * (gpl.GRID_Y_MAX + 1)), value)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ["fp8", "nvfp4", "fp8-block5000", "mxfp4"])
def test_call_plans_agree_across_ranks(size, name):
    """What every rank sends each rank is what that rank expects, segments stay inside
    the buffers, send rows are the other shards' pieces and gather rows every piece."""
    fmt = gpl.wire_format(codec_of(name))
    pieces = Pieces.cut(100_003, size, 4096 * size)
    plans = [gpl.call_tables(fmt, pieces, r) for r in range(size)]
    assert pieces.stages > 4
    for s in range(pieces.stages):
        for kind in ("alltoall", "allgather"):
            ex = [getattr(p.stages[s], kind) for p in plans]
            for r in range(size):
                assert ex[r].send_counts[r] == ex[r].recv_counts[r] == 0  # nothing to itself
                for p in range(size):
                    assert ex[p].send_counts[r] == ex[r].recv_counts[p]
        for r, plan in enumerate(plans):
            stage = plan.stages[s]
            send, own = plan.rows[stage.send], plan.rows[stage.own]
            gather = plan.rows[stage.gather]
            others = [pieces.piece_range(j, s) for j in range(size) if j != r]
            assert [(int(a), int(a + n)) for a, n in send[:, [gpl.VALUES, gpl.COUNT]]] == others
            assert send[:, gpl.INDEX].tolist() == [lo for lo, _ in others]
            lo, hi = pieces.piece_range(r, s)
            assert own[0, gpl.COUNT] == hi - lo and own[0, gpl.INDEX] == lo and own[0, 0] == 0
            assert stage.own_bytes == fmt.wire_size(hi - lo)
            assert gather.shape[0] == size and gather[r, gpl.WIRE] == own[0, gpl.WIRE]
            sizes = [fmt.wire_size(int(n)) for n in send[:, gpl.COUNT]]
            assert all(
                int(w) + b <= plan.send_bytes for w, b in zip(send[:, gpl.WIRE], sizes, strict=True)
            )
            assert stage.alltoall.recv_counts.sum() <= plan.recv_bytes
    # the encoders' amax slots (fp8 tile walk) never overlap within a call
    for plan in plans:
        spans = [
            (int(r[gpl.AMAX]), int(r[gpl.AMAX] + r[gpl.SCALES]))
            for st in plan.stages
            for part in (st.send, st.own)
            for r in plan.rows[part]
            if r[gpl.TILES]
        ]
        assert bool(spans) == (name == "fp8-block5000")
        for (_, end), (start, _) in itertools.pairwise(sorted(spans)):
            assert start >= end
        assert plan.amax == (max(end for _, end in spans) if spans else 0)


def test_reduce_scatter_plans_have_no_gather_rows():
    fmt = gpl.wire_format(codec_of("fp8"))
    pieces = Pieces.cut(50_000, 3, 3 * 4096)
    plan = gpl.call_tables(fmt, pieces, 2, result_offset=int(pieces.bounds[2]), gather=False)
    assert all(plan.rows[st.gather].shape[0] == 0 for st in plan.stages)


def test_staged_send_rows_pack_the_maps_reads():
    fmt = gpl.wire_format(codec_of("fp8"))
    pieces = Pieces.cut(40_000, 4, 4 * 4096)
    plan = gpl.call_tables(fmt, pieces, 1, staged=True)
    for stage in plan.stages:
        send = plan.rows[stage.send]
        starts = np.concatenate([[0], np.cumsum(send[:, gpl.COUNT])[:-1]])
        assert send[:, gpl.VALUES].tolist() == starts.tolist()
    assert plan.staged == max(int(plan.rows[st.send][:, gpl.COUNT].sum()) for st in plan.stages)


# ---------------------------------------------------------------------------
# the whole pipeline on N ranks in lockstep: batched (C core kernels) == host-driven


def rank_inputs(size: int, count: int, seed: int = 0) -> list[np.ndarray]:
    out = []
    for r in range(size):
        rng = np.random.default_rng([seed, r, count])
        scale = np.repeat(np.exp2(rng.integers(-12, 13, -(-count // 700))), 700)[:count]
        x = (rng.standard_normal(count) * scale).astype(np.float32)
        x[rng.integers(0, count, 3)] = [np.inf, np.nan, 1e-42]
        out.append(x)
    return out


def run_both(codec, xs, chunk, gather=True, in_place=False, mapper=None, rounding_stream=11):
    """(host-driven results, batched results) of every rank."""
    size, count = len(xs), xs[0].size
    pieces = Pieces.cut(count, size, chunk)
    fmt = gpl.wire_format(codec)
    results = []
    for batched in (False, True):
        comms = loopback(size, "nccl", device_arrays=True)
        pipes, outs = [], []
        for r, comm in enumerate(comms):
            lo, hi = int(pieces.bounds[r]), int(pieces.bounds[r + 1])
            source = xs[r].copy()
            out = (
                (source if in_place else np.full(count, np.nan, np.float32))
                if gather
                else np.full(hi - lo, np.nan, np.float32)
            )
            offset = 0 if gather else lo
            m = mapper(r, source, out, offset) if mapper else None
            src = out if (m is not None and gather) else source
            if batched:
                pipes.append(
                    gp.BatchedPipeline(
                        comm,
                        fmt,
                        pieces,
                        src,
                        out,
                        offset,
                        gather,
                        m,
                        rounding_stream,
                        kernels=gp.HostKernels(),
                    )
                )
            else:
                pipes.append(
                    Pipeline(comm, codec, pieces, src, out, offset, gather, m, rounding_stream)
                )
            outs.append((out, m))
        run_lockstep(pipes)
        results.append(outs)
    return results


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), f"{np.count_nonzero(~same)} values differ, first at {np.argmin(same)}"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(CODECS))
def test_batched_equals_host_driven_allreduce(size, name):
    xs = rank_inputs(size, 30_011)
    for stochastic in (False, True) if name != "none" else (False,):
        codec = codec_of(name, stochastic)
        host, batched = run_both(codec, xs, chunk=4096 * size)  # 2-8 stages
        for (want, _), (got, _) in zip(host, batched, strict=True):
            assert_bits_equal(got, want)
        for got, _ in batched[1:]:
            assert_bits_equal(got, batched[0][0])  # every rank alike


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", ["fp8", "fp8-block5000", "nvfp4", "mxfp4", "bf16"])
def test_batched_equals_host_driven_reduce_scatter_and_in_place(size, name):
    xs = rank_inputs(size, 20_003, seed=1)
    codec = codec_of(name, stochastic=True)
    host, batched = run_both(codec, xs, chunk=4096 * size, gather=False)
    for (want, _), (got, _) in zip(host, batched, strict=True):
        assert_bits_equal(got, want)
    host, batched = run_both(codec, xs, chunk=4096 * size, in_place=True)
    for (want, _), (got, _) in zip(host, batched, strict=True):
        assert_bits_equal(got, want)


def test_one_stage_and_tiny_inputs():
    for count, size in ((1, 1), (5, 3), (4097, 2), (100, 4)):
        xs = rank_inputs(size, count, seed=2)
        host, batched = run_both(codec_of("nvfp4", True), xs, chunk=1 << 20)
        for (want, _), (got, _) in zip(host, batched, strict=True):
            assert_bits_equal(got, want)


class RecordingMap:
    """A RangeMap that doubles every value it reads into one scratch it reuses (as
    PartsMap does for reduce-scatter), halves finished ranges back, and records the
    calls in order. It tracks what was encoded: every quantization is told."""

    tracks_encoding = True

    def __init__(self, rank, source, result, offset):
        self.source, self.result, self.offset = source, result, offset
        self.values = source
        self.scratch = np.empty(source.size, np.float32)
        self.calls = []

    def read(self, lo, hi, out=None):
        self.calls.append(("read", lo, hi))
        if out is None:
            out = self.scratch[: hi - lo]
        np.multiply(self.source[lo:hi], np.float32(2), out=out)
        return out

    def encoded(self, lo, hi, values, wire):
        # the host path hands the whole all-gather send buffer: compare the body only
        body = wire[: self.codec.wire_size(hi - lo)]
        self.calls.append(("encoded", lo, hi, float(values.sum(dtype=np.float64)), bytes(body)))

    def done(self, lo, hi):
        self.calls.append(("done", lo, hi))

    def encode(self, lo, hi, codec, wire, rounding_stream):
        return False  # the steps one by one, so each is recorded

    def decode(self, lo, hi, codec, wire):
        return False
        self.result[lo - self.offset : hi - self.offset] *= np.float32(0.5)

    def split(self, lo, hi, back):
        return None  # not a split map: the pipeline reads and hands back step by step


@pytest.mark.parametrize("gather", [True, False])
def test_maps_are_called_per_piece_in_order(gather):
    """read, encoded and done once per piece, each kind in the host-driven order, every
    read before the encoded of its piece; the same values, wires and results."""
    xs = rank_inputs(3, 25_000, seed=3)
    for x in xs:
        x[~np.isfinite(x)] = 0.0  # the map's sums compare by value
    codec = RecordingMap.codec = codec_of("fp8", stochastic=True)
    host, batched = run_both(codec, xs, chunk=3 * 4096, gather=gather, mapper=RecordingMap)
    for (want, want_map), (got, got_map) in zip(host, batched, strict=True):
        assert_bits_equal(got, want)
        for kind in ("read", "encoded", "done"):
            assert [c for c in got_map.calls if c[0] == kind] == [
                c for c in want_map.calls if c[0] == kind
            ]
        for i, call in enumerate(got_map.calls):
            if call[0] == "encoded":
                assert ("read", *call[1:3]) in got_map.calls[:i]


class UntrackedMap(RecordingMap):
    """A RecordingMap that does not track what was encoded: the batched pipeline may
    then encode the owner's sum as it adds it up, without storing it."""

    tracks_encoding = False


@pytest.mark.parametrize("size", [1, 3])
def test_an_untracked_map_gets_the_owner_sum_fused(size):
    """Without tracking, the batched all-reduce encodes the owner's mapped piece and
    the received bodies in one launch (no fp32 sum, no re-encode): the same results
    and the same reads and dones as the host-driven pipeline, and no ``encoded`` of
    the owner's sums, which were never stored."""
    xs = rank_inputs(size, 25_000, seed=8)
    for x in xs:
        x[~np.isfinite(x)] = 0.0
    UntrackedMap.codec = codec_of("fp8", stochastic=True)
    host, batched = run_both(UntrackedMap.codec, xs, chunk=3 * 4096, mapper=UntrackedMap)
    pieces = Pieces.cut(xs[0].size, size, 3 * 4096)
    for rank, ((want, want_map), (got, got_map)) in enumerate(zip(host, batched, strict=True)):
        assert_bits_equal(got, want)
        for kind in ("read", "done"):
            assert [c for c in got_map.calls if c[0] == kind] == [
                c for c in want_map.calls if c[0] == kind
            ]
        own = [pieces.piece_range(rank, s) for s in range(pieces.stages)]
        own_sums = sum(hi > lo for lo, hi in own)
        assert own_sums > 0
        sent = sum(c[0] == "encoded" for c in got_map.calls)
        assert sent == sum(c[0] == "encoded" for c in want_map.calls) - own_sums


def test_error_feedback_residuals_match():
    """PartsMap with an error-feedback residual: the batched pipeline leaves the same
    residuals (every quantization's error) and results as the host-driven one."""
    size, count = 3, 20_000
    xs = rank_inputs(size, count, seed=4)
    for x in xs:
        x[~np.isfinite(x)] = 0.0
    codec = codec_of("nvfp4", stochastic=True)
    parts = [Part(0, (count,), "w")]

    def mapper(rank, source, result, offset):
        residual = np.random.default_rng([5, rank]).standard_normal(count).astype(np.float32) * 1e-3
        return PartsMap(source, result, offset, parts, [], [], residual, codec)

    host, batched = run_both(codec, xs, chunk=3 * 4096, mapper=mapper)
    for (want, want_map), (got, got_map) in zip(host, batched, strict=True):
        assert_bits_equal(got, want)
        assert_bits_equal(got_map.residual, want_map.residual)


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "mxfp4"])
def test_split_encode_gives_the_bytes_of_map_then_encode(name, monkeypatch):
    """The host pipeline encodes a piece that lies inside a split-mapped tensor in
    one pass (the plan's split encode); the batched one hands the split to its
    kernels (fp8 teams: the encoder maps what it reads, the decoder maps back what
    it writes, the owner's piece mapped before the received bodies are added) or
    maps it into a scratch and encodes that (other formats); the results are
    bitwise equal on every rank. Two tensors: a 300 x 257 matrix whose rows the
    pieces cut anywhere, and a 40 x 100 one that shares a piece with it (that
    piece is read and encoded step by step)."""
    size, shapes = 3, [(300, 257), (40, 100)]
    count = sum(m * n for m, n in shapes)
    xs = rank_inputs(size, count, seed=6)
    for x in xs:
        x[~np.isfinite(x)] = 0.0  # the sides are summed here with numpy
    quantizer = codec_of(name, stochastic=True)
    parts = [Part(0, shapes[0], "a"), Part(shapes[0][0] * shapes[0][1], shapes[1], "b")]
    rng = np.random.default_rng(7)
    bases = [
        kernels.orthonormalize(rng.standard_normal((4, n)).astype(np.float32), 1) for _, n in shapes
    ]
    plans = [
        [SplitPlan(MapShape(m, n, 4), vt, False) for (m, n), vt in zip(shapes, bases, strict=True)]
        for _ in xs
    ]
    for x, rank_plans in zip(xs, plans, strict=True):
        for part, plan in zip(parts, rank_plans, strict=True):
            plan.begin(x[part.offset : part.offset + part.size])
    sums = [sum(p[i].side for p in plans) for i in range(len(parts))]
    fused = []
    encode = type(quantizer).encode_split_wire

    def split_encode(self, *args, **kw):
        fused.append(args[0].size)
        encode(self, *args, **kw)

    monkeypatch.setattr(type(quantizer), "encode_split_wire", split_encode)
    kernel_splits = {"encode": [], "decode": []}
    for kind in kernel_splits:
        plain = getattr(gp.HostKernels, kind)

        def recorded(self, *args, _plain=plain, _kind=kind, **kw):
            kernel_splits[_kind].append(kw.get("split") is not None)
            _plain(self, *args, **kw)

        monkeypatch.setattr(gp.HostKernels, kind, recorded)

    def mapper(rank, source, result, offset):
        return PartsMap(
            source, result, offset, parts, list(zip(parts, plans[rank], strict=True)), sums
        )

    host, batched = run_both(quantizer, xs, chunk=3 * 4096, mapper=mapper)
    for (want, _), (got, _) in zip(host, batched, strict=True):
        assert_bits_equal(got, want)
    assert fused, "the host pipeline took the split encode"
    for kind, splits in kernel_splits.items():  # fp8 teams map in the kernels, and not always
        assert any(splits) == (name == "fp8") and not all(splits), (kind, splits)


def test_the_flat_plan_takes_the_host_path_for_numpy():
    """NumPy arrays never reach the batched pipeline, whatever the backend says."""
    from geocomm.engine.call import Signature
    from geocomm.engine.run import FlatPlan

    comm = loopback(1, "nccl", device_arrays=True)[0]
    x = rank_inputs(1, 5000)[0]
    out = np.empty_like(x)
    parts = (Part(0, (5000,), None),)
    fp8 = codec_of("fp8")
    signature = Signature("allreduce", 5000, np.dtype(np.float32), "sum", fp8, comm, parts)
    plan = FlatPlan(signature, 0)
    assert plan.fmt is not None, "the codec has a device format: only the arrays decide"
    assert plan.pipeline(x, out, None, 0) is False
    assert not plan.device_plans
    want = np.empty_like(x)
    Pipeline(loopback(1)[0], fp8, plan.pieces, x, want, 0, True).run()
    assert_bits_equal(out, want)


# ---------------------------------------------------------------------------
# the CUDA launches, against the kernels' signatures (no GPU: the launches are recorded)

_C_TYPES = {"int": np.int32, "unsigned int": np.uint32, "gc_u64": np.uint64, "float": np.float32}


def kernel_signatures() -> dict[str, list[type | None]]:
    """Parameter types of every kernel of gc_pipeline.cu: None for a pointer."""
    import re

    text = (cuda_build.source_dir() / "gc_pipeline.cu").read_text()
    out = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', text):
        types = []
        for param in params.split(","):
            decl = " ".join(param.split()[:-1]).replace("const ", "")
            types.append(None if "*" in param else _C_TYPES[decl])
        out[name] = types
    return out


@pytest.fixture
def launches(monkeypatch):
    """CudaKernels whose launches are checked against the signatures and recorded."""
    signatures = kernel_signatures()
    log = []

    def kernel(cupy, name, source):
        assert source is gp.kernel_source
        types = signatures[name]

        def launch(grid, block, args):
            assert len(args) == len(types), (name, len(args), len(types))
            for i, (arg, want) in enumerate(zip(args, types, strict=True)):
                if want is None:  # a pointer: an array, or NULL (a slot outside a call)
                    assert isinstance(arg, np.ndarray) or arg is cuda.UNMOVED, (name, i, arg)
                else:
                    assert type(arg) is want, (name, i, type(arg), want)
            assert len(grid) == 2 and all(1 <= g for g in grid) and block[0] % 32 == 0
            log.append((name, grid, block, args))

        return launch

    monkeypatch.setattr(cuda_build, "kernel", kernel)
    kernels = gp.CudaKernels.__new__(gp.CudaKernels)
    kernels.cupy = np  # the stochastic key's one-value array (key=None)
    return kernels, log


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("name", list(CODECS))
def test_cuda_launches_match_the_kernels(launches, name, stochastic):
    kernels, log = launches
    fmt = gpl.wire_format(codec_of(name, stochastic and name != "none"))
    pieces = [
        gpl.Piece(0, 5000, 0, 0),
        gpl.Piece(5000, 0, fmt.wire_size(5000), 5000),
        gpl.Piece(6000, 4097, fmt.wire_size(5000), 6000),
    ]
    rows, amax = gpl.segment_rows(fmt, pieces)
    seg = gp.Segments(rows, rows)
    x = np.zeros(20_000, np.float32)
    wire = np.zeros(2 * fmt.wire_size(5000), np.uint8)
    scratch = np.zeros(max(amax, 1), np.uint32)
    kernels.encode(fmt, x, seg, wire, scratch, rounding_stream=5)
    kernels.encode(
        fmt, x, seg, wire, scratch, gp.Incoming(wire, 2, fmt.wire_size(5000)), rounding_stream=6
    )
    kernels.reduce(fmt, x, seg, gp.Incoming(wire, 1, 7), x)
    kernels.decode(fmt, wire, seg, x)
    names = [entry[0] for entry in log]
    encoder = {
        gpl.RAW: ["gc_pipe_value_encode"],
        gpl.BF16: ["gc_pipe_value_encode"],
        gpl.NVFP4: ["gc_pipe_nvfp4_encode"],
        gpl.MXFP8: ["gc_pipe_mxfp8_encode"],
        gpl.MXFP4: ["gc_pipe_mxfp4_encode"],
    }.get(fmt.family)
    if encoder is None:
        encoder = (
            [cuda.team_kernel("gc_pipe_fp8_encode_team", fmt.block)]
            if gpl.team_walk(fmt)
            else ["gc_pipe_amax_tiles", "gc_pipe_fp8_encode_tiles"]
        )
    decoder = (
        "gc_pipe_e2m1_decode"
        if fmt.family in (gpl.NVFP4, gpl.MXFP4)
        else "gc_pipe_decode"
        if fmt.family != gpl.FP8
        else "gc_pipe_fp8_decode_team"
        if gpl.team_walk(fmt)
        else "gc_pipe_fp8_decode_tiles"
    )
    assert names == 2 * encoder + ["gc_pipe_reduce", decoder]
    for entry, walk in zip(
        log, [gpl.encode_walk(fmt)] * 2 * len(encoder) + ["quad", None], strict=True
    ):
        want = gpl.launch_grid(walk or gpl.decode_walk(fmt), rows, fmt)
        assert entry[1] == want and entry[1][1] == 3
    threads = gpl.NVFP4_THREADS if fmt.family == gpl.NVFP4 else cuda.THREADS
    assert log[0][2] == (threads,)
    # the rounding key, read from device memory: this rounding stream's under stochastic
    # rounding; else the table, a valid pointer the kernels never read
    keys = [args[-2] for n, _, _, args in log if n in encoder[-1:]]
    if fmt.stochastic:
        assert [k.tolist() for k in keys] == [[fmt.key(5)], [fmt.key(6)]]
    else:
        assert all(k is seg.device for k in keys)
    # the second encode adds the incoming bodies; the first passes none
    # (family,) x, moved, table, in, nin, stride
    at = 4 + (encoder[-1] == "gc_pipe_value_encode")
    incoming = [(int(args[at]), int(args[at + 1])) for n, _, _, args in log if n == encoder[-1]]
    assert incoming == [(0, 0), (2, fmt.wire_size(5000))]


def test_no_launch_without_values(launches):
    kernels, log = launches
    fmt = gpl.wire_format(codec_of("fp8"))
    rows, _ = gpl.segment_rows(fmt, [gpl.Piece(0, 0, 0, 0)])
    seg = gp.Segments(rows, rows)
    empty = np.zeros(0, np.float32)
    kernels.encode(fmt, empty, seg, np.zeros(0, np.uint8), np.zeros(1, np.uint32))
    kernels.reduce(fmt, empty, seg, gp.Incoming(np.zeros(0, np.uint8), 2, 0), empty)
    kernels.decode(fmt, np.zeros(0, np.uint8), seg, empty)
    assert log == []


class CountingComm:
    """A loopback rank whose requests count how they are waited for."""

    def __init__(self, comm, log):
        self.comm, self.log = comm, log
        self.rank, self.size, self.backend = comm.rank, comm.size, comm.backend
        self.device_arrays = comm.device_arrays

    def alltoallv(self, *args):
        request, log = self.comm.alltoallv(*args), self.log

        class Counted:
            def test(self):
                log.append("test")
                return request.test()

            def wait(self):
                log.append("wait")
                request.wait()

            def wait_stream(self):
                log.append("wait_stream")
                request.wait_stream()

        log.append("post")
        return Counted()


@pytest.mark.parametrize("gather", [True, False])
def test_batched_pipeline_never_waits_on_the_host(gather):
    """Every transfer is one grouped call per stage and phase, waited for once, on the
    stream (wait_stream): no test() polling, no host wait()."""
    size, count = 3, 40_000
    xs = rank_inputs(size, count, seed=6)
    pieces = Pieces.cut(count, size, 4096 * size)
    fmt = gpl.wire_format(codec_of("fp8"))
    logs = [[] for _ in range(size)]
    pipes = []
    for r, comm in enumerate(loopback(size, "nccl", device_arrays=True)):
        lo, hi = int(pieces.bounds[r]), int(pieces.bounds[r + 1])
        out = np.empty(count if gather else hi - lo, np.float32)
        pipes.append(
            gp.BatchedPipeline(
                CountingComm(comm, logs[r]),
                fmt,
                pieces,
                xs[r],
                out,
                0 if gather else lo,
                gather,
                kernels=gp.HostKernels(),
            )
        )
    run_lockstep(pipes)
    calls = pieces.stages * (2 if gather else 1)
    for log in logs:
        assert log.count("post") == log.count("wait_stream") == calls
        assert "test" not in log and "wait" not in log


def test_only_fp8_teams_take_a_split_map():
    """A split map handed to a format whose kernels cannot run it is refused, by the
    reference kernels as by the CUDA ones (the same check), before anything is written;
    a split whose coefficients do not fit its basis is refused too."""
    from geocomm.codecs.formats import Split

    x = rank_inputs(1, 300)[0]
    vt = kernels.orthonormalize(np.eye(2, 30, dtype=np.float32), 1)
    split = Split(0, 30, np.ones((10, 2), np.float32), vt, None)
    for name in ("nvfp4", "mxfp8", "bf16", "fp8-block5000"):
        fmt = gpl.wire_format(codec_of(name))
        rows, _ = gpl.segment_rows(fmt, [gpl.Piece(0, x.size, 0, 0)])
        seg = gp.Segments(rows, rows)
        wire = np.full(fmt.wire_size(x.size), 7, np.uint8)
        with pytest.raises(ValueError, match="team kernels"):
            gp.HostKernels().encode(fmt, x, seg, wire, None, split=split)
        with pytest.raises(ValueError, match="team kernels"):
            gp.HostKernels().decode(fmt, wire, seg, np.empty_like(x), split=split)
        assert np.all(wire == 7), name
    with pytest.raises(ValueError, match="C-contiguous float32"):
        gp._split_args(Split(0, 30, np.ones((10, 3), np.float32), vt, None))
