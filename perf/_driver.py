"""Shared driver of the nccl-tests-style perf tools (all_reduce_perf, reduce_scatter_perf).

A collective plugs in four things (see :class:`Collective`): how to run it,
its bus-bandwidth factor, the bytes a rank sends, and the error bound used to
count ``#wrong``. Inputs are regenerated from the seed on every rank, so each
rank checks its result against an fp64 reduction of all inputs. Columns
follow nccl-tests (size, count, type, redop, time, algbw, busbw, #wrong) plus
the bytes a rank sent (measured: payload, side channels and the metadata
check), the ratio to fp32 ring traffic and the relative error. A header comment
line and the JSON (``yardstick``) give the machine's copy and fp8 encode
speeds measured in the same run (:func:`geocomm.testing.yardstick`); the
timing and size helpers live in :mod:`geocomm.testing` too.

Inputs (``--input``): ``gaussian`` vectors, or ``gradient``: matrices of
``--cols`` columns like a weight gradient, a signal of rank 16 shared by the
ranks (singular values falling by 2x every 4 directions, 90% of the energy)
plus each rank's own noise. Transforming codecs (geofp8, geonvfp4, hadamard)
get ``gradient`` by default, since they leave 1-D tensors plain. Their
results are checked norm-wise (``#wrong`` is 1 when ||error|| exceeds the
derived bound): no element-wise bound exists for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from lab import breakdown, emulated_link, launch_command, parse_size, timed, yardstick

import geocomm
from geocomm.api import get_comm, resolve_codec
from geocomm.api.calls import requested_topology
from geocomm.codecs import TransformingCodec, bounds, get_codec
from geocomm.comm.nodes import node_layout
from geocomm.engine.costs import codec_for
from geocomm.testing import MeteredComm

DTYPES = {"float": np.float32, "half": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclass
class Collective:
    name: str
    #: run(x, codec, op, stage_size) -> result
    run: Callable
    #: busbw = algbw * bus_factor(N)
    bus_factor: Callable[[int], float]
    #: span(count, rank, size) -> the flat range [lo, hi) of the reduction this rank holds
    span: Callable
    #: bound(input slices, codec, size, op, amaxes, a_prime) -> per-element error bound of
    #: those elements of the result (amaxes, a_prime: whole-tensor scalars of the bound;
    #: a_prime None: the result was quantized once)
    bound: Callable
    #: norm_bound(inputs, codec, rank, size, op, twice) -> bound of ||error|| (transforming
    #: codecs; twice: whether the result was quantized twice)
    norm_bound: Callable
    #: gather: whether the all-gather phase exists (wire bytes, breakdown)
    gather: bool


def parse_args(name: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"{name}_perf", description=f"geocomm {name} perf sweep")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument(
        "-c", "--check", type=int, default=1, choices=[0, 1], help="check results (1) or not (0)"
    )
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg"])
    p.add_argument("-d", "--datatype", default="float", choices=list(DTYPES))
    p.add_argument("-J", "--output_file", default=None, help="write results as JSON")
    p.add_argument("--codec", default="fp8", help="codec id (none, bf16, fp8, nvfp4, geofp8...)")
    p.add_argument("--codec-args", default="{}", help='JSON codec parameters, e.g. {"fmt":"e5m2"}')
    p.add_argument(
        "--stage-size",
        type=int,
        default=None,
        help="values per pipeline stage (default: the backend's)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time encode, communication and decode on their own",
    )
    p.add_argument(
        "--input",
        choices=["auto", "gaussian", "gradient"],
        default="auto",
        help="gaussian vectors or gradient-like matrices (auto: gradient for transforming codecs)",
    )
    p.add_argument("--cols", type=int, default=4096, help="columns of gradient-like inputs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        p.error(f"sizes must satisfy 1 <= -b <= -e, got -b {args.minbytes} -e {args.maxbytes}")
    if args.stepfactor < 1 or args.iters < 1 or args.warmup_iters < 0:
        p.error("-f and -n must be at least 1 and -w at least 0")
    try:
        args.codec_config = {"id": args.codec, **json.loads(args.codec_args)}
        get_codec(args.codec_config)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        p.error(f"--codec {args.codec} --codec-args {args.codec_args}: {exc}")
    return args


def _inputs(
    count: int, ranks: list[int], seed: int, index: int, dtype, kind: str, cols: int
) -> list[np.ndarray]:
    """The inputs of ``ranks`` for sweep point ``index`` (any rank can rebuild any)."""
    if kind == "gaussian" or count < 2 * cols or count % cols:
        return [
            np.random.default_rng([seed, index, r]).standard_normal(count, np.float32).astype(dtype)
            for r in ranks
        ]
    rows, rank_k = count // cols, 16
    shared = np.random.default_rng([seed, index, 1 << 20])
    sigma = 2.0 ** (-np.arange(rank_k) / 4)
    u = shared.standard_normal((rows, rank_k), np.float32) * sigma.astype(np.float32)
    v = shared.standard_normal((rank_k, cols), np.float32)
    signal = u @ v
    # noise of 1/3 the signal's rms: the rank-16 signal holds ~90% of the energy
    scale = np.float32(float(np.sqrt(np.mean(signal * signal))) / 3)
    return [
        (
            signal
            + scale
            * np.random.default_rng([seed, index, r]).standard_normal((rows, cols), np.float32)
        ).astype(dtype)
        for r in ranks
    ]


#: Values per slice of the result check: the check holds a few fp64 copies of one
#: slice at a time, so it fits in memory at any size and rank count.
CHECK_SLICE = 1 << 22


def check(
    coll: Collective,
    xs: list[np.ndarray],
    result: np.ndarray,
    codec: Any,
    comm: Any,
    op: str,
    dtype: Any,
) -> tuple[int, float]:
    """(#wrong over all ranks, the largest relative error of any rank's result) of
    ``result`` against the fp64 reduction of every rank's input ``xs``, slice by slice.

    Element-wise codecs count the elements outside the derived bound;
    transforming codecs (no element-wise bound) count 1 when the error's norm
    exceeds the norm-wise bound. Results in bf16/fp16 also carry the output
    cast's half unit.
    """
    rank, size = comm.rank, comm.size
    flat = [
        x.reshape(-1) if x.dtype == np.float32 else x.reshape(-1).astype(np.float32) for x in xs
    ]
    lo, hi = coll.span(flat[0].size, rank, size)
    got = result.reshape(-1)
    out_unit = 0.0 if dtype == np.float32 else (2.0**-11 if dtype == np.float16 else 2.0**-8)
    transforms = isinstance(codec, TransformingCodec)
    amaxes = [float(np.max(np.abs(f))) if f.size else 0.0 for f in flat]
    twice = coll.gather or _uneven_nodes(comm)
    a_prime = None
    if not transforms and not codec.lossless and twice:
        a_prime = max(
            (
                bounds.stage_two_amax([f[a:b] for f in flat], codec, amaxes)
                for a, b in _slices(0, flat[0].size)
            ),
            default=0.0,
        )
    mine, err2, norm2 = 0, 0.0, 0.0
    for a, b in _slices(lo, hi):
        exact = np.zeros(b - a, np.float64)
        for f in flat:
            exact += f[a:b]
        if op == "avg":
            exact /= size
        diff = np.abs(got[a - lo : b - lo].astype(np.float64) - exact)
        err2 += float(diff @ diff)
        norm2 += float(exact @ exact)
        if not transforms:
            bound = coll.bound([f[a:b] for f in flat], codec, size, op, amaxes, a_prime)
            mine += int(np.sum(diff > bound * (1 + out_unit) + out_unit * np.abs(exact)))
    if transforms:
        bound = coll.norm_bound(xs, codec, rank, size, op, twice)
        bound = bound * (1 + out_unit) + out_unit * np.sqrt(norm2)
        mine = int(np.sqrt(err2) > bound)
    wrong = int(comm.allgather_int64(np.array([mine], np.int64)).sum())
    relerr = np.array([np.sqrt(err2 / norm2) if norm2 > 0 else 0.0])
    worst = np.empty_like(relerr)
    comm.allreduce(relerr, worst, "max")
    return wrong, float(worst[0])


def _uneven_nodes(comm: Any) -> bool:
    """Whether a call may run node-aware on nodes of unequal size, where a
    reduce-scatter returns the node-aware all-reduce's shard (quantized twice):
    GEOCOMM_TOPOLOGY is not "flat" and the layout (gathered at the sweep's first
    call, cached) is such. Every rank asks at the same point."""
    if comm.size == 1 or requested_topology(None) == "flat":
        return False
    layout = node_layout(comm)
    return layout is not None and not layout.trivial and len(set(layout.sizes())) > 1


def _slices(lo: int, hi: int) -> Any:
    return ((a, min(a + CHECK_SLICE, hi)) for a in range(lo, hi, CHECK_SLICE))


def main(coll: Collective, argv: list[str] | None = None) -> int:
    args = parse_args(coll.name, argv)
    comm = get_comm()
    rank, size = comm.rank, comm.size
    codec = resolve_codec(args.codec_config)
    big = codec_for(
        codec, args.maxbytes // np.dtype(DTYPES[args.datatype]).itemsize, comm.backend, size
    )
    kind = (
        args.input
        if args.input != "auto"
        else ("gradient" if isinstance(big, TransformingCodec) else "gaussian")
    )
    dtype = DTYPES[args.datatype]
    itemsize = np.dtype(dtype).itemsize
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"# geocomm {coll.name}_perf: {size} ranks, codec {codec.get_config()}, "
        f"op {args.op}, type {args.datatype}, stage size {args.stage_size or 'default'}, "
        f"input {kind}" + (f" ({args.cols} columns)" if kind == "gradient" else "")
    )
    say("# command: " + launch_command(size))
    ruler = yardstick(comm)
    say(f"# yardstick: {ruler}")
    head = (
        f"{'size':>12} {'count':>10} {'type':>8} {'redop':>6} {'time(us)':>10} "
        f"{'algbw':>7} {'busbw':>7} {'#wrong':>7} {'wire(B)':>12} {'ratio':>6} {'relerr':>9}"
    )
    if args.breakdown:
        head += f" {'enc(us)':>9} {'comm(us)':>9} {'dec(us)':>9} {'pipe(us)':>9} {'overlap':>7}"
    say(head)
    rows = []
    nbytes, index = args.minbytes, 0
    while nbytes <= args.maxbytes:
        count = max(nbytes // itemsize, 1)
        ranks = list(range(size)) if args.check else [rank]
        xs = _inputs(count, ranks, args.seed, index, dtype, kind, args.cols)
        x = xs[rank] if args.check else xs[0]

        def call(x=x, comm=comm) -> np.ndarray:
            return coll.run(x, codec, args.op, args.stage_size, comm)

        for _ in range(args.warmup_iters):
            call()
        seconds = timed(comm, call, args.iters)
        used = codec_for(codec, count, comm.backend, size)  # what carried it ("auto" switches)
        metered = MeteredComm(comm)
        result = call(comm=metered)
        wire = max(int(r[0]) for r in comm.allgather_int64(np.array([metered.sent])))
        wrong, relerr = -1, float("nan")
        if args.check:
            wrong, relerr = check(coll, xs, result, used, comm, args.op, dtype)
        fp32_wire = coll.bus_factor(size) * count * 4
        algbw = count * itemsize / seconds / 1e9
        row = {
            "size": count * itemsize,
            "count": count,
            "type": args.datatype,
            "redop": args.op,
            "time_us": seconds * 1e6,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * coll.bus_factor(size),
            "wrong": wrong,
            "wire_bytes": wire,
            "ratio_to_fp32": wire / fp32_wire if fp32_wire else 0.0,
            "relerr": relerr,
        }
        line = (
            f"{row['size']:>12} {count:>10} {args.datatype:>8} {args.op:>6} "
            f"{row['time_us']:>10.1f} {algbw:>7.3f} {row['busbw_GBps']:>7.3f} {wrong:>7} "
            f"{wire:>12} {row['ratio_to_fp32']:>6.3f} {relerr:>9.2e}"
        )
        if args.breakdown and not codec.lossless:
            parts = breakdown(comm, codec, x, args.stage_size, coll.gather)
            serial = parts["encode"] + parts["comm"] + parts["decode"]
            row["breakdown_us"] = {k: v * 1e6 for k, v in parts.items()}
            row["overlap_ratio"] = parts["pipelined"] / serial if serial else float("nan")
            line += (
                f" {parts['encode'] * 1e6:>9.1f} {parts['comm'] * 1e6:>9.1f} "
                f"{parts['decode'] * 1e6:>9.1f} {parts['pipelined'] * 1e6:>9.1f} "
                f"{row['overlap_ratio']:>7.3f}"
            )
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
        say(
            f"# Largest size busbw   : {rows[-1]['busbw_GBps']:.4f} GB/s "
            f"at {rows[-1]['size']} bytes"
        )
    if rank == 0 and args.output_file:
        report = {
            "tool": f"{coll.name}_perf",
            "command": launch_command(size),
            "ranks": size,
            "codec": codec.get_config(),
            "op": args.op,
            "datatype": args.datatype,
            "link": emulated_link() or "shared memory",
            "input": kind,
            "cols": args.cols if kind == "gradient" else None,
            "stage_size": args.stage_size,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "geocomm": geocomm.__version__,
            "rows": rows,
            "wrong_total": total_wrong,
            "avg_busbw_GBps": avg_busbw,
            "yardstick": dataclasses.asdict(ruler),
        }
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if total_wrong == 0 else 1
