"""perf/gpu_check.py's ``ddp`` and ``backend`` sections (perf/gpu_check_device.py)
on the CPU, with a 1-rank gloo group standing in for NCCL, so a GPU run only has to
exercise the GPU itself: ``ddp``'s comparison (every bucket the hook reduced ==
geocomm.allreduce of a copy of it over MPI, bit for bit, one collective per bucket,
fp32/fp16/bf16), and ``backend``'s cases on the geocomm torch.distributed backend
(compressed all-reduce and reduce-scatter == geocomm's over MPI, exact calls
unchanged, DDP with no hook at fp8's error) through its gloo route."""

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
