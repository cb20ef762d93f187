"""perf/gpu_check.py without a GPU: it imports and explains itself, exits 2
without CuPy, and its sections' logic (inputs, comparisons, report) runs
correctly with NumPy standing in for CuPy and the C core standing in for the
CUDA kernels, so a first run on a GPU only has to exercise the GPU itself.

With the stand-ins every GPU result equals the CPU result by construction:
these tests prove the plumbing (arguments, conversions, which results are
compared, how failures are reported), not the kernels. A planted mismatch
checks that a wrong byte is caught and named.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from geocomm import cuda, gpu_pipeline, native

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_works_without_cupy():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "collectives" in proc.stdout


def test_missing_cupy_exits_2_with_a_clear_message(tmp_path):
    pytest.importorskip("geocomm")
    if cuda.available:
        pytest.skip("CuPy and a GPU are present")
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no GPU path to check" in proc.stderr and "CuPy" in proc.stderr
    assert not out.exists()


def test_block_list_covers_the_kernel_switches(gc):
    """fp8 blocks on both sides of the team/tile switch (1024) and of one tile
    (4096), several tiles, and block 0; odd sizes around the same edges."""
    blocks = set(gc.FP8_BLOCKS)
    assert {0, cuda.TEAM_MAX, cuda.TEAM_MAX + 1, cuda.TILE, cuda.TILE + 1} <= blocks
    assert any(b > 2 * cuda.TILE for b in blocks)
    assert {n % 2 for n in gc.ODD_SIZES} == {0, 1} and 0 in gc.ODD_SIZES
    configs = gc.configs()
    assert ("nvfp4", 0) in configs and ("bf16", 0) in configs
    assert {f for f, _ in configs} == {"e4m3", "e5m2", "nvfp4", "bf16"}


def test_value_diff_treats_any_nan_alike_and_names_the_first_mismatch(gc):
    import ml_dtypes

    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        a = np.array([1.0, np.nan, -0.0, 2.0], dtype)
        b = a.copy()
        b.view(f"u{a.itemsize}")[1] ^= 1  # another NaN payload: still equal
        assert gc.value_diff(a, b)["equal"]
        b[2] = 0.0  # -0.0 vs +0.0 differ in bits
        diff = gc.value_diff(a, b)
        assert not diff["equal"] and diff["first"] == 2 and diff["mismatches"] == 1
    assert not gc.value_diff(np.zeros(2, np.float32), np.zeros(2, np.float16))["equal"]
    assert not gc.byte_diff(np.zeros(3, np.uint8), np.zeros(4, np.uint8))["equal"]


# ---------------------------------------------------------------------------
# NumPy standing in for CuPy


class FakeEvent:
    done = True

    def record(self, stream=None):
        return self

    def synchronize(self):
        pass


class FakeStream:
    ptr = 0

    def __init__(self, non_blocking=False):
        self.waited = 0

    def record(self):
        return FakeEvent()

    def wait_event(self, event):
        self.waited += 1

    def synchronize(self):
        pass


class FakeDevice:
    id = 0
    compute_capability = "90"
    attributes: ClassVar[dict] = {"ClockRate": 1_980_000}

    def synchronize(self):
        pass


def fake_cupy() -> types.SimpleNamespace:
    cuda_ns = types.SimpleNamespace(
        Stream=FakeStream, Event=FakeEvent, Device=lambda *a: FakeDevice(),
        get_current_stream=FakeStream, get_elapsed_time=lambda start, end: 1.0,
        runtime=types.SimpleNamespace())
    return types.SimpleNamespace(
        __version__="fake", asarray=lambda a, dtype=None: np.array(a, dtype=dtype),
        asnumpy=lambda a: np.array(a), full=np.full, zeros=np.zeros, empty=np.empty,
        empty_like=np.empty_like, concatenate=np.concatenate, arange=np.arange,
        copyto=np.copyto, uint8=np.uint8, int8=np.int8, int64=np.int64, uint32=np.uint32,
        float32=np.float32, float64=np.float64,
        random=types.SimpleNamespace(default_rng=np.random.default_rng), cuda=cuda_ns,
        RawKernel=lambda source, name: (lambda grid, block, args: None))


def _fmt(fmt):
    return native.FORMATS[fmt] if isinstance(fmt, str) else fmt


@pytest.fixture
def stand_ins(gc, monkeypatch):
    """A Context on fake CuPy whose 'NCCL' communicator is MPI, and the CUDA
    codec replaced by the C core (what the kernels must equal)."""
    monkeypatch.setattr(cuda, "encode", lambda fmt, x, block, wire, stream=None:
                        native.encode(_fmt(fmt), x, block, wire))
    monkeypatch.setattr(cuda, "decode", lambda fmt, wire, block, out, accumulate=False,
                        stream=None: native.decode(_fmt(fmt), wire, block, out, accumulate))
    # the batched kernels: their contract run by the C core
    monkeypatch.setattr(gpu_pipeline, "CudaKernels", gpu_pipeline.HostKernels)

    class StandInContext(gc.Context):
        def nccl(self):
            return self.mpi()

    return StandInContext(fake_cupy(), argparse.Namespace(seed=5))


def small_inputs(gc):
    rng = np.random.default_rng(3)
    return [(name, x) for name, x in gc.cases(rng, big=0) if x.size <= 70_000] + \
        [("wide", gc.wide(rng, 5000))]


def test_bytes_section_passes_when_gpu_equals_c_core(gc, stand_ins):
    configs = [("e4m3", 0), ("e4m3", 1025), ("e5m2", 4097), ("nvfp4", 0), ("bf16", 0)]
    result = gc.check_bytes(stand_ins, configs, small_inputs(gc))
    assert result["ok"], result["failures"][:3]
    rows = result["rows"]
    # every input, plus the odd-offset and explicit-stream variants, per config
    assert len(rows) == len(configs) * (len(small_inputs(gc)) + 2)
    assert {r["case"] for r in rows} >= {"wide offset", "edges stream", "n=0", "n=4097"}
    compared = {k for r in rows for k in r if k.endswith(("_native", "_reference"))}
    assert compared == {"encode_vs_native", "encode_vs_reference", "decode_vs_native",
                        "decode_vs_reference", "accumulate_vs_native",
                        "accumulate_vs_reference"}


def test_bytes_section_names_a_wrong_byte(gc, stand_ins, monkeypatch):
    def off_by_one(fmt, x, block, wire, stream=None):
        native.encode(_fmt(fmt), x, block, wire)
        if wire.size:
            wire[-1] ^= 1

    monkeypatch.setattr(cuda, "encode", off_by_one)
    result = gc.check_bytes(stand_ins, [("e4m3", 128)], [("n=17", gc.wide(
        np.random.default_rng(1), 17))])
    assert not result["ok"]
    assert "e4m3 block=128 n=17" in result["failures"][0]
    assert result["rows"][0]["encode_vs_native"]["first"] == native.wire_size(1, 17, 128) - 1


def test_collectives_section_compares_every_case(gc, stand_ins, monkeypatch):
    full = gc.check_lockstep
    monkeypatch.setattr(gc, "check_lockstep", lambda ctx: full(ctx, n=9001))
    result = gc.check_collectives(stand_ins, n=3001, chunk=256)
    assert result["ok"], result["failures"][:3]
    cases = {(r["collective"], r["dtype"], r["codec"], r["in_place"]) for r in result["rows"]}
    codecs = len(gc.COLLECTIVE_CODECS)
    # allreduce also in place; then every codec but the map on 3 loopback ranks, both ways
    assert len(cases) == len(result["rows"]) == 3 * 3 * codecs + 3 * codecs + 2 * (codecs - 1)
    assert ("allreduce", "bfloat16", "nvfp4", True) in cases
    assert ("reduce_scatter x3 loopback", "float32", "mxfp4 stochastic", False) in cases
    lockstep = [r for r in result["rows"] if "loopback" in r["collective"]]
    assert all({"rank0", "rank1", "rank2"} <= set(r) for r in lockstep)


def test_collectives_cover_every_format_and_the_map(gc):
    import geocomm

    formats = {gpu_pipeline.wire_format(geocomm.get_codec(c)).family
               for c in gc.COLLECTIVE_CODECS.values()}
    assert formats == {gpu_pipeline.RAW, gpu_pipeline.FP8, gpu_pipeline.NVFP4,
                       gpu_pipeline.BF16, gpu_pipeline.MXFP8, gpu_pipeline.MXFP4}
    walks = {gpu_pipeline.encode_walk(gpu_pipeline.wire_format(geocomm.get_codec(c)))
             for c in gc.COLLECTIVE_CODECS.values()}
    assert {"team", "tile", "superblock", "pair", "value"} <= walks
    assert any(isinstance(c, dict) and c.get("error_feedback")
               for c in gc.COLLECTIVE_CODECS.values())


def test_batched_checks_cover_every_format_and_walk(gc, stand_ins):
    """Every batched config runs its four comparisons (equal here by construction)."""
    import geocomm

    rng = np.random.default_rng(4)
    x = gc.cases(rng, big=0)[1][1]  # edge values
    others = [gc.wide(rng, 20_000) for _ in range(3)]
    walks = set()
    for name, config in gc.batched_configs():
        row = gc.check_batched(stand_ins.cp, name, config, x, others)
        assert row["ok"], row
        assert {"encode", "decode", "sum_encode", "sum"} <= set(row)
        walks.add(gpu_pipeline.encode_walk(gpu_pipeline.wire_format(geocomm.get_codec(config))))
    assert walks == {"team", "tile", "superblock", "pair", "value"}
    assert sum("stochastic" in name for name, _ in gc.batched_configs()) == len(
        gc.BATCHED_CODECS) - 1


def test_batched_check_names_a_wrong_byte(gc, stand_ins, monkeypatch):
    class OffByOne(gpu_pipeline.HostKernels):
        def encode(self, fmt, x, seg, wire, amax, incoming=None, stream=0):
            super().encode(fmt, x, seg, wire, amax, incoming, stream)
            wire[-1] ^= 1

    monkeypatch.setattr(gpu_pipeline, "CudaKernels", OffByOne)
    rng = np.random.default_rng(5)
    row = gc.check_batched(stand_ins.cp, "fp8", {"id": "fp8"}, gc.wide(rng, 30_000),
                           [gc.wide(rng, 20_000)])
    assert not row["ok"] and not row["encode"]["equal"] and row["decode"]["equal"]


def test_geofp8_section_runs_the_same_sequence(gc, stand_ins):
    result = gc.check_geofp8(stand_ins, shape=(96, 256), steps=2)
    assert result["ok"], result["failures"]
    assert result["status"] == "ran" and len(result["rows"]) == 3 + 2  # kernels, then steps


def test_timing_section_reports_every_operation(gc, stand_ins):
    result = gc.check_timing(stand_ins, sizes_mib=(1,), repeats=1)
    ops = [r["op"] for r in result["pipeline"]]
    assert ops == ["cupy copy", "NCCL all-reduce (fp32)", "geocomm fp8 pipeline"]
    assert result["pipeline"][0]["vs_copy"] == 1.0
    assert all(r["GBps"] > 0 and r["gpu_GBps"] > 0 for r in result["pipeline"])
    assert result["pipeline"][2]["stages"] == 1 and result["pipeline"][0]["stages"] is None
    # the fake device times every call alike: the pipeline meets the must-show
    assert result["ok"] and result["pipeline"][2]["vs_copy"] >= gc.MUST_SHOW_VS_COPY
    stage = result["stage_cost"]
    assert stage["stages"] == 8 and stage["model_stage_s"] is None  # MPI: a host backend
    report = {"ok": True, "seconds": 1.0, "environment": {"device": "fake"},
              "sections": {"timing": {**result, "status": "ran", "seconds": 1.0}}}
    md = gc.markdown(report)
    assert "| 1 | geocomm fp8 pipeline | 1 |" in md and "device GB/s" in md
    assert {(r["fmt"], r["op"]) for r in result["kernels"]} >= {("e4m3", "encode"),
                                                                ("nvfp4", "accumulate")}


def test_a_raising_section_does_not_stop_the_others(gc, stand_ins, monkeypatch, tmp_path):
    def broken(ctx):
        raise RuntimeError("planted")

    monkeypatch.setitem(gc.SECTIONS, "errors", broken)
    monkeypatch.setitem(gc.SECTIONS, "bytes", lambda ctx: {"ok": True, "rows": [],
                                                          "failures": []})
    results = gc.run_sections(stand_ins, ["errors", "bytes", "torch"], budget_s=600)
    assert results["errors"]["status"] == "failed" and not results["errors"]["ok"]
    assert "planted" in results["errors"]["error"]
    assert results["bytes"]["ok"]
    # torch without CUDA (the CPU build here) skips with a reason, and passes
    assert results["torch"]["ok"] and results["torch"]["status"] in ("skipped", "ran")
    report = {"ok": False, "seconds": 1.0, "environment": {"device": "fake"},
              "sections": results}
    gc.write_report(report, tmp_path / "r.json")
    md = (tmp_path / "r.md").read_text()
    assert "| errors | FAIL |" in md and "planted" in md
    assert json.loads((tmp_path / "r.json").read_text())["sections"]["bytes"]["ok"]


def test_budget_skips_late_sections(gc, stand_ins):
    results = gc.run_sections(stand_ins, ["torch"], budget_s=-1)
    assert results["torch"]["status"] == "skipped" and not results["torch"]["ok"]
