"""perf/gpu_check.py's ``geofp8`` section: GeoFP8's geometry kernels (rank 0) and its
collective (every rank) on CuPy == on NumPy, bit for bit."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
from gpu_check_common import all_equal, digest, gradient, value_diff

#: (m, n, k, lo, length): flat ranges that start and end inside rows
KERNEL_RANGES = ((64, 4099, 12, 0, 64 * 4099), (33, 1000, 5, 517, 20_000), (9, 77, 1, 76, 78))


def check_kernels(ctx: Any) -> list[dict[str, Any]]:
    """The geometry kernels (native/gc_geometry.cu vs native/geometry.c) on ragged
    ranges with a NaN input."""
    from geocomm.codecs.geo import kernels

    cp = ctx.cp
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(ctx.args.seed)
    for m, n, k, lo, length in KERNEL_RANGES:
        x = rng.standard_normal(length).astype(np.float32)
        x[length // 2] = np.nan
        vt = kernels.orthonormalize(rng.standard_normal((k, n)).astype(np.float32), 1)
        want_coef = kernels.project(x, lo, n, vt)
        got_coef = kernels.project(cp.asarray(x), lo, n, cp.asarray(vt))
        want_out = np.empty_like(x)
        kernels.expand(x, lo, n, want_coef, vt, -1.0, want_out)
        got_out = cp.empty(length, cp.float32)
        kernels.expand(cp.asarray(x), lo, n, cp.asarray(want_coef), cp.asarray(vt), -1.0, got_out)
        x[length // 2] = 0.25  # accumulation is defined on finite values
        want_acc = np.zeros((k, n), np.float32)
        kernels.accumulate(x, lo, n, want_coef, want_acc)
        got_acc = cp.zeros((k, n), cp.float32)
        kernels.accumulate(cp.asarray(x), lo, n, cp.asarray(want_coef), got_acc)
        row = {
            "kernels": f"{m}x{n} k={k} range [{lo}, {lo + length})",
            "project": value_diff(cp.asnumpy(got_coef), want_coef),
            "expand": value_diff(cp.asnumpy(got_out), want_out),
            "accumulate": value_diff(cp.asnumpy(got_acc), want_acc),
        }
        row["ok"] = all_equal(row)
        rows.append(row)
    return rows


def check_geofp8(
    ctx: Any, shape: tuple[int, int] | None = None, steps: int | None = None
) -> dict[str, Any]:
    """GeoFP8's kernels and collective on CuPy == on NumPy, bit for bit.

    The geometry kernels on rank 0 (:func:`check_kernels`); then on every rank the
    same sequence of GeoFP8 all-reduces (state carried across steps by key, the
    basis refreshed on the way) on CuPy over NCCL and on NumPy over MPI, inputs
    seeded per rank: each rank's result and state checksum == its MPI twin's, and
    the ranks hold the same result and the same state.
    """
    import geocomm

    shape = ctx.sizes.geo_shape if shape is None else tuple(shape)
    steps = ctx.sizes.geo_steps if steps is None else steps
    cp, nccl, mpi = ctx.cp, ctx.nccl(), ctx.mpi()
    rows: list[dict[str, Any]] = ctx.on_root(lambda: check_kernels(ctx)) or []
    on_gpu, on_cpu = geocomm.get_codec("geofp8"), geocomm.get_codec("geofp8")
    for step in range(steps):
        row: dict[str, Any] = {"step": step}
        got = state = None
        try:
            g = gradient(np.random.default_rng([ctx.args.seed, nccl.rank, step]), shape)
            want = geocomm.allreduce(g.copy(), codec=on_cpu, key="layer.w", comm=mpi)
            got = cp.asnumpy(
                geocomm.allreduce(cp.asarray(g), codec=on_gpu, key="layer.w", comm=nccl)
            )
            state = on_gpu.state_checksum()
            row["vs_numpy_mpi"] = value_diff(got, want)
            row["state_equal"] = {"equal": state == on_cpu.state_checksum()}
        except Exception:
            row["error"] = traceback.format_exc()
        if ctx.size > 1:  # every rank, even after an error here: the same calls
            sums = ctx.world.allgather((digest(got), state))
            row["ranks_agree"] = {"equal": all(None not in s for s in sums) and len(set(sums)) == 1}
        row["ok"] = "error" not in row and all_equal(row)
        rows.append(row)
    return {
        "ok": all(r["ok"] for r in rows),
        "status": "ran",
        "shape": list(shape),
        "ranks": ctx.size,
        "rows": rows,
        "failures": [str(r) for r in rows if not r["ok"]],
    }
