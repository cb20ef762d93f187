"""Soak: many mixed collectives on every rank, each result checked, memory watched.

    python -m geocomm.launch -n 3 -- python tests/jobs/soak.py --ops 2000      # CI default
    python -m geocomm.launch -n 3 -- python tests/jobs/soak.py --ops 10000     # the long soak

Random sizes (0..64K values), codecs, ops and collectives, the same sequence
on every rank (shared seed); each rank regenerates all inputs, so every
result is checked against the fp64 reference with the derived error bound
(geocomm.codecs.bounds) and compared across ranks by hash. RSS is sampled
after a warm-up and at the end: growth beyond 5% (and 8 MiB) fails. Prints
"N passed, M failed" on rank 0 and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import geocomm
from geocomm.api import resolve_codec
from geocomm.codecs import bounds
from geocomm.engine.layout import shard_bounds

CODECS = ["none", "bf16", "fp8", {"id": "fp8", "fmt": "e5m2", "block": 0}, "nvfp4"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def check(
    kind: str, op: str, codec, xs: list[np.ndarray], result: np.ndarray, rank: int, size: int
) -> bool:
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    if codec.lossless:
        bound = 2 * size * bounds.FP32_UNIT * np.sum([np.abs(x) for x in xs], axis=0)
    elif kind == "allreduce":
        bound = bounds.allreduce_bound(xs, codec)
    else:
        bound = bounds.reduce_scatter_bound(xs, codec)
    if kind == "reduce_scatter":
        offsets = shard_bounds(exact.size, size)
        exact, bound = (a[offsets[rank] : offsets[rank + 1]] for a in (exact, bound))
    if op == "avg":
        exact, bound = exact / size, bound / size + 2.0**-23 * bound
    return bool(np.all(np.abs(result - exact) <= bound))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    comm = geocomm.init()
    rank, size = comm.rank, comm.size
    plan = np.random.default_rng(args.seed)
    passed = failed = 0
    baseline = None
    for i in range(args.ops):
        if i == min(200, args.ops // 10):
            baseline = rss_bytes()
        count = int(plan.integers(0, 1 << 16)) if plan.random() < 0.9 else int(plan.integers(0, 9))
        codec = resolve_codec(CODECS[int(plan.integers(len(CODECS)))])
        op = "sum" if plan.random() < 0.5 else "avg"
        kind = "allreduce" if plan.random() < 0.7 else "reduce_scatter"
        xs = [
            np.random.default_rng([args.seed, i, r]).standard_normal(count, np.float32)
            for r in range(size)
        ]
        fn = geocomm.allreduce if kind == "allreduce" else geocomm.reduce_scatter
        result = fn(xs[rank], codec=codec, op=op)
        ok = check(kind, op, codec, xs, result.astype(np.float64), rank, size)
        if kind == "allreduce":
            digest = np.frombuffer(hashlib.sha256(result.tobytes()).digest()[:8], np.int64)
            ok &= bool((comm.allgather_int64(digest) == digest).all())
        verdict = comm.allgather_int64(np.array([int(ok)]))
        if verdict.all():
            passed += 1
        else:
            failed += 1
            if rank == 0:
                print(
                    f"op {i}: {kind} {op} {codec.get_config()} count {count} failed on ranks "
                    f"{np.nonzero(verdict.ravel() == 0)[0].tolist()}",
                    flush=True,
                )
    growth = rss_bytes() - (baseline or rss_bytes())
    limit = max(0.05 * (baseline or 0), 8 << 20)
    growths = comm.allgather_int64(np.array([growth]))
    leak = bool((growths > limit).any())
    if rank == 0:
        print(
            f"soak: {args.ops} collectives on {size} ranks; RSS growth after warm-up per rank "
            f"(bytes): {growths.ravel().tolist()}, limit {int(limit)}"
        )
        print(f"{passed + (not leak)} passed, {failed + leak} failed")
    return 1 if failed or leak else 0


if __name__ == "__main__":
    sys.exit(main())
