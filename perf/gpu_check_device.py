"""perf/gpu_check.py's sections that need a real GPU: ``torch`` (torch CUDA tensors
through geocomm over NCCL), ``timing`` (device time of the pipeline, NCCL and a copy;
the must-show of issue #14) and ``ddp`` (geocomm's DDP hook on CUDA gradients);
``backend`` is in gpu_check_backend.py. The CuPy twin runs no torch CUDA tensors
and measures no device time: ``--twin`` skips them.
"""

from __future__ import annotations

import functools
import time
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

# ---------------------------------------------------------------------------
# timing


def median_seconds(ctx: Any, op: Callable[[], Any], repeats: int) -> float:
    """Median wall time of op() between device synchronizations: what a caller that
    waits for the result sees, host overhead included."""
    for _ in range(2):
        op()
    ctx.sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


#: Holds a stream for a number of clock cycles (gpu_seconds queues work behind it).
SPIN_SOURCE = r"""
extern "C" __global__ void gc_spin(long long cycles)
{
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


def gpu_seconds(ctx: Any, op: Callable[[], Any], repeats: int) -> tuple[float, bool]:
    """(device seconds per call of op(), whether the host was out of the way).

    The calls are queued behind a kernel that holds the current stream for twice
    as long as the host takes to queue them, and timed by events on that stream
    around them: what the device spends on the work itself (kernels, transfers and
    the gaps between them), not Python's launch overhead. The second value is False
    if the hold ended before the host had queued every call (then host time leaked
    in). Work that waits on the host inside a call could not be queued ahead, so
    this also shows that a call does not.
    """
    cp = ctx.cp
    op()
    ctx.sync()
    began = time.perf_counter()
    for _ in range(repeats):
        op()
    enqueue = time.perf_counter() - began
    ctx.sync()
    try:
        clock_hz = 1e3 * cp.cuda.Device().attributes["ClockRate"]  # kHz
    except Exception:  # an attribute this CUDA no longer reports: assume 2 GHz
        clock_hz = 2e9
    spin = cp.RawKernel(SPIN_SOURCE, "gc_spin")
    start, end = cp.cuda.Event(), cp.cuda.Event()
    spin((1,), (1,), (np.int64((2 * enqueue + 0.02) * clock_hz),))
    start.record()
    for _ in range(repeats):
        op()
    gated = not start.done
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats, gated


#: The must-show of issue #14: the fp8 all-reduce's codec throughput (device time)
#: reaches this share of the device's copy bandwidth.
MUST_SHOW_VS_COPY = 0.5


def time_pipeline(ctx: Any, size_mib: int, repeats: int) -> list[dict[str, Any]]:
    """Copy, plain NCCL all-reduce and the batched fp8 pipeline on ``size_mib`` of fp32.

    GB/s is the algorithm bandwidth: tensor bytes / time (for the copy that is
    half its read + write traffic). ``seconds``/``GBps``: wall time per call,
    host included; ``gpu_seconds``/``gpu_GBps``: device time per call
    (:func:`gpu_seconds`); ``vs_copy``: gpu_GBps over the copy's: on one rank the
    pipeline moves nothing over a link, so this is its codec throughput against
    the device's copy bandwidth. ``stages``: the pipeline stages the backend's
    model chose (geocomm.engine.costs).
    """
    import geocomm
    from geocomm.engine.layout import Pieces, stage_size

    cp, nccl = ctx.cp, ctx.nccl()
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(1).standard_normal(n, dtype=cp.float32)
    y = cp.empty_like(x)
    stage = stage_size(nccl.backend, n, nccl.size)
    ops = {
        "cupy copy": (lambda: cp.copyto(y, x), None),
        "NCCL all-reduce (fp32)": (lambda: nccl.allreduce(x, y, "sum"), None),
        "geocomm fp8 pipeline": (
            lambda: geocomm.allreduce(x, codec="fp8", out=y, comm=nccl),
            Pieces.cut(n, nccl.size, stage).stages,
        ),
    }
    rows = []
    for name, (op, stages) in ops.items():
        seconds = median_seconds(ctx, op, repeats)
        device, gated = gpu_seconds(ctx, op, repeats)
        rows.append(
            {
                "size_MiB": size_mib,
                "op": name,
                "stages": stages,
                "seconds": seconds,
                "GBps": x.nbytes / seconds / 1e9,
                "gpu_seconds": device,
                "gpu_GBps": x.nbytes / device / 1e9,
                "host_out_of_the_way": gated,
            }
        )
    copy = rows[0]["gpu_GBps"]
    for row in rows:
        row["vs_copy"] = row["gpu_GBps"] / copy
    return rows


def time_stage_cost(
    ctx: Any, size_mib: int = 64, stages: int = 8, repeats: int = 10
) -> dict[str, Any]:
    """The cost of one pipeline stage, as the backend model assumes it (``stage_s``):
    the fp8 all-reduce's wall time in ``stages`` stages against one stage."""
    import geocomm
    from geocomm.engine import costs as backends

    cp, nccl = ctx.cp, ctx.nccl()
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(3).standard_normal(n, dtype=cp.float32)
    y = cp.empty_like(x)
    times = [
        median_seconds(
            ctx,
            lambda c=c: geocomm.allreduce(x, codec="fp8", out=y, comm=nccl, stage_size=c),
            repeats,
        )
        for c in (n, -(-n // stages))
    ]
    profile = backends.profile(nccl.backend)
    return {
        "size_MiB": size_mib,
        "stages": stages,
        "one_stage_s": times[0],
        "many_stages_s": times[1],
        "stage_s": (times[1] - times[0]) / (stages - 1),
        "model_stage_s": profile.stage_s if profile else None,
    }


def time_kernels(ctx: Any, size_mib: int, repeats: int) -> list[dict[str, Any]]:
    """Encode, decode and decode+accumulate alone (CUDA events on one stream)."""
    from geocomm.kernels import cuda

    cp = ctx.cp
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(2).standard_normal(n, dtype=cp.float32)
    out = cp.zeros(n, cp.float32)
    rows = []
    for fmt, block in (("e4m3", 128), ("e4m3", 0), ("e5m2", 128), ("nvfp4", 0), ("bf16", 0)):
        wire = cp.empty(cuda.wire_size(fmt, n, block), cp.uint8)
        ops = {
            "encode": functools.partial(cuda.encode, fmt, x, block, wire),
            "decode": functools.partial(cuda.decode, fmt, wire, block, out),
            "accumulate": functools.partial(cuda.decode, fmt, wire, block, out, accumulate=True),
        }
        for name, op in ops.items():
            for _ in range(3):
                op()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(repeats):
                op()
            end.record()
            end.synchronize()
            seconds = cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats
            rows.append(
                {
                    "fmt": fmt,
                    "block": block,
                    "op": name,
                    "seconds": seconds,
                    "fp32_GBps": x.nbytes / seconds / 1e9,
                }
            )
    return rows


def check_timing(
    ctx: Any, sizes_mib: tuple[int, ...] = (64, 256), repeats: int = 10
) -> dict[str, Any]:
    """Timings, and the issue's must-show: the fp8 pipeline's codec throughput reaches
    MUST_SHOW_VS_COPY of the copy bandwidth at every size (a failure otherwise)."""
    pipeline = [row for size in sizes_mib for row in time_pipeline(ctx, size, repeats)]
    kernels = time_kernels(ctx, max(sizes_mib), 2 * repeats)
    stage = time_stage_cost(ctx, min(sizes_mib), repeats=repeats)
    failures = [
        f"fp8 pipeline at {r['size_MiB']} MiB: codec throughput {r['vs_copy']:.2f} of "
        f"the copy bandwidth (must be >= {MUST_SHOW_VS_COPY})"
        for r in pipeline
        if r["op"] == "geocomm fp8 pipeline" and r["vs_copy"] < MUST_SHOW_VS_COPY
    ]
    return {
        "ok": not failures,
        "pipeline": pipeline,
        "kernels": kernels,
        "stage_cost": stage,
        "failures": failures,
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


def check_ddp(ctx: Any, steps: int = 3) -> dict[str, Any]:
    """geocomm_hook in a 1-rank DDP over a NCCL process group: see :func:`ddp_rows`."""
    return one_rank_nccl_section(
        ctx, "a 1-rank DDP", "dtype", lambda d: ddp_rows(d, ctx.mpi(), ctx.args.seed, steps)
    )


def ddp_rows(device: Any, mpi: Any, seed: int, steps: int) -> list[dict[str, Any]]:
    """For fp32, fp16 and bf16 models on ``device`` (torch.distributed initialised
    with one rank): each bucket, copied as DDP hands it over (on the gradients'
    stream, behind a long kernel), is reduced by the hook's worker on its own
    stream; the gradients DDP writes back must equal geocomm.allreduce of the copy
    on the CPU over ``mpi``, bit for bit, with one collective per bucket."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm
    import geocomm.adapters.torch as gt

    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        row: dict[str, Any] = {"dtype": str(dtype)}
        state = None
        try:
            torch.manual_seed(seed % 2**31)
            net = torch.nn.Sequential(
                torch.nn.Linear(512, 1024),
                torch.nn.GELU(),
                torch.nn.Linear(1024, 1024),
                torch.nn.GELU(),
                torch.nn.Linear(1024, 16),
            ).to(device, dtype)
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
                    line, group = buffer.cpu().view(1, -1), state.layout(params, index).compressed
                    total = geocomm.allreduce(group.take(line), codec="fp8", op="avg", comm=mpi,
                                              stage_size=state.reducer.stage_size)  # fmt: skip
                    want = line.clone()
                    group.put(want, total)
                    want = want.view(-1)
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
