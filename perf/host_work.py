"""What one steady-state compressed all-reduce asks of the host, on the GPU path.

Per call, after warm-up calls with the same arrays: geocomm's Python function calls
(``sys.setprofile``, functions of the geocomm package only), device allocations,
host synchronizations, launches (kernels, copies, NCCL groups queued one by one),
graph launches and event records. The device counts come from the CPU twin of CuPy
(``tests/twin``: it counts what reaches its device), so this runs without a GPU and
gives the same numbers on every machine; a real GPU gives the Python calls only.

    python -m geocomm.launch -n 1 -- env PYTHONPATH=tests/twin \\
        python perf/host_work.py --out perf/results/host_work

``--before FILE`` adds the columns of an earlier run's JSON (the same script run on
an older checkout) to the table. perf/results/host_work_before.json is this script
run on commit 1618988 (before the call object and the device plans), installed
beside the tree: ``git archive 1618988 | tar -x -C OLD && pip install --no-deps
--target OLDPKG OLD``, then the command above with ``PYTHONPATH=OLDPKG:tests/twin``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: values per call: 64 pipeline stages of 4096 values at the smallest stage size
COUNT = 64 * 4096
STAGES = (1, 8, 64)
CODECS = {
    "fp8": "fp8",
    "nvfp4": "nvfp4",
    "fp8 stochastic": {"id": "fp8", "rounding": "stochastic"},
    "geofp8 power step": "geofp8",
    "geofp8 power step, eager": "geofp8",
    "geofp8 between steps": "geofp8",
    "geofp8 flat": "geofp8",
}
#: GeoFP8 maps matrices: its calls reduce a keyed (512, 512) gradient (COUNT values) of
#: rank 8 plus noise through one codec object, which keeps the key's state from call to
#: call: its power steps come every 1, 2, 4 and then 8 calls (the basis settles). The
#: rows are the last call of GEO_CALLS that took a step (a replay: the key stepped at
#: that rank twice before), the last that took one eagerly (the first time it stepped
#: at that rank: a bucket whose keys step in a new pattern), and the last that did not.
#: "geofp8 flat": white noise, whose flat spectrum goes plain and is measured again
#: when due (the last call of GEO_CALLS)
MATRIX = (512, 512)
WARMUP = 3
GEO_CALLS = 20


def geocomm_calls(run: Any) -> int:
    """Python function calls into the geocomm package while ``run()`` runs."""
    import geocomm

    package = os.path.dirname(geocomm.__file__)
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def device_counts() -> dict[str, int]:
    """The twin's counters (empty on a real GPU)."""
    try:
        from cupy import _memory
    except ImportError:
        return {}
    return dict(getattr(_memory, "counters", {}))


def measure(comm: Any, cupy: Any, name: str, stages: int) -> dict[str, int]:
    import geocomm

    rng = np.random.default_rng(comm.rank)
    stream = cupy.cuda.Stream(non_blocking=True)
    codec, values, options = CODECS[name], rng.standard_normal(COUNT), {}
    geo = name.startswith("geofp8")
    if geo:
        m, n = MATRIX
        values = rng.standard_normal(MATRIX)
        if name != "geofp8 flat":
            values += 3 * rng.standard_normal((m, 8)) @ rng.standard_normal((8, n))
        codec, options = geocomm.get_codec("geofp8"), {"key": "w"}
    with stream:
        x = cupy.asarray(values.astype(np.float32))
        out = cupy.empty_like(x)

        def call() -> None:
            geocomm.allreduce(
                x, codec=codec, comm=comm, out=out, stage_size=COUNT // stages, **options
            )

        def counted() -> tuple[bool, dict[str, int]]:
            """(whether the key's basis changed in the call, its counts)"""
            refreshed = codec.state_info("w")["refreshed"] if geo else 0
            before = device_counts()
            row = {"python_calls": geocomm_calls(call)}
            after = device_counts()
            for kind in ("allocations", "syncs", "launches", "graph_launches", "events"):
                row[kind] = after.get(kind, 0) - before.get(kind, 0)
            return geo and codec.state_info("w")["refreshed"] != refreshed, row

        for _ in range(WARMUP):
            call()
        if not geo or name == "geofp8 flat":
            row = counted()[1]
        else:
            calls = [counted() for _ in range(GEO_CALLS)]
            step = name.startswith("geofp8 power step")
            eager = name.endswith("eager")
            row = [
                r
                for stepped, r in calls
                if stepped == step and (not eager or r["graph_launches"] == 0)
            ][-1]
        stream.synchronize()
    return row


def markdown(rows: list[dict[str, Any]], before: list[dict[str, Any]] | None) -> str:
    kinds = ("python_calls", "allocations", "syncs", "launches", "graph_launches", "events")
    old = {(r["codec"], r["stages"]): r for r in before or []}
    head = ["codec", "stages"] + [k.replace("_", " ") for k in kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["codec"], str(r["stages"])]
        for k in kinds:
            was = old.get((r["codec"], r["stages"]), {}).get(k)
            cells.append(f"{was} -> {r[k]}" if was is not None else str(r[k]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write OUT.json and OUT.md")
    p.add_argument("--before", help="an earlier run's JSON, shown beside this one")
    args = p.parse_args()
    import cupy

    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator()
    rows = []
    for name in CODECS:
        for stages in STAGES:
            rows.append({"codec": name, "stages": stages, **measure(comm, cupy, name, stages)})
    before = json.loads(Path(args.before).read_text())["rows"] if args.before else None
    table = markdown(rows, before)
    if comm.rank == 0:
        print(table)
        if args.out:
            twin = bool(getattr(cupy, "TWIN", False))
            report = {"count": COUNT, "ranks": comm.size, "twin": twin, "rows": rows}
            Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
            before_arg = f" --before {args.before}" if before else ""
            Path(args.out + ".md").write_text(
                f"# Host work per steady-state call\n\n{COUNT} float32 values, {comm.size} "
                f"rank(s), {'the CPU twin of CuPy' if twin else 'a GPU'}, after {WARMUP} "
                f"calls with the same arrays (GeoFP8: the last call of the {GEO_CALLS} after "
                "them that took a power step, the last that took one eagerly, and the last "
                "that did not). Command: "
                "`python -m geocomm.launch -n 1 -- env PYTHONPATH=tests/twin python "
                "perf/host_work.py --out perf/results/host_work"
                f"{before_arg}`. A cell of two numbers is before -> after (the docstring of "
                "perf/host_work.py says how the before column was made).\n\n" + table
            )
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
