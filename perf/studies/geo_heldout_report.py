"""The report of perf/studies/geo_heldout.py: tables per half, the targets, the curves."""

from __future__ import annotations

import json
import pathlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from geo_zoo_report import yardstick_line
from lab import write_results

#: Issue 40's targets on the held-out half, at <= 1.05x FP8's bytes.
TARGETS = {"median": 0.45, "calls28": 0.6, "model": 0.35, "bytes_steady": 1.05}
#: The default (the split, on either kind of device: geocomm.codecs.geo.policy's
#: DEVICE_GEOMETRY) and the whitening (``transform="whiten"``), at the default bytes.
DEFAULTS = {"default (split)": "split 1.05", "whiten": "whiten 1.05"}
KINDS = ("embeddings", "positions", "projections", "head")
#: The tuning rule: settings within this much of the best mean median count as tied.
TIE = 0.01


def _halves(r: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for half in ("tuning", "heldout"):
        rows = [s for s in r["sources"] if s["half"] == half]
        if rows:
            out.append((half, rows))
    return out


def _source_cell(s: dict[str, Any]) -> str:
    return f"{s['source']} ({s['params'] / 1e6:.1f}M, {s['world']} ranks)"


def _header(r: dict[str, Any]) -> list[str]:
    return [
        f"Command: `{r['command']}`",
        "",
        yardstick_line(r),
        "",
        "Halves (perf/studies/zoo.py): tuning "
        + ", ".join(f"`{n}`" for n in r["halves"]["tuning"])
        + "; held out "
        + ", ".join(f"`{n}`" for n in r["halves"]["heldout"])
        + ".",
        "",
        "Every source from a fresh codec state, as many simulated ranks as the source has. "
        "Ratios against E4M3 block 128: `median` over matrices of each matrix's median over "
        "calls 2..W (steady state); `calls 2-8` the median over calls 2..8 of the per-call "
        "median over matrices (a fresh key); `last` the per-call median at the last call; "
        "`model` the whole model's error (all parameters), median over calls 2..W; `bytes` a "
        "rank's payload and side channel over FP8's payload, calls 2..W; `plain tensors' "
        "share`: of the whole model's squared error over calls 2..W, the part in tensors the "
        "codec leaves plain (1-D ones, and matrices below `min_dim`/`min_numel`), and `model, "
        "plain exact` the whole model's ratio without it (summed over calls, not a median).",
        "",
    ]


def tuning_choice(r: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The whitening setting the rule picks (geo_heldout.py's docstring), and every
    setting's mean steady median over the tuning sources."""
    rows = [s for s in r["sources"] if s["half"] == "tuning"]
    means = {
        label: float(np.mean([s["summary"][label]["median"] for s in rows]))
        for label in r["variants"]
        if label.startswith("whiten")
    }
    best = min(means.values())
    tied = [label for label, v in means.items() if v <= best + TIE]
    return min(tied, key=lambda label: int(label.split()[1])), means


def tune_markdown(r: dict[str, Any]) -> str:
    lines = ["# GeoFP8's whitening knobs on the tuning half of the zoo", "", *_header(r)]
    labels = [lb for lb in r["variants"] if lb != r["base"]]
    lines += [
        "Steady median / whole model per source, at the default bytes (side budget 5%).",
        "",
        "| source | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    rows = [s for s in r["sources"] if s["half"] == "tuning"]
    for s in rows:
        cells = [
            f"{s['summary'][lb]['median']:.3f} / {s['summary'][lb]['model']:.3f}" for lb in labels
        ]
        lines.append(f"| {_source_cell(s)} | " + " | ".join(cells) + " |")
    mean = [
        f"{np.mean([s['summary'][lb]['median'] for s in rows]):.3f} / "
        f"{np.mean([s['summary'][lb]['model'] for s in rows]):.3f}"
        for lb in labels
    ]
    lines.append("| mean | " + " | ".join(mean) + " |")
    choice, means = tuning_choice(r)
    lines += [
        "",
        f"Rule (fixed before the run): the lowest mean steady median; among settings within "
        f"{TIE} of it, the fewest whitened directions. Chosen: **{choice}** (mean "
        f"{means[choice]:.3f}; best {min(means.values()):.3f}).",
        "",
        f"Configs: `{json.dumps(r['variants'])}`",
    ]
    return "\n".join(lines) + "\n"


def _defaults_table(r: dict[str, Any]) -> list[str]:
    lines = []
    for device, lb in DEFAULTS.items():
        lines += [
            f"### {device} (`{lb}`: transform `{r['variants'][lb]['transform']}`)",
            "",
            "| half | source | median | calls 2-8 | worst of 2-8 | last | model | bytes "
            "| plain tensors' share of the model's error | model, plain exact |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for half, rows in _halves(r):
            for s in rows:
                d = s["summary"][lb]
                lines.append(
                    f"| {half} | {_source_cell(s)} | {d['median']:.3f} | {d['calls28']:.3f} | "
                    f"{d['worst28']:.3f} | {d['last']:.3f} | {d['model']:.3f} | "
                    f"{d['bytes_steady']:.3f} | {d['plain_share']:.3f} | "
                    f"{d['model_plain_exact']:.3f} |"
                )
        lines.append("")
    return lines


def _targets_table(r: dict[str, Any]) -> list[str]:
    rows = [s for s in r["sources"] if s["half"] == "heldout"]
    lines = [
        "| geometry | source | median <= 0.45 | calls 2-8 <= 0.6 | model <= 0.35 | bytes <= 1.05 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for device, lb in DEFAULTS.items():
        met = dict.fromkeys(TARGETS, 0)
        for s in rows:
            d = s["summary"][lb]
            cells = []
            for key, bound in TARGETS.items():
                ok = d[key] <= bound + (5e-4 if key == "bytes_steady" else 0.0)
                met[key] += ok
                cells.append(f"{d[key]:.3f} {'yes' if ok else 'no'}")
            lines.append(f"| {device} | {s['source']} | " + " | ".join(cells) + " |")
        lines.append(
            f"| {device} | **met** | "
            + " | ".join(f"{met[k]} of {len(rows)}" for k in TARGETS)
            + " |"
        )
    return lines


def _curve_table(r: dict[str, Any], key: str) -> list[str]:
    points = list(r["byte_points"])
    lines = [
        "| half | source | " + " | ".join(f"{p}x: split / whiten" for p in points) + " |",
        "| --- | --- | " + " | ".join("---" for _ in points) + " |",
    ]
    for half, rows in _halves(r):
        for s in rows:
            cells = []
            for p in points:
                split = s["summary"].get(f"split {p}")
                white = s["summary"][f"whiten {p}"]
                left = "1.000" if split is None else f"{split[key]:.3f}"
                right_bytes = max(white["bytes_steady"], split["bytes_steady"] if split else 1.0)
                cells.append(f"{left} / {white[key]:.3f} ({right_bytes:.3f})")
            lines.append(f"| {half} | {s['source']} | " + " | ".join(cells) + " |")
    return lines


def _range_table(r: dict[str, Any]) -> list[str]:
    lines = [
        "| half | variant | median | calls 2-8 | model | bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for half, rows in _halves(r):
        for lb in r["variants"]:
            if lb == r["base"]:
                continue
            cells = []
            for key in ("median", "calls28", "model", "bytes_steady"):
                vals = [s["summary"][lb][key] for s in rows]
                cells.append(f"{min(vals):.3f}-{max(vals):.3f}")
            lines.append(f"| {half} | {lb} | " + " | ".join(cells) + " |")
    return lines


def _kinds_table(r: dict[str, Any]) -> list[str]:
    lines = [
        "| half | geometry | " + " | ".join(KINDS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in KINDS) + " |",
    ]
    for half, rows in _halves(r):
        for device, lb in DEFAULTS.items():
            cells = []
            for kind in KINDS:
                kinds = [s["summary"][lb]["kinds"] for s in rows]
                vals = [k[kind] for k in kinds if kind in k]
                count = sum(int(s["summary"][lb]["kinds"].get(f"{kind} count", 0)) for s in rows)
                cells.append(f"{np.median(vals):.3f} ({count})" if vals else "-")
            lines.append(f"| {half} | {device} | " + " | ".join(cells) + " |")
    return lines


def curve_markdown(r: dict[str, Any]) -> str:
    lines = ["# GeoFP8 on the held-out half of the gradient zoo, beside the tuning half", ""]
    if r.get("input_side"):
        lines[0] += ": GPT-2's Conv1D gradients transposed (the maps on their input side)"
    lines += _header(r)
    lines += ["## The default and the whitening, at the default bytes", "", *_defaults_table(r)]
    lines += ["## Targets on the held-out half (issue 40), at <= 1.05x FP8's bytes", ""]
    lines += [*_targets_table(r), ""]
    lines += [
        "## Error against bytes, per source (the headline)",
        "",
        "Steady median per point: split / whiten (the larger of their bytes over FP8's in "
        "brackets; at 1.00 the split is FP8 itself and the whitening sends no side bytes).",
        "",
        *_curve_table(r, "median"),
        "",
        "Median over calls 2-8 of a fresh key, same layout:",
        "",
        *_curve_table(r, "calls28"),
        "",
        "Whole model, same layout:",
        "",
        *_curve_table(r, "model"),
        "",
        "## Ranges per half (min-max over the half's sources)",
        "",
        *_range_table(r),
        "",
        "## Per kind of matrix (median over the half's matrices of that kind; count)",
        "",
        *_kinds_table(r),
        "",
        f"Configs: `{json.dumps(r['variants'])}`",
    ]
    return "\n".join(lines) + "\n"


def markdown(r: dict[str, Any]) -> str:
    return tune_markdown(r) if r["mode"] == "tune" else curve_markdown(r)


def plot(r: dict[str, Any], path: Path) -> None:
    if r["mode"] == "tune":
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for _, half in _halves(r) for s in half]
    cols = 4
    fig, axes = plt.subplots(
        -(-len(rows) // cols), cols, figsize=(13, 2.6 * -(-len(rows) // cols)), squeeze=False
    )
    points = list(r["byte_points"])
    for ax, s in zip(axes.flat, rows, strict=False):
        for geometry, style in (("split", "o-"), ("whiten", "s-")):
            xs, ys = [1.0], [1.0]
            if geometry == "whiten":
                xs, ys = [], []
            for p in points:
                row = s["summary"].get(f"{geometry} {p}")
                if row is not None:
                    xs.append(row["bytes_steady"])
                    ys.append(row["median"])
            ax.plot(xs, ys, style, ms=3, label=geometry)
        ax.axhline(TARGETS["median"], color="r", ls="--", lw=0.8)
        ax.axvline(TARGETS["bytes_steady"], color="r", ls=":", lw=0.8)
        ax.set_title(f"{s['source']} [{s['half']}]", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("bytes per call / FP8's (payload + side)")
    fig.supylabel("median per-matrix error / FP8's (steady)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write(result: dict[str, Any], path: Path) -> None:
    write_results(path, result, markdown, plot)
    print(markdown(result))
