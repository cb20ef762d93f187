"""Error versus wire bytes of the geometry transforms on synthetic gradient streams.

Every step, each of N simulated ranks holds G_i = S_t + E_i: a shared
low-rank signal S_t = U_t diag(s) V_t^T whose singular vectors drift from
step to step (``--drift``; s_j ~ 1/(j+1) over ``--rank`` directions) plus
independent Gaussian noise per rank (``--noise``, relative to ||S_t||). The
all-reduce runs as in DESIGN section 4 (two quantizations, np.array_split
shards; ``geocomm.codecs.geometry.simulate_allreduce``) with the codec state
carried from step to step; the error is ||result - sum_i G_i|| / ||sum_i G_i||,
median over the steps after ``--skip``. Bytes per element count the quantized
payload (scales included) and the side channel (basis refresh, exact
coefficients) each rank sends, per call.

    python perf/geo_fidelity.py --shape 512x512 --ranks 2 --steps 12
    python perf/geo_fidelity.py --sweep default -J results/geo_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np
from geocomm.codecs.geometry import simulate_allreduce

from geocomm.codecs import get_codec

# (label, config) pairs; max_side/min_share are opened up so every variant applies
UNLIMITED = {"max_side": 1e9, "min_share": 0.0}
SWEEPS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "default": [
        ("fp8 b128", {"id": "fp8", "block": 128}),
        ("fp8 b32", {"id": "fp8", "block": 32}),
        ("geofp8 default", {"id": "geofp8"}),
        ("hadamard", {"id": "hadamard"}),
        *[(f"whiten a={a} k={k} {r}", {"id": "geofp8", "transform": "whiten", "alpha": a,
                                        "k": k, "refresh": r, **UNLIMITED})
          for r in ("current", "past") for k in (4, 8, 16) for a in (0.125, 0.25)],
        *[(f"split k={k} {r}", {"id": "geofp8", "transform": "split", "k": k, "refresh": r,
                                **UNLIMITED})
          for r in ("current", "past") for k in (2, 4, 8, 16, 32)],
    ],
    "nvfp4": [
        ("nvfp4", {"id": "nvfp4"}),
        ("geonvfp4 default", {"id": "geonvfp4"}),
        *[(f"geonvfp4 {t} k={k}", {"id": "geonvfp4", "transform": t, "k": k, **UNLIMITED})
          for t in ("whiten", "split") for k in (4, 8, 16)],
    ],
    "dmin": [
        (f"whiten a={a} dmin={d}", {"id": "geofp8", "transform": "whiten", "alpha": a,
                                    "d_min": d, **UNLIMITED})
        for a in (0.125, 0.25, 0.5) for d in (0.03125, 0.125, 0.25)
    ],
}


class Stream:
    """Per-rank synthetic gradients with a drifting low-rank signal (reproducible)."""

    def __init__(self, m: int, n: int, ranks: int, rank: int, drift: float, noise: float,
                 seed: int):
        self.m, self.n, self.ranks, self.drift, self.noise = m, n, ranks, drift, noise
        self.rng = np.random.default_rng([seed, m, n])
        self.u = np.linalg.qr(self.rng.standard_normal((m, rank)))[0]
        self.v = np.linalg.qr(self.rng.standard_normal((n, rank)))[0]
        self.s = 1.0 / np.arange(1, rank + 1)

    def _move(self, basis: np.ndarray) -> np.ndarray:
        step = self.rng.standard_normal(basis.shape) * self.drift / math.sqrt(basis.shape[0])
        return np.linalg.qr(basis + step)[0]

    def next(self) -> list[np.ndarray]:
        self.u, self.v = self._move(self.u), self._move(self.v)
        signal = (self.u * self.s) @ self.v.T
        scale = self.noise * np.linalg.norm(signal) / math.sqrt(self.m * self.n)
        return [(signal + scale * self.rng.standard_normal((self.m, self.n))).astype(np.float32)
                for _ in range(self.ranks)]


def run_variant(config: dict[str, Any], shape: tuple[int, int], args: argparse.Namespace
                ) -> dict[str, Any]:
    codecs = [get_codec(config) for _ in range(args.ranks)]
    stream = Stream(*shape, args.ranks, args.rank, args.drift, args.noise, args.seed)
    errors, sides = [], []
    for t in range(args.steps):
        xs = stream.next()
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        result, side = simulate_allreduce(codecs, xs, key="w")
        if t >= args.skip:
            errors.append(float(np.linalg.norm(result - exact) / np.linalg.norm(exact)))
            sides.append(side)
    count = shape[0] * shape[1]
    payload = codecs[0].wire_size(count)
    return {"config": config, "shape": list(shape), "rel_err": float(np.median(errors)),
            "bytes_per_elem": (payload + float(np.mean(sides))) / count,
            "side_fraction": float(np.mean(sides)) / payload}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None,
                        help="MxN (repeatable; default 256x688, 512x512, 1024x1024)")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default="default")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--rank", type=int, default=32, help="directions in the signal")
    parser.add_argument("--drift", type=float, default=0.5)
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-J", "--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shape or
              ["256x688", "512x512", "1024x1024"])]
    rows = []
    print(f"# ranks={args.ranks} steps={args.steps} drift={args.drift} noise={args.noise} "
          f"rank={args.rank}")
    print(f"{'variant':<28} {'shape':>10} {'rel_err':>9} {'B/elem':>7} {'side':>6} "
          f"{'vs first':>8}")
    for shape in shapes:
        base = None
        for label, config in SWEEPS[args.sweep]:
            t0 = time.perf_counter()
            row = run_variant(config, shape, args)
            row["label"], row["seconds"] = label, time.perf_counter() - t0
            base = base or row["rel_err"]
            rows.append(row)
            print(f"{label:<28} {'x'.join(map(str, shape)):>10} {row['rel_err']:9.5f} "
                  f"{row['bytes_per_elem']:7.4f} {row['side_fraction']:6.3f} "
                  f"{row['rel_err'] / base:8.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
