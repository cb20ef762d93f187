"""What GeoFP8's side channel sends on N real ranks: wire bytes over its quantizer's.

Each rank of an N-rank job (``geocomm.launch``) feeds one simulated rank's
recorded gradients of a zoo source (perf/studies/zoo.py; N at most the
source's ``world``) through ``geocomm.allreduce`` over a ``MeteredComm`` of
MPI, which counts the bytes this rank hands its all-to-alls and all-gathers
(its own segments only, as a network would see them). Per codec pair (GeoFP8
over fp8, GeoNVFP4 over nvfp4, each a fresh codec) it reports the pair's bytes
summed over all ranks and over the recorded steps 2..W (step 1 measures the
bases: no side channel) in two layouts: every parameter its own call
(``key=name``), and DDP's buckets of 25 MB of fp32 in reverse parameter order
(``parts=``). The side channel's budget (``side_budget``) counts what a rank
contributes; this is what the ranks send for it.

    python perf/studies/side_bytes.py --ranks 2,3,4,8 -J perf/results/side_bytes.json \
        [--baseline an-earlier-run.json]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import geo_steps  # noqa: E402
import numpy as np  # noqa: E402
import zoo  # noqa: E402

PAIRS = (("geofp8", "fp8"), ("geonvfp4", "nvfp4"))
SOURCE = "gpt2-192-0.5k-late64-x8"


def sent_bytes(codec_id: str, layout: str, z: dict[str, Any], comm: Any) -> int:
    """Bytes this rank sends over steps 2..W of source ``z`` through a fresh codec."""
    import geocomm
    from geocomm.codecs import get_codec
    from geocomm.testing import MeteredComm

    metered = MeteredComm(comm)
    codec = get_codec(codec_id)
    names = z["names"]
    for step, ranks in enumerate(z["steps"]):
        grads = ranks[comm.rank]
        if step == 1:
            metered.reset()
        if layout == "tensor":
            for name in names:
                geocomm.allreduce(grads[name], codec=codec, comm=metered, key=name)
            continue
        for bucket in geo_steps.buckets({n: grads[n].size for n in names}):
            flat = np.concatenate([grads[n].reshape(-1) for n in bucket])
            parts = [(n, grads[n].shape) for n in bucket]
            geocomm.allreduce(flat, codec=codec, comm=metered, parts=parts)
    return int(metered.sent)


def worker(args: argparse.Namespace) -> int:
    """One rank of an N-rank job: prints rank 0's JSON row of summed bytes."""
    from geocomm.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    (src,) = zoo.select(args.source)
    if comm.size > src.world:
        raise SystemExit(f"{src.name} records {src.world} ranks, not {comm.size}")
    z = zoo.load(src, verbose=False)
    row: dict[str, Any] = {"ranks": comm.size, "source": src.name}
    for layout in ("tensor", "bucket"):
        for geo, plain in PAIRS:
            for codec_id in (geo, plain):
                mine = np.array([sent_bytes(codec_id, layout, z, comm)], np.int64)
                row[f"{layout}/{codec_id}"] = int(comm.allgather_int64(mine).sum())
    if comm.rank == 0:
        print("ROW " + json.dumps(row), flush=True)
    return 0


def ratios(row: dict[str, Any]) -> dict[str, float]:
    return {
        f"{layout}/{geo}": row[f"{layout}/{geo}"] / row[f"{layout}/{plain}"]
        for layout in ("tensor", "bucket")
        for geo, plain in PAIRS
    }


def markdown(result: dict[str, Any]) -> str:
    """The ratios per rank count; with a baseline run, each cell is "baseline -> this"."""
    base = {row["ranks"]: ratios(row) for row in result.get("baseline", {}).get("rows", [])}
    lines = [
        f"# GeoFP8's wire bytes over its quantizer's on N ranks ({result['source']})",
        "",
        f"{result['date']}, commit {result['commit']}; `{result['command']}`. "
        "Bytes every rank handed MPI (MeteredComm), summed over ranks and recorded "
        "steps 2..W, over the plain quantizer's for the same calls.",
    ]
    if base:
        lines += ["", f"Each cell: commit {result['baseline']['commit']} -> {result['commit']}."]
    lines += [
        "",
        "| ranks | GeoFP8 / fp8, per tensor | GeoNVFP4 / nvfp4, per tensor | "
        "GeoFP8 / fp8, 25 MB buckets | GeoNVFP4 / nvfp4, 25 MB buckets |",
        "| --- | --- | --- | --- | --- |",
    ]
    columns = ("tensor/geofp8", "tensor/geonvfp4", "bucket/geofp8", "bucket/geonvfp4")
    for row in result["rows"]:
        now, before = ratios(row), base.get(row["ranks"])
        cells = [
            f"{now[c]:.3f}" if before is None else f"{before[c]:.3f} -> {now[c]:.3f}"
            for c in columns
        ]
        lines.append(f"| {row['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3,4,8", help="comma-separated rank counts")
    p.add_argument("--source", default=SOURCE, help="a zoo source recorded on enough ranks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-J", "--json", type=pathlib.Path, help="write JSON here (and .md beside)")
    p.add_argument("--baseline", type=pathlib.Path, help="an earlier run's JSON to set beside")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    zoo.load(zoo.select(args.source)[0])  # made once, before the ranks read it
    rows = []
    for n in (int(x) for x in args.ranks.split(",")):
        command = [sys.executable, "-m", "geocomm.launch", "-n", str(n), "--timeout", "3000"]
        command += ["--", sys.executable, __file__, "--worker", "--source", args.source]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        found = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not found:
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"{n} ranks failed (exit {done.returncode})")
        rows.append(json.loads(found[0][4:]))
        print({k: round(v, 4) for k, v in ratios(rows[-1]).items()}, f"on {n} ranks", flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=pathlib.Path(__file__).parent,
    ).stdout.strip()
    result = {
        "source": args.source,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "command": "python perf/studies/side_bytes.py " + " ".join(argv or sys.argv[1:]),
    }
    if args.baseline:
        result["baseline"] = json.loads(args.baseline.read_text())
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
