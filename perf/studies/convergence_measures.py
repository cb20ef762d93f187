"""What a convergence run measures besides the loss: payload bytes, the communication
error against the exact average, the sampling spread between ranks, parameter checksums.
"""

from __future__ import annotations

import zlib
from typing import Any

import llama  # perf/studies/llama.py, beside this file
import numpy as np
import torch

import geocomm
from geocomm.engine.costs import codec_for
from geocomm.engine.layout import DEFAULT_STAGE_SIZE, Pieces, wire_bytes

# ---------------------------------------------------------------------------
# byte counting


def payload_bytes(codec: Any, model: torch.nn.Module, comm: Any) -> int:
    """Bytes this rank sends per step for the quantized payload alone (no side
    channels): :func:`geocomm.engine.layout.wire_bytes` of every parameter's pieces."""
    return sum(
        wire_bytes(
            codec_for(codec, p.numel()),
            Pieces.cut(p.numel(), comm.size, DEFAULT_STAGE_SIZE),
            comm.rank,
        )
        for p in model.parameters()
    )


# ---------------------------------------------------------------------------
# training


def mean_over_ranks(comm: Any, values: list[float]) -> np.ndarray:
    """Exact float64 average of a few scalars over the ranks."""
    x = np.asarray(values, np.float64)
    return geocomm.allreduce(x, codec="none", op="avg", comm=comm)


def flat_grads(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.grad.detach().numpy().reshape(-1).copy() for p in model.parameters()]


def comm_errors(exact: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    """(relative error over all gradients at once, median per-tensor relative error)."""
    num = [float(np.sum((g.astype(np.float64) - e) ** 2)) for e, g in zip(exact, got, strict=True)]
    den = [float(np.sum(e.astype(np.float64) ** 2)) for e in exact]
    per = [np.sqrt(n / d) for n, d in zip(num, den, strict=True) if d > 0]
    total = np.sqrt(sum(num) / sum(den)) if sum(den) > 0 else 0.0
    return float(total), float(np.median(per)) if per else 0.0


def sampling_spread(comm: Any, exact: list[np.ndarray], local: list[np.ndarray]) -> float:
    """How far the ranks' own gradients lie from their average, as the noise of the
    average: sqrt(mean_r ||g_r - avg||^2 / (N - 1)) / ||avg||. For independent
    batches this estimates the sampling noise ||avg - E[g]|| / ||avg|| of the
    averaged gradient, the noise floor the communication error is compared with."""
    if comm.size < 2:
        return float("nan")
    dev = sum(
        float(np.sum((g.astype(np.float64) - e) ** 2)) for e, g in zip(exact, local, strict=True)
    )
    norm = sum(float(np.sum(e.astype(np.float64) ** 2)) for e in exact)
    mean_dev = float(mean_over_ranks(comm, [dev])[0])
    return float(np.sqrt(mean_dev / (comm.size - 1) / norm)) if norm > 0 else float("nan")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / den if den > 0 else 0.0


def params_crc(model: torch.nn.Module) -> int:
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
    return crc


def heldout(model: llama.Llama, data: llama.TextData, comm: Any, batches: int) -> float:
    return float(
        mean_over_ranks(comm, [llama.heldout_loss(model, data, batches, comm.rank, comm.size)])[0]
    )


def flat_params(model: torch.nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()]).astype(
        np.float64
    )
