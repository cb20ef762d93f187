"""Shared driver of the nccl-tests-style perf tools (all_reduce_perf, reduce_scatter_perf).

A collective plugs in four things (see :class:`Collective`): how to run it,
its bus-bandwidth factor, the bytes a rank sends, and the per-element error
bound used to count ``#wrong``. Inputs are regenerated from the seed on every
rank, so each rank checks its result against an fp64 reduction of all
inputs. Columns follow nccl-tests (size, count, type, redop, time, algbw,
busbw, #wrong) plus wire bytes per rank, the ratio to fp32 ring traffic and
the relative error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import geocomm
from geocomm.collectives import Layout, get_comm, resolve_codec

DTYPES = {"float": np.float32, "half": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclass
class Collective:
    name: str
    #: run(x, codec, op, chunk) -> result
    run: Callable
    #: busbw = algbw * bus_factor(N)
    bus_factor: Callable[[int], float]
    #: expected(inputs_f64_sum, rank, size) -> the slice of the reduction this rank holds
    expected: Callable
    #: bound(inputs, codec, rank, size) -> per-element error bound on this rank's result
    bound: Callable
    #: gather: whether the all-gather phase exists (wire bytes, breakdown)
    gather: bool


class MeteredComm:
    """A communicator that forwards to ``inner`` and counts the bytes this rank sends.

    All-to-all: the segments addressed to other ranks. All-gather: its
    segment once per other rank. Plain all-reduce: 2(N-1)/N of the buffer
    (ring). The small int64 all-gather of the consistency check is counted too.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.rank, self.size, self.backend = inner.rank, inner.size, inner.backend
        self.sent = 0

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        self.sent += int(np.sum(send_counts)) - int(send_counts[self.rank])
        return self.inner.alltoallv(send, send_counts, send_displs, recv, recv_counts,
                                    recv_displs)

    def allgatherv(self, send, recv, counts, displs):
        self.sent += (self.size - 1) * int(send.nbytes)
        return self.inner.allgatherv(send, recv, counts, displs)

    def allreduce(self, send, recv, op):
        self.sent += ring_bytes(int(send.nbytes), self.size)
        return self.inner.allreduce(send, recv, op)

    def allgather_int64(self, values):
        self.sent += (self.size - 1) * int(np.asarray(values).nbytes)
        return self.inner.allgather_int64(values)

    def barrier(self) -> None:
        self.inner.barrier()


def command_line(nranks: int) -> str:
    """The command that reproduces this run, launcher included."""
    link = os.environ.get("GEOCOMM_LINK")  # set by perf/emulated_link.py
    launcher = (f"python perf/emulated_link.py --rate {link.split()[0]} -n {nranks}" if link
                else f"python -m geocomm.launch -n {nranks}")
    return " ".join([launcher, "--", "python", *sys.argv])


def parse_size(text: str) -> int:
    """'8', '1K', '128M', '1G' -> bytes (binary multiples, like nccl-tests)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_args(name: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"{name}_perf", description=f"geocomm {name} perf sweep")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="check results (1) or not (0)")
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg"])
    p.add_argument("-d", "--datatype", default="float", choices=list(DTYPES))
    p.add_argument("-J", "--output_file", default=None, help="write results as JSON")
    p.add_argument("--codec", default="fp8", help="codec id (none, bf16, fp8, nvfp4, geofp8...)")
    p.add_argument("--codec-args", default="{}", help='JSON codec parameters, e.g. {"fmt":"e5m2"}')
    p.add_argument("--chunk", type=int, default=None, help="pipeline chunk (values per stage)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time encode, communication and decode on their own")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _inputs(count: int, size: int, seed: int, index: int, dtype) -> list[np.ndarray]:
    return [np.random.default_rng([seed, index, r]).standard_normal(count, np.float32)
            .astype(dtype) for r in range(size)]


def slowest(comm, value: float) -> float:
    """The largest of every rank's ``value``."""
    mine, worst = np.array([value], np.float64), np.empty(1)
    comm.allreduce(mine, worst, "max")
    return float(worst[0])


def timed(comm, fn: Callable, iters: int) -> float:
    """Mean seconds per call, the slowest rank's (as nccl-tests reports)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest(comm, (time.perf_counter() - start) / max(iters, 1))


def ring_bytes(nbytes: int, size: int) -> int:
    """Bytes a rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N of them."""
    return 2 * (size - 1) * nbytes // size


def breakdown(comm, codec, x: np.ndarray, chunk: int | None, gather: bool,
              repeats: int = 3) -> dict[str, float]:
    """Seconds of encode, communication and decode run one after the other
    (no overlap) and of the pipelined run, for the same call; each the best
    of ``repeats`` runs, the slowest rank's."""
    runs = [_breakdown_once(comm, codec, x, chunk, gather) for _ in range(repeats)]
    return {part: min(run[part] for run in runs) for part in runs[0]}


def _breakdown_once(comm, codec, x: np.ndarray, chunk: int | None,
                    gather: bool) -> dict[str, float]:
    source = np.ascontiguousarray(x, np.float32).reshape(-1)
    layout = Layout.plan(source.size, comm.size, chunk or geocomm.collectives.DEFAULT_CHUNK_ELEMS)
    bounds = layout.bounds
    offset = 0 if gather else int(bounds[comm.rank])
    length = source.size if gather else int(bounds[comm.rank + 1] - bounds[comm.rank])
    result = np.empty(length, np.float32)
    parts = {"encode": 0.0, "comm": 0.0, "decode": 0.0}

    def clock(part: str, fn: Callable, *args) -> None:
        start = time.perf_counter()
        fn(*args)
        parts[part] += time.perf_counter() - start

    pipe = geocomm.collectives.Pipeline(comm, codec, layout, source, result, offset, gather)
    comm.barrier()
    for s in range(layout.stages):
        clock("encode", pipe.encode_stage, s)
        clock("comm", lambda s=s: (pipe.start_alltoall(s), pipe.a2a_req[s].wait()))
        clock("decode", pipe.reduce_stage, s)
        if gather:
            clock("encode", pipe.reencode_stage, s)
            clock("comm", lambda s=s: (pipe.start_allgather(s), pipe.ag_req[s].wait()))
            clock("decode", pipe.decode_stage, s)
    pipelined = geocomm.collectives.Pipeline(comm, codec, layout, source, result, offset, gather)
    comm.barrier()
    start = time.perf_counter()
    pipelined.run()
    parts["pipelined"] = time.perf_counter() - start
    mine = np.array([parts["encode"], parts["comm"], parts["decode"], parts["pipelined"]])
    slowest = np.empty(4)
    comm.allreduce(mine, slowest, "max")
    return dict(zip(["encode", "comm", "decode", "pipelined"], slowest.tolist(), strict=True))


def main(coll: Collective, argv: list[str] | None = None) -> int:
    args = parse_args(coll.name, argv)
    comm = get_comm()
    rank, size = comm.rank, comm.size
    codec = resolve_codec({"id": args.codec, **json.loads(args.codec_args)})
    dtype = DTYPES[args.datatype]
    itemsize = np.dtype(dtype).itemsize
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# geocomm {coll.name}_perf: {size} ranks, codec {codec.get_config()}, "
        f"op {args.op}, type {args.datatype}, chunk {args.chunk or 'default'}")
    say("# command: " + command_line(size))
    head = (f"{'size':>12} {'count':>10} {'type':>8} {'redop':>6} {'time(us)':>10} "
            f"{'algbw':>7} {'busbw':>7} {'#wrong':>7} {'wire(B)':>12} {'ratio':>6} {'relerr':>9}")
    if args.breakdown:
        head += f" {'enc(us)':>9} {'comm(us)':>9} {'dec(us)':>9} {'pipe(us)':>9} {'overlap':>7}"
    say(head)
    rows = []
    nbytes, index = args.minbytes, 0
    while nbytes <= args.maxbytes:
        count = max(nbytes // itemsize, 1)
        xs = _inputs(count, size, args.seed, index, dtype) if args.check else None
        x = xs[rank] if xs is not None else _inputs(count, 1, args.seed, index, dtype)[0]

        def call(x=x, count=count) -> np.ndarray:
            return coll.run(x, codec, args.op, args.chunk)

        for _ in range(args.warmup_iters):
            call()
        seconds = timed(comm, call, args.iters)
        result = call()
        wrong, relerr = -1, float("nan")
        if xs is not None:
            f64 = [v.astype(np.float64) for v in xs]
            exact = coll.expected(np.sum(f64, axis=0), rank, size, args.op)
            diff = np.abs(result.astype(np.float64) - exact)
            bound = coll.bound([v.astype(np.float32) for v in xs], codec, rank, size, args.op)
            out_unit = 0.0 if dtype == np.float32 else (2.0**-8 if itemsize == 2 and
                                                        dtype != np.float16 else 2.0**-11)
            bound = bound * (1 + out_unit) + out_unit * np.abs(exact)
            counts = np.array([int(np.sum(diff > bound))], np.int64)
            wrong = int(comm.allgather_int64(counts).sum())
            norm = np.linalg.norm(exact)
            relerr = float(np.linalg.norm(diff) / norm) if norm > 0 else 0.0
        layout = Layout.plan(count, size, args.chunk or geocomm.collectives.DEFAULT_CHUNK_ELEMS)
        if codec.lossless:
            wire = ring_bytes(count * 4, size) if coll.gather else \
                int((size - 1) / size * count * 4)
        else:
            wire = max(int(r[0]) for r in comm.allgather_int64(np.array(
                [geocomm.collectives.wire_bytes(codec, layout, rank, coll.gather)])))
        fp32_wire = coll.bus_factor(size) * count * 4
        algbw = count * itemsize / seconds / 1e9
        row = {
            "size": count * itemsize, "count": count, "type": args.datatype, "redop": args.op,
            "time_us": seconds * 1e6, "algbw_GBps": algbw,
            "busbw_GBps": algbw * coll.bus_factor(size), "wrong": wrong, "wire_bytes": wire,
            "ratio_to_fp32": wire / fp32_wire if fp32_wire else 0.0, "relerr": relerr,
        }
        line = (f"{row['size']:>12} {count:>10} {args.datatype:>8} {args.op:>6} "
                f"{row['time_us']:>10.1f} {algbw:>7.3f} {row['busbw_GBps']:>7.3f} {wrong:>7} "
                f"{wire:>12} {row['ratio_to_fp32']:>6.3f} {relerr:>9.2e}")
        if args.breakdown and not codec.lossless:
            parts = breakdown(comm, codec, x, args.chunk, coll.gather)
            serial = parts["encode"] + parts["comm"] + parts["decode"]
            row["breakdown_us"] = {k: v * 1e6 for k, v in parts.items()}
            row["overlap_ratio"] = parts["pipelined"] / serial if serial else float("nan")
            line += (f" {parts['encode'] * 1e6:>9.1f} {parts['comm'] * 1e6:>9.1f} "
                     f"{parts['decode'] * 1e6:>9.1f} {parts['pipelined'] * 1e6:>9.1f} "
                     f"{row['overlap_ratio']:>7.3f}")
        say(line)
        rows.append(row)
        nbytes, index = nbytes * args.stepfactor, index + 1
        if args.stepfactor <= 1:
            break
    total_wrong = sum(max(r["wrong"], 0) for r in rows)
    avg_busbw = float(np.mean([r["busbw_GBps"] for r in rows])) if rows else 0.0
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    say(f"# Avg bus bandwidth    : {avg_busbw:.4f} GB/s")
    if rows:
        say(f"# Largest size busbw   : {rows[-1]['busbw_GBps']:.4f} GB/s "
            f"at {rows[-1]['size']} bytes")
    if rank == 0 and args.output_file:
        report = {
            "tool": f"{coll.name}_perf", "command": command_line(size), "ranks": size,
            "codec": codec.get_config(), "op": args.op, "datatype": args.datatype,
            "link": os.environ.get("GEOCOMM_LINK", "shared memory"),
            "chunk": args.chunk, "machine": platform.machine(), "python": platform.python_version(),
            "geocomm": geocomm.__version__, "rows": rows, "wrong_total": total_wrong,
            "avg_busbw_GBps": avg_busbw,
        }
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if total_wrong == 0 else 1
