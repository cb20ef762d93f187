"""Convergence: data-parallel pretraining of a small Llama under each codec.

Every MPI rank trains the byte-level decoder of ``perf/studies/llama.py`` from
scratch with AdamW on the shipped text; after each backward pass every
parameter's gradient is averaged through ``geocomm.allreduce(grad,
codec=..., op="avg", out=grad, key=name)``. For a given seed every codec
starts from the same weights and sees the same batches, so the loss gap to
the exact average (codec ``none``, i.e. fp32) is a paired difference.

Per step and per run the script logs: the train loss (mean over ranks), the
communication error ``||avg_codec - avg_exact|| / ||avg_exact||`` over all
gradients at once (the exact average is computed from a copy of the same
gradients with codec ``none`` every ``--err-every`` steps; that reference
call is not timed) and the median of the per-tensor relative errors, the
bytes this rank sent (counted by a communicator wrapper: all-to-all and
all-gather segments to other ranks, and 2(N-1)/N of a plain all-reduce's
buffer, as a ring all-reduce would send; geometry side channels included),
and the step time. Held-out loss is measured every ``--eval-every`` steps
and at the end. Rank 0 writes ``PREFIX.json`` (all curves, metadata, the
command, the machine yardstick of :func:`geocomm.testing.yardstick`),
``PREFIX.md`` (table per codec) and ``PREFIX.png`` (curves), written by
``perf/studies/convergence_report.py``.

Two regimes (``--regime``):

* ``sampled`` (the default): every step draws fresh windows of the shipped
  text, rank r its own slice of the step's global batch. The averaged
  gradient carries sampling noise (about 0.75 of its norm here, 25x fp8's
  all-reduce error), which hides the codec's error (perf/results/convergence.md).
* ``noise-free``: full-batch training on a fixed data set, so that the codec's
  error is the only perturbation. Rank r holds ``--batch`` windows drawn once
  per seed (slice r of step 0's global batch) and uses exactly those every
  step: the objective is the mean loss over the ``world * batch`` windows,
  and the exact average of the ranks' gradients *is* its full gradient, step
  after step, with no sampling noise at all. This removes the noise by
  construction. The alternative, the same batch on every rank made large by
  accumulation, either draws it afresh each step, which only shrinks the noise
  by the square root of the accumulated count at that many times the compute,
  or keeps it fixed, and then every rank quantizes the same values, so its
  round-to-nearest errors are identical on all ranks instead of independent,
  unlike data parallelism. Here each rank quantizes its own (different)
  gradient, as in real training. Default codecs:
  fp32, E4M3, E5M2 with round-to-nearest, stochastic rounding and error
  feedback, NVFP4 likewise, MXFP8, MXFP4, GeoFP8, GeoNVFP4. Stochastic
  rounding draws its bits from the run's seed. The table of the verdicts
  says whether stochastic rounding or error feedback closes at least half of
  RNE's train-loss gap to fp32 (gap(variant) <= 0.5 gap(RNE), means over
  seeds, with the per-seed count and the paired differences). The defaults
  (32 windows per rank, lr 1e-4, 64 steps, seeds 0-2) stop the run while
  the comparison still means something; see :data:`REGIMES` for the
  measurements behind them.

    python -m geocomm.launch -n 2 --timeout 3600 -- python perf/studies/convergence.py
    python -m geocomm.launch -n 2 --timeout 3600 -- python perf/studies/convergence.py \
        --regime noise-free
    python perf/studies/convergence.py --report perf/results/convergence.json  # tables/plot
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# One BLAS thread per rank, set before NumPy loads OpenBLAS: the ranks already
# fill the cores, and oversubscribed BLAS threads made the geometry transforms
# 10-100x slower on the 2-core machine (measured).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import llama  # noqa: E402  (perf/studies/llama.py: model, data, optimizer)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from convergence_measures import (  # noqa: E402
    comm_errors,
    cosine,
    flat_grads,
    flat_params,
    heldout,
    mean_over_ranks,
    params_crc,
    payload_bytes,
    sampling_spread,
)
from convergence_report import markdown, merge, tail_mean, write_outputs  # noqa: E402
from convergence_setup import CODECS, DEFAULT_MODEL, NAMES, REGIMES, codec_config, codec_labels  # noqa: E402

import geocomm  # noqa: E402
import geocomm.codecs.geo  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import yardstick  # noqa: E402

from geocomm.testing import MeteredComm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def train_run(
    label: str,
    seed: int,
    args: argparse.Namespace,
    mcfg: llama.LlamaConfig,
    tc: llama.TrainConfig,
    comm: Any,
    reference: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """One training run of ``args.steps`` steps under codec ``label``; curves on every rank.

    Every ``args.drift_every`` steps the parameters are compared with
    ``reference`` (the fp32 run's parameters at the same steps, same seed):
    drift = ||theta - theta_fp32|| / ||theta_fp32 - theta_0||, how far the run
    has left the full-precision trajectory relative to how far that trajectory
    has moved. The exact run (``none``) returns its snapshots under
    ``"snapshots"`` to serve as the reference of the others.
    """
    # a fresh instance: no geometry state or residual carried over
    codec = geocomm.get_codec(codec_config(label, seed))
    metered = MeteredComm(comm)
    model = llama.build_model(mcfg, seed)
    opt = llama.make_optimizer(model, tc)
    data = llama.TextData(mcfg, seed)
    noise_free = args.regime == "noise-free"
    # noise-free: this rank's fixed windows, the same every step (full-batch gradient)
    fixed = data.batches("train", comm.rank, comm.size, 0) if noise_free else None
    named = list(model.named_parameters())
    exact_codec = label == "none"
    log: dict[str, list] = {
        k: []
        for k in (
            "loss",
            "err",
            "err_tensor",
            "err_autocorr",
            "err_align",
            "spread",
            "bytes",
            "step_s",
            "comm_s",
            "drift",
        )
    }
    previous_error: np.ndarray | None = None
    theta0 = flat_params(model)
    snapshots: list[np.ndarray] = []
    evals: list[tuple[int, float]] = []
    t_run = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = fixed if noise_free else data.batches("train", comm.rank, comm.size, step)
        loss = llama.train_step(model, opt, *batch)
        t1 = time.perf_counter()
        measure = step % args.err_every == 0
        if measure:  # the exact average of the same gradients (not timed)
            local = flat_grads(model)
            exact = [geocomm.allreduce(g, codec="none", op="avg", comm=comm) for g in local]
            log["spread"].append(sampling_spread(comm, exact, local))
        t2 = time.perf_counter()
        before = metered.sent
        for name, p in named:
            geocomm.allreduce(
                p.grad, codec=codec, op="avg", out=p.grad, key=name, comm=metered, check=False
            )
        t3 = time.perf_counter()
        sent = metered.sent - before
        if measure and not exact_codec:
            got = flat_grads(model)
            err, err_tensor = comm_errors(exact, got)
            error = np.concatenate(
                [g.astype(np.float64) - e for e, g in zip(exact, got, strict=True)]
            )
            log["err_align"].append(cosine(error, np.concatenate(exact).astype(np.float64)))
            if previous_error is not None:
                log["err_autocorr"].append(cosine(error, previous_error))
            previous_error = error
        else:
            err, err_tensor = (0.0, 0.0) if exact_codec else (float("nan"), float("nan"))
        llama.apply_update(model, opt, tc, step)
        t4 = time.perf_counter()
        if args.drift_every and (step + 1) % args.drift_every == 0:
            theta = flat_params(model)
            if exact_codec:
                snapshots.append(theta)
            elif reference is not None:
                ref = reference[len(log["drift"])]
                log["drift"].append(
                    float(np.linalg.norm(theta - ref) / np.linalg.norm(ref - theta0))
                )
        log["loss"].append(float(mean_over_ranks(comm, [loss])[0]))
        log["err"].append(err)
        log["err_tensor"].append(err_tensor)
        log["bytes"].append(sent)
        log["step_s"].append((t1 - t0) + (t4 - t2))
        log["comm_s"].append(t3 - t2)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            evals.append((step + 1, heldout(model, data, comm, args.eval_batches)))
    final = heldout(model, data, comm, args.final_eval_batches)
    evals.append((args.steps, final))
    crcs = comm.allgather_int64(np.array([params_crc(model)], np.int64))
    return {
        "codec": label,
        "seed": seed,
        **log,
        "eval": evals,
        "heldout": final,
        "payload_bytes": payload_bytes(codec, model, comm),
        "codec_config": codec.get_config(),
        "ranks_agree": bool(np.all(crcs == crcs[0])),
        "wall_s": time.perf_counter() - t_run,
        "loadavg_end": os.getloadavg(),
        **({"snapshots": snapshots} if exact_codec else {}),
    }


# ---------------------------------------------------------------------------
# main


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def provenance() -> dict[str, Any]:
    """Git commit, whether tracked files differ from it, and the hash of the installed
    GeoFP8 package the codecs ran with (it may carry uncommitted work)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", *a], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            return ""

    geometry = hashlib.sha256()
    for source in sorted(Path(geocomm.codecs.geo.__file__).parent.glob("*.py")):
        geometry.update(source.read_bytes())
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": git("status", "--porcelain", "--untracked-files=no"),
        "geometry_sha256": geometry.hexdigest()[:16],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--regime",
        choices=sorted(REGIMES),
        default="sampled",
        help="sampled: fresh batches every step (sampling noise); noise-free: "
        "every rank its fixed windows every step (full-batch gradients, the "
        "codec error is the only perturbation). Sets the defaults of "
        "--codecs, --seeds, --steps, --lr, --batch and --out",
    )
    p.add_argument(
        "--codecs",
        default=None,
        help="comma-separated labels, or LABEL=JSON for an extra codec config "
        f"(known: {', '.join(CODECS)}; default: the regime's)",
    )
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2)")
    p.add_argument(
        "--steps", type=int, default=None, help="default: 200 (sampled), 64 (noise-free)"
    )
    p.add_argument("--d-model", type=int, default=DEFAULT_MODEL.d_model)
    p.add_argument("--layers", type=int, default=DEFAULT_MODEL.n_layers)
    p.add_argument("--heads", type=int, default=DEFAULT_MODEL.n_heads)
    p.add_argument("--ff", type=int, default=DEFAULT_MODEL.ff)
    p.add_argument("--seq-len", type=int, default=DEFAULT_MODEL.seq_len)
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per rank (default: 8 sampled, 32 noise-free)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"default: {llama.TrainConfig.lr} (sampled), "
        f"{REGIMES['noise-free']['lr']} (noise-free)",
    )
    p.add_argument(
        "--err-every", type=int, default=1, help="measure the comm error every this many steps"
    )
    p.add_argument(
        "--eval-every", type=int, default=0, help="held-out loss every N steps (0: only at the end)"
    )
    p.add_argument(
        "--drift-every",
        type=int,
        default=10,
        help="compare the parameters with the fp32 run every N steps (0: never)",
    )
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--final-eval-batches", type=int, default=16)
    p.add_argument(
        "--tail",
        type=int,
        default=0,
        help="final train loss = mean of the last TAIL steps (0: steps / 10)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--title", default="")
    p.add_argument(
        "--out",
        default=None,
        help="output prefix (.json, .md, .png; default: "
        "perf/results/convergence, or convergence_noisefree for noise-free)",
    )
    p.add_argument(
        "--report",
        metavar="JSON",
        nargs="+",
        help="only rewrite .md/.png from result files; several files of the same "
        "configuration are merged into one table (written to --out)",
    )
    args = p.parse_args(argv)
    for name, value in REGIMES[args.regime].items():
        if getattr(args, name) is None:
            setattr(args, name, ",".join(value) if name == "codecs" else value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        results = [json.loads(Path(f).read_text()) for f in args.report]
        if len(results) == 1:
            write_outputs(results[0], Path(args.report[0]).with_suffix(""))
        else:
            write_outputs(merge(results, args.title), ROOT / args.out)
        return 0
    torch.set_num_threads(args.threads)
    comm = geocomm.init()
    labels = codec_labels(args.codecs)
    seeds = [int(s) for s in args.seeds.split(",")]
    mcfg = replace(
        DEFAULT_MODEL,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        ff=args.ff,
        seq_len=args.seq_len,
        batch=args.batch,
    )
    tc = replace(llama.TrainConfig(), lr=args.lr)
    prefix = ROOT / args.out
    ruler = yardstick(comm)
    noise_free = args.regime == "noise-free"
    title = (
        f"Convergence without sampling noise: full-batch training on a fixed data set "
        f"({comm.size} ranks)"
        if noise_free
        else f"Convergence under each codec ({comm.size} ranks)"
    )
    result: dict[str, Any] = {
        "title": args.title or title,
        "regime": args.regime,
        "command": f"python -m geocomm.launch -n {comm.size} --timeout 3600 -- python "
        + shlex.join(sys.argv),
        "world": comm.size,
        "model": asdict(mcfg),
        "n_params": mcfg.n_params(),
        "train": asdict(tc),
        "steps": args.steps,
        "seeds": seeds,
        "tail": args.tail or max(1, args.steps // 10),
        "err_every": args.err_every,
        "drift_every": args.drift_every,
        "final_eval_batches": args.final_eval_batches,
        "codecs": {label: CODECS[label] for label in labels},
        "names": {label: NAMES[label] for label in labels if label in NAMES},
        "bytes_note": "bytes this rank sends per step: all-to-all/all-gather segments to "
        "other ranks, 2(N-1)/N of plain all-reduce buffers (ring), geometry "
        "side channels included; payload_bytes: geocomm.engine.layout.wire_bytes, "
        "the quantized payload alone",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "geocomm": geocomm.__version__,
            "threads_per_rank": args.threads,
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        },
        "provenance": provenance(),
        "load_before": uptime(),
        "yardstick": dataclasses.asdict(ruler) if ruler else None,
        "runs": [],
    }
    t0 = time.perf_counter()
    # the exact run first: it is the reference trajectory of the drift
    labels = sorted(labels, key=lambda label: label != "none")
    for seed in seeds:
        reference = None
        for label in labels:
            run = train_run(label, seed, args, mcfg, tc, comm, reference)
            if "snapshots" in run:
                reference = run.pop("snapshots")
            result["runs"].append(run)
            if comm.rank == 0:
                print(
                    f"{label:>10s} seed {seed}: loss {tail_mean(run['loss'], result['tail']):.4f}"
                    f" heldout {run['heldout']:.4f} err {np.nanmean(run['err']):.4f} "
                    f"{np.mean(run['bytes']) / 1e6:.3f} MB/step {run['wall_s']:.0f} s "
                    f"(load {run['loadavg_end'][0]:.2f})",
                    flush=True,
                )
                result["wall_s"] = time.perf_counter() - t0
                result["load_after"] = uptime()
                write_outputs(result, prefix)  # after every run: partial results survive
    if comm.rank == 0:
        print(f"wall {result['wall_s'] / 60:.1f} min; {result['load_after']}")
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
