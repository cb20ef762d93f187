"""The report of perf/studies/geo_zoo.py: markdown tables, the targets and a plot."""

from __future__ import annotations

import json
import pathlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results

DEFAULT = "geofp8 (default)"
#: issue 23's targets, per zoo source (time is perf/geo_bench.py's, on 4096 x 4096)
TARGETS = {"median": 0.45, "model": 0.4, "bytes_steady": 1.05, "fresh": 0.6}


def _fresh_worst(row: dict[str, Any]) -> float:
    """The largest per-call median over calls 2..8 of a fresh key."""
    return max(row["fresh"][1:8])


def _fresh_median(row: dict[str, Any]) -> float:
    """The median over calls 2..8 of a fresh key of the per-call median over matrices."""
    calls = sorted(row["fresh"][1:8])
    mid = len(calls) // 2
    return calls[mid] if len(calls) % 2 else (calls[mid - 1] + calls[mid]) / 2


def yardstick_line(r: dict[str, Any]) -> str:
    """The zoo studies' machine yardstick (geo_zoo.yardstick), before and after the run."""
    y0, y1 = r["yardstick"]["before"], r["yardstick"]["after"]
    return (
        f"Yardstick (one core, same run, before / after): np.copyto "
        f"{y0['copyto_GBps']:.2f} / {y1['copyto_GBps']:.2f} GB/s; FP8 E4M3 b128 encode of 4M "
        f"values {y0['fp8_encode_ms_4M']:.2f} / {y1['fp8_encode_ms_4M']:.2f} ms."
    )


def markdown(r: dict[str, Any]) -> str:
    lines = [
        "# GeoFP8 on the gradient zoo",
        "",
        f"Command: `{r['command']}`",
        "",
        yardstick_line(r),
        "",
        f"{r['world']} simulated ranks (the source's), every source's recorded steps from a "
        "fresh codec state "
        "(perf/studies/zoo.py). Ratios against E4M3 block 128: `median`/`p90` over matrices "
        "of each matrix's median over calls 2..W; `model`: the whole model's error (all "
        "parameters), median over calls 2..W; `fresh`: the per-call median over matrices at "
        "calls 2..8 of a fresh key, their median and (`worst`) their largest; `bytes`: a "
        "rank's payload + side (coefficients, their energies and the power steps' sums) "
        "over FP8's payload, calls 2..W (with call 1's cold start in brackets); `time`: the "
        "simulated calls' seconds over FP8's.",
        "",
        f"## {DEFAULT}",
        "",
        "| source | params | median | p90 | model | fresh | worst | bytes | time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in r["sources"]:
        d = s["summary"][DEFAULT]
        lines.append(
            f"| {s['source']} | {s['params'] / 1e6:.2f}M | {d['median']:.3f} | {d['p90']:.3f} | "
            f"{d['model']:.3f} | {_fresh_median(d):.3f} | {_fresh_worst(d):.3f} | "
            f"{d['bytes_steady']:.3f} "
            f"({d['bytes_all']:.3f}) | {d['time']:.2f}x |"
        )
    lines += ["", "## Every variant (median / model / bytes)", ""]
    labels = list(r["variants"])
    lines += [
        "| source | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    for s in r["sources"]:
        cells = [
            f"{v['median']:.3f} / {v['model']:.3f} / {v['bytes_steady']:.3f}"
            for v in (s["summary"][label] for label in labels)
        ]
        lines.append(f"| {s['source']} | " + " | ".join(cells) + " |")
    lines += ["", "## Targets (issue 23), default config", ""]
    lines += [
        "| source | median <= 0.45 | model <= 0.4 | bytes <= 1.05 | fresh <= 0.6 "
        "| worst call <= 0.6 |"
    ]
    lines += ["| --- | --- | --- | --- | --- | --- |"]
    for s in r["sources"]:
        d = s["summary"][DEFAULT]
        got = {**d, "fresh": _fresh_median(d), "worst": _fresh_worst(d)}
        targets = {**TARGETS, "worst": TARGETS["fresh"]}
        cells = [f"{got[k]:.3f} {'yes' if got[k] <= t else 'no'}" for k, t in targets.items()]
        lines.append(f"| {s['source']} | " + " | ".join(cells) + " |")
    lines += ["", f"Configs: `{json.dumps(r['variants'])}`"]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for label in r["variants"]:
        if label == r["base"]:
            continue
        pts = [
            (s["summary"][label]["bytes_steady"], s["summary"][label]["median"])
            for s in r["sources"]
        ]
        ax.scatter(*zip(*pts, strict=True), label=label, s=18)
    ax.axhline(TARGETS["median"], color="r", ls="--", lw=1, label="median target 0.45")
    ax.axvline(TARGETS["bytes_steady"], color="r", ls=":", lw=1, label="bytes target 1.05")
    ax.set_xlabel("bytes per call / FP8's (payload + side)")
    ax.set_ylabel("median per-matrix error / FP8's")
    ax.set_title("GeoFP8 on the gradient zoo (one point per source)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(result: dict[str, Any], path: Path) -> None:
    write_results(path, result, markdown, plot)
    print(markdown(result))
