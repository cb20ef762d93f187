"""perf/gpu_check.py's torch sections' parts: ``torch`` (torch CUDA tensors through
geocomm over NCCL), the 1-rank NCCL group the torch.distributed sections run on,
and the ``ddp`` section's bucket check (geocomm's DDP hook on CUDA gradients); the
section ``ddp`` and ``fsdp`` with docs/torch.md's examples are in gpu_check_examples.py,
``backend`` in gpu_check_backend.py, ``timing`` in gpu_check_timing.py. The CuPy twin
runs no torch CUDA tensors: ``--twin`` skips ``torch``, ``ddp``, ``fsdp`` and
``backend``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from gpu_check_common import all_equal, gradient, value_diff

# ---------------------------------------------------------------------------
# torch CUDA round trip


def _torch_bits(t: Any) -> np.ndarray:
    """The host values of a torch tensor as a NumPy array of the same dtype
    (bfloat16 through its int16 bits)."""
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def torch_cuda_missing() -> dict[str, Any] | None:
    """The "skipped" result when torch or its CUDA device is missing, else None."""
    try:
        import torch
    except ImportError as exc:
        return {"ok": True, "status": "skipped", "reason": f"torch is not installed ({exc})"}
    if not torch.cuda.is_available():
        return {
            "ok": True,
            "status": "skipped",
            "reason": f"torch {torch.__version__} has no CUDA device (a CPU build?)",
        }
    return None


def check_torch(ctx: Any, n: int = 300_001, stage_size: int = 65_536) -> dict[str, Any]:
    if (missing := torch_cuda_missing()) is not None:
        return missing
    import torch

    import geocomm

    nccl, mpi = ctx.nccl(), ctx.mpi()
    device = torch.device("cuda", ctx.cp.cuda.Device().id)
    values = torch.from_numpy(gradient(np.random.default_rng([ctx.args.seed, 7]), (n,)))
    busy = torch.randn(4096, 4096, device=device)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for in_place in (False, True):
            row: dict[str, Any] = {"dtype": str(dtype), "in_place": in_place}
            try:
                host = values.to(dtype)
                want = geocomm.allreduce(
                    host.clone(), codec="fp8", op="avg", comm=mpi, stage_size=stage_size
                )
                staged = host.to(device)
                torch.cuda.synchronize(device)
                # the input is written behind a long kernel on torch's current
                # stream: geocomm must read it in that stream's order
                for _ in range(4):
                    busy = busy @ busy / 64.0  # entries keep variance ~1
                x = staged.clone()
                out = x if in_place else None
                result = geocomm.allreduce(
                    x, codec="fp8", op="avg", comm=nccl, out=out, stage_size=stage_size
                )
                # a consumer on a side stream waits for the current stream only
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    consumed = result * 1
                side.synchronize()
                row["kind"] = {
                    "equal": isinstance(result, torch.Tensor)
                    and result.dtype == dtype
                    and result.device == device
                    and result.shape == host.shape
                }
                if in_place:
                    row["same_storage"] = {"equal": result is x}
                row["vs_cpu_mpi"] = value_diff(_torch_bits(consumed), _torch_bits(want))
                row["ok"] = all_equal(row)
            except Exception:
                row.update(ok=False, error=traceback.format_exc())
            rows.append(row)
    return {
        "ok": all(r["ok"] for r in rows),
        "status": "ran",
        "rows": rows,
        "failures": [
            f"{r['dtype']} {'in place' if r['in_place'] else 'new result'}: "
            f"{ {k: v for k, v in r.items() if k not in ('dtype', 'in_place')} }"
            for r in rows
            if not r["ok"]
        ],
    }


# ---------------------------------------------------------------------------
# the DDP hook on CUDA gradients


def one_rank_nccl_section(
    ctx: Any, what: str, label: str, rows_of: Callable[[Any], list[dict[str, Any]]]
) -> dict[str, Any]:
    """A section that runs on a 1-rank NCCL default group (``what`` names it in the
    skip reason): ``rows_of(device)`` gives its rows, each with ``ok`` and a ``label``
    field that names it among the failures."""
    if (missing := torch_cuda_missing()) is not None:
        return missing
    if ctx.size > 1:
        return {
            "ok": True,
            "status": "skipped",
            "reason": f"{what}: run on one rank (the other sections span the ranks)",
        }
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", ctx.cp.cuda.Device().id)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = rows_of(device)
    return {
        "ok": all(r["ok"] for r in rows),
        "status": "ran",
        "rows": rows,
        "failures": [
            f"{r[label]}: { {k: v for k, v in r.items() if k != label} }"
            for r in rows
            if not r["ok"]
        ],
    }


def mlp(outputs: int) -> Any:
    """A 512-1024-1024-``outputs`` GELU MLP (ddp_rows'; docs/torch.md's FSDP2 example's
    with 10 outputs), made from torch's current seed."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.GELU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.GELU(),
        torch.nn.Linear(1024, outputs),
    )


def one_rank_reference(layout: Any, values: Any, mpi: Any, stage_size: int | None) -> Any:
    """What one rank's reduction of the flat CPU tensor ``values`` (one row of the
    adapters' ``layout``, geocomm.adapters.torch.grads) must give, flat: its
    compressed tensors geocomm's fp8 average of them on the CPU over ``mpi``, its
    plain tensors unchanged (the exact average over one rank)."""
    import geocomm

    rows = values.reshape(1, -1)
    want = rows.clone()
    group = layout.compressed
    if group is not None:
        total = geocomm.allreduce(
            group.take(rows), codec="fp8", op="avg", comm=mpi, stage_size=stage_size
        )
        group.put(want, total)
    return want.view(-1)


def ddp_rows(device: Any, mpi: Any, seed: int, steps: int) -> list[dict[str, Any]]:
    """For fp32, fp16 and bf16 models on ``device`` (torch.distributed initialised
    with one rank): each bucket, copied as DDP hands it over (on the gradients'
    stream, behind a long kernel), is reduced by the hook's worker on its own
    stream; the gradients DDP writes back must equal geocomm.allreduce of the copy
    on the CPU over ``mpi``, bit for bit, with one collective per bucket."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm.adapters.torch as gt

    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        row: dict[str, Any] = {"dtype": str(dtype)}
        state = None
        try:
            torch.manual_seed(seed % 2**31)
            net = mlp(16).to(device, dtype)
            model = DDP(
                net, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=1
            )
            state = gt.GeocommHookState(net, codec="fp8")
            seen: list[tuple[Any, list[Any], int]] = []

            def hook(state, bucket, seen=seen):  # no annotation: DDP checks it
                seen.append((bucket.buffer().clone(), bucket.parameters(), bucket.index()))
                return gt.geocomm_hook(state, bucket)

            model.register_comm_hook(state, hook)
            busy = torch.randn(1024, 1024, device=device)
            diffs, buckets = [], 0
            for _ in range(steps):
                seen.clear()
                for _ in range(4):  # the gradients come behind a long kernel
                    busy = busy @ busy / 32.0  # entries keep variance ~1
                x = torch.randn(256, 512, device=device, dtype=dtype)
                model(x).float().pow(2).mean().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                for buffer, params, index in seen:
                    # the hook sends a bucket's tensors in its layout's order (module order)
                    want = one_rank_reference(
                        state.layout(params, index), buffer.cpu(), mpi, state.reducer.stage_size
                    )
                    got = torch.cat([p.grad.reshape(-1) for p in params])
                    diffs.append(value_diff(_torch_bits(got), _torch_bits(want)))
                buckets += len(seen)
                model.zero_grad()
            row["buckets"] = buckets
            row["vs_cpu_mpi"] = next((d for d in diffs if not d["equal"]), diffs[0])
            row["one_collective_per_bucket"] = {
                "equal": all(
                    b.collectives == 1 for step in state.telemetry.history for b in step.buckets
                )
            }
            row["ok"] = all_equal(row)
        except Exception:
            row.update(ok=False, error=traceback.format_exc())
        finally:
            if state is not None:
                state.close()
        rows.append(row)
    return rows
