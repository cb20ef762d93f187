"""The report of perf/studies/geo_training.py: loss gaps to the exact run with intervals, curves."""

from __future__ import annotations

import math
import pathlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results, yardstick_line

#: Two-sided 95% quantiles of Student's t for 1..12 degrees of freedom.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)
#: Train losses are averaged over this many last steps (a step's own batch is noisy).
TAIL = 10


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval); half-width nan with one value."""
    x = np.asarray(values, np.float64)
    if x.size < 2:
        return float(x.mean()), math.nan
    return float(x.mean()), T95[x.size - 2] * float(x.std(ddof=1)) / math.sqrt(x.size)


def _by_seed(r: dict[str, Any], label: str, key: str) -> dict[int, float]:
    out = {}
    for run in r["runs"]:
        if run["codec"] == label:
            out[run["seed"]] = (
                float(np.mean(run["train"][-TAIL:])) if key == "train" else float(run[key])
            )
    return out


def gaps(r: dict[str, Any], label: str, key: str) -> list[float]:
    """Per seed: the codec's loss minus the exact run's (paired)."""
    mine, exact = _by_seed(r, label, key), _by_seed(r, "exact", key)
    return [mine[s] - exact[s] for s in sorted(mine) if s in exact]


def _fmt(mean: float, half: float, digits: int = 5) -> str:
    return f"{mean:+.{digits}f} ± {half:.{digits}f}"


def _measures(r: dict[str, Any]) -> list[tuple[str, str]]:
    out = [("final_eval", "eval (held out)"), ("train", f"train (last {TAIL} steps)")]
    if r["regime"] == "fixed":
        out.append(("final_objective", "objective after the last step"))
    return out


def gap_table(r: dict[str, Any]) -> list[str]:
    measures = _measures(r)
    lines = [
        "| codec | seeds | eval loss | "
        + " | ".join(f"gap to exact: {name}" for _, name in measures)
        + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in measures) + " |",
    ]
    for label in r["codecs"]:
        evals = list(_by_seed(r, label, "final_eval").values())
        mean, half = interval(evals)
        cells = [_fmt(*interval(gaps(r, label, key))) for key, _ in measures]
        lines.append(
            f"| {label} | {len(evals)} | {mean:.4f} ± {half:.4f} | " + " | ".join(cells) + " |"
        )
    return lines


def pair_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (Euclidean, geometry) pair and measure: the Euclidean gap, the geometry's,
    their paired difference (geometry minus Euclidean) with intervals, and the verdict."""
    rows = []
    for base, geo in r["pairs"]:
        for key, name in _measures(r):
            b, g = gaps(r, base, key), gaps(r, geo, key)
            diff = [y - x for x, y in zip(b, g, strict=True)]
            bm, bh = interval(b)
            dm, dh = interval(diff)
            rows.append(
                {
                    "base": base,
                    "geo": geo,
                    "measure": name,
                    "base_gap": (bm, bh),
                    "geo_gap": interval(g),
                    "diff": (dm, dh),
                    "base_measurable": bm - bh > 0,
                    "smaller": dm + dh < 0,
                    "seeds_lower": sum(d < 0 for d in diff),
                    "seeds": len(diff),
                }
            )
    return rows


def pair_table(r: dict[str, Any]) -> list[str]:
    lines = [
        "| Euclidean | geometry | measure | Euclidean gap | geometry gap | difference "
        "(geometry - Euclidean) | seeds where lower | Euclidean gap measurable? | "
        "geometry's measurably smaller? |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in pair_rows(r):
        lines.append(
            f"| {row['base']} | {row['geo']} | {row['measure']} | {_fmt(*row['base_gap'])} | "
            f"{_fmt(*row['geo_gap'])} | {_fmt(*row['diff'])} | "
            f"{row['seeds_lower']}/{row['seeds']} | "
            f"{'yes' if row['base_measurable'] else 'no'} | "
            f"{'yes' if row['smaller'] else 'no'} |"
        )
    return lines


def markdown(r: dict[str, Any]) -> str:
    m, a = r["model"], r["args"]
    seeds = sorted({run["seed"] for run in r["runs"]})
    regime = {
        "fixed": "full-batch training on a fixed set: each rank's own "
        f"{m['batch']} windows of {m['seq_len']} bytes, the same at every step, so the "
        "exact gradient has no sampling noise and the codec's error is the only thing that "
        "moves a run off the exact one",
        "sampled": f"fresh windows every step ({m['batch']} of {m['seq_len']} bytes per rank)",
    }[r["regime"]]
    lines = [
        "# GeoFP8 in training: DDP with geocomm's hook, loss gap to the exact average",
        "",
        f"Command: `{r['command']}`",
        "",
        yardstick_line(r.get("yardstick")),
        "",
        f"The zoo's byte-level Llama (width {m['d_model']}, {m['n_layers']} layers, "
        f"SwiGLU {m['ff']}, {m['positions']} positions), DDP over gloo on {r['ranks']} ranks, "
        f"every bucket averaged by `geocomm_hook` under each codec; AdamW lr {a['lr']} "
        f"(warm-up {a['warmup']}), {a['steps']} steps, seeds {seeds}; regime: {regime}. "
        "For one seed every codec starts from the same weights and sees the same batches, so "
        "each gap is paired; ± is the half-width of the 95% t-interval over seeds. Eval: "
        f"the mean loss over {a['final_batches']} fixed held-out batches after the last step. "
        f"Wall time {r['wall_s'] / 60:.1f} min.",
        "",
        "## Gap to the exact run",
        "",
        *gap_table(r),
        "",
        "## Geometry against the Euclidean quantizer it maps for",
        "",
        "A gap is measurable when its interval excludes zero; the geometry's is measurably "
        "smaller when the interval of the paired difference lies below zero.",
        "",
        *pair_table(r),
        "",
        "Codecs: " + "; ".join(f"`{k}` = `{v}`" for k, v in r["codecs"].items()),
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.4))
    exact = {run["seed"]: run for run in r["runs"] if run["codec"] == "exact"}
    colors = plt.get_cmap("tab10").colors
    for i, label in enumerate(r["codecs"]):
        runs = [run for run in r["runs"] if run["codec"] == label]
        train = np.mean([run["train"] for run in runs], axis=0)
        # the quantizer by colour family, the geometry by line: plain, split, whitening
        style = ":" if label.endswith("whiten") else "--" if label.endswith("split") else "-"
        color = colors[i % len(colors)]
        ax0.plot(np.arange(1, train.size + 1), train, style, lw=1, color=color, label=label)
        if label == "exact":
            continue
        steps = [s for s, _ in runs[0]["eval"]]
        diff = np.array(
            [
                [
                    v - e
                    for (_, v), (_, e) in zip(run["eval"], exact[run["seed"]]["eval"], strict=True)
                ]
                for run in runs
            ]
        )
        mean = diff.mean(axis=0)
        half = [interval(list(col))[1] for col in diff.T]
        ax1.errorbar(steps, mean, yerr=half, fmt=style, color=color, lw=1, capsize=2, label=label)
    ax0.set_xlabel("step")
    ax0.set_ylabel("train loss (mean over seeds)")
    ax0.set_yscale("log")
    ax0.legend(fontsize=7)
    ax1.axhline(0, color="k", lw=0.6)
    ax1.set_xlabel("step")
    ax1.set_ylabel("held-out loss - exact run's (mean, 95% CI)")
    ax1.set_title("gap to the exact run")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(result: dict[str, Any], path: Path) -> None:
    write_results(path, result, markdown, plot)
    print(markdown(result))
