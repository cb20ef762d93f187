"""Non-finite gradients stay visible after every codec's all-reduce.

Mixed-precision loss scalers skip a step when any gradient is inf/NaN, so a
NaN or inf on one rank must come out non-finite on all ranks, at the same
positions (NVFP4: the whole block of 16 around it, docs/design.md, "Formats").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import geocomm

pytestmark = pytest.mark.mpi

CODECS = [
    "none",
    "bf16",
    "fp8",
    {"id": "fp8", "fmt": "e5m2", "block": 0},
    "nvfp4",
    "geofp8",
    "geonvfp4",
]
SHAPE = (96, 256)  # large enough for the geometry codecs to transform it


def _spread(codec) -> int:
    """How many neighbours a non-finite value may take with it (NVFP4 blocks)."""
    name = codec if isinstance(codec, str) else codec["id"]
    return 16 if "nvfp4" in name else 1


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_nonfinite_positions_propagate(comm, codec):
    rng = np.random.default_rng([comm.rank, 11])
    x = rng.standard_normal(SHAPE).astype(np.float32)
    nan_at, inf_at = 1000, 20_001
    if comm.rank == 0:
        x.flat[nan_at] = np.nan
    if comm.rank == comm.size - 1:
        x.flat[inf_at] = np.inf
    for step in range(3):  # stateful codecs: also after their state exists
        y = geocomm.allreduce(x, codec=codec, key="w")
        bad = ~np.isfinite(y.ravel())
        assert bad[nan_at] and bad[inf_at], f"step {step}"
        spread = _spread(codec)
        allowed = np.zeros_like(bad)
        for p in (nan_at, inf_at):
            allowed[p // spread * spread : p // spread * spread + spread] = True
        assert not np.any(bad & ~allowed), f"step {step}: non-finite values elsewhere"


def test_grad_scaler_style_overflow_check(comm):
    """The check torch.amp.GradScaler performs (any non-finite grad -> skip the
    step) gives the same verdict on every rank after a compressed all-reduce."""
    grads = [torch.randn(64, 128), torch.randn(512)]
    if comm.rank == comm.size - 1:
        grads[0][3, 7] = float("inf")  # overflow on one rank only
    found_inf = False
    for i, g in enumerate(grads):
        geocomm.allreduce(g, codec="geofp8", op="avg", out=g, key=f"p{i}")
        found_inf |= not bool(torch.isfinite(g).all())
    verdicts = comm.allgather_int64(np.array([int(found_inf)]))
    assert verdicts.ravel().tolist() == [1] * comm.size
