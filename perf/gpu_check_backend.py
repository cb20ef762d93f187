"""perf/gpu_check.py's ``backend`` section: the geocomm torch.distributed backend on
CUDA tensors (its NCCL route, issue #21). Needs a real GPU; ``--twin`` skips it, and
tests/test_gpu_check_ddp.py runs its cases on the CPU through the gloo route.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from gpu_check_common import all_equal, value_diff
from gpu_check_device import _torch_bits, one_rank_nccl_section

# ---------------------------------------------------------------------------
# the torch.distributed backend on CUDA tensors


def check_backend(ctx: Any, n: int = 300_001) -> dict[str, Any]:
    """The ``geocomm`` torch.distributed backend on CUDA tensors, one rank (its
    NCCL route, issue #21): see :func:`backend_rows`."""
    return one_rank_nccl_section(
        ctx,
        "a 1-rank process group",
        "case",
        lambda d: backend_rows(d, ctx.mpi(), ctx.args.seed, n),
    )


def backend_rows(device: Any, mpi: Any, seed: int, n: int) -> list[dict[str, Any]]:
    """On a 1-rank group made with ``new_group(backend="cpu:geocomm,cuda:geocomm")``
    (the device-qualified name; the default group is NCCL): an fp32 CUDA
    ``all_reduce`` (SUM) and ``reduce_scatter_tensor`` of ``n`` values are
    compressed and equal geocomm's fp8 all-reduce / reduce-scatter of the same
    values on the CPU over ``mpi``, bit for bit; an int32 SUM, a MAX and a tensor
    below ``min_numel`` go exact (on one rank: unchanged); DDP with no hook on the
    group trains a CUDA model step, compressed (fp8's error, not zero). With a CPU
    ``device`` (and a gloo default group) the same cases take the gloo route: a
    dry run of this check without a GPU."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm
    from geocomm.adapters.torch import backend as tb

    torch.manual_seed(seed % 2**31)
    tb.configure(codec="fp8", min_numel=4096)
    try:
        group = dist.new_group(backend="cpu:geocomm,cuda:geocomm")
    finally:
        tb.reset_configuration()
    stage = tb.configure(group).stage_size

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows: list[dict[str, Any]] = []

    def case(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        row: dict[str, Any] = {"case": name}
        try:
            row.update(fn())
            row["ok"] = all_equal(row)
        except Exception:
            row.update(ok=False, error=traceback.format_exc())
        rows.append(row)

    def compressed(kind: str) -> dict[str, Any]:
        x = torch.randn(n, device=device) * torch.linspace(0.01, 10.0, n, device=device)
        host = x.cpu().numpy().copy()  # on a CPU device .cpu() is x itself
        before = tb.stats(group).compressed
        if kind == "all_reduce":
            dist.all_reduce(x, group=group)
            got = x
            want = geocomm.allreduce(host, codec="fp8", op="sum", comm=mpi, stage_size=stage)
        else:
            got = torch.empty_like(x)
            dist.reduce_scatter_tensor(got, x, group=group)
            want = geocomm.reduce_scatter(host, codec="fp8", op="sum", comm=mpi, stage_size=stage)
        sync()
        row = {
            "vs_cpu_mpi": value_diff(_torch_bits(got), np.asarray(want)),
            "counted_compressed": {"equal": tb.stats(group).compressed == before + 1},
        }
        if kind == "all_reduce":  # a 1-rank reduce-scatter keeps its own shard as it is
            row["changed_by_the_codec"] = {"equal": not np.array_equal(_torch_bits(got), host)}
        return row

    def exact() -> dict[str, Any]:
        ints = torch.arange(n, device=device, dtype=torch.int32)
        floats = torch.randn(n, device=device)
        small = torch.randn(1000, device=device)
        want = [t.cpu().numpy().copy() for t in (ints, floats, small)]
        before = tb.stats(group).compressed
        dist.all_reduce(ints, group=group)
        dist.all_reduce(floats, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(small, group=group)
        sync()
        got = [_torch_bits(t) for t in (ints, floats, small)]
        row = {f"{name}_unchanged": value_diff(g, w) for name, g, w in
               zip(("int32_sum", "max", "small"), got, want, strict=True)}  # fmt: skip
        row["none_compressed"] = {"equal": tb.stats(group).compressed == before}
        return row

    def ddp() -> dict[str, Any]:
        torch.manual_seed(seed % 2**31)
        net = torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 16)
        ).to(device)
        plain = [p.detach().clone() for p in net.parameters()]
        reference = torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 16)
        ).to(device)
        with torch.no_grad():
            for p, q in zip(reference.parameters(), plain, strict=True):
                p.copy_(q)
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(net, process_group=group, device_ids=ids, bucket_cap_mb=1)
        x = torch.randn(256, 512, device=device)
        before = tb.stats(group).compressed
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        sync()
        got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        rel = float((got - want).norm() / want.norm())
        return {
            "buckets_compressed": {"equal": tb.stats(group).compressed > before},
            # fp8 E4M3 with 128-value blocks: a relative error of a few percent, not 0
            "fp8_error": {"equal": 0.0 < rel < 0.06, "relative_error": rel},
        }

    case("all_reduce", lambda: compressed("all_reduce"))
    case("reduce_scatter_tensor", lambda: compressed("reduce_scatter"))
    case("exact calls", exact)
    case("ddp without a hook", ddp)
    dist.destroy_process_group(group)
    return rows
