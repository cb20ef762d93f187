"""Per-codec timing table of geocomm's all-reduce on GPUs, against the device copy and
plain NCCL measured in the same run (issue 38).

    python perf/gpu_timing.py --out perf/results/gpu_timing.json
    python -m geocomm.launch -n 2 -- python perf/gpu_timing.py     # one GPU per rank
    python perf/gpu_timing.py --twin --out /tmp/gpu_timing.json    # no GPU: the CuPy twin

Writes the JSON and a markdown table beside it (.md; rank 0 only) and prints the
table. For each size (64 and 256 MiB of fp32 per rank; the twin: 1 MiB) and each
operation (the device copy, NCCL's fp32 all-reduce, then geocomm.allreduce with
every codec of ``--codecs``; ``nvfp4-sr``: NVFP4 with stochastic rounding;
``geofp8`` with its defaults, power steps included, ``geofp8-steady`` between power
steps, ``geofp8-stepped`` with a power step every call; both replay one CUDA graph
per call once warm, the stepped one with its step's copies to the host behind it)
one row, per steady-state call
(perf/gpu_clock.py):

* ``wall_s``: calls queued back to back, one synchronization, divided by calls;
* ``host_s``: the host's own time per call with the device held;
* ``device_s``: CUDA events around the queued calls, per call;
* ``vs_copy``: the copy's device time over the call's: its fp32 throughput as a
  share of the device copy's (which moves two bytes of traffic per fp32 byte);
  ``vs_nccl`` likewise against NCCL's fp32 all-reduce;
* ``rel_error``: ||result - exact|| / ||exact||, the exact sum of every rank's
  input in fp64 (on the host); ``wire_ratio``: fp32 bytes per wire byte of the
  codec's body (GeoFP8's side channel not counted).

Inputs are gradient-like (a rank-4 signal plus noise, gpu_check_common.gradient,
shaped rows x 4096 for GeoFP8's maps), seeded per rank. Then the kernel rows:
every single-body encode, decode and decode+accumulate of geocomm.kernels.cuda at
the largest size, device time and least traffic (bytes read + written) over the
copy's traffic rate (gpu_check_timing.time_kernels; in both roundings, against the
bar of 0.85), and the host time of a signature's first two calls (first_call_rows:
fp8, NVFP4, GeoFP8; target 300 us for the first). The yardsticks (the copy's
traffic rate, NCCL's algorithm bandwidth) and the command line go in the header.
On the twin the clocks are the host's: the numbers are not meaningful, and the
table says so. ``--budget-s`` skips the rows that would start after it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling modules (python -P too)
    sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from gpu_check_common import PROFILES, gradient  # noqa: E402
from gpu_check_report import host_bound, kernel_lines  # noqa: E402
from gpu_check_timing import TWIN_NOTE, copy_op, time_kernels, timed_row  # noqa: E402
from gpu_clock import device_clock, is_twin, sync  # noqa: E402

CODECS = (
    "none", "bf16", "fp8", "nvfp4", "nvfp4-sr", "mxfp8", "mxfp4",
    "geofp8", "geofp8-steady", "geofp8-stepped",
)  # fmt: skip
#: the names of CODECS that are not codec ids. "geofp8-steady": GeoFP8's calls between
#: power steps alone (after its first call, a measure, it never steps; k = 8 is the
#: rank the defaults give with a step every call, so the map is the same);
#: "geofp8-stepped": a power step at every call, as most of the gradient zoo's calls
#: take one (perf/results/geo_steps.md)
SPECS: dict[str, Any] = {
    "nvfp4-sr": {"id": "nvfp4", "rounding": "stochastic"},
    "geofp8-steady": {"id": "geofp8", "k": 8, "refresh": 10**9, "refresh_max": 10**9},
    "geofp8-stepped": {"id": "geofp8", "k": 8, "refresh_max": 1},
}
#: columns of every input matrix (GeoFP8 maps rows x COLUMNS; the others see it flat)
COLUMNS = 4096
#: the codecs whose first call of a signature is timed (:func:`first_call_rows`), and
#: the host time issue 38 allows it
FIRST_CALL_CODECS = ("fp8", "nvfp4", "geofp8")
FIRST_CALL_TARGET_S = 300e-6
#: signatures each first-call row times (the median is reported)
FIRST_CALL_TRIALS = 3


def codec_spec(name: str) -> Any:
    """What ``geocomm.get_codec`` takes for ``name`` of :data:`CODECS`."""
    return SPECS.get(name, name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("perf/results/gpu_timing.json"))
    p.add_argument("--sizes-mib", type=float, nargs="+", help="default 64 256 (twin: 1)")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    p.add_argument("--calls", type=int, help="calls per measurement (default 20; twin: 2)")
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument("--budget-s", type=float, default=180.0, help="start no row after this")
    p.add_argument("--twin", action="store_true", help="the CPU twin of CuPy (tests/twin)")
    args = p.parse_args(argv)
    profile = PROFILES["twin" if args.twin else "gpu"]
    args.sizes_mib = args.sizes_mib or list(profile.timing_mib)
    args.calls = args.calls or (profile.timing_calls if args.twin else 20)
    return args


def exact_sum(ctx: Any, x_host: np.ndarray) -> np.ndarray:
    """Every rank's input summed in fp64 (the reference of ``rel_error``)."""
    mine = x_host.astype(np.float64)
    if ctx.size == 1:
        return mine
    total = np.empty_like(mine)
    from mpi4py import MPI

    ctx.world.Allreduce(mine, total, op=MPI.SUM)
    return total


def rel_error(result: np.ndarray, exact: np.ndarray, chunk: int = 1 << 24) -> float:
    """||result - exact|| / ||exact|| in fp64, ``chunk`` values at a time."""
    got, want = result.reshape(-1), exact.reshape(-1)
    err = norm = 0.0
    for lo in range(0, want.size, chunk):
        w = want[lo : lo + chunk]
        err += float(np.sum((got[lo : lo + chunk].astype(np.float64) - w) ** 2))
        norm += float(np.sum(w * w))
    return float(np.sqrt(err / norm)) if norm else float(np.sqrt(err))


def size_rows(
    ctx: Any, size_mib: float, args: argparse.Namespace, start: float
) -> tuple[list[dict], tuple[Any, Any]]:
    """The rows of one size: copy, NCCL fp32, then each codec (``skipped`` past the
    budget); and the size's device input and output arrays."""
    import geocomm

    cp, nccl = ctx.cp, ctx.nccl()
    rows_n = max(1, int(size_mib * (1 << 20)) // 4 // COLUMNS)
    host = gradient(np.random.default_rng([args.seed, ctx.rank]), (rows_n, COLUMNS))
    exact = exact_sum(ctx, host)
    x = cp.asarray(host)
    y = cp.empty_like(x)
    ops: dict[str, Any] = {
        "device copy": copy_op(cp, x, y),
        "NCCL all-reduce (fp32)": lambda: nccl.allreduce(x, y, "sum"),
    }
    for codec in args.codecs:
        key = {"key": "gpu_timing"} if codec.startswith("geofp8") else {}
        spec = codec_spec(codec)
        ops[f"geocomm {codec}"] = lambda c=spec, k=key: geocomm.allreduce(
            x, codec=c, out=y, comm=nccl, **k
        )
    rows: list[dict] = []
    for name, op in ops.items():
        row: dict[str, Any] = {"size_MiB": size_mib, "op": name}
        if ctx.decide(time.monotonic() - start > args.budget_s):
            rows.append({**row, "skipped": f"time budget of {args.budget_s:.0f} s used up"})
            continue
        row.update(timed_row(cp, op, args.calls, x.nbytes))
        if name != "device copy":
            row["rel_error"] = rel_error(cp.asnumpy(y), exact)
        if name.startswith("geocomm "):
            codec = geocomm.get_codec(codec_spec(name.split()[1]))
            row["wire_ratio"] = x.nbytes / codec.wire_size(x.size)
        rows.append(row)
    copy, plain = (rows[0].get("device_s"), rows[1].get("device_s"))
    for row in rows:
        if "device_s" in row:
            row["vs_copy"] = copy / row["device_s"] if copy else None
            row["vs_nccl"] = plain / row["device_s"] if plain else None
    return rows, (x, y)


def first_call_rows(
    ctx: Any, x: Any, y: Any, size_mib: float, args: argparse.Namespace
) -> list[dict]:
    """The host time of a signature's first call (it plans: tables, buffers, the check's
    first exchange) and of its second (fp8 and NVFP4: captured into a CUDA graph, with
    the ranks' exchange of whether their captures succeeded; GeoFP8's key may still run
    eagerly), with the device idle and the ranks together before each first call: each
    of :data:`FIRST_CALL_TRIALS` trials takes a new signature (one row fewer, and for
    GeoFP8 a new key), and the row gives their medians against
    :data:`FIRST_CALL_TARGET_S`. The calls take leading rows of ``x`` (the size's input
    matrix, rows x COLUMNS) into ``y``; none where it has too few rows. (At the twin's
    1 MiB GeoFP8's rows are too few to map: it quantizes plainly there.)"""
    import geocomm

    cp, nccl = ctx.cp, ctx.nccl()
    rows_n = x.shape[0]
    rows: list[dict] = []
    if rows_n <= FIRST_CALL_TRIALS:
        return rows
    for codec in (c for c in FIRST_CALL_CODECS if c in args.codecs):
        first, second = [], []
        for trial in range(FIRST_CALL_TRIALS):
            part, out = x[: rows_n - 1 - trial], y[: rows_n - 1 - trial]
            key = {"key": f"first call {trial}"} if codec.startswith("geofp8") else {}
            sync(cp)
            ctx.world.Barrier()  # no rank's time includes waiting for a late peer
            for times in (first, second):
                began = time.perf_counter()
                geocomm.allreduce(part, codec=codec_spec(codec), out=out, comm=nccl, **key)
                times.append(time.perf_counter() - began)
            sync(cp)
        rows.append({
            "size_MiB": size_mib, "op": f"geocomm {codec}", "trials": FIRST_CALL_TRIALS,
            "first_call_host_s": float(np.median(first)),
            "second_call_host_s": float(np.median(second)),
        })  # fmt: skip
    return rows


def run(ctx: Any, args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    largest = max(args.sizes_mib)
    rows: list[dict] = []
    for size in args.sizes_mib:
        size_result, arrays = size_rows(ctx, size, args, start)
        rows += size_result
        if size == largest:
            largest_arrays = arrays  # the first calls' input too: drawn once
    copy = next(r for r in rows if r["op"] == "device copy" and r["size_MiB"] == largest)
    plain = next(r for r in rows if r["op"].startswith("NCCL") and r["size_MiB"] == largest)
    traffic_Bps = 2 * copy["device_GBps"] * 1e9 if "device_s" in copy else None
    kernels: list[dict] = []
    if traffic_Bps and not ctx.decide(time.monotonic() - start > args.budget_s):
        kernels = ctx.on_root(lambda: time_kernels(ctx.cp, largest, args.calls, traffic_Bps)) or []
    first_calls: list[dict] = []
    if not ctx.decide(time.monotonic() - start > args.budget_s):
        first_calls = first_call_rows(ctx, *largest_arrays, largest, args)
    return {
        "rows": rows,
        "kernels": kernels,
        "first_calls": first_calls,
        "first_call_target_s": FIRST_CALL_TARGET_S,
        "yardsticks": {
            "size_MiB": largest,
            "copy_traffic_GBps": traffic_Bps / 1e9 if traffic_Bps else None,
            "nccl_fp32_GBps": plain.get("device_GBps"),
        },
        "device_clock": device_clock(ctx.cp),
        "meaningful": not is_twin(ctx.cp),
        "seconds": time.monotonic() - start,
    }


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, spec)


def markdown(result: dict[str, Any]) -> str:
    env, yard = result["environment"], result["yardsticks"]
    lines = [
        f"# geocomm all-reduce per codec ({env.get('device', '?')}; {env['ranks']} rank(s))",
        "",
        f"Command: `{result['command']}`; {result['date']}.",
        "",
        f"Yardsticks, measured in this run at {yard['size_MiB']} MiB: the device copy moves "
        f"{fmt(yard['copy_traffic_GBps'], '.4g')} GB/s of traffic (read + write); NCCL's "
        f"fp32 all-reduce {fmt(yard['nccl_fp32_GBps'], '.4g')} GB/s (fp32 bytes / time).",
        "",
        "Per steady-state call: wall (calls queued back to back, one synchronization), "
        f"host (the host's own time, device held), device (measured by "
        f"{result['device_clock']}). "
        "vs copy / vs NCCL: their device time over the call's (fp32 throughput as a share "
        "of theirs); rel. error: against the exact fp64 sum of the ranks' inputs; wire "
        "ratio: fp32 bytes per wire byte (GeoFP8's side channel not counted).",
    ]
    if not result["meaningful"]:
        lines += ["", f"**Not meaningful**: {TWIN_NOTE}."]
    lines += [
        "",
        "| MiB | operation | wall us | host us | device us | device GB/s | vs copy | vs NCCL "
        "| rel. error | wire ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['size_MiB']} | {r['op']} | skipped: {r['skipped']} |")
            continue
        lines.append(
            f"| {r['size_MiB']} | {r['op']} | {fmt(r['wall_s'], '.1f', 1e6)} | "
            f"{fmt(r['host_s'], '.1f', 1e6)} | {fmt(r['device_s'], '.1f', 1e6)} | "
            f"{fmt(r['device_GBps'], '.4g')} | {fmt(r['vs_copy'], '.3f')}{host_bound(r)} | "
            f"{fmt(r['vs_nccl'], '.3f')} | {fmt(r.get('rel_error'), '.2e')} | "
            f"{fmt(r.get('wire_ratio'), '.2f')} |"
        )
    if result["kernels"]:
        lines += [
            "",
            "Kernels alone (rank 0; traffic / copy's: least bytes read + written per second "
            "over the copy's traffic rate):",
            "",
            *kernel_lines(result["kernels"]),
        ]
    if result["first_calls"]:
        target = result["first_call_target_s"] * 1e6
        lines += [
            "",
            "A signature's first two calls (host time, median of "
            f"{result['first_calls'][0]['trials']} new signatures, the device idle and the "
            "ranks together before each; the first plans it, the second captures fp8's and "
            f"NVFP4's CUDA graph; target for the first: <= {target:.0f} us):",
            "",
            "| MiB | operation | first call host us | second call host us |",
            "| --- | --- | --- | --- |",
            *(
                f"| {r['size_MiB']} | {r['op']} | {r['first_call_host_s'] * 1e6:.1f} | "
                f"{r['second_call_host_s'] * 1e6:.1f} |"
                for r in result["first_calls"]
            ),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gpu_check import Context, environment, gpu_path

    cp = gpu_path(args.twin, "time")
    from lab import launch_command, write_results
    from mpi4py import MPI

    ctx = Context(cp, args, MPI.COMM_WORLD)
    try:
        result = run(ctx, args)
    finally:
        ctx.close()
    if ctx.is_root:
        result.update(
            environment=environment(cp, ctx),
            command=launch_command(ctx.size) if ctx.size > 1 else " ".join(["python", *sys.argv]),
            date=time.strftime("%Y-%m-%d %H:%M %Z"),
            args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        )
        write_results(args.out, result, markdown)
        print(markdown(result))
        print(f"gpu_timing: wrote {args.out} and {args.out.with_suffix('.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
