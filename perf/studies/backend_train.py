"""DDP with no hook on the "geocomm" torch.distributed backend against plain gloo DDP.

    python perf/studies/backend_train.py                      # root (link emulation), ~1 min
    python perf/studies/backend_train.py --steps 3 --warmup 1 --out /tmp/backend_train

One MPI job inside ``perf/emulated_link.py --rate 1gbit -n 2`` (both ranks in
a network namespace whose loopback is shaped to 1 Gbit/s), each rank one
torch thread. The model is six ``Linear(1024, 1024)`` layers with ReLU
between (6.3M parameters, 25 MB of fp32 gradients), ``--batch`` rows per
rank, SGD, DDP with ``--bucket-mb`` buckets (2: one layer each) and no comm hook. Methods, from
the same initial weights and data: ``gloo`` (DDP on the job's gloo default
group) and ``geocomm-CODEC`` (DDP on ``new_group(backend="geocomm")`` with
that codec), which is all the user changes. Per method: the median step
time (the slower rank's per step), parameters hashed after every step and
compared across ranks, the drift from gloo's parameters at the end, and the
backend's counters (bytes this rank sent through its compressed
communicator, the uncompressed ring's bytes for the same calls, compressed
and exact calls). Writes ``OUT.json`` and ``OUT.md`` (default
``perf/results/backend_train``) with the command and the machine yardstick.
"""

from __future__ import annotations

import os
import pathlib
import sys

# One BLAS/OpenMP thread per rank before NumPy and torch load: the ranks fill the cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from ddp_train import strip_options  # noqa: E402  (perf/studies/ddp_train.py)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results, yardstick, yardstick_line  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
METHODS = ("gloo", "geocomm-fp8", "geocomm-nvfp4")


def _model(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    blocks: list[Any] = []
    for i in range(layers):
        blocks.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            blocks.append(torch.nn.ReLU())
    return torch.nn.Sequential(*blocks)


def _digest(net: Any) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _method(args: argparse.Namespace, method: str, rank: int, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from geocomm.adapters.torch import backend

    group = None
    if method != "gloo":  # "geocomm-CODEC"
        backend.configure(codec=method.split("-", 1)[1], check=not args.no_check)
        group = dist.new_group(backend=backend.NAME)
    net = _model(args.width, args.layers)
    model = DDP(net, process_group=group, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, agree = [], True
    for step in range(args.warmup + args.steps):
        if step == args.warmup and group is not None:
            group.flush()
            group.reset_stats()  # count the timed steps only
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(float(elapsed))
        digests = [None] * size
        dist.all_gather_object(digests, _digest(net))
        agree = agree and all(d == digests[0] for d in digests)
    result: dict[str, Any] = {
        "step_s": float(np.median(times)),
        "step_times_s": times,
        "ranks_agree": agree,
        "params": [p.detach().numpy().ravel().copy() for p in net.parameters()],
    }
    if group is not None:
        stats = backend.stats(group)
        result["stats"] = {
            "sent_per_step": stats.sent / args.steps,
            "baseline_per_step": stats.baseline / args.steps,
            "ratio": stats.ratio,
            "compressed_per_step": stats.compressed / args.steps,
            "exact_per_step": stats.exact / args.steps,
            "codec": group.codec.get_config(),
        }
    return result


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from geocomm.adapters.torch import init_distributed_from_mpi

    init_distributed_from_mpi()
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {m: _method(args, m, rank, size) for m in args.methods.split(",")}
    ruler = yardstick() if rank == 0 else None
    if rank != 0:
        return
    out: dict[str, Any] = {"ranks": size, "methods": {}}
    gloo_params = results["gloo"]["params"] if "gloo" in results else None
    for name, r in results.items():
        params = r.pop("params")
        if gloo_params is not None and name != "gloo":
            r["max_drift_from_gloo"] = float(
                max(np.abs(a - b).max() for a, b in zip(params, gloo_params, strict=True))
            )
        out["methods"][name] = r
    out["gradient_mb"] = 4 * sum(p.numel() for p in _model(args.width, args.layers).parameters())
    out["gradient_mb"] /= 1e6
    out["yardstick"] = asdict(ruler) if ruler is not None else None
    Path(args.worker_json).write_text(json.dumps(out))


def write_report(result: dict[str, Any], out: Path) -> None:
    """OUT.json, then OUT.md (:func:`markdown`)."""
    write_results(out, result, markdown)


def markdown(result: dict[str, Any]) -> str:
    methods = result["job"]["methods"]
    gloo = methods.get("gloo", {}).get("step_s")
    lines = [
        "# DDP with no hook on the geocomm backend vs plain gloo DDP",
        "",
        f"`{result['command']}` on {result['host']}; 2 ranks over an emulated "
        f"{result['rate']} link (perf/emulated_link.py), one torch thread each; six "
        f"Linear(1024, 1024) layers, {result['job']['gradient_mb']:.1f} MB of fp32 gradients. "
        + yardstick_line(result["job"]["yardstick"]),
        "",
        "| method | median step (s) | speed-up vs gloo | ranks agree | bytes sent / step "
        "(compressed comm) | uncompressed ring / step | ratio | max drift from gloo |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in methods.items():
        s = r.get("stats")
        speed = f"{gloo / r['step_s']:.2f}x" if gloo else "-"
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {speed} | {r['ranks_agree']} | "
            + (
                f"{s['sent_per_step'] / 1e6:.2f} MB | {s['baseline_per_step'] / 1e6:.2f} MB | "
                f"{s['ratio']:.2f} | {r['max_drift_from_gloo']:.2e} |"
                if s
                else "- | - | - | - |"
            )
        )
    for name, r in methods.items():
        g = r.get("stats")
        if g:
            lines.append(
                f"\n{name}: {g['compressed_per_step']:.1f} compressed calls per step (DDP's "
                f"buckets), {g['exact_per_step']:.1f} exact calls on the geocomm group (the "
                "script's own barrier, timing and digest collectives use the gloo default group)."
            )
    lines.append(
        '\nThe user\'s change: `DDP(net, process_group=dist.new_group(backend="geocomm"))` '
        '(or `init_process_group("geocomm")`), the codec from `backend.configure`.'
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="1gbit", help="emulated link rate (tc units)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--no-check", action="store_true", help="no metadata check per call")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--bucket-mb", type=float, default=2.0)
    p.add_argument("--out", default=str(ROOT / "perf" / "results" / "backend_train"))
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    given = argv if argv is not None else sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        job_json = Path(tmp) / "job.json"
        worker = [sys.executable, str(Path(__file__)), "--worker", "--worker-json", str(job_json)]
        worker += strip_options(given, ("--out", "--rate"))
        cmd = [sys.executable, str(ROOT / "perf" / "emulated_link.py"), "--rate", args.rate]
        cmd += ["-n", "2", "--", *worker]
        print("#", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        job = json.loads(job_json.read_text())
    result = {
        "host": f"{platform.node()}, {os.cpu_count()} cores",
        "command": shlex.join(["python", "perf/studies/backend_train.py", *given]),
        "rate": args.rate,
        "job": job,
    }
    write_report(result, Path(args.out))
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
