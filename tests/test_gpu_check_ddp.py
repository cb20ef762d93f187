"""perf/gpu_check.py's ``ddp``, ``fsdp`` and ``backend`` sections on the CPU, with a
1-rank gloo group standing in for NCCL, so a GPU run only has to exercise the GPU
itself: ``ddp``'s comparison (every bucket the hook reduced == geocomm.allreduce of
a copy of it over MPI, bit for bit, one collective per bucket, fp32/fp16/bf16), the
README's DDP and FSDP2 examples compressed against uncompressed
(perf/gpu_check_examples.py: every call == the CPU over MPI, the exact calls exact,
every value within fp8's all-reduce bound, the losses within fp8's relative bound),
with planted faults that those comparisons must catch, and ``backend``'s cases on
the geocomm torch.distributed backend (compressed all-reduce and reduce-scatter ==
geocomm's over MPI, exact calls unchanged, DDP with no hook at fp8's error) through
its gloo route."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

PERF = Path(__file__).resolve().parents[1] / "perf"
SCRIPT = PERF / "gpu_check_device.py"  # the sections that need a real GPU


@pytest.fixture
def single_rank_gloo():
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sections(script: Path = SCRIPT):
    """perf/<script> loaded as a module (its siblings importable by name)."""
    if str(PERF) not in sys.path:  # its siblings gpu_check_common, gpu_check_device
        sys.path.insert(0, str(PERF))
    spec = importlib.util.spec_from_file_location(f"{script.stem}_under_test", script)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    return gc


def test_ddp_section_on_cpu(single_rank_gloo):
    gc = _sections()
    from geocomm.comm.mpi import MPICommunicator

    rows = gc.ddp_rows(torch.device("cpu"), MPICommunicator(), seed=5, steps=2)
    assert [r["dtype"] for r in rows] == ["torch.float32", "torch.float16", "torch.bfloat16"]
    for row in rows:
        assert row["ok"], row
        assert row["buckets"] >= 3  # DDP's first single bucket, then its rebuilt ones


def test_backend_section_on_cpu(single_rank_gloo):
    gc = _sections(PERF / "gpu_check_backend.py")
    from geocomm.comm.mpi import MPICommunicator

    rows = gc.backend_rows(torch.device("cpu"), MPICommunicator(), seed=5, n=300_001)
    cases = ["all_reduce", "reduce_scatter_tensor", "exact calls", "ddp without a hook"]
    assert [r["case"] for r in rows] == cases
    for row in rows:
        assert row["ok"], row


#: the README examples' rows hold these comparisons, each {"equal": ...}
EXAMPLE_CHECKS = ("vs_cpu_mpi", "exact_calls_exact", "within_fp8_bound", "compressed", "losses")


def test_readme_ddp_example_on_cpu(single_rank_gloo):
    ex = _sections(PERF / "gpu_check_examples.py")
    from geocomm.comm.mpi import MPICommunicator

    row = ex.ddp_example_row(torch.device("cpu"), MPICommunicator())
    assert row["ok"], row
    assert all(row[k]["equal"] for k in EXAMPLE_CHECKS)
    # one bucket a step (bucket_cap_mb=4 holds the 0.5M parameters), 20 steps
    assert row["calls"] == ex.STEPS
    assert row["losses"]["largest_relative_gap"] <= row["losses"]["limit"] == 2 * 2.0**-4


def test_readme_fsdp_example_on_cpu(single_rank_gloo):
    ex = _sections(PERF / "gpu_check_examples.py")
    from geocomm.comm.mpi import MPICommunicator

    [row] = ex.fsdp_rows(torch.device("cpu"), MPICommunicator())
    assert row["ok"], row
    assert all(row[k]["equal"] for k in EXAMPLE_CHECKS)
    # one compressed all-reduce hook per Linear (the root module owns no parameter)
    assert row["hooks"] == 3 and row["calls"] == 3 * ex.STEPS
    report = _sections(PERF / "gpu_check_report.py")
    table = report.example_lines([row])
    assert table[1] == "## train_fsdp.py on the device (1 rank, fp8 against uncompressed)"
    assert table[-1].startswith(f"| {3 * ex.STEPS} | yes | yes | yes | ")


@pytest.mark.parametrize(("where", "caught"), [(0, "vs_cpu_mpi"), (-1, "exact_calls_exact")])
def test_fsdp_rows_catch_a_wrong_value(single_rank_gloo, monkeypatch, where, caught):
    """A reducer that flips the lowest bit of one value after reducing: the first
    (the first weight's, compressed) breaks the equality with the CPU over MPI; the
    last (the last bias's, sent exact) also breaks the exact calls' equality."""
    ex = _sections(PERF / "gpu_check_examples.py")
    from geocomm.adapters.torch import grads
    from geocomm.comm.mpi import MPICommunicator

    reduce = grads.GradReducer.allreduce

    def flipped(self, layout, buffer, *args, **kwargs):
        stats = reduce(self, layout, buffer, *args, **kwargs)
        buffer.view(torch.int32)[where] ^= 1
        return stats

    monkeypatch.setattr(grads.GradReducer, "allreduce", flipped)
    [row] = ex.fsdp_rows(torch.device("cpu"), MPICommunicator(), steps=2)
    assert not row["ok"] and not row[caught]["equal"] and not row["vs_cpu_mpi"]["equal"]
    assert row["exact_calls_exact"]["equal"] == (caught != "exact_calls_exact")


def test_loss_check_holds_at_its_bound():
    """2U relative per step (2^-3 for E4M3), and both runs must train."""
    ex = _sections(PERF / "gpu_check_examples.py")
    plain = [2.0, 1.5, 1.0]
    at_limit = [2.0, 1.5 * (1 + 2.0**-3), 1.0]
    assert ex.loss_check(at_limit, plain)["equal"]
    assert not ex.loss_check([2.0, 1.5 * (1 + 2.0**-2), 1.0], plain)["equal"]
    assert not ex.loss_check([2.0, 1.5, 2.0], [2.0, 1.5, 2.0])["equal"]  # no training
