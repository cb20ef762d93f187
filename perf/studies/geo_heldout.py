"""GeoFP8 on the held-out half of the gradient zoo, beside the tuning half: error against bytes.

The zoo (perf/studies/zoo.py) has two halves: ``tuning``, the sources the
defaults are chosen on, and ``heldout``, sources nothing was chosen on. For
every source, every variant's codec (one per simulated rank, as many ranks
as the source has) reduces every parameter of every recorded step with
:func:`geocomm.testing.simulate_allreduce` (the bits of that many real
ranks) and ``key=name``, from a fresh state at the window's first step, and
perf/studies/geo_zoo.py's measures compare each result with the exact sum:
per matrix the error ratio against E4M3 block 128's; ``median`` the median
over matrices of each matrix's median over calls 2..W (steady state);
``calls 2-8`` the median over calls 2..8 of the per-call median over
matrices (a fresh key); ``last`` the per-call median at the last call;
``model`` the whole model's error ratio (all parameters), median over calls
2..W; ``bytes`` what a rank sends per call (payload, coefficients, their
energies and the power steps' sums) over FP8's payload, calls 2..W. Per kind
of matrix (token embeddings, position tables, output heads, the other
projections) the median too; and the share of the whole model's squared
error (calls 2..W) in the tensors the codec leaves plain (1-D ones and those
below ``min_dim``/``min_numel``), with the whole model's ratio were those
sent exactly instead (``model, plain exact``: what such tensors bound).

The headline is a curve per source: each geometry at the byte points of
issue 40 (nominal 1.00, 1.05 (the defaults), 1.10, 1.25 and 1.5 times FP8's
bytes; the knobs in :data:`BYTE_POINTS`). ``split`` sends the top
directions exactly and quantizes the rest (the host's default);
``whiten`` adds the input-side whitening of the next directions (the GPU's
default; no bytes in an all-reduce, so at 1.00 it is the whitening alone).

``--input-side`` is a layout experiment: GPT-2's Conv1D layers store their
weights as (inputs, outputs), so the maps, which act on the right side, act
on their output side there; the option hands the codecs those gradients
transposed (outputs, inputs), as every other layer of the zoo stores them,
so that the maps act on their input side (perf/results/geo_heldout_conv1d.md).

``--tune`` runs the whitening's knobs instead, on the tuning half only
(:data:`TUNE`), at the default bytes; the rule that picks the default is
fixed before the run: the lowest mean over the tuning sources of the steady
median; among settings within 0.01 of it, the one with the fewest whitened
directions (the cheapest).

    python perf/studies/geo_heldout.py --tune -J perf/results/geo_heldout_tuning.json
    python perf/studies/geo_heldout.py -J perf/results/geo_heldout.json
    python perf/studies/geo_heldout.py --report perf/results/geo_heldout.json
    python perf/studies/geo_heldout.py --input-side \
        --only gpt2-256-2k-late32,gpt2-192-0.5k-late64-x8 -J perf/results/geo_heldout_conv1d.json
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import zoo  # noqa: E402
from geo_heldout_report import write  # noqa: E402
from geo_zoo import BASE, codecs_for, run_source, yardstick  # noqa: E402

from geocomm.codecs import get_codec  # noqa: E402

#: The byte points of the curve: knobs that let the side channel grow to about
#: that many times FP8's payload (the side budget caps it; the compute budget and
#: max_side let the larger points use it).
BYTE_POINTS: dict[str, dict[str, Any]] = {
    "1.00": {"side_budget": 0.0},
    "1.05": {},
    "1.10": {"side_budget": 0.1},
    "1.25": {"side_budget": 0.25, "budget": 120.0},
    "1.5": {"side_budget": 0.5, "budget": 400.0, "max_side": 1.0},
}
GEOMETRIES = ("split", "whiten")
#: Which tensors the defaults leave plain: a function of shape and config only.
DEFAULT = get_codec("geofp8")
#: The whitening's knobs tried on the tuning half (directions, exponent).
TUNE = ((16, 0.25), (32, 0.25), (64, 0.25), (128, 0.25), (32, 0.125), (32, 0.5))


def label(geometry: str, point: str) -> str:
    return f"{geometry} {point}"


def curve_variants() -> dict[str, dict[str, Any]]:
    """FP8, then every geometry at every byte point (the split at 1.00 is FP8 itself)."""
    variants = {BASE: {"id": "fp8", "fmt": "e4m3", "block": 128}}
    for geometry in GEOMETRIES:
        for point, knobs in BYTE_POINTS.items():
            if geometry == "split" and point == "1.00":
                continue
            variants[label(geometry, point)] = {"id": "geofp8", "transform": geometry, **knobs}
    return variants


def tune_variants() -> dict[str, dict[str, Any]]:
    variants = {BASE: {"id": "fp8", "fmt": "e4m3", "block": 128}}
    variants[label("split", "1.05")] = {"id": "geofp8", "transform": "split"}
    for rows, alpha in TUNE:
        variants[f"whiten {rows} alpha {alpha:g}"] = {
            "id": "geofp8",
            "transform": "whiten",
            "whiten": rows,
            "alpha": alpha,
        }
    return variants


def kind_of(name: str) -> str:
    """The kind of a matrix from its parameter name."""
    low = name.lower()
    if "pos" in low or "wpe" in low:
        return "positions"
    if "embed" in low or "wte" in low:
        return "embeddings"
    if low.endswith(("head.weight", "embed_out.weight")):
        return "head"
    return "projections"


def per_kind(raw: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per variant and kind: the median over that kind's matrices of each matrix's
    median error ratio over calls 2..W (and how many matrices)."""
    base = raw[BASE]["rel"]
    out: dict[str, dict[str, float]] = {}
    for variant, r in raw.items():
        groups: dict[str, list[float]] = {}
        for name, errs in r["rel"].items():
            ratios = [a / b for a, b in zip(errs[1:], base[name][1:], strict=True) if b > 0]
            if ratios:
                groups.setdefault(kind_of(name), []).append(float(np.median(ratios)))
        out[variant] = {k: float(np.median(v)) for k, v in groups.items()}
        out[variant] |= {f"{k} count": float(len(v)) for k, v in groups.items()}
    return out


#: GPT-2's Conv1D weights (inputs, outputs): the attention's and the MLP's projections
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def input_side(name: str, grad: np.ndarray) -> np.ndarray:
    """A Conv1D gradient transposed to (outputs, inputs); every other as stored."""
    return np.ascontiguousarray(grad.T) if name.endswith(CONV1D) else grad


def plain_floor(raw: dict[str, Any], plain: set[str]) -> dict[str, dict[str, float]]:
    """Per variant: the share of its whole-model squared error (calls 2..W) in the
    ``plain`` tensors, and its whole-model ratio against the base's with those
    tensors' error taken out (what sending them exactly would leave)."""
    base = sum(sum(e[1:]) for e in raw[BASE]["sq"].values())
    out = {}
    for variant, r in raw.items():
        total = sum(sum(e[1:]) for e in r["sq"].values())
        plain_sq = sum(sum(r["sq"][n][1:]) for n in plain)
        out[variant] = {
            "plain_share": plain_sq / total if total > 0 else 0.0,
            "model_plain_exact": ((total - plain_sq) / base) ** 0.5 if base > 0 else 0.0,
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = tune_variants() if args.tune else curve_variants()
    chosen = zoo.select(args.only or ("tuning" if args.tune else None))
    before = yardstick()
    sources = []
    for src in chosen:
        start = time.perf_counter()
        view = input_side if args.input_side else None
        result = run_source(src, codecs_for(variants, src.world), view)
        raw = result.pop("raw")
        kinds = per_kind(raw)
        shapes = result.pop("shapes")
        floors = plain_floor(raw, {n for n in shapes if DEFAULT.map_shape(shapes[n]) is None})
        for variant, row in result["summary"].items():
            calls = row["fresh"]
            row["calls28"] = float(np.median(calls[1:8]))
            row["worst28"] = float(max(calls[1:8]))
            row["last"] = float(calls[-1])
            row["kinds"] = kinds[variant]
            row |= floors[variant]
        half = "tuning" if src in zoo.TUNING else "heldout"
        sources.append(
            {**result, "half": half, "world": src.world, "tokens": src.tokens, "late": src.late}
        )
        d = result["summary"][label("whiten", "1.05") if not args.tune else BASE]
        print(
            f"{src.name:30s} {half:8s} whiten 1.05: median {d['median']:.3f} "
            f"calls 2-8 {d['calls28']:.3f} model {d['model']:.3f} bytes {d['bytes_steady']:.3f} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return {
        "command": "python " + " ".join(sys.argv),
        "mode": "tune" if args.tune else "curve",
        "input_side": bool(args.input_side),
        "halves": {h: [s.name for s in srcs] for h, srcs in zoo.HALVES.items()},
        "variants": variants,
        "byte_points": BYTE_POINTS,
        "tune": [list(t) for t in TUNE],
        "base": BASE,
        "yardstick": {"before": before, "after": yardstick()},
        "sources": sources,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated zoo source names or halves")
    p.add_argument("--tune", action="store_true", help="the whitening's knobs, tuning half")
    p.add_argument("--input-side", action="store_true", help="GPT-2's Conv1D gradients transposed")
    p.add_argument("-J", "--json", default="perf/results/geo_heldout.json")
    p.add_argument("--report", default=None, help="re-render md and png from this JSON")
    args = p.parse_args(argv)
    if args.report:
        write(json.loads(Path(args.report).read_text()), Path(args.report))
        return 0
    write(run(args), Path(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
