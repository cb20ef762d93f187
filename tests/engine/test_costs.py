"""The cost model behind the stage size and auto's crossover (geocomm.engine.costs).

Host backends keep their measured numbers (so the NumPy/MPI path is unchanged);
the NCCL profile's numbers follow from the model, checked here on its own
terms: the chosen stage count minimizes the modelled time, devices take few
large stages (a stage costs ~100 us there), slower links take more, one rank
never compresses, and auto's switch point is where compression starts to win.
"""

from __future__ import annotations

import math

import pytest

import geocomm
from geocomm.codecs.auto import AutoCodec
from geocomm.engine import costs as backends
from geocomm.engine.layout import DEFAULT_STAGE_SIZE, Pieces, stage_size

NCCL = backends.DEVICE["nccl"]
MIB = 1 << 20


def test_host_backends_keep_the_measured_numbers():
    for backend in ("mpi", "torch", "sim", None):
        for count in (0, 1, 10**6, 10**9):
            for size in (1, 2, 8):
                assert stage_size(backend, count, size) == DEFAULT_STAGE_SIZE == 1 << 20
        assert backends.crossover_bytes(backend, 2) == backends.HOST_CROSSOVER_BYTES == 2 * MIB
    assert backends.profile("mpi") is None and backends.profile("nccl") is NCCL


@pytest.mark.parametrize("size", [2, 3, 8, 64])
@pytest.mark.parametrize("mib", [1, 16, 64, 256, 1024, 8192])
def test_best_stages_minimize_the_modelled_time(size, mib):
    nbytes = mib * MIB
    best = backends.best_stages(NCCL, nbytes, size, backends.FP8_RATIO)
    times = {
        k: backends.compressed_seconds(NCCL, nbytes, size, backends.FP8_RATIO, k)
        for k in range(1, 200)
    }
    assert times[best] == pytest.approx(min(times.values()), rel=1e-12)


def test_model_terms():
    # one stage: codec and link do not overlap; many: the larger one plus the stage costs
    link = 2 * 7 / 8 * 0.25 * 1e9 / NCCL.link_Bps
    codec = 1e9 / NCCL.codec_Bps
    one = backends.compressed_seconds(NCCL, 1e9, 8, 0.25, 1)
    assert one == pytest.approx(NCCL.call_s + NCCL.stage_s + link + codec)
    many = backends.compressed_seconds(NCCL, 1e9, 8, 0.25, 1000)
    assert many == pytest.approx(
        NCCL.call_s + 1000 * NCCL.stage_s + max(link, codec) + min(link, codec) / 1000
    )
    assert backends.plain_seconds(NCCL, 1e9, 8) == pytest.approx(2 * 7 / 8 * 1e9 / NCCL.link_Bps)
    assert backends.plain_seconds(NCCL, 1e9, 1) == 0.0


def test_device_stages_are_few_and_large():
    """~100 us per stage: one stage up to a few hundred MiB on NVLink, a handful above."""
    counts = {mib: stage_size("nccl", mib * MIB // 4, 8) for mib in (1, 64, 256, 1024)}
    assert counts[1] == MIB // 4 and counts[64] == 16 * MIB  # one stage each
    assert 1 < math.ceil(256 * MIB // 4 / counts[256]) <= 4
    assert 1 < math.ceil(1024 * MIB // 4 / counts[1024]) <= 8
    assert counts[1024] <= backends.MAX_STAGE_SIZE
    # the host's 1M values per stage would cut 256 MiB into 64 stages: 6.4 ms of stage
    # costs, several times the best call
    best = backends.best_stages(NCCL, 256 * MIB, 8, backends.FP8_RATIO)
    modelled = [
        backends.compressed_seconds(NCCL, 256 * MIB, 8, backends.FP8_RATIO, k) for k in (best, 64)
    ]
    assert modelled[1] > 3 * modelled[0]


def test_one_rank_takes_one_stage_and_never_compresses():
    for mib in (1, 64, 256):
        assert stage_size("nccl", mib * MIB // 4, 1) == mib * MIB // 4
    assert stage_size("nccl", 4 << 30, 1) == backends.MAX_STAGE_SIZE  # scratch bound
    assert backends.crossover_bytes("nccl", 1) is None


def test_stages_hide_the_smaller_cost_and_slow_links_compress_sooner():
    """K grows with the smaller of codec and link time (what pipelining can hide): as
    sqrt of the message size; a slower link leaves the codec the smaller cost."""
    ks = [backends.best_stages(NCCL, mib * MIB, 8, backends.FP8_RATIO) for mib in (256, 4096)]
    assert ks[1] == pytest.approx(4 * ks[0], abs=1)
    slow = backends.Profile(
        stage_s=NCCL.stage_s, call_s=NCCL.call_s, link_Bps=25e9, codec_Bps=NCCL.codec_Bps
    )
    codec_s = 256 * MIB / NCCL.codec_Bps
    assert backends.best_stages(slow, 256 * MIB, 8, backends.FP8_RATIO) == round(
        math.sqrt(codec_s / NCCL.stage_s)
    )
    backends.DEVICE["slow"] = slow
    try:
        assert backends.crossover_bytes("slow", 8) < backends.crossover_bytes("nccl", 8)
    finally:
        del backends.DEVICE["slow"]


@pytest.mark.parametrize("size", [2, 4, 8, 64])
def test_device_crossover_is_where_compression_starts_to_win(size):
    cross = backends.crossover_bytes("nccl", size)
    assert cross is not None and cross & (cross - 1) == 0  # a power of two
    ratio = backends.FP8_RATIO

    def wins(nbytes):
        k = backends.best_stages(NCCL, nbytes, size, ratio)
        return backends.compressed_seconds(NCCL, nbytes, size, ratio, k) < backends.plain_seconds(
            NCCL, nbytes, size
        )

    assert wins(cross) and all(wins(cross << i) for i in range(1, 8))
    assert not wins(cross // 2)
    # NVLink moves hundreds of GB/s: compression pays for tens of MiB, not the host's 2 MiB
    assert 16 * MIB <= cross <= 512 * MIB
    # a smaller wire (nvfp4) saves more per byte: it never switches later
    assert backends.crossover_bytes("nccl", size, 0.14) <= cross


def test_never_when_the_codec_is_slower_than_the_link_it_saves():
    backends.DEVICE["slowcodec"] = backends.Profile(
        stage_s=1e-4, call_s=1e-4, link_Bps=300e9, codec_Bps=1e9
    )
    try:
        assert backends.crossover_bytes("slowcodec", 8) is None
    finally:
        del backends.DEVICE["slowcodec"]


def test_auto_takes_the_backends_crossover():
    auto = AutoCodec()
    assert auto.get_config()["crossover_bytes"] is None
    codec_for = backends.codec_for
    # one rank on a device: never compress
    assert backends.crossover_bytes("nccl", 1) is None
    assert codec_for(auto, 10**9, "nccl", 1).lossless
    cross = backends.crossover_bytes("nccl", 8, auto.inner.wire_size(1 << 20) / (4 << 20))
    assert cross is not None
    assert codec_for(auto, cross // 4, "nccl", 8) is auto.inner
    assert codec_for(auto, cross // 4 - 1, "nccl", 8).lossless
    # host: as measured, whatever the size
    assert backends.HOST_CROSSOVER_BYTES == MIB * 2
    assert codec_for(auto, MIB // 2, "mpi", 2) is auto.inner
    assert codec_for(auto, MIB // 2 - 1, "mpi", 2).lossless
    # a configured crossover holds for every backend
    fixed = AutoCodec(crossover_bytes=4000)
    assert codec_for(fixed, 1000, "nccl", 1) is fixed.inner
    assert codec_for(fixed, 999, "mpi", 8).lossless
    # every other codec carries itself
    fp8 = geocomm.get_codec("fp8")
    assert codec_for(fp8, 1, "mpi", 2) is fp8
    assert geocomm.get_codec(fixed.get_config()) == fixed
    for bad in (-1, 1.5, "2M"):
        with pytest.raises(ValueError, match="crossover_bytes"):
            AutoCodec(crossover_bytes=bad)


def test_stage_size_cuts_valid_pieces():
    for count in (1, 4095, 10**6 + 7, 3 * 10**7):
        for size in (1, 2, 8):
            chunk = stage_size("nccl", count, size)
            plan = Pieces.cut(count, size, chunk)
            assert plan.stages >= 1 and plan.piece * plan.stages * size >= count
