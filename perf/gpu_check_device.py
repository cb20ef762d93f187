"""perf/gpu_check.py's sections that need a real GPU: ``torch`` (torch CUDA tensors
through geocomm over NCCL), ``timing`` (device time of the pipeline, NCCL and a copy;
the must-show of issue #14), ``ddp`` (geocomm's DDP hook on CUDA gradients) and
``backend`` (the geocomm torch.distributed backend on CUDA tensors). The CuPy twin
runs no torch CUDA tensors and measures no device time: ``--twin`` skips them.
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
    from geocomm import cuda

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


def check_ddp(ctx: Any, steps: int = 3) -> dict[str, Any]:
    """geocomm_hook in a 1-rank DDP over a NCCL process group: see :func:`ddp_rows`."""
    if (missing := torch_cuda_missing()) is not None:
        return missing
    if ctx.size > 1:
        return {
            "ok": True,
            "status": "skipped",
            "reason": "a 1-rank DDP: run on one rank (the other sections span the ranks)",
        }
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", ctx.cp.cuda.Device().id)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = ddp_rows(device, ctx.mpi(), ctx.args.seed, steps)
    return {
        "ok": all(r["ok"] for r in rows),
        "status": "ran",
        "rows": rows,
        "failures": [
            f"{r['dtype']}: { {k: v for k, v in r.items() if k != 'dtype'} }"
            for r in rows
            if not r["ok"]
        ],
    }


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


# ---------------------------------------------------------------------------
# the torch.distributed backend on CUDA tensors


def check_backend(ctx: Any, n: int = 300_001) -> dict[str, Any]:
    """The ``geocomm`` torch.distributed backend on CUDA tensors, one rank (its
    NCCL route, issue #21): see :func:`backend_rows`."""
    if (missing := torch_cuda_missing()) is not None:
        return missing
    if ctx.size > 1:
        return {
            "ok": True,
            "status": "skipped",
            "reason": "a 1-rank process group: run on one rank (the other sections span the ranks)",
        }
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", ctx.cp.cuda.Device().id)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = backend_rows(device, ctx.mpi(), ctx.args.seed, n)
    return {
        "ok": all(r["ok"] for r in rows),
        "status": "ran",
        "rows": rows,
        "failures": [
            f"{r['case']}: { {k: v for k, v in r.items() if k != 'case'} }"
            for r in rows
            if not r["ok"]
        ],
    }


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
    from geocomm.adapters import torch_backend as tb

    torch.manual_seed(seed % 2**31)
    tb.configure(min_numel=4096)
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
