"""GeoFP8's trade-off: error on real gradients against time on one core, per (k, refresh).

Joins the sweep of perf/studies/geo_real_gradients.py (error relative to E4M3
block 128 on the small Llama's gradients) with the sweep of perf/geo_bench.py
(time of a call on a 4096 x 4096 gradient relative to FP8's encode + decode)
and marks the default. Writes a markdown table and a plot.

    python perf/studies/geo_tradeoff.py perf/results/geo_real_gradients.json \\
        perf/results/geo_bench.json -o perf/results/geo_tradeoff

Given the zoo sweep (``geo_real_gradients.py --zoo``) instead, the table has
one column per zoo source (median per-matrix error over FP8's, and bytes):

    python perf/studies/geo_tradeoff.py perf/results/geo_zoo_sweep.json \\
        perf/results/geo_bench.json -o perf/results/geo_zoo_tradeoff
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def join(study: dict[str, Any], bench: dict[str, Any]) -> list[dict[str, Any]]:
    """(k, refresh, error ratio, time ratio) for every setting both sweeps ran."""
    times = {(s["k"], s["refresh"]): s["ratio_to_fp8"] for s in bench["sweep"]}
    rows = []
    for v in study["variants"]:
        key = (v.get("k"), v.get("refresh"))
        if key in times:
            rows.append(
                {
                    "k": key[0],
                    "refresh": key[1],
                    "error_ratio": v["rel_ratio"],
                    "time_ratio": times[key],
                }
            )
    return rows


def zoo_markdown(study: dict[str, Any], bench: dict[str, Any]) -> str:
    """One row per (k, refresh): the time on one core, and per zoo source the median
    per-matrix error ratio and the bytes over FP8's."""
    times = {(s["k"], s["refresh"]): s["ratio_to_fp8"] for s in bench["sweep"]}
    names = [s["source"] for s in study["sources"]]
    lines = [
        "# GeoFP8 on the gradient zoo: error, bytes and time per (k, refresh)",
        "",
        f"Error and bytes: `{study['command']}`. Time: `{bench['command']}` "
        f"({bench['shape'][0]} x {bench['shape'][1]}, one core, over FP8 encode + decode = "
        f"{bench['fp8_seconds'] * 1e3:.2f} ms; np.copyto {bench['copyto_GBps']:.2f} GB/s in "
        "the same run). Cells: median per-matrix error / FP8's, and bytes / FP8's.",
        "",
        "| k | refresh | time / FP8 | " + " | ".join(names) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for v in study["sweep"]:
        cells = []
        for s in study["sources"]:
            row = s["summary"][v["label"]]
            cells.append(f"{row['median']:.3f} / {row['bytes_steady']:.3f}")
        t = times.get((v["k"], v["refresh"]))
        lines.append(
            f"| {v['k']} | {v['refresh']} | {'-' if t is None else f'{t:.2f}'} | "
            + " | ".join(cells)
            + " |"
        )
    d = [f"{s['summary']['geofp8 (default)']['median']:.3f}" for s in study["sources"]]
    lines.append(
        f"| default | {bench['default']['config']['refresh']} | "
        f"{bench['default']['ratio_to_fp8']:.2f} | " + " | ".join(d) + " |"
    )
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict[str, Any]], study: dict[str, Any], bench: dict[str, Any]) -> str:
    default = next(v for v in study["variants"] if v["label"] == "geofp8 (default)")
    d = bench["default"]
    lines = [
        "# GeoFP8: error against time",
        "",
        f"Error: `{study['command']}` (median over the small Llama's weight matrices, "
        "relative to E4M3 block 128). Time: "
        f"`{bench['command']}` ({bench['shape'][0]} x {bench['shape'][1]}, one core, relative "
        f"to FP8 encode + decode = {bench['fp8_seconds'] * 1e3:.2f} ms; np.copyto "
        f"{bench['copyto_GBps']:.2f} GB/s in the same run).",
        "",
        f"Default (k = {d['k']}, refresh {d['config']['refresh']}): error "
        f"{default['rel_ratio']:.3f}x, time {d['ratio_to_fp8']:.2f}x.",
        "",
        "| k | refresh | error / FP8 | time / FP8 |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['k']} | {r['refresh']} | {r['error_ratio']:.3f} | {r['time_ratio']:.2f} |"
        for r in sorted(rows, key=lambda r: (r["refresh"], r["k"]))
    ]
    return "\n".join(lines) + "\n"


def plot(
    rows: list[dict[str, Any]], study: dict[str, Any], bench: dict[str, Any], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for refresh in sorted({r["refresh"] for r in rows}):
        pts = sorted(
            (r["time_ratio"], r["error_ratio"], r["k"]) for r in rows if r["refresh"] == refresh
        )
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"refresh every {refresh}"
        )
        for t, e, k in pts:
            ax.annotate(f"k={k}", (t, e), textcoords="offset points", xytext=(4, 3), fontsize=7)
    default = next(v for v in study["variants"] if v["label"] == "geofp8 (default)")
    ax.plot(
        [bench["default"]["ratio_to_fp8"]], [default["rel_ratio"]], "k*", ms=14, label="default"
    )
    ax.axhline(0.5, color="r", ls="--", lw=1, label="error target 0.5")
    ax.axvline(4.0, color="r", ls=":", lw=1, label="time target 4x")
    ax.set_xlabel("time of a call / FP8 encode+decode (4096 x 4096, one core)")
    ax.set_ylabel("error / E4M3 block 128 error (real gradients)")
    ax.set_title("GeoFP8 split map: error against time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="geo_real_gradients JSON")
    p.add_argument("bench", help="geo_bench JSON")
    p.add_argument("-o", "--out", default="perf/results/geo_tradeoff", help="output stem")
    args = p.parse_args(argv)
    study = json.loads(Path(args.study).read_text())
    bench = json.loads(Path(args.bench).read_text())
    if "sources" in study:
        text = zoo_markdown(study, bench)
        Path(args.out).with_suffix(".md").write_text(text)
        print(text)
        return 0
    rows = join(study, bench)
    out = Path(args.out)
    out.with_suffix(".md").write_text(markdown(rows, study, bench))
    plot(rows, study, bench, out.with_suffix(".png"))
    print(markdown(rows, study, bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
