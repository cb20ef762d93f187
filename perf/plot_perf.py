"""Plot and tabulate perf-tool JSON (``-J``) results.

    python perf/plot_perf.py perf/results/main_none_n2.json perf/results/main_fp8_n2.json \\
        --out perf/results/main_n2 --title "all-reduce, 2 ranks, shared memory"

Draws bus bandwidth and relative error against message size (one line per
input file) into OUT.png and writes OUT.md: a table of time per call for
every size and, when the first file is a baseline, each other file's speed-up
over it (time ratio, measured in the same way on the same machine), and
the machine yardstick each run measured (copy and fp8 encode speeds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
from lab import yardstick_line

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def label(report: dict) -> str:
    config = report["codec"]
    extra = ",".join(f"{k}={v}" for k, v in config.items() if k != "id")
    return config["id"] + (f"({extra})" if extra else "")


def plot(reports: list[dict], png: str | Path, title: str = "", short: bool = False) -> None:
    """Bus bandwidth and relative error against message size, one line per report, into
    ``png``; ``short``: lines named by codec id alone (long configurations crowd the plot)."""
    fig, (bw, err) = plt.subplots(1, 2, figsize=(11, 4))
    for r in reports:
        name = r["codec"]["id"] if short else label(r)
        sizes = [row["size"] for row in r["rows"]]
        bw.plot(sizes, [row["busbw_GBps"] for row in r["rows"]], marker="o", label=name)
        err.plot(sizes, [max(row["relerr"], 1e-9) for row in r["rows"]], marker="o", label=name)
    for ax, name in ((bw, "bus bandwidth (GB/s)"), (err, "relative error vs fp64")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    err.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="JSON files from all_reduce_perf -J (baseline first)")
    p.add_argument("--out", required=True, help="output path without suffix")
    p.add_argument("--title", default="")
    args = p.parse_args()
    reports = [json.loads(Path(f).read_text()) for f in args.inputs]
    plot(reports, f"{args.out}.png", args.title)

    names = [label(r) for r in reports]
    lines = [f"# {args.title}", "", "Commands:", ""]
    lines += [
        f"- `{r['command']}` ({r['ranks']} ranks). {yardstick_line(r.get('yardstick'))}"
        for r in reports
    ]
    lines += [
        "",
        "| size (B) | "
        + " | ".join(f"{n} time (us)" for n in names)
        + "".join(f" | {n} speed-up vs {names[0]}" for n in names[1:])
        + " | "
        + " | ".join(f"{n} wire/fp32" for n in names)
        + " |",
    ]
    lines.append("|---:" * (2 * len(names) + len(names) - 1 + 1) + "|")
    by_size = [{row["size"]: row for row in r["rows"]} for r in reports]
    for size in sorted(by_size[0]):
        rows = [b.get(size) for b in by_size]
        if any(row is None for row in rows):
            continue
        cells = [f"{row['time_us']:.1f}" for row in rows]
        cells += [f"{rows[0]['time_us'] / row['time_us']:.2f}x" for row in rows[1:]]
        cells += [f"{row['ratio_to_fp32']:.3f}" for row in rows]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    lines += ["", f"![busbw and error]({Path(args.out).name}.png)", ""]
    Path(f"{args.out}.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
