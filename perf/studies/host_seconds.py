"""geocomm's own host time per steady-state device call, estimated without a GPU.

On the CPU twin of CuPy (tests/twin) a steady-state compressed all-reduce replays
one captured graph; the twin's replay (and each event record) hands work to a
Python thread per stream, which a GPU does not have. Here those two are replaced,
after warm-up, by no-ops (an event already passed), so what is timed is what a
GPU's host would run of geocomm's Python: the argument checks, the signature's
cache, the cross-rank check (an MPI all-gather of the fingerprint) and the
plan's bookkeeping, plus the twin's array attributes (slower than CuPy's). Not
timed: CuPy's graph launch and event record themselves (a few microseconds on a
GPU's host). Numbers are this CPU's: compare only rows of one run, or runs
alternated in one sitting (``--label``, then ``--merge``).

    python -m geocomm.launch -n 1 -- env PYTHONPATH=tests/twin \\
        python perf/studies/host_seconds.py --label HEAD -J OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/codec_bench.py
from codec_bench import cpu_model

COUNT = 1 << 18
CALLS = 3000
#: (row name, codec, check)
ROWS = (
    ("fp8", "fp8", True),
    ("fp8, check=False", "fp8", False),
    ("nvfp4", "nvfp4", True),
    ("bf16", "bf16", True),
)


def measure(comm: Any, cupy: Any, codec: str, check: bool) -> dict[str, float]:
    """Median and 10th percentile of ``CALLS`` steady-state calls, in microseconds."""
    from cupy import _device  # the twin's device

    import geocomm

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.asarray(np.random.default_rng(0).standard_normal(COUNT).astype(np.float32))
        out = cupy.empty_like(x)

        def call() -> None:
            geocomm.allreduce(x, codec=codec, comm=comm, out=out, check=check)

        for _ in range(3):
            call()
        passed = stream.record()
        stream.synchronize()
        saved = _device.Graph.launch, _device.Stream.record, _device.Stream._record
        _device.Graph.launch = lambda self, stream=None: None
        _device.Stream.record = _device.Stream._record = lambda self, event=None: passed
        try:
            seconds = []
            for _ in range(CALLS):
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
        finally:
            _device.Graph.launch, _device.Stream.record, _device.Stream._record = saved
    seconds.sort()
    return {"median_us": seconds[CALLS // 2] * 1e6, "p10_us": seconds[CALLS // 10] * 1e6}


def markdown(runs: list[dict[str, Any]]) -> str:
    head = ["call"] + [f"{r['label']} median / p10 (us)" for r in runs]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, (name, _, _) in enumerate(ROWS):
        cells = [name] + [
            f"{r['rows'][i]['median_us']:.1f} / {r['rows'][i]['p10_us']:.1f}" for r in runs
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="this build", help="the run's column heading")
    p.add_argument("-J", "--json", help="write this run to JSON")
    p.add_argument("--merge", nargs="+", help="runs' JSON files: print their table, run none")
    p.add_argument("--out", help="with --merge: write the runs to OUT.json and OUT.md")
    args = p.parse_args()
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        table = markdown(runs)
        print(table)
        if args.out:
            Path(args.out + ".json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
            Path(args.out + ".md").write_text(
                "# geocomm's host time per steady-state device call, on the CPU twin\n\n"
                f"{runs[0]['count']} float32 values, {runs[0]['ranks']} rank(s), median and "
                f"10th percentile of {runs[0]['calls']} calls after 3 warm-up calls, the "
                "twin's graph replay and event records left out (perf/studies/host_seconds.py "
                f"says what is timed), CPU {runs[0]['cpu']}. Columns alternate builds in one "
                "sitting. Command per column: `python -m geocomm.launch -n 1 -- env "
                "PYTHONPATH=[OLD_BUILD:]tests/twin python perf/studies/host_seconds.py "
                "--label L -J L.json`, then `--merge *.json --out OUT`.\n\n" + table
            )
        return 0
    import cupy

    if not getattr(cupy, "TWIN", False):
        sys.exit("host_seconds: needs the CPU twin of CuPy (PYTHONPATH=tests/twin)")
    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator()
    rows = [{"call": n, **measure(comm, cupy, c, k)} for n, c, k in ROWS]
    run = {"label": args.label, "ranks": comm.size, "count": COUNT, "calls": CALLS,
           "cpu": cpu_model(), "rows": rows}  # fmt: skip
    comm.close()
    if comm.rank == 0:
        print(markdown([run]))
        if args.json:
            Path(args.json).write_text(json.dumps(run, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
