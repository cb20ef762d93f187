"""The main job (``bash perf/run_main.sh``): compressed all-reduce against plain fp32 MPI.

    python perf/main_job.py                       # what run_main.sh runs: into perf/out/
    python perf/main_job.py --publish             # into perf/results/ (committed)
    python perf/main_job.py --links shm --codecs fp8 --max 1M   # a short look

Sweeps ``perf/all_reduce_perf.py`` for plain fp32 (``--codec none``) and
each codec over shared memory (``geocomm.launch``) and, where this machine
can make a network namespace (root, ``ip`` and ``tc``: see
``perf/emulated_link.py``), over emulated links (``--plain``: no thread
variables, as a plain mpiexec leaves them). Every job checks its results
against the derived error bounds and writes its JSON report to
``OUT/main_{link}_{codec}_n{ranks}.json``; then one summary table per link
(:mod:`main_summary`) is printed and written to ``OUT/main_n{ranks}.md`` and
``.json``, with a plot per link, ``OUT/main_{link}_n{ranks}.png``. Where no
namespace can be made, it says why and what the shared-memory numbers mean.

OUT is ``perf/out/`` (not tracked), so a run leaves the repository as it was;
``--publish`` writes to ``perf/results/`` instead, to refresh the committed
results on purpose, and ``--out`` anywhere else. The last line says where.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import main_summary
from emulated_link import namespace_problem
from lab import write_results

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: where a run writes: its own untracked folder, or the committed results with --publish
SCRATCH, PUBLISHED = HERE / "out", HERE / "results"
#: sweep settings per link: (largest size, warm-up calls, timed calls); the links
#: are slow, so fewer calls there (one 64 MiB fp32 call takes ~1 s at 1 Gbit/s)
SWEEPS = {"shm": ("64M", 3, 10), "10gbit": ("64M", 2, 6), "1gbit": ("64M", 1, 4)}
#: the sizes: SMALLEST times powers of FACTOR up to the link's largest (1 KiB .. 64 MiB)
SMALLEST, FACTOR = "1K", "4"
CODECS = ("none", "fp8", "nvfp4", "mxfp8", "geofp8")
#: at least this many (warm-up, timed) calls for geofp8: its first calls build the map
#: (the cold start stays in the warm-up), and the timed ones span two refresh periods
GEO_CALLS = (4, 8)


def sweep_command(link: str, codec: str, ranks: int, largest: str, out: Path) -> list[str]:
    """The command of one all_reduce_perf job on ``link`` (``shm``: shared memory), to
    run in the repository root."""
    _, warm, iters = SWEEPS[link]
    if codec.startswith("geo"):
        warm, iters = max(warm, GEO_CALLS[0]), max(iters, GEO_CALLS[1])
    py = sys.executable
    shaping = [] if link == "shm" else ["--rate", link, "--plain"]
    launcher = [py, "-m", "geocomm.launch"] if link == "shm" else [py, "perf/emulated_link.py"]
    launcher += [*shaping, "-n", str(ranks), "--timeout", "1800"]
    perf = [py, "perf/all_reduce_perf.py", "-b", SMALLEST, "-e", largest, "-f", FACTOR]
    perf += ["-w", str(warm), "-n", str(iters), "--codec", codec, "--input", "gradient"]
    shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    return [*launcher, "--", *perf, "-J", str(shown)]


def run_link(link: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every codec's sweep on ``link``; the link's summary table."""
    reports = []
    largest = args.max or SWEEPS[link][0]
    for codec in args.codecs.split(","):
        out = args.out / f"main_{link}_{codec}_n{args.ranks}.json"
        cmd = sweep_command(link, codec, args.ranks, largest, out)
        print(f"# main job: {link}, {codec}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        reports.append(json.loads(out.read_text()))
    launch = "geocomm.launch" if link == "shm" else "plain mpiexec (no thread variables)"
    draw(link, reports, args.ranks, args.out)
    return main_summary.link_table(link, reports, launch)


def draw(link: str, reports: list[dict[str, Any]], ranks: int, out: Path) -> None:
    """The link's plot, ``out/main_{link}_n{ranks}.png``."""
    from plot_perf import plot  # matplotlib (the perf extra) only when drawing

    where = "shared memory" if link == "shm" else f"emulated {link} link"
    title = f"all-reduce, {ranks} ranks, {where}"
    plot(reports, out / f"main_{link}_n{ranks}.png", title, short=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's arguments; ``out`` is the folder it writes to."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="shm,10gbit,1gbit", help="shm and/or tc rates")
    p.add_argument("--codecs", default=",".join(CODECS), help="none first: the baseline")
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--max", default=None, help="largest size (default: per link)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=SCRATCH, help="folder (default: perf/out)")
    where.add_argument(
        "--publish",
        action="store_const",
        dest="out",
        const=PUBLISHED,
        help="write to perf/results/, the committed results",
    )
    p.add_argument("--report", action="store_true", help="re-render the md and plots from the JSON")
    args = p.parse_args(argv)
    if args.codecs.split(",")[0] != "none":
        p.error("--codecs must start with none (plain fp32, the baseline)")
    unknown = set(args.links.split(",")) - set(SWEEPS)
    if unknown:
        p.error(f"unknown links {sorted(unknown)}; known: {', '.join(SWEEPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = args.out / f"main_n{args.ranks}"
    if args.report:
        summary = json.loads(stem.with_suffix(".json").read_text())
        for t in summary["links"]:
            names = ["none", *t["codecs"]]
            files = [args.out / f"main_{t['link']}_{c}_n{args.ranks}.json" for c in names]
            draw(t["link"], [json.loads(f.read_text()) for f in files], args.ranks, args.out)
        text = main_summary.document(summary)
        stem.with_suffix(".md").write_text(text)
        print(text)
        print(written(stem), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    links = args.links.split(",")
    shaped = [link for link in links if link != "shm"]
    problem = namespace_problem() if shaped else None
    if problem:
        print(
            f"# main job: no emulated link on this machine ({problem}); shared memory only. "
            + main_summary.SHM_NOTE,
            flush=True,
        )
        links = [link for link in links if link == "shm"]
    summary: dict[str, Any] = {
        "command": "bash perf/run_main.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
        "no_link": problem and f"{problem}; shared memory only. {main_summary.SHM_NOTE}",
        "links": [run_link(link, args) for link in links],
    }
    summary["command"] = summary["command"].strip()
    text = main_summary.document(summary)
    write_results(stem, summary, text)
    print(text, flush=True)
    print(written(stem), flush=True)
    return 0


def written(stem: Path) -> str:
    """The closing line: where the summary, the plots and the reports are."""
    folder = stem.parent.resolve()
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    line = f"# main job: summary {stem.name}.md and .json, plots and reports in {shown}/"
    if folder == SCRATCH:
        line += " (not tracked; bash perf/run_main.sh --publish writes to perf/results/)"
    return line


if __name__ == "__main__":
    sys.exit(main())
