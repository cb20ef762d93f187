"""perf/gpu_check.py's sections as tests: ``gpu_check.py --twin`` on the CPU twin of CuPy
(tests/twin) at 1, 2 and 3 ranks, one test per (rank count, section).

Each rank count runs the script once (a module-scoped fixture: a subprocess, under
``geocomm.launch`` for 2 and 3 ranks, bounded by a timeout); the tests read its JSON
report. Without a GPU the twin runs the kernels (the project's .cu files compiled for
the host), the streams and NCCL (over MPI), so these are the GPU check's own
comparisons, not stand-ins; the twin's timings are host times, reported and not
enforced. The last tests check the script's plumbing without any CuPy: NumPy
standing in for CuPy and the C core for the kernels, with planted wrong bytes, the
timing must-shows on a device clock that is not the twin's, a raising section and
the time budget.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from gpu_helpers import on_ranks

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "perf"
SCRIPT = PERF / "gpu_check.py"
RANKS = (1, 2, 3)
#: what the twin runs, and what it skips (and must say why)
RAN = ("bytes", "errors", "nccl", "collectives", "geofp8", "timing")
SKIPPED = ("torch", "ddp", "fsdp", "backend")
#: one run of the script; the three take about 45 s each on two cores
RUN_TIMEOUT_S = 600


@dataclass
class Run:
    ranks: int
    returncode: int
    output: str
    report: dict[str, Any] | None
    out: Path
    seconds: float

    def section(self, name: str) -> dict[str, Any]:
        assert self.report is not None, f"no report; the run's output ends:\n{self.output[-4000:]}"
        return self.report["sections"][name]


@pytest.fixture(scope="module", params=RANKS, ids=lambda n: f"{n}rank")
def run(request, tmp_path_factory) -> Run:
    """``perf/gpu_check.py --twin`` on ``n`` ranks, once per rank count."""
    n = request.param
    folder = tmp_path_factory.mktemp(f"gpu_check_{n}rank")
    out = folder / "gpu_check.json"
    command = [sys.executable, "-P", str(SCRIPT), "--twin", "--out", str(out)]
    command = on_ranks(command, n, RUN_TIMEOUT_S)
    began = time.monotonic()
    proc = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 60, check=False
    )
    seconds = time.monotonic() - began
    report = json.loads(out.read_text()) if out.exists() else None
    print(f"gpu_check --twin on {n} rank(s): exit {proc.returncode} in {seconds:.1f} s")
    return Run(n, proc.returncode, proc.stdout + proc.stderr, report, out, seconds)


@pytest.mark.parametrize("section", RAN)
def test_section_passes(run, section):
    result = run.section(section)
    failures = result.get("failures", [])
    assert result["status"] == "ran", result
    assert result["ok"], (
        f"{section} on {run.ranks} rank(s): {len(failures)} failures:\n"
        + "\n".join(str(f)[:600] for f in failures[:20])
        + f"\n{result.get('error', '')}"
    )
    if run.ranks > 1:  # every rank reported, and passed
        assert [r["rank"] for r in result["per_rank"]] == list(range(run.ranks))
        assert all(r["ok"] for r in result["per_rank"]), result["per_rank"]


def test_skipped_sections_say_why(run):
    for name in SKIPPED:
        result = run.section(name)
        assert result["status"] == "skipped" and result["ok"], result
        assert result["reason"] == "needs a real GPU (the twin runs no torch CUDA tensors)"


def test_one_exit_status_and_one_report(run):
    """Exit 0 exactly when every section that ran passed; only rank 0 wrote."""
    assert run.report is not None, run.output[-4000:]
    assert run.returncode == (0 if run.report["ok"] else 1), run.output[-4000:]
    assert run.report["ok"] == all(s["ok"] for s in run.report["sections"].values())
    assert run.report["environment"]["ranks"] == run.ranks
    assert run.report["environment"].get("twin") is True
    assert sorted(p.name for p in run.out.parent.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    assert f"{run.ranks} rank(s)" in run.out.with_suffix(".md").read_text()


def test_collectives_span_the_ranks(run):
    """NCCL over every rank; each case compared on every rank, and all-reduce and
    all-gather results identical across the ranks."""
    assert run.section("nccl")["size"] == run.ranks
    rows = run.section("collectives")["rows"]
    public = [r for r in rows if "loopback" not in r["collective"]]
    assert len(public) == 3 * 3 * 13 + 3 * 13  # kinds x dtypes x codecs, allreduce in place
    assert len(rows) - len(public) == 2 * 12  # the loopback pipeline, on rank 0
    agreeing = [r for r in public if r["collective"] != "reduce_scatter"]
    if run.ranks > 1:
        assert all(r["ranks_agree"]["equal"] for r in agreeing)
        steps = [r for r in run.section("geofp8")["rows"] if "step" in r]
        assert steps and all(r["ranks_agree"]["equal"] for r in steps)
    else:
        assert not any("ranks_agree" in r for r in rows)


def test_unknown_format_check_is_fixed(run):
    """The errors section's unknown format is no format (format 7 is MXFP4, whose
    encode succeeds): the check passes on a correct build."""
    from geocomm.kernels import native

    if run.ranks != 1:
        pytest.skip("shown once")
    errors = run.section("errors")
    bad = errors["unknown_format"]
    assert bad not in native.FORMATS.values() and bad == max(native.FORMATS.values()) + 1
    rows = {r["check"]: r for r in errors["rows"]}
    assert rows[f"unknown format {bad} -> ValueError"]["ok"]
    assert native.FORMATS["mxfp4"] == 7  # what the old check passed as "unknown"
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    native.encode(7, x, 16, np.zeros(native.wire_size(7, 100, 16), np.uint8))
    with pytest.raises(ValueError):
        native.encode(bad, x, 16, np.zeros(200, np.uint8))


# ---------------------------------------------------------------------------
# the script's plumbing, without CuPy


def _load(name: str) -> types.ModuleType:
    """perf/<name>.py, imported as the script imports its siblings (perf/ on sys.path)."""
    if str(PERF) not in sys.path:
        sys.path.insert(0, str(PERF))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def gc():
    return _load("gpu_check")


def test_perf_files_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PERF.glob("*.py")}
    assert max(sizes.values()) <= 500, sizes


def test_help_works_without_cupy():
    proc = subprocess.run(
        [sys.executable, "-P", str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "--twin" in proc.stdout and "collectives" in proc.stdout


def test_without_twin_and_gpu_exits_2(tmp_path):
    if os.environ.get("GEOCOMM_TWIN") != "1":
        pytest.skip("a real GPU may be present")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GEOCOMM_TWIN")}
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "-P", str(SCRIPT), "--out", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 2 and "no GPU path" not in proc.stderr:
        pytest.skip("CuPy with a GPU is installed")
    assert proc.returncode == 2 and "no GPU path to check" in proc.stderr, proc.stderr
    assert not out.exists()


def test_block_list_covers_the_kernel_switches():
    from geocomm.kernels import cuda

    common = _load("gpu_check_common")
    blocks = set(common.FP8_BLOCKS)
    assert {0, cuda.TEAM_MAX, cuda.TEAM_MAX + 1, cuda.TILE, cuda.TILE + 1} <= blocks
    assert any(b > 2 * cuda.TILE for b in blocks)
    assert {n % 2 for n in common.ODD_SIZES} == {0, 1} and 0 in common.ODD_SIZES
    configs = common.configs()
    assert ("nvfp4", 0) in configs and ("bf16", 0) in configs
    assert {f for f, _ in configs} == {"e4m3", "e5m2", "nvfp4", "bf16"}
    gpu, twin = common.PROFILES["gpu"], common.PROFILES["twin"]
    assert twin.stage_size == gpu.stage_size
    assert twin.collective_n > 4 * twin.stage_size  # many stages


def test_value_diff_treats_any_nan_alike_and_names_the_first_mismatch():
    import ml_dtypes

    common = _load("gpu_check_common")
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        a = np.array([1.0, np.nan, -0.0, 2.0], dtype)
        b = a.copy()
        b.view(f"u{a.itemsize}")[1] ^= 1  # another NaN payload: still equal
        assert common.value_diff(a, b)["equal"] and common.digest(a) == common.digest(b)
        b[2] = 0.0  # -0.0 vs +0.0 differ in bits
        diff = common.value_diff(a, b)
        assert not diff["equal"] and diff["first"] == 2 and diff["mismatches"] == 1
        assert common.digest(a) != common.digest(b)
    assert not common.value_diff(np.zeros(2, np.float32), np.zeros(2, np.float16))["equal"]
    assert not common.byte_diff(np.zeros(3, np.uint8), np.zeros(4, np.uint8))["equal"]


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
    """NumPy in CuPy's clothes: what the timing and plumbing tests run on."""
    cuda_ns = types.SimpleNamespace(
        Stream=FakeStream,
        Event=FakeEvent,
        Device=lambda *a: FakeDevice(),
        get_current_stream=FakeStream,
        get_elapsed_time=lambda start, end: 1.0,
        runtime=types.SimpleNamespace(),
    )
    return types.SimpleNamespace(
        __version__="fake",
        asarray=lambda a, dtype=None: np.array(a, dtype=dtype),
        asnumpy=lambda a: np.array(a),
        full=np.full,
        zeros=np.zeros,
        empty=np.empty,
        empty_like=np.empty_like,
        concatenate=np.concatenate,
        arange=np.arange,
        copyto=np.copyto,
        uint8=np.uint8,
        int8=np.int8,
        int64=np.int64,
        uint32=np.uint32,
        float32=np.float32,
        float64=np.float64,
        random=types.SimpleNamespace(default_rng=np.random.default_rng),
        cuda=cuda_ns,
        RawKernel=lambda source, name: lambda grid, block, args: None,
    )


@pytest.fixture
def stand_ins(gc, monkeypatch):
    """A Context on fake CuPy whose 'NCCL' communicator is MPI, and the CUDA codec
    and batched kernels replaced by the C core (what the kernels must equal)."""
    from geocomm.engine import device as gpu_pipeline
    from geocomm.kernels import cuda, native

    def fmt_id(fmt):
        return native.FORMATS[fmt] if isinstance(fmt, str) else fmt

    monkeypatch.setattr(
        cuda,
        "encode",
        lambda fmt, x, block, wire, stream=None, **rounding: native.encode(
            fmt_id(fmt), x, block, wire, **rounding
        ),
    )
    monkeypatch.setattr(
        cuda,
        "decode",
        lambda fmt, wire, block, out, accumulate=False, stream=None: native.decode(
            fmt_id(fmt), wire, block, out, accumulate
        ),
    )
    monkeypatch.setattr(gpu_pipeline, "CudaKernels", gpu_pipeline.HostKernels)

    class StandInContext(gc.Context):
        def nccl(self):
            return self.mpi()

    return StandInContext(fake_cupy(), argparse.Namespace(seed=5))


def test_bytes_section_names_a_wrong_byte(stand_ins, monkeypatch):
    from geocomm.kernels import cuda, native

    gcb, common = _load("gpu_check_bytes"), _load("gpu_check_common")

    def off_by_one(fmt, x, block, wire, stream=None):
        native.encode(native.FORMATS[fmt], x, block, wire)
        if wire.size:
            wire[-1] ^= 1

    monkeypatch.setattr(cuda, "encode", off_by_one)
    result = gcb.check_bytes(
        stand_ins, [("e4m3", 128)], [("n=17", common.wide(np.random.default_rng(1), 17))]
    )
    assert not result["ok"]
    assert "e4m3 block=128 n=17" in result["failures"][0]
    assert result["rows"][0]["encode_vs_native"]["first"] == native.wire_size(1, 17, 128) - 1


def test_batched_check_names_a_wrong_byte(stand_ins, monkeypatch):
    from geocomm.engine import device as gpu_pipeline

    gcb, common = _load("gpu_check_bytes"), _load("gpu_check_common")

    class OffByOne(gpu_pipeline.HostKernels):
        def encode(self, fmt, x, seg, wire, amax, incoming=None, rounding_stream=0):
            super().encode(fmt, x, seg, wire, amax, incoming, rounding_stream)
            wire[-1] ^= 1

    monkeypatch.setattr(gpu_pipeline, "CudaKernels", OffByOne)
    rng = np.random.default_rng(5)
    row = gcb.check_batched(
        stand_ins.cp, "fp8", {"id": "fp8"}, common.wide(rng, 30_000), [common.wide(rng, 20_000)]
    )
    assert not row["ok"] and not row["encode"]["equal"] and row["decode"]["equal"]


def test_timing_section_reports_every_operation(gc, stand_ins):
    from geocomm.kernels import cuda, native

    timing = _load("gpu_check_timing")
    result = timing.check_timing(stand_ins, sizes_mib=(1,), calls=1)
    ops = [r["op"] for r in result["pipeline"]]
    assert ops == ["cupy copy", "NCCL all-reduce (fp32)", "geocomm fp8 pipeline"]
    assert result["pipeline"][0]["vs_copy"] == 1.0
    assert all(r["GBps"] > 0 and r["device_GBps"] > 0 for r in result["pipeline"])
    assert result["pipeline"][2]["stages"] == 1 and result["pipeline"][0]["stages"] is None
    # the fake device's events time every call alike (1 ms): the pipeline meets the
    # throughput must-show; its host time is a CPU pipeline's (MPI, the C core), far
    # above 30 us, and on a device that is not the twin that fails, and says so
    fp8 = result["pipeline"][2]
    assert fp8["vs_copy"] >= timing.MUST_SHOW_VS_COPY and fp8["host_s"] > timing.MUST_SHOW_HOST_S
    assert result["enforced"] and not result["ok"]
    assert result["failures"] == [
        f"fp8 pipeline at 1 MiB: {fp8['host_s'] * 1e6:.1f} us of host time per call "
        "(must be <= 30 us)"
    ]
    stage = result["stage_cost"]
    assert stage["stages"] == 8 and stage["model_stage_s"] is None  # MPI: a host backend
    report = {
        "ok": True,
        "seconds": 1.0,
        "environment": {"device": "fake"},
        "sections": {"timing": {**result, "status": "ran", "seconds": 1.0}},
    }
    md = gc.markdown(report)
    assert "| 1 | geocomm fp8 pipeline | 1 |" in md and "device GB/s" in md
    kernels = [(r["fmt"], r["block"], r["op"], r["rounding"]) for r in result["kernels"]]
    assert kernels == timing.kernel_cases()
    # every format the C core has, in both roundings, each with its least traffic counted
    # and held against the bar
    assert {f for f, _ in timing.KERNEL_FORMATS} == set(native.FORMATS)
    assert {f for f, _ in timing.STOCHASTIC_FORMATS} == set(native.FORMATS)
    n = timing.values_of(1)
    for r in result["kernels"]:
        wire = cuda.wire_size(r["fmt"], n, r["block"])
        extra = 4 * n if r["op"] == "accumulate" else 0
        assert r["traffic_bytes"] == 4 * n + wire + extra
        assert r["meets_bar"] == (r["vs_copy_traffic"] >= timing.KERNEL_BAR)
    assert "| e4m3 | 128 | encode | stochastic | 1 |" in md


@pytest.mark.parametrize(
    ("vs_copy", "host_us", "missed"),
    [(0.7, 30.0, 0), (0.69, 30.0, 1), (0.7, 30.5, 1), (0.5, 100.0, 2)],
)
def test_must_shows_hold_at_their_bars(vs_copy, host_us, missed):
    """Issue 38's bars: throughput >= 0.7 of the copy's, host <= 30 us per call; rows
    of other operations are never judged."""
    timing = _load("gpu_check_timing")
    rows = [
        {"op": "geocomm fp8 pipeline", "size_MiB": 64, "vs_copy": vs_copy, "host_s": host_us / 1e6},
        {"op": "NCCL all-reduce (fp32)", "size_MiB": 64, "vs_copy": 0.1, "host_s": 1.0},
    ]
    assert len(timing.must_show_failures(rows)) == missed


def test_timing_is_reported_not_enforced_on_the_twin(run):
    """The twin runs the timing section at its small size with host clocks: every row
    is there, the must-shows are listed as not enforced, and the section passes."""
    timing = run.section("timing")
    assert timing["ok"] and not timing["enforced"] and "not meaningful" in timing["note"]
    assert timing["device_clock"].startswith("the host clock")
    assert [r["op"] for r in timing["pipeline"]] == [
        "cupy copy",
        "NCCL all-reduce (fp32)",
        "geocomm fp8 pipeline",
    ]
    assert all(
        r["size_MiB"] == 1 and r["device_s"] > 0 and r["gated"] is None for r in timing["pipeline"]
    )
    assert timing["failures"] == [] and isinstance(timing["not_enforced"], list)
    assert "**Not enforced**" in run.out.with_suffix(".md").read_text()


def test_a_raising_section_does_not_stop_the_others(gc, stand_ins, monkeypatch, tmp_path):
    def broken(ctx):
        raise RuntimeError("planted")

    monkeypatch.setitem(gc.SECTIONS, "errors", broken)
    monkeypatch.setitem(gc.SECTIONS, "bytes", lambda ctx: {"ok": True, "rows": [], "failures": []})
    results = gc.run_sections(stand_ins, ["errors", "bytes", "torch"], budget_s=600)
    assert results["errors"]["status"] == "failed" and not results["errors"]["ok"]
    assert "planted" in results["errors"]["error"]
    assert results["bytes"]["ok"]
    # torch without CUDA (the CPU build here) skips with a reason, and passes
    assert results["torch"]["ok"] and results["torch"]["status"] in ("skipped", "ran")
    report = {"ok": False, "seconds": 1.0, "environment": {"device": "fake"}, "sections": results}
    gc.write_report(report, tmp_path / "r.json")
    md = (tmp_path / "r.md").read_text()
    assert "| errors | FAIL |" in md and "planted" in md
    assert json.loads((tmp_path / "r.json").read_text())["sections"]["bytes"]["ok"]


def test_budget_skips_late_sections(gc, stand_ins):
    results = gc.run_sections(stand_ins, ["torch"], budget_s=-1)
    assert results["torch"]["status"] == "skipped" and not results["torch"]["ok"]
