"""perf/gpu_timing.py (the per-codec timing table) on the CPU twin of CuPy, at 1 and 2
ranks: every row and column is there, and the error column is bounded.

The twin's clocks are the host's, so the times are only required to be there and
positive, with the table saying they are not meaningful. The errors are real: the
twin runs the project's own kernels on the script's inputs, which the test draws
again (gpu_check_common.gradient, seeded per rank), so each codec's relative error
must lie within its derived bound for those inputs (geocomm.codecs.bounds):
||allreduce_bound|| / ||exact|| for the element-wise codecs (|error| <= bound in
every element gives the norms' inequality), transformed_bound / ||exact|| for
GeoFP8, and for the exact sums (geocomm "none", NCCL's fp32 all-reduce) the fp32
additions' 2 N 2^-24 sum |x_i|.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import on_ranks

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "perf"
SCRIPT = PERF / "gpu_timing.py"
CODECS = (
    "none", "bf16", "fp8", "nvfp4", "nvfp4-sr", "mxfp8", "mxfp4",
    "geofp8", "geofp8-steady", "geofp8-stepped",
)  # fmt: skip
SEED = 20261129  # the script's default
TIMEOUT_S = 600  # one run takes about 20 s per rank on two cores


def _perf(name: str):
    if str(PERF) not in sys.path:
        sys.path.insert(0, str(PERF))
    return importlib.import_module(name)


@pytest.fixture(scope="module", params=(1, 2), ids=lambda n: f"{n}rank")
def table(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"gpu_timing_{n}rank") / "gpu_timing.json"
    command = [sys.executable, "-P", str(SCRIPT), "--twin", "--out", str(out)]
    command = on_ranks(command, n, TIMEOUT_S)
    done = subprocess.run(
        command, cwd=out.parent, capture_output=True, text=True, timeout=TIMEOUT_S + 60, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return n, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_every_row_and_column(table):
    n, result, md = table
    ops = ["device copy", "NCCL all-reduce (fp32)", *(f"geocomm {c}" for c in CODECS)]
    assert [r["op"] for r in result["rows"]] == ops
    assert result["environment"]["ranks"] == n and not result["meaningful"]
    for row in result["rows"]:
        assert row["size_MiB"] == 1 and row["calls"] == 2
        assert min(row["wall_s"], row["host_s"], row["device_s"]) > 0, row
    copy, plain = result["rows"][:2]
    assert copy["vs_copy"] == 1.0 and plain["vs_nccl"] == 1.0
    yard = result["yardsticks"]
    assert yard["copy_traffic_GBps"] == pytest.approx(2 * copy["device_GBps"])
    assert yard["nccl_fp32_GBps"] == plain["device_GBps"]
    assert "**Not meaningful**" in md and "Yardsticks, measured in this run" in md
    assert f"-n {n}" in result["command"] if n > 1 else "gpu_timing.py --twin" in result["command"]


def test_kernel_rows_cover_every_format(table):
    _, result, _ = table
    timing = _perf("gpu_check_timing")
    got = [(r["fmt"], r["block"], r["op"], r["rounding"]) for r in result["kernels"]]
    assert got == timing.kernel_cases()
    assert all(r["vs_copy_traffic"] > 0 for r in result["kernels"])


def test_first_calls_of_new_signatures_are_timed(table):
    """The first-call rows time first calls: each trial's signature is new (one row
    fewer than the table's matrix, and for GeoFP8 a new key)."""
    _, result, md = table
    script = _perf("gpu_timing")
    rows = result["first_calls"]
    assert [r["op"] for r in rows] == [f"geocomm {c}" for c in script.FIRST_CALL_CODECS]
    steady = {r["op"]: r["host_s"] for r in result["rows"]}
    steady["geocomm geofp8"] = steady["geocomm geofp8-steady"]  # without its power steps
    for r in rows:
        assert r["trials"] == script.FIRST_CALL_TRIALS and r["size_MiB"] == 1
        assert r["second_call_host_s"] > 0, r
        # a first call plans its signature and runs every kernel eagerly, where a steady
        # call of the same codec replays one graph: it takes the host longer (3-6x on
        # the twin)
        assert r["first_call_host_s"] > steady[r["op"]], (r, steady[r["op"]])
    assert result["first_call_target_s"] == 300e-6
    assert "| 1 | geocomm fp8 |" in md and "target for the first: <= 300 us" in md


def test_errors_within_the_derived_bounds(table):
    import geocomm
    from geocomm.codecs.bounds import FP32_UNIT, allreduce_bound, transformed_bound

    n, result, _ = table
    common, script = _perf("gpu_check_common"), _perf("gpu_timing")
    rows = (1 << 20) // 4 // script.COLUMNS
    inputs = [
        common.gradient(np.random.default_rng([SEED, r]), (rows, script.COLUMNS)).astype(np.float64)
        for r in range(n)
    ]
    exact = np.sum(inputs, axis=0)
    norm = float(np.linalg.norm(exact))
    summed = 2 * n * FP32_UNIT * float(np.linalg.norm(np.sum(np.abs(inputs), axis=0)))
    errors = {r["op"]: r.get("rel_error") for r in result["rows"]}
    assert errors["device copy"] is None
    assert errors["NCCL all-reduce (fp32)"] <= summed / norm
    assert errors["geocomm none"] <= summed / norm
    for codec in CODECS[1:]:
        c = geocomm.get_codec(script.codec_spec(codec))
        if codec.startswith("geofp8"):
            bound = transformed_bound(inputs, c)
        else:
            bound = float(np.linalg.norm(allreduce_bound(inputs, c)))
        assert 0 < errors[f"geocomm {codec}"] <= bound / norm, codec  # compressed, bounded
        row = next(r for r in result["rows"] if r["op"] == f"geocomm {codec}")
        assert row["wire_ratio"] == 4 * exact.size / c.wire_size(exact.size)
