"""GeoFP8 on real gradients: the error of every codec variant, and its price in bytes.

Trains the byte-level Llama of ``perf/studies/llama.py`` data-parallel on
``--world`` ranks simulated in one process, with the exact average of their
gradients (what training applies). Every step, each weight matrix's per-rank
gradients also go through every variant's all-reduce,
:func:`geocomm.testing.simulate_allreduce` (both quantizations, the owner's
own piece exact, the exact side sums and refresh rounds: the bits that
``geocomm.allreduce`` gives on that many real ranks, which the test suite
checks). Stateful variants see every step, as in training; the others only
the measured ones. On measured steps (``--start``, then every ``--every``)
each result Q is compared with the exact average G:

* ``rel``: ||Q - G|| / ||G||; ``out``: the part of the error outside the
  top-4 singular subspace of G, relative to ||G - G_4||;
* ``cos``: the cosine between Q and G;
* ``side``: the side channel a rank sends (its bfloat16 coefficients and
  power-step sums) over the quantized payload, for the
  whole model and for one 4096 x 4096 gradient (every matrix counted as
  mapped: an upper bound).

Ratios are per matrix and step against the variant's base quantizer (E4M3
block 128 or NVFP4), reduced by the median over steps, then over matrices.

    python perf/studies/geo_real_gradients.py -J perf/results/geo_real_gradients.json
    python perf/studies/geo_real_gradients.py --report perf/results/geo_real_gradients.json

``--zoo`` runs the sweep over every source of the gradient zoo instead
(perf/studies/zoo.py, the measures of perf/studies/geo_zoo.py; every split
with no byte budget, so each (k, refresh) is itself) and writes the per-source
table that perf/studies/geo_tradeoff.py joins with perf/geo_bench.py's times:

    python perf/studies/geo_real_gradients.py --zoo -J perf/results/geo_zoo_sweep.json
"""

from __future__ import annotations

import os
import pathlib
import sys

# one BLAS and torch thread: the study runs on one core, repeatably
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from llama import (  # noqa: E402
    CONFIGS,
    TextData,
    TrainConfig,
    apply_update,
    build_model,
    make_optimizer,
    train_step,
)

from geocomm.codecs import TransformingCodec, get_codec  # noqa: E402
from geocomm.codecs.geo.policy import direction_bytes  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results  # noqa: E402

from geocomm.testing import simulate_allreduce, simulate_reduce_scatter  # noqa: E402

FP8 = {"id": "fp8", "fmt": "e4m3", "block": 128}
NVFP4 = {"id": "nvfp4"}
# the sweep sets k and refresh itself: no cost, side or model-wide cap
OPEN = {"budget": 1e9, "max_side": 1e9, "side_budget": math.inf}
SWEEP_K = (4, 8, 12, 16, 24, 32)
SWEEP_REFRESH = (1, 4, 8)
BIG = (4096, 4096)
ZOO_K = (2, 4, 8, 12)
ZOO_REFRESH = (1, 4)


def variants() -> list[dict[str, Any]]:
    """label, codec config and base of every variant, bases first."""
    rows = [
        {"label": "fp8 b128", "codec": FP8, "base": "fp8 b128"},
        {"label": "nvfp4", "codec": NVFP4, "base": "nvfp4"},
        {"label": "geofp8 (default)", "codec": {"id": "geofp8"}, "base": "fp8 b128"},
        {"label": "geonvfp4 (default)", "codec": {"id": "geonvfp4"}, "base": "nvfp4"},
        {
            "label": "geofp8 side_budget 0.15",
            "codec": {"id": "geofp8", "side_budget": 0.15},
            "base": "fp8 b128",
        },
        {"label": "fp8 b32", "codec": {**FP8, "block": 32}, "base": "fp8 b128"},
        {"label": "hadamard", "codec": {"id": "hadamard"}, "base": "fp8 b128"},
        # reduce-scatter only (one quantization; the basis refreshed from shards)
        {
            "label": "fp8 b128 (reduce-scatter)",
            "codec": FP8,
            "base": "fp8 b128 (reduce-scatter)",
            "collective": "reduce_scatter",
        },
        {
            "label": "geofp8 (default, reduce-scatter)",
            "codec": {"id": "geofp8"},
            "base": "fp8 b128 (reduce-scatter)",
            "collective": "reduce_scatter",
        },
    ]
    rows += [
        {
            "label": f"split k={k} refresh={r}",
            "codec": {"id": "geofp8", "k": k, "refresh": r, "refresh_max": r, **OPEN},
            "base": "fp8 b128",
            "k": k,
            "refresh": r,
        }
        for k in SWEEP_K
        for r in SWEEP_REFRESH
    ]
    return rows


# ---------------------------------------------------------------------------
# metrics


def top_subspace(g: np.ndarray, k: int = 4) -> tuple[np.ndarray, np.ndarray, float]:
    """Top-k left/right singular vectors of g and the energy of its rank-k part."""
    u, s, vt = np.linalg.svd(g, full_matrices=False)
    return u[:, :k], vt[:k].T, float(np.sum(s[:k] ** 2))


def metrics(
    q: np.ndarray, g: np.ndarray, sub: tuple[np.ndarray, np.ndarray, float]
) -> dict[str, float]:
    """Error metrics of q against the exact average g (both float64, same shape)."""
    u, v, top = sub
    e = q - g
    total, err = float(np.sum(g * g)), float(np.sum(e * e))
    inside = float(np.sum((u.T @ e @ v) ** 2))
    cos = float(np.sum(q * g) / math.sqrt(max(float(np.sum(q * q)) * total, 1e-300)))
    return {
        "rel": math.sqrt(err / total),
        "out": math.sqrt(max(err - inside, 0.0) / max(total - top, 1e-300)),
        "cos": cos,
    }


def side_fraction(codec: Any, shapes: list[tuple[int, ...]]) -> float:
    """An upper bound on side bytes over quantized payload bytes per all-reduce of
    ``shapes``: every eligible matrix mapped at its cap k, its coefficients
    every call and its power-step sums every refresh period, at most the
    codec's model-wide ``side_budget``."""
    payload = side = 0.0
    for shape in shapes:
        payload += codec.wire_size(math.prod(shape))
        if isinstance(codec, TransformingCodec):
            dims = codec.map_shape(shape)
            if dims is not None:
                side += dims.k * direction_bytes(dims, codec.refresh_period)
    return min(side / payload, getattr(codec, "side_budget", math.inf))


# ---------------------------------------------------------------------------
# the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    cfg = CONFIGS[args.config]
    tc = TrainConfig()
    model = build_model(cfg, args.seed)
    opt = make_optimizer(model, tc)
    data = TextData(cfg, args.seed)
    params = dict(model.named_parameters())
    matrices = [n for n, p in params.items() if p.ndim == 2]
    rows = variants()
    codecs = {v["label"]: [get_codec(v["codec"]) for _ in range(args.world)] for v in rows}
    measured = list(range(args.start, args.steps, args.every))
    raw: dict[str, dict[str, list[dict[str, float]]]] = {
        v["label"]: {n: [] for n in matrices} for v in rows
    }
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        local, loss = [], 0.0
        for rank in range(args.world):
            loss += train_step(model, opt, *data.batches("train", rank, args.world, step))
            local.append({n: p.grad.detach().numpy().copy() for n, p in params.items()})
        for n, p in params.items():  # the exact average: what training applies
            p.grad.copy_(torch.from_numpy(sum(g[n] for g in local) / args.world))
        apply_update(model, opt, tc, step)
        losses.append(loss / args.world)
        measure = step in measured
        for v in rows:
            group = codecs[v["label"]]
            if not (measure or isinstance(group[0], TransformingCodec)):
                continue
            for name in matrices:
                result = reduce(v, group, [g[name] for g in local], name)
                if measure:
                    exact = sum(g[name].astype(np.float64) for g in local)
                    v_raw = raw[v["label"]][name]
                    v_raw.append(
                        metrics(
                            result.astype(np.float64) / args.world,
                            exact / args.world,
                            _subspace(exact, name, step),
                        )
                    )
        if measure:
            print(
                f"step {step:4d} loss {losses[-1]:.4f} "
                f"{(time.perf_counter() - start) / (step + 1):.2f} s/step",
                flush=True,
            )
    shapes = [tuple(p.shape) for p in params.values()]
    return {
        "command": "python " + " ".join(sys.argv),
        "world": args.world,
        "model": args.config,
        "params": cfg.n_params(),
        "steps": args.steps,
        "measured_steps": measured,
        "loss": losses,
        "seconds": time.perf_counter() - start,
        "variants": summarize(rows, codecs, raw, shapes, matrices),
    }


def reduce(
    variant: dict[str, Any], codecs: list[Any], xs: list[np.ndarray], key: str
) -> np.ndarray:
    """The variant's collective on simulated ranks: the all-reduce, or every rank's
    reduce-scatter shard put back together."""
    if variant.get("collective") == "reduce_scatter":
        shards = simulate_reduce_scatter(codecs, xs, key)
        return np.concatenate([np.asarray(s) for s in shards]).reshape(xs[0].shape)
    return simulate_allreduce(codecs, xs, key=key)


_SUBSPACES: dict[tuple[str, int], Any] = {}


def _subspace(exact: np.ndarray, name: str, step: int) -> Any:
    key = (name, step)
    if key not in _SUBSPACES:
        _SUBSPACES.clear() if len(_SUBSPACES) > 256 else None
        _SUBSPACES[key] = top_subspace(exact)
    return _SUBSPACES[key]


def summarize(
    rows: list[dict[str, Any]],
    codecs: dict[str, list[Any]],
    raw: dict[str, dict[str, list[dict[str, float]]]],
    shapes: list[tuple[int, ...]],
    matrices: list[str],
) -> list[dict[str, Any]]:
    out = []
    for v in rows:
        base = raw[v["base"]]
        ratios = {"rel": [], "out": []}
        pairs = []
        for name in matrices:
            mine, ref = raw[v["label"]][name], base[name]
            for key in ratios:
                per_step = [a[key] / b[key] for a, b in zip(mine, ref, strict=True)]
                ratios[key].append(float(np.median(per_step)))
                if key == "rel":
                    pairs += per_step
        codec = codecs[v["label"]][0]
        out.append(
            {
                **{k: v[k] for k in ("label", "codec", "base") if k in v},
                "k": v.get("k"),
                "refresh": v.get("refresh"),
                "rel": float(
                    np.median([np.median([m["rel"] for m in raw[v["label"]][n]]) for n in matrices])
                ),
                "rel_ratio": float(np.median(ratios["rel"])),
                "out_ratio": float(np.median(ratios["out"])),
                "p90_ratio": float(np.percentile(pairs, 90)),
                "max_ratio": float(np.max(pairs)),
                "cos": float(np.median([m["cos"] for n in matrices for m in raw[v["label"]][n]])),
                "side_model": side_fraction(codec, shapes),
                "side_4096": side_fraction(codec, [BIG]),
            }
        )
    return out


# ---------------------------------------------------------------------------
# report


def markdown(r: dict[str, Any]) -> str:
    lines = [
        "# GeoFP8 on real gradients",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Byte-level Llama `{r['model']}` ({r['params'] / 1e6:.2f}M parameters), "
        f"{r['world']} simulated ranks (the bits of real ones), {r['steps']} AdamW steps on "
        f"the exact average (loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}); metrics on "
        f"{len(r['measured_steps'])} steps, every weight matrix. Ratios: per matrix and step "
        "against the base quantizer, median over steps, then over matrices. `side`: side "
        "channel over quantized payload (model; one 4096 x 4096 gradient).",
        "",
        "| variant | base | rel | rel ratio | p90 / max | out ratio | cos | side model | "
        "side 4096² |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v in r["variants"]:
        lines.append(
            f"| {v['label']} | {v['base']} | {v['rel']:.4f} | {v['rel_ratio']:.3f} | "
            f"{v['p90_ratio']:.2f} / {v['max_ratio']:.2f} | {v['out_ratio']:.3f} | "
            f"{v['cos']:.5f} | {v['side_model']:+.1%} | {v['side_4096']:+.1%} |"
        )
    default = next(v for v in r["variants"] if v["label"] == "geofp8 (default)")
    rs = next((v for v in r["variants"] if v["label"] == "geofp8 (default, reduce-scatter)"), None)
    lines += [
        "",
        "## Targets",
        "",
        "| codec | target | measured | met |",
        "| --- | --- | --- | --- |",
        f"| geofp8 (default) | median error <= 0.5x E4M3 block 128 | "
        f"{default['rel_ratio']:.3f} | {'yes' if default['rel_ratio'] <= 0.5 else 'no'} |",
        f"| geofp8 (default) | error outside the top-4 subspace <= 0.5x | "
        f"{default['out_ratio']:.3f} | {'yes' if default['out_ratio'] <= 0.5 else 'no'} |",
        *(
            [
                f"| geofp8 (default), reduce-scatter only | keeps most of the all-reduce "
                f"gain | {rs['rel_ratio']:.3f} (all-reduce {default['rel_ratio']:.3f}) | "
                f"{'yes' if rs['rel_ratio'] <= 0.5 else 'no'} |"
            ]
            if rs
            else []
        ),
        "",
        f"Default config: `{json.dumps(default['codec'])}`",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for refresh in SWEEP_REFRESH:
        pts = [(v["k"], v["rel_ratio"]) for v in r["variants"] if v.get("refresh") == refresh]
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"refresh every {refresh}")
    default = next(v for v in r["variants"] if v["label"] == "geofp8 (default)")
    ax.axhline(
        default["rel_ratio"], color="k", ls=":", lw=1, label=f"default ({default['rel_ratio']:.3f})"
    )
    ax.axhline(0.5, color="r", ls="--", lw=1, label="target 0.5")
    ax.set_xlabel("rank k of the split map")
    ax.set_ylabel("error / E4M3 block 128 error (median)")
    ax.set_title("GeoFP8 split map on real gradients")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(result: dict[str, Any], path: Path) -> None:
    write_results(path, result, markdown, plot)


def run_zoo(args: argparse.Namespace) -> dict[str, Any]:
    """The (k, refresh) sweep on every zoo source: geo_zoo's measures per source."""
    import geo_zoo
    import zoo

    sweep = {f"split k={k} refresh={r}": (k, r) for r in ZOO_REFRESH for k in ZOO_K}
    configs = {geo_zoo.BASE: FP8, "geofp8 (default)": {"id": "geofp8"}}
    configs |= {
        label: {
            "id": "geofp8",
            "k": k,
            "refresh": r,
            "refresh_max": r,
            **OPEN,
        }
        for label, (k, r) in sweep.items()
    }
    sources = []
    for src in zoo.select(args.only):
        summary = geo_zoo.run_source(src, geo_zoo.codecs_for(configs, src.world))["summary"]
        sources.append({"source": src.name, "summary": summary})
        print(f"{src.name}: " + ", ".join(f"{lb} {v['median']:.3f}" for lb, v in summary.items()))
    return {
        "command": "python " + " ".join(sys.argv),
        "world": sorted({src.world for src in zoo.select(args.only)}),
        "configs": configs,
        "sweep": [{"label": lb, "k": k, "refresh": r} for lb, (k, r) in sweep.items()],
        "sources": sources,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--world", type=int, default=2, help="simulated ranks")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--start", type=int, default=20, help="first measured step")
    p.add_argument("--every", type=int, default=5, help="measure every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-J", "--json", default="perf/results/geo_real_gradients.json")
    p.add_argument("--report", default=None, help="re-render md and png from this JSON")
    p.add_argument("--zoo", action="store_true", help="sweep over the gradient zoo instead")
    p.add_argument(
        "--only", default="tuning", help="with --zoo: comma-separated source names or halves"
    )
    args = p.parse_args(argv)
    if args.zoo:
        default = p.get_default("json")
        path = "perf/results/geo_zoo_sweep.json" if args.json == default else args.json
        write_results(path, run_zoo(args))
        return 0
    if args.report:
        write(json.loads(Path(args.report).read_text()), Path(args.report))
        return 0
    result = run(args)
    write(result, Path(args.json))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
