"""Codecs (fp8, nvfp4, mxfp8, geofp8) against plain fp32 MPI on emulated links: one table.

Runs ``perf/all_reduce_perf.py`` inside ``perf/emulated_link.py`` (ranks in a
network namespace whose loopback is shaped with tc; MPI over TCP) for every
(link, rank count, codec), on the same gradient-like inputs (``--input
gradient``: 4096-column matrices, a rank-16 signal plus noise), with checking
on, and tabulates each codec's time against the plain fp32 all-reduce
(``--codec none``, Open MPI's own algorithm) of the same run. A last job
repeats geofp8 at 64 MiB under a plain ``mpiexec`` environment (no thread
variables set, as mpirun, srun or torchrun users have it) next to the same
job under geocomm.launch's per-rank thread share (``--plain-repeats 0``:
none). ``--load N`` runs N busy loops beside the jobs: an emulated slower
machine. Needs root (namespaces).

    python perf/studies/geo_links.py -o perf/results/geo_links
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import busy_loops, write_results, yardstick

ROOT = Path(__file__).resolve().parents[2]
#: (warm-up, timed) iterations per codec: enough timed calls for two refresh
#: periods of geofp8 and its cold start inside the warm-up
ITERS = {"none": (1, 3), "fp8": (2, 6), "nvfp4": (2, 6), "mxfp8": (2, 6), "geofp8": (4, 8)}
#: the compressed codecs of the table, in its column order (each against ``none``)
CODECS = ("fp8", "nvfp4", "mxfp8", "geofp8")


def sweep(
    link: str,
    ranks: int,
    codec: str,
    sizes: tuple[str, str],
    plain: bool = False,
    timeout: float = 3600,
) -> dict[str, Any]:
    """One all_reduce_perf job on the emulated link; its JSON report."""
    warm, iters = ITERS[codec]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [
            sys.executable,
            "perf/emulated_link.py",
            "--rate",
            link,
            "-n",
            str(ranks),
            *(["--plain"] if plain else []),
            "--",
            sys.executable,
            "perf/all_reduce_perf.py",
            "-b",
            sizes[0],
            "-e",
            sizes[1],
            "-f",
            "4",
            "-w",
            str(warm),
            "-n",
            str(iters),
            "--codec",
            codec,
            "--input",
            "gradient",
            "-J",
            str(out),
        ]
        print("#", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout)
        return json.loads(out.read_text())


def run(args: argparse.Namespace) -> dict[str, Any]:
    with busy_loops(args.load):
        return _sweeps(args)


def _sweeps(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "load": args.load,
        "yardstick_before": asdict(yardstick()),
        "runs": [],
    }
    for link in args.links.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for codec in ("none", *CODECS):
                report = sweep(link, ranks, codec, (args.min, args.max))
                result["runs"].append(
                    {
                        "link": link,
                        "ranks": ranks,
                        "codec": codec,
                        "launch": "geocomm.launch",
                        "report": report,
                    }
                )
    result["runs"] += plain_check(args)
    result["yardstick_after"] = asdict(yardstick())
    return result


def plain_check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """geofp8 at 64 MiB on 2 ranks under a plain mpiexec environment and under
    geocomm.launch, alternating, ``--plain-repeats`` jobs each (one job's time
    moves with the machine by more than the 10% compared)."""
    runs = []
    for _ in range(args.plain_repeats):
        for plain in (False, True):
            report = sweep(args.plain_link, 2, "geofp8", ("64M", "64M"), plain=plain)
            runs.append(
                {
                    "link": args.plain_link,
                    "ranks": 2,
                    "codec": "geofp8",
                    "launch": "plain mpiexec" if plain else "geocomm.launch",
                    "report": report,
                    "plain_check": True,
                }
            )
    return runs


def _row(run: dict[str, Any], size: int) -> dict[str, Any]:
    return next(r for r in run["report"]["rows"] if r["size"] == size)


def _time(run: dict[str, Any], size: int) -> float | None:
    return next((r["time_us"] for r in run["report"]["rows"] if r["size"] == size), None)


def markdown(r: dict[str, Any]) -> str:
    yb, ya = r["yardstick_before"], r["yardstick_after"]
    lines = [
        "# Compressed all-reduce on emulated links",
        "",
        f"Command: `{r['command']}` (root: network namespaces). Yardstick in the same run: "
        f"np.copyto {yb['copy_GBps']:.2f} GB/s before, {ya['copy_GBps']:.2f} after; "
        f"fp8 encode {yb['fp8_encode_GBps']:.2f} / {ya['fp8_encode_GBps']:.2f} GB/s.",
        "",
        *(
            [
                f"Background load: {r['load']} busy-loop processes beside the ranks (an emulated "
                "slower machine: each rank gets about half a core; the yardstick, one thread's "
                "speed when it runs, does not show it).",
                "",
            ]
            if r.get("load")
            else []
        ),
        "Inputs: 4096-column gradient-like matrices (rank-16 signal plus noise), checking on. "
        "Time: mean per call, the slowest rank's. Speed-up: time of plain fp32 MPI "
        "(`--codec none`) over the codec's time, same link, ranks and size.",
        "",
        "| link | ranks | size | fp32 MPI ms | "
        + " | ".join(f"{c} ms" for c in CODECS)
        + " | "
        + " | ".join(f"{c} speed-up" for c in CODECS)
        + " | "
        + " | ".join(f"{c} rel. error" for c in CODECS)
        + " | #wrong |",
        "| --- | --- | --- | ---: |" + " ---: |" * (3 * len(CODECS)) + " ---: |",
    ]
    sweeps = [x for x in r["runs"] if not x.get("plain_check")]
    keys = sorted({(x["link"], x["ranks"]) for x in sweeps}, key=lambda k: (k[0], k[1]))
    verdicts = []
    for link, ranks in keys:
        runs = {x["codec"]: x for x in sweeps if x["link"] == link and x["ranks"] == ranks}
        codecs = [c for c in CODECS if c in runs]  # results of older runs lack some
        for row in runs["none"]["report"]["rows"]:
            size = row["size"]
            base = row["time_us"]
            got = {c: _row(runs[c], size) for c in codecs}
            target = 3.0 if link.startswith("1gbit") else 1.5
            verdicts.append((link, ranks, size, base / got["geofp8"]["time_us"], target))
            cells = [f"{got[c]['time_us'] / 1e3:.1f}" if c in got else "" for c in CODECS]
            cells += [f"{base / got[c]['time_us']:.2f}x" if c in got else "" for c in CODECS]
            cells += [f"{got[c]['relerr']:.2e}" if c in got else "" for c in CODECS]
            wrong = sum(got[c]["wrong"] for c in codecs)
            lines.append(
                f"| {link} | {ranks} | {size >> 20} MiB | {base / 1e3:.1f} | "
                + " | ".join(cells)
                + f" | {wrong} |"
            )
    met = sum(v >= t for *_, v, t in verdicts)
    lines += [
        "",
        f"Must-show (geofp8 >= 3x fp32 at 1 Gbit/s, >= 1.5x at 10 Gbit/s): met at "
        f"{met} of {len(verdicts)} points.",
    ]
    checks = [x for x in r["runs"] if x.get("plain_check")]
    if checks:
        t = {
            launch: [_time(x, 64 << 20) / 1e3 for x in checks if x["launch"] == launch]
            for launch in ("plain mpiexec", "geocomm.launch")
        }
        plain, launch = (float(np.median(t[k])) for k in ("plain mpiexec", "geocomm.launch"))
        redo = f" (rerun by `{r['plain_command']}`)" if "plain_command" in r else ""
        lines += [
            "",
            f"Plain mpiexec (no thread variables) vs geocomm.launch{redo}, "
            f"geofp8 64 MiB, "
            f"2 ranks, {checks[0]['link']}, {len(t['plain mpiexec'])} alternating jobs "
            f"each: median {plain:.1f} ms vs {launch:.1f} ms ({plain / launch:.3f}x; "
            "target within 10%); the jobs: plain "
            + ", ".join(f"{v:.1f}" for v in t["plain mpiexec"])
            + " ms, launch "
            + ", ".join(f"{v:.1f}" for v in t["geocomm.launch"])
            + " ms.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="1gbit,10gbit")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--min", default="16M")
    p.add_argument("--max", default="256M")
    p.add_argument("--plain-link", default="10gbit", help="link of the plain-mpiexec check")
    p.add_argument("--plain-repeats", type=int, default=3, help="jobs of each launch")
    p.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy-loop processes beside the jobs (an emulated slower machine)",
    )
    p.add_argument(
        "--plain-only",
        action="store_true",
        help="redo only the plain-mpiexec check in the existing JSON",
    )
    p.add_argument("-o", "--out", default="perf/results/geo_links")
    p.add_argument("--report", action="store_true", help="re-render the md from the JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        result = json.loads(out.with_suffix(".json").read_text())
    elif args.plain_only:
        result = json.loads(out.with_suffix(".json").read_text())
        result["runs"] = [x for x in result["runs"] if not x.get("plain_check")]
        result["runs"] += plain_check(args)
        result["plain_command"] = "python " + " ".join(sys.argv)
    else:
        if os.geteuid() != 0:
            print("geo_links: needs root for the emulated links", file=sys.stderr)
            return 2
        result = run(args)
    write_results(out, result, markdown)  # --report: the record as it was, the md again
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
