"""The FSDP2 half of the DDP study (perf/studies/ddp_train.py runs it): the small Llama
trained with ``fully_shard`` per block, with torch's own reduce-scatter and with
``geocomm.adapters.torch.compress_fsdp`` per codec."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from typing import Any

import numpy as np

FSDP_CODECS = ("fp8", "geofp8")


def init_dist() -> tuple[int, int]:
    """Join the gloo default group from mpirun's variables; (rank, world size)."""
    import torch
    import torch.distributed as dist

    import geocomm.adapters.torch as gt

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the (shaped) loopback
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    gt.init_distributed_from_mpi("gloo")
    return dist.get_rank(), dist.get_world_size()


def _fsdp_run(
    cfg: Any, codec: str | None, seed: int, steps: int, rank: int, size: int
) -> dict[str, Any]:
    import torch.distributed as dist
    from llama import TextData, TrainConfig, apply_update, build_model, make_optimizer
    from torch.distributed.fsdp import fully_shard

    import geocomm.adapters.torch as gt

    model = build_model(cfg, seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    fsdp = gt.compress_fsdp(model, codec) if codec else None
    tc = TrainConfig()
    opt = make_optimizer(model, tc)
    data = TextData(cfg, seed)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        tokens, targets = data.batches("train", rank, size, step)
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        apply_update(model, opt, tc, step)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / size)
    row: dict[str, Any] = {
        "codec": codec or "none",
        "seed": seed,
        "losses": losses,
        "last10": float(np.mean(losses[-10:])),
        "seconds_per_step": (time.perf_counter() - t0) / steps,
    }
    if fsdp is not None:
        hist = fsdp.telemetry.history
        row.update(
            {
                "bytes_sent_per_step": float(np.mean([s.bytes_sent for s in hist])),
                "baseline_bytes_per_step": float(np.mean([s.baseline_bytes for s in hist])),
                "collectives_per_step": hist[-1].collectives,
                "reduce_scatters_per_step": len(hist[-1].buckets),
                "rel_error_est": float(np.median([s.rel_error for s in hist])),
            }
        )
    return row


def run_fsdp(args: argparse.Namespace) -> dict[str, Any] | None:
    """The FSDP2 job on this rank; the result on rank 0 (None elsewhere)."""
    import torch.distributed as dist
    from llama import CONFIGS

    rank, size = init_dist()
    cfg = CONFIGS["small"]
    if args.fsdp_batch:
        cfg = replace(cfg, batch=args.fsdp_batch)
    runs = [
        _fsdp_run(cfg, None, seed, args.fsdp_steps, rank, size) for seed in range(args.fsdp_seeds)
    ]
    runs += [_fsdp_run(cfg, codec, 0, args.fsdp_steps, rank, size) for codec in FSDP_CODECS]
    if rank == 0:
        for r in runs:
            sent = (
                f" sent {r['bytes_sent_per_step'] / 1e6:.2f} MB/step"
                if "bytes_sent_per_step" in r
                else ""
            )
            print(
                f"fsdp {r['codec']:>6} seed {r['seed']}: last-10 loss {r['last10']:.4f} "
                f"{r['seconds_per_step']:.2f} s/step{sent}",
                flush=True,
            )
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"config": cfg.__dict__, "ranks": size, "steps": args.fsdp_steps, "runs": runs}
