"""Training with geocomm's DDP hook and FSDP2 reduce-scatter: step time, overlap, bytes, agreement.

    python perf/studies/ddp_train.py                # root: both jobs below, ~5 min
    python perf/studies/ddp_train.py --steps 4 --warmup 2 --fsdp-steps 4 --fsdp-seeds 1 \\
        --out /tmp/ddp_train                        # a short validation run

Two MPI jobs, each rank a process with one torch thread, gloo over TCP:

* ``ddp`` inside ``perf/emulated_link.py --rate 1gbit -n 2`` (both ranks in a
  network namespace whose loopback is shaped to 1 Gbit/s): the Llama of
  ``llama.py`` scaled to ~26 MB of fp32 gradients (d_model 512, 2 layers,
  one sequence of 32 bytes per rank: little compute, so communication
  decides), DDP with ``--bucket-mb`` buckets, SGD with momentum
  (``--optimizer adamw``: llama.py's AdamW with clipping, ~25 ms more per
  step for every method). Methods, each from the same initial weights and
  data: DDP's default fp32 all-reduce, DDP's ``fp16_compress_hook``,
  geocomm's hook with ``fp8`` and ``geofp8``, and ``nocomm`` (a hook that
  returns the local gradient at once: forward + backward + optimizer alone).
  Per method: median step time (the slower rank's per step), parameters
  hashed after every step and compared across ranks, and for geocomm the
  telemetry (collectives per step, DDP buckets per step, bytes, ratio, error
  estimate) and the hook alone: one step's buckets reduced again with the
  hook's ``reduce_bucket`` one after the other with nothing else running;
  hidden = (nocomm + hook alone - step) / hook alone. With one sequence the
  backward (~30 ms) is much shorter than fp8's ~110 ms on the wire, so at
  most a quarter can hide; the overlap run repeats nocomm, fp8 and geofp8
  with ``--overlap-batch`` sequences, a backward about as long as the
  communication.
* ``fsdp`` (``python -m geocomm.launch -n 2``, no shaping): the small Llama
  (``CONFIGS["small"]``) under FSDP2 (``fully_shard`` per block and the
  root), ``--fsdp-steps`` steps uncompressed with ``--fsdp-seeds`` seeds
  (the seed noise) and compressed (``fp8``, ``geofp8``) with seed 0; the mean
  loss of the last 10 steps against the uncompressed runs' spread, and the
  bytes the compressed reduce-scatter sent (counted at its communicator).

``--load N`` runs N busy-loop processes beside the jobs: each rank then gets
about half a core instead of one, an emulated slow day on which compute and
codec take longer while the link stays as fast. (The yardstick does not show
it: a single thread's copy speed, measured when it runs.)

Writes ``OUT.json`` and ``OUT.md`` (default ``perf/results/ddp_train``) with
the command and the machine yardstick of :func:`geocomm.testing.yardstick`
measured in the same run. Only geocomm's public API is used.
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
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from ddp_train_methods import (  # noqa: E402
    FIRST_HOOK,
    HOOK_CALLS,
    ddp_model,
    hook_alone,
    max_over_ranks,
)
from ddp_train_report import write_report  # noqa: E402
from fsdp_train import init_dist, run_fsdp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import busy_loops, yardstick  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DDP_METHODS = ("default", "fp16", "powersgd", "fp8", "nvfp4", "geofp8", "nocomm")


# ---------------------------------------------------------------------------
# helpers used on the ranks


def params_digest(model: Any) -> str:
    """SHA-256 of every parameter's bytes."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach().contiguous()
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# DDP


def ddp_config(args: argparse.Namespace) -> Any:
    from llama import LlamaConfig

    return LlamaConfig(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=8,
        ff=args.ff,
        seq_len=args.seq_len,
        batch=args.batch,
    )


def _run_methods(
    cfg: Any, methods: list[str], args: argparse.Namespace, rank: int, size: int, side: Any
) -> dict[str, Any]:
    """Every method on ``cfg``: step times, agreement, telemetry, the hook alone."""
    import torch.distributed as dist
    from llama import TextData

    data = TextData(cfg, args.seed)
    rows: dict[str, Any] = {}
    for method in methods:
        net, model, state, wrapper, opt, update = ddp_model(cfg, args, method, side, size)
        times, agree, buckets_per_step, losses = [], True, [], []
        first_hook, optimizer = [], []  # ms into the step; ms of the update
        for step in range(args.warmup + args.steps + args.error_steps):
            tokens, targets = data.batches("train", rank, size, step)
            HOOK_CALLS[0] = 0
            FIRST_HOOK[0] = None
            measuring = step >= args.warmup + args.steps  # after the timed steps
            if wrapper is not None:
                wrapper.measure = measuring
                wrapper.start_step()
            dist.barrier(group=side)
            t = time.perf_counter()
            loss = model(tokens, targets)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            t_update = time.perf_counter()
            update(step)
            t_end = time.perf_counter()
            elapsed = t_end - t
            digests: list[Any] = [None] * size
            dist.all_gather_object(digests, params_digest(net), group=side)
            agree = agree and all(d == digests[0] for d in digests)
            if args.warmup <= step and not measuring:
                times.append(elapsed)
                optimizer.append((t_end - t_update) * 1e3)
                hooked = FIRST_HOOK[0]
                first_hook.append(float("nan") if hooked is None else (hooked - t) * 1e3)
                buckets_per_step.append(HOOK_CALLS[0])
                losses.append(float(loss.detach()))
        times = max_over_ranks(times, side)
        row: dict[str, Any] = {
            "median_ms": float(np.median(times)) * 1e3,
            "step_ms": [t * 1e3 for t in times],
            "ranks_identical": agree,
            "loss_last": losses[-1],
            "optimizer_ms": float(np.median(max_over_ranks(optimizer, side))),
        }
        first_hook = max_over_ranks(first_hook, side)  # every rank: one entry per step
        if not np.isnan(first_hook).all():
            row["first_hook_ms"] = float(np.nanmedian(first_hook))
        if wrapper is not None and wrapper.steps:
            errors = max_over_ranks(wrapper.rel_errors(), side)
            row["rel_error_measured"] = float(np.median(errors))
            row["rel_error_steps"] = errors
        if state is not None:
            # the timed steps' records: the measured steps come after them
            steps = state.telemetry.history[: args.warmup + args.steps][-args.steps :]
            row.update(
                {
                    "buckets_per_step": buckets_per_step,
                    "collectives_per_step": [s.collectives for s in steps],
                    "bytes_sent_per_step": [s.bytes_sent for s in steps],
                    "ratio": float(np.median([s.ratio for s in steps])),
                    "rel_error_est": float(np.median([s.rel_error for s in steps])),
                    "params": sum(1 for _ in net.parameters()),
                }
            )
            state.close()
            alone = hook_alone(args, net, method, data, rank, size, side)
            row["hook_alone_ms"] = alone["seconds"] * 1e3
            row["alone_buckets"] = alone["buckets"]
        rows[method] = row
        if rank == 0:
            extra = ""
            if state is not None:
                extra = (
                    f" collectives/step {row['collectives_per_step'][-1]} buckets/step "
                    f"{row['buckets_per_step'][-1]} ratio {row['ratio']:.2f} err "
                    f"{row['rel_error_est']:.2e} hook alone {row['hook_alone_ms']:.1f} ms"
                )
            print(
                f"{method:>8}: median step {row['median_ms']:8.1f} ms identical {agree}{extra}",
                flush=True,
            )
        del model
    nocomm = rows.get("nocomm", {}).get("median_ms")
    for row in rows.values():
        if nocomm is not None and "hook_alone_ms" in row:
            row["hidden_fraction"] = (nocomm + row["hook_alone_ms"] - row["median_ms"]) / row[
                "hook_alone_ms"
            ]
    return rows


def run_ddp(args: argparse.Namespace) -> dict[str, Any] | None:
    """The DDP job on this rank; the result on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    rank, size = init_dist()
    side = dist.new_group(backend="gloo")  # barriers and timing, apart from DDP and geocomm
    cfg = ddp_config(args)
    methods = args.methods.split(",")
    result: dict[str, Any] = {
        "config": cfg.__dict__,
        "ranks": size,
        "link": os.environ.get("GEOCOMM_LINK", "unshaped"),
        "bucket_mb": args.bucket_mb,
        "steps": args.steps,
        "warmup": args.warmup,
        "optimizer": args.optimizer,
    }
    if rank == 0:
        print(
            f"# ddp: {cfg.n_params() / 1e6:.2f}M parameters ({cfg.n_params() * 4 / 1e6:.1f} "
            f"MB of fp32 gradients), {size} ranks, link {result['link']}",
            flush=True,
        )
    result["methods"] = _run_methods(cfg, methods, args, rank, size, side)
    if args.overlap_batch:
        # more tokens per step: a backward long enough to hide the communication behind
        big = replace(cfg, batch=args.overlap_batch)
        if rank == 0:
            print(f"# overlap: {big.batch} x {big.seq_len} tokens per rank", flush=True)
        chosen = [m for m in ("nocomm", "fp8", "geofp8") if m in methods]
        result["overlap"] = {
            "config": big.__dict__,
            "methods": _run_methods(big, chosen, args, rank, size, side),
        }
    dist.destroy_process_group()
    if rank != 0:
        return None
    result["yardstick"] = asdict(yardstick())
    return result


# ---------------------------------------------------------------------------
# orchestration (the report: ddp_train_report.py)


def _job(argv: list[str], launcher: list[str], name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.json"
        cmd = [
            *launcher,
            "--",
            sys.executable,
            str(Path(__file__)),
            "--worker",
            name,
            "--worker-json",
            str(out),
            *argv,
        ]
        print("#", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    p.add_argument("--skip", choices=("ddp", "fsdp"), default=None, help="run only the other job")
    p.add_argument("--rate", default="1gbit", help="emulated link of the DDP job")
    p.add_argument("--methods", default=",".join(DDP_METHODS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=1376)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default="sgd",
        help="sgd: SGD with momentum (one pass); adamw: llama.py's AdamW with "
        "clipping (about 25 ms more per step here, the same for every method)",
    )
    p.add_argument(
        "--overlap-batch",
        type=int,
        default=12,
        help="sequences per rank of the overlap run (0: none)",
    )
    p.add_argument("--alone-repeats", type=int, default=5)
    p.add_argument(
        "--error-steps",
        type=int,
        default=3,
        help="steps after the timed ones on which each hook's result is compared with "
        "the exact fp32 average (untimed)",
    )
    p.add_argument(
        "--stage-size",
        type=int,
        default=None,
        help="values per pipeline stage of the hook (default: the hook's)",
    )
    p.add_argument("--fsdp-steps", type=int, default=100)
    p.add_argument("--fsdp-seeds", type=int, default=3)
    p.add_argument("--fsdp-batch", type=int, default=0, help="sequences per rank (0: config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy-loop processes beside the jobs (an emulated slower machine)",
    )
    p.add_argument("--out", default=str(ROOT / "perf" / "results" / "ddp_train"))
    args = p.parse_args(argv)
    if args.worker:
        result = run_ddp(args) if args.worker == "ddp" else run_fsdp(args)
        if result is not None:
            Path(args.worker_json).write_text(json.dumps(result))
        return 0
    given = argv if argv is not None else sys.argv[1:]
    passthrough = strip_options(given, ("--out", "--skip", "--rate", "--load"))
    result: dict[str, Any] = {
        "host": f"{platform.node()}, {os.cpu_count()} cores",
        "command": shlex.join(["python", "perf/studies/ddp_train.py", *given]),
        "load": args.load,
    }
    with busy_loops(args.load):
        result["yardstick"] = asdict(yardstick())
        if args.skip != "ddp":
            result["ddp"] = _job(
                passthrough,
                [
                    sys.executable,
                    str(ROOT / "perf" / "emulated_link.py"),
                    "--rate",
                    args.rate,
                    "-n",
                    "2",
                ],
                "ddp",
            )
            result["yardstick"] = result["ddp"].pop("yardstick")  # rank 0's, beside the ranks
        if args.skip != "fsdp":
            result["fsdp"] = _job(
                passthrough, [sys.executable, "-m", "geocomm.launch", "-n", "2"], "fsdp"
            )
    write_report(result, Path(args.out))
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


def strip_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without ``options`` and their values (``--opt v`` or ``--opt=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
