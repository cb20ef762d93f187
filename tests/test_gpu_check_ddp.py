"""perf/gpu_check.py's ``ddp`` section (perf/gpu_check_device.py) on the CPU: the
same comparison (every bucket the hook reduced == geocomm.allreduce of a copy of it
over MPI, bit for bit, one collective per bucket, fp32/fp16/bf16) with a 1-rank gloo
group standing in for NCCL, so a GPU run only has to exercise the GPU itself."""

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


def test_ddp_section_on_cpu(single_rank_gloo):
    if str(PERF) not in sys.path:  # its sibling gpu_check_common
        sys.path.insert(0, str(PERF))
    spec = importlib.util.spec_from_file_location("gpu_check_ddp_under_test", SCRIPT)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    from geocomm.comm.mpi import MPICommunicator

    rows = gc.ddp_rows(torch.device("cpu"), MPICommunicator(), seed=5, steps=2)
    assert [r["dtype"] for r in rows] == ["torch.float32", "torch.float16", "torch.bfloat16"]
    for row in rows:
        assert row["ok"], row
        assert row["buckets"] >= 3  # DDP's first single bucket, then its rebuilt ones
