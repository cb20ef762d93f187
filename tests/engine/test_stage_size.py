"""The pipeline's stage size never changes the bits of a result (issue #16).

The collectives cut every shard into pieces of about ``stage_size / N``
values and encode each piece as its own wire body. Every scale of every
format covers a fixed run of values counted from the start of its body, its
``scale_span`` (fp8: its block, 128 by default; MX: 32; NVFP4: 16 under a
superblock scale of 4096), and pieces start at multiples of
``lcm(PIECE_ALIGN, scale_span)`` from their shard's start (a span of 0, one
scale a body, makes each shard one piece), so the same values share a scale
whatever the piece size; stochastic rounding draws by global element index.
So ``allreduce`` and ``reduce_scatter`` give identical bits for stage_size
2^20, 2^15 and 4096 per rank (one aligned unit per piece: the most stages),
with both roundings.

Stochastic rounding's stream also counts the calls made with a codec and key
(``geocomm.calls`` counts them): the two calls compared start from a fresh
count, as two runs of a training job would.

The stages' byte layout (``call_bytes``, derived once per signature) agrees
across ranks: every all-to-all sends what its receiver expects.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import geocomm
from geocomm.engine import call as calls
from geocomm.engine.layout import PIECE_ALIGN, Pieces, call_bytes

COUNT = 300_007  # shards of odd lengths; 2^15 gives several stages, 2^20 one
CHUNKS = (1 << 20, 1 << 15)
CODECS = {
    "fp8": {"id": "fp8", "fmt": "e4m3", "block": 128},
    # blocks that 4096 is no multiple of: pieces of lcm(4096, 96) = 12288 values,
    # and one piece a shard for one scale a body (these changed with the stage
    # size before pieces followed the codec's scale span)
    "fp8 block 96": {"id": "fp8", "block": 96},
    "fp8 block 0": {"id": "fp8", "block": 0},
    "nvfp4": {"id": "nvfp4"},
    "mxfp8": {"id": "mxfp8", "fmt": "e4m3"},
    "mxfp4": {"id": "mxfp4"},
}
ROUNDINGS = {"nearest": {}, "stochastic": {"rounding": "stochastic", "seed": 11}}


def rank_input(rank: int) -> np.ndarray:
    """Gaussians whose magnitude changes every 1000 values (2^-12 .. 2^12), so
    neighbouring scales, superblock scales included, differ."""
    rng = np.random.default_rng([rank, COUNT, 16])
    scale = np.repeat(np.exp2(rng.integers(-12, 13, -(-COUNT // 1000))), 1000)[:COUNT]
    return (rng.standard_normal(COUNT) * scale).astype(np.float32)


@pytest.mark.parametrize("span", [1, 16, 4096, 96, 1000, 0])
def test_pieces_start_at_multiples_of_the_scale_span_in_their_shard(span):
    # every piece of every stage starts at a multiple of lcm(PIECE_ALIGN, span) from
    # its shard's start (PIECE_ALIGN itself for the formats' spans, which divide it);
    # a span of 0 (one scale over a body) leaves each shard one piece
    assert PIECE_ALIGN % 4096 == 0
    unit = math.lcm(PIECE_ALIGN, span) if span else None
    for count in (1, 4095, 4097, COUNT, 10**6 + 7):
        for size in (1, 2, 3, 5, 8):
            for chunk in (1, 777, 4096, *CHUNKS, 1 << 24):
                plan = Pieces.cut(count, size, chunk, span)
                if unit is None:
                    assert plan.stages == 1
                    continue
                assert plan.piece % unit == 0
                for shard in range(size):
                    start = int(plan.bounds[shard])
                    for stage in range(plan.stages):
                        lo, hi = plan.piece_range(shard, stage)
                        assert (lo - start) % unit == 0 or lo == hi


def test_call_bytes_agree_across_ranks():
    # what rank r sends to rank j in a stage's all-to-all is what j expects from r (the
    # wire bytes of r's piece of shard j), packed in rank order on both sides; every
    # rank sees the same all-gather; the buffer sizes are the largest stage's
    wire = geocomm.get_codec("nvfp4").wire_size  # not proportional: a body has scales
    for count in (1, 4097, COUNT):
        for size in (1, 2, 3, 5):
            for chunk in (4096, *CHUNKS):
                pieces = Pieces.cut(count, size, chunk)
                ranks = [call_bytes(wire, pieces, r) for r in range(size)]
                for s in range(pieces.stages):
                    stages = [layout.stages[s] for layout in ranks]
                    for r, mine in enumerate(stages):
                        assert mine.ranges == tuple(pieces.piece_range(j, s) for j in range(size))
                        assert mine.sizes == tuple(wire(hi - lo) for lo, hi in mine.ranges)
                        for j, theirs in enumerate(stages):
                            sent = 0 if j == r else mine.sizes[j]
                            assert mine.send_counts[j] == theirs.recv_counts[r] == sent
                        for counts, displs in (
                            (mine.send_counts, mine.send_displs),
                            (mine.recv_counts, mine.recv_displs),
                            (mine.gather_counts, mine.gather_displs),
                        ):
                            assert list(displs) == [0, *np.cumsum(counts)[:-1]]
                        assert list(mine.gather_counts) == list(stages[0].sizes)
                for r, layout in enumerate(ranks):
                    for field, counts in (
                        ("send_bytes", lambda t: t.send_counts.sum()),
                        ("recv_bytes", lambda t: t.recv_counts.sum()),
                        ("own_bytes", lambda t, r=r: t.sizes[r]),
                        ("gather_bytes", lambda t: t.gather_counts.sum()),
                    ):
                        largest = max((int(counts(t)) for t in layout.stages), default=0)
                        assert getattr(layout, field) == largest, (count, size, chunk, field)


@pytest.fixture
def saved_counts():
    """The test resets the stochastic-rounding call counts; later tests get theirs back."""
    with calls.saved_call_counts():
        yield


def _run(kind: str, x: np.ndarray, codec: dict, chunk: int) -> np.ndarray:
    if kind == "allreduce":
        return geocomm.allreduce(x.copy(), codec=codec, stage_size=chunk)
    return geocomm.reduce_scatter(x.copy(), codec=codec, stage_size=chunk)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("rounding", list(ROUNDINGS))
@pytest.mark.parametrize("name", list(CODECS))
def test_stage_size_does_not_change_the_bits(comm, saved_counts, kind, rounding, name):
    chunks = (*CHUNKS, PIECE_ALIGN * comm.size)
    codec = {**CODECS[name], **ROUNDINGS[rounding]}
    span = geocomm.get_codec(codec).scale_span()
    stages = [Pieces.cut(COUNT, comm.size, chunk, span).stages for chunk in chunks]
    assert stages[0] == 1
    if span:  # the calls really cut differently
        assert stages[0] < stages[1] <= stages[2]
    x = rank_input(comm.rank)
    results = []
    for chunk in chunks:
        calls.reset_call_counts()  # a fresh stochastic-rounding count
        results.append(_run(kind, x, codec, chunk))
    for other in results[1:]:
        assert results[0].dtype == other.dtype == np.float32
        np.testing.assert_array_equal(results[0].view(np.uint32), other.view(np.uint32))
    if rounding == "stochastic" and (kind == "allreduce" or comm.size > 1):
        # without the fresh count the next call draws other bits: the results above
        # are stochastic ones (a reduce-scatter on one rank quantizes nothing: its
        # own piece never travels)
        again = _run(kind, x, codec, chunks[-1])
        assert not np.array_equal(again.view(np.uint32), results[-1].view(np.uint32))
