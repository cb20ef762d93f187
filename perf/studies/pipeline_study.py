"""Chunk-size sweep of the pipelined all-reduce and the overlap it buys.

For one message size (default 64 MiB of fp32) and each stage size, reports
the pipelined time per call and, measured in the same run, encode,
communication and decode run one after the other without overlap. The
overlap ratio is pipelined / (encode + comm + decode); below 1 the pipeline
hides work. Picks the stage size with the fastest pipelined time. The machine
yardstick (:func:`geocomm.testing.yardstick`) is measured first and stated
with the table.

    python -m geocomm.launch -n 2 -- python perf/studies/pipeline_study.py --codec fp8
    python perf/emulated_link.py --rate 10gbit -n 2 -- \
        python perf/studies/pipeline_study.py --codec fp8 --out perf/results/pipeline_10gbit
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from pathlib import Path

import numpy as np

import geocomm
from geocomm.engine.costs import codec_for
from geocomm.engine.layout import DEFAULT_STAGE_SIZE

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import (
    breakdown,
    emulated_link,
    launch_command,
    parse_size,
    timed,
    write_results,
    yardstick,
    yardstick_line,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="bytes of fp32")
    p.add_argument("--codec", default="fp8")
    p.add_argument(
        "--stage-sizes",
        default="65536,262144,1048576,4194304,16777216",
        help="values per pipeline stage, comma separated",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="perf/results/pipeline")
    args = p.parse_args()
    comm = geocomm.get_comm()
    count = args.size // 4
    codec = codec_for(geocomm.get_codec(args.codec), count)
    ruler = yardstick(comm)
    x = np.random.default_rng([comm.rank, 7]).standard_normal(count, np.float32)
    rows = []
    for stage_size in [int(c) for c in args.stage_sizes.split(",")]:

        def call(stage_size: int = stage_size) -> None:
            geocomm.allreduce(x, codec=codec, stage_size=stage_size, comm=comm)

        call()  # warm-up
        seconds = timed(comm, call, args.iters)
        parts = breakdown(comm, codec, x, stage_size, gather=True)
        serial = parts["encode"] + parts["comm"] + parts["decode"]
        rows.append(
            {
                "stage_size": stage_size,
                "allreduce_ms": seconds * 1e3,
                **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
                "serial_ms": serial * 1e3,
                "overlap_ratio": parts["pipelined"] / serial,
            }
        )
        if comm.rank == 0:
            r = rows[-1]
            print(
                f"stage size {stage_size:>9}: allreduce {r['allreduce_ms']:8.2f} ms | encode "
                f"{r['encode_ms']:7.2f} comm {r['comm_ms']:7.2f} decode {r['decode_ms']:7.2f} "
                f"serial {r['serial_ms']:7.2f} pipelined {r['pipelined_ms']:7.2f} "
                f"ratio {r['overlap_ratio']:.3f}",
                flush=True,
            )
    if comm.rank != 0:
        return 0
    best = min(rows, key=lambda r: r["allreduce_ms"])
    link = emulated_link() or "shared memory"
    report = {
        "command": launch_command(comm.size),
        "link": link,
        "yardstick": dataclasses.asdict(ruler),
        "ranks": comm.size,
        "bytes": count * 4,
        "codec": codec.get_config(),
        "default_stage_size": DEFAULT_STAGE_SIZE,
        "best_stage_size": best["stage_size"],
        "rows": rows,
    }
    out = Path(f"{args.out}_n{comm.size}")
    write_results(out, report)  # the record first: a failing table loses nothing
    lines = [
        f"# Pipelined all-reduce, {count * 4 >> 20} MiB fp32, {comm.size} ranks, "
        f"codec {codec.get_config()}, link: {link}",
        "",
        f"Command: `{report['command']}`",
        "",
        yardstick_line(report["yardstick"]),
        "",
        "| stage size (values) | all-reduce ms | encode ms | comm ms | decode ms | serial ms "
        "| pipelined ms | pipelined / serial |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['stage_size']} | {r['allreduce_ms']:.2f} | {r['encode_ms']:.2f} | "
        f"{r['comm_ms']:.2f} | {r['decode_ms']:.2f} | {r['serial_ms']:.2f} | "
        f"{r['pipelined_ms']:.2f} | {r['overlap_ratio']:.3f} |"
        for r in rows
    ]
    lines += [
        "",
        f"Fastest stage size: {best['stage_size']} values (library default {DEFAULT_STAGE_SIZE}).",
    ]
    write_results(out, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
