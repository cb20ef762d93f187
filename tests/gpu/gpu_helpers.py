"""What the GPU tests share (imported after conftest.py has put the twin in place)."""

from __future__ import annotations

import sys

import cupy
import numpy as np

#: whether this run is on the CPU twin of CuPy (tests/twin) rather than a GPU
ON_TWIN = getattr(cupy, "TWIN", False)


def inputs(rank: int, n: int, tag: int = 0) -> np.ndarray:
    """Gradient-like float32 values every rank can rebuild for any rank: a wide
    dynamic range, a few subnormals and exact zeros."""
    rng = np.random.default_rng([rank, tag, 20261201])
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 8, n))).astype(np.float32)
    if n > 10:
        x[rng.integers(0, n, 3)] = np.float32(3e-39)  # subnormal
        x[rng.integers(0, n, 2)] = 0.0
    return x


def twice(call):
    """(device result, host result) of ``call(device: bool)`` run as the same call twice:
    stochastic rounding draws from a stream counted per (config, keys) call, so the
    host's count is put back before the host call repeats the device's."""
    from geocomm.engine import call as calls

    with calls.saved_call_counts():
        device = call(True)
    return device, call(False)


def on_ranks(command: list[str], ranks: int, timeout_s: int) -> list[str]:
    """``command`` (argv) as run on ``ranks`` ranks: itself on one, else under
    ``geocomm.launch``, which ends the job after ``timeout_s``."""
    if ranks == 1:
        return command
    launch = [sys.executable, "-P", "-m", "geocomm.launch", "-n", str(ranks)]
    return [*launch, "--timeout", str(timeout_s), "--", *command]
