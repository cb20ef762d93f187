"""GeoFP8 in training: the zoo's Llama under DDP with geocomm's hook, exact against FP8 and GeoFP8.

Every MPI rank is a torch.distributed rank (gloo); the zoo's byte-level
Llama (perf/studies/llama.py, as perf/studies/zoo_models.py builds it) is
wrapped in DDP and its gradient buckets are averaged by
``geocomm.adapters.torch.geocomm_hook`` under each codec of :data:`CODECS`:
the exact average (``none``: fp32 sums in rank order), FP8 E4M3, E5M2 and
NVFP4, and GeoFP8 over each of them with the host's geometry (the split)
and the GPU's (split and whitening). For one seed every codec starts from
the same weights and sees the same batches (AdamW, llama.py's clipping and
warm-up), so the loss gap to the exact run is a paired difference.

Regimes (``--regime``): ``sampled`` (the default) draws fresh windows every
step, rank r its slice of the step's global batch; ``fixed`` trains on a
fixed set (each rank's own windows, the same at every step: full-batch
training, whose exact gradient has no sampling noise). The default learning
rate (3e-4, below llama.py's 2e-3) keeps runs of one seed close to the exact
one, so that a gap is the codec's and not the divergence of chaotic
trajectories (at 2e-3, perf/results/convergence.md: gaps of either sign, no
codec resolved). Evaluation: ``eval`` is the mean loss on fixed held-out
windows (split over the ranks), every ``--eval-every`` steps and at the end;
``train`` the mean loss of the step's batches over the ranks (in ``fixed``,
the objective itself).

Reported (perf/studies/geo_training_report.py): per codec the final eval
and train losses and their gap to the exact run, mean over seeds with a
95% t-interval of the paired gaps; per Euclidean / geometry pair the paired
difference of the gaps with its interval; loss curves.

    python -m geocomm.launch -n 2 --timeout 3600 -- python perf/studies/geo_training.py
    python perf/studies/geo_training.py --report perf/results/geo_training.json
"""

from __future__ import annotations

import os
import pathlib
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py

#: label -> codec config. GeoFP8 runs with each device kind's geometry, named.
CODECS: dict[str, dict[str, Any]] = {
    "exact": {"id": "none"},
    "fp8 e4m3": {"id": "fp8", "fmt": "e4m3"},
    "geofp8 e4m3 split": {"id": "geofp8", "fmt": "e4m3", "transform": "split"},
    "geofp8 e4m3 whiten": {"id": "geofp8", "fmt": "e4m3", "transform": "whiten"},
    "fp8 e5m2": {"id": "fp8", "fmt": "e5m2"},
    "geofp8 e5m2 split": {"id": "geofp8", "fmt": "e5m2", "transform": "split"},
    "geofp8 e5m2 whiten": {"id": "geofp8", "fmt": "e5m2", "transform": "whiten"},
    "nvfp4": {"id": "nvfp4"},
    "geonvfp4 split": {"id": "geonvfp4", "transform": "split"},
    "geonvfp4 whiten": {"id": "geonvfp4", "transform": "whiten"},
}
#: (Euclidean codec, the geometry over the same quantizer)
PAIRS = [
    (base, geo)
    for base, geos in (
        ("fp8 e4m3", ("geofp8 e4m3 split", "geofp8 e4m3 whiten")),
        ("fp8 e5m2", ("geofp8 e5m2 split", "geofp8 e5m2 whiten")),
        ("nvfp4", ("geonvfp4 split", "geonvfp4 whiten")),
    )
    for geo in geos
]


def model_config(args: argparse.Namespace) -> Any:
    """The zoo's Llama at ``--width`` (zoo_models.build's shape), ``--batch`` windows."""
    from llama import LlamaConfig
    from zoo import SEQ_LEN

    width = args.width
    return LlamaConfig(d_model=width, ff=width * 43 // 16, seq_len=SEQ_LEN, batch=args.batch)


def train_run(label: str, seed: int, args: argparse.Namespace, side: Any) -> dict[str, Any]:
    """One run of ``args.steps`` steps under codec ``label`` (every rank); curves."""
    import torch
    import torch.distributed as dist
    from llama import TextData, TrainConfig, apply_update, build_model, make_optimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm.adapters.torch as gt

    rank, size = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    net = build_model(cfg, seed)
    model = DDP(net)
    state = gt.GeocommHookState(net, codec=dict(CODECS[label]))
    model.register_comm_hook(state, gt.geocomm_hook)
    tc = TrainConfig(lr=args.lr, warmup=args.warmup)
    opt = make_optimizer(net, tc)
    data = TextData(cfg, seed)
    fixed = data.batches("train", rank, size, 0)
    train, evals, start = [], [], time.perf_counter()

    def mean(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=side)
        return float(t[0]) / size

    def evaluate(batches: int) -> float:
        # held-out windows r, r + size, ...: every rank a share, the same set for every run
        net.eval()
        with torch.no_grad():
            losses = [
                float(net(*data.batches("heldout", 0, 1, i))) for i in range(rank, batches, size)
            ]
        net.train()
        return mean(float(np.sum(losses))) * size / batches

    for step in range(args.steps):
        tokens, targets = (
            fixed if args.regime == "fixed" else data.batches("train", rank, size, step)
        )
        opt.zero_grad(set_to_none=False)
        loss = model(tokens, targets)
        loss.backward()
        apply_update(net, opt, tc, step)
        train.append(mean(float(loss.detach())))
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            evals.append((step + 1, evaluate(args.eval_batches)))
    final = evaluate(args.final_batches)
    evals.append((args.steps, final))
    objective = None
    if args.regime == "fixed":  # the objective after the last update
        net.eval()
        with torch.no_grad():
            objective = mean(float(net(*fixed)))
        net.train()
    state.close()
    return {
        "codec": label,
        "seed": seed,
        "train": train,
        "eval": evals,
        "final_eval": final,
        "final_objective": objective,
        "seconds": time.perf_counter() - start,
    }


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    import geocomm.adapters.torch as gt

    torch.set_num_threads(1)
    gt.init_distributed_from_mpi()
    side = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    labels = args.codecs.split(",")
    runs = []
    start = time.perf_counter()
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label in labels:
            row = train_run(label, seed, args, side)
            runs.append(row)
            if rank == 0:
                print(
                    f"seed {seed} {label:22s} train {np.mean(row['train'][-10:]):.4f} "
                    f"eval {row['final_eval']:.4f} ({row['seconds']:.0f} s)",
                    flush=True,
                )
    dist.destroy_process_group()
    if rank != 0:
        return None
    from lab import yardstick

    return {
        "command": "python -m geocomm.launch -n " + f"{size} -- python " + " ".join(sys.argv),
        "ranks": size,
        "regime": args.regime,
        "model": model_config(args).__dict__,
        "args": vars(args),
        "codecs": {label: CODECS[label] for label in labels},
        "pairs": [p for p in PAIRS if p[0] in labels and p[1] in labels],
        "wall_s": time.perf_counter() - start,
        "yardstick": yardstick().__dict__,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regime", choices=("fixed", "sampled"), default="sampled")
    p.add_argument("--width", type=int, default=128, help="the zoo's Llama at this width")
    p.add_argument("--batch", type=int, default=16, help="windows of 128 bytes per rank")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--final-batches", type=int, default=32)
    p.add_argument("-J", "--json", default="perf/results/geo_training.json")
    p.add_argument("--report", default=None, help="re-render md and png from this JSON")
    args = p.parse_args(argv)
    from geo_training_report import write

    if args.report:
        write(json.loads(Path(args.report).read_text()), Path(args.report))
        return 0
    result = run(args)
    if result is not None:
        write(result, Path(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
