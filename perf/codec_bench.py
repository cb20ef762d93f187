"""Single-process throughput of the native codec next to the casts people use today.

One fp32 input (normal, fixed seed, ``--size-mib`` MiB) goes through every
case: native encode, decode and decode+accumulate for E4M3 and E5M2 with
block 128, NVFP4, BF16, MXFP8 (E4M3) and MXFP4; native encode with stochastic
rounding of each (MX with the rceil scale rule it needs); ml_dtypes ``astype(float8_e4m3fn)``; torch
``tensor.to(torch.float8_e4m3fn)`` on one thread; and ``np.copyto`` into a
preallocated array (the memory-bandwidth yardstick). Each case runs twice to
warm up, then ``--repeats`` times; the median time is reported as GB/s of
fp32 data (4 bytes per element, 1 GB = 1e9 bytes), whichever direction the
case converts. All cases run on one thread; ``--threads N`` (N > 1) adds a row
set of the native encode, decode and decode+accumulate on N threads (the
codec's gc_codec_threads, what ``GEOCOMM_CODEC_THREADS`` sets). Each case is also reported
against copy and against its memory-traffic limit (8 bytes per value for
copy over the bytes the case reads and writes per value), with copy's GB/s
in this run as the yardstick.

Correctness is checked in the same run, nccl-tests style: native wire bodies
must equal the NumPy reference, decoded values must equal the reference
decode, and torch's E4M3 bytes must equal ml_dtypes'. Writes
``codec_bench.json`` (with machine info and the command line) and
``codec_bench.md`` to ``--out-dir``.

    python perf/codec_bench.py [--size-mib 64] [--repeats 7] [--threads 1] [--out-dir perf/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

import geocomm
from geocomm.codecs import reference as ref
from geocomm.kernels import native

SEED = 20261129
FORMATS = [("e4m3", 128), ("e5m2", 128), ("nvfp4", 0), ("bf16", 0), ("mxfp8_e4m3", 0), ("mxfp4", 0)]


@dataclass
class Case:
    """One timed operation: ``run()`` converts the whole input once."""

    name: str
    run: Callable[[], object]
    #: check() -> "ok" or a description of the mismatch (run after timing)
    check: Callable[[], str] = lambda: "-"
    times: list[float] = field(default_factory=list)


def time_case(case: Case, repeats: int, warmup: int = 2) -> None:
    # warm-up: page faults, lazy initialisation, caches, and glibc raising its
    # mmap threshold so that the baselines' fresh outputs stop faulting pages
    for _ in range(warmup):
        case.run()
    for _ in range(repeats):
        start = time.perf_counter()
        case.run()
        case.times.append(time.perf_counter() - start)


def median(values: list[float]) -> float:
    return float(np.median(values))


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, NaN matching NaN."""
    nan = np.isnan(b)
    return bool(
        np.array_equal(np.isnan(a), nan)
        and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])
    )


def on_threads(count: int, run: Callable[[], object]) -> Callable[[], object]:
    """``run`` with the codec on ``count`` threads (and back to one after)."""

    def threaded() -> object:
        native.set_threads(count)
        try:
            return run()
        finally:
            native.set_threads(1)

    return threaded


def native_cases(x: np.ndarray, fmt: str, block: int, threads: int = 1) -> list[Case]:
    """Encode, decode and decode+accumulate of one native format, on ``threads`` threads."""
    code = native.FORMATS[fmt]
    wire = np.empty(native.wire_size(code, x.size, block), np.uint8)
    out = np.empty_like(x)
    acc = np.zeros_like(x)
    label = (
        f"{fmt}"
        + (f" block {block}" if block else "")
        + (f" {threads} threads" if threads > 1 else "")
    )

    def check_encode() -> str:
        native.encode(code, x, block, wire)
        return "ok" if np.array_equal(wire, ref.encode(fmt, x, block)) else "WIRE MISMATCH"

    def check_decode() -> str:
        native.decode(code, wire, block, out)
        return "ok" if same_values(out, ref.decode(fmt, wire, x.size, block)) else "MISMATCH"

    def check_accumulate() -> str:
        np.copyto(acc, x)
        native.decode(code, wire, block, acc, accumulate=True)
        expected = x + ref.decode(fmt, wire, x.size, block)
        return "ok" if same_values(acc, expected) else "MISMATCH"

    cases = [
        Case(f"native encode {label}", lambda: native.encode(code, x, block, wire), check_encode),
        Case(f"native decode {label}", lambda: native.decode(code, wire, block, out), check_decode),
        Case(
            f"native decode+acc {label}",
            lambda: native.decode(code, wire, block, acc, accumulate=True),
            check_accumulate,
        ),
    ]
    if threads > 1:
        for case in cases:
            case.run = on_threads(threads, case.run)
            case.check = on_threads(threads, case.check)
    return cases


def stochastic_case(x: np.ndarray, fmt: str, block: int) -> Case:
    """Native encode with stochastic rounding (seed 1, stream 2, offset 0)."""
    code = native.FORMATS[fmt]
    wire = np.empty(native.wire_size(code, x.size, block), np.uint8)
    mx = fmt.startswith("mx")
    flags = native.STOCHASTIC | (native.RCEIL if mx else 0)
    options = {
        "rounding": "stochastic",
        "seed": 1,
        "rounding_stream": 2,
        **({"scale_rule": "rceil"} if mx else {}),
    }

    def run() -> None:
        native.encode(code, x, block, wire, flags=flags, seed=1, rounding_stream=2)

    def check() -> str:
        run()
        return (
            "ok"
            if np.array_equal(wire, ref.encode(fmt, x, block, **options))
            else ("WIRE MISMATCH")
        )

    label = f"{fmt}" + (f" block {block}" if block else "")
    return Case(f"native encode {label} stochastic", run, check)


def baseline_cases(x: np.ndarray) -> list[Case]:
    """ml_dtypes and torch casts to E4M3FN, and a plain copy."""
    dst = np.empty_like(x)
    cases = [
        Case("ml_dtypes astype e4m3fn", lambda: x.astype(ml_dtypes.float8_e4m3fn)),
        Case(
            "numpy copyto",
            lambda: np.copyto(dst, x),
            lambda: "ok" if np.array_equal(dst, x) else "MISMATCH",
        ),
    ]
    try:
        import torch
    except ImportError:
        return cases
    torch.set_num_threads(1)
    t = torch.from_numpy(x)

    def check_torch() -> str:
        mine = t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        theirs = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return "ok (== ml_dtypes)" if np.array_equal(mine, theirs) else "differs from ml_dtypes"

    cases.insert(
        1, Case("torch .to(float8_e4m3fn) 1 thread", lambda: t.to(torch.float8_e4m3fn), check_torch)
    )
    return cases


#: wire bytes per value of each benchmarked format (scales included)
WIRE_BYTES = {
    "e4m3": 1 + 4 / 128,
    "e5m2": 1 + 4 / 128,
    "nvfp4": 0.5 + 1 / 16 + 4 / 4096,
    "bf16": 2.0,
    "mxfp8_e4m3": 1 + 1 / 32,
    "mxfp4": 0.5 + 1 / 32,
}


def traffic_bytes(name: str) -> float | None:
    """Memory traffic per value of a case (bytes read + written), or None.

    copy reads 4 and writes 4; encode reads 4 and writes the wire; decode
    reads the wire and writes 4; decode+accumulate reads the wire and the
    output (4) and writes 4. A case's limit relative to copy is 8 / this."""
    if name == "numpy copyto":
        return 8.0
    parts = name.split()
    if parts[0] != "native":
        return None
    wire = WIRE_BYTES[parts[2]]
    return {"encode": 4 + wire, "decode": wire + 4, "decode+acc": wire + 8}[parts[1]]


def gbps(case: Case, nbytes: int) -> float:
    return nbytes / median(case.times) / 1e9


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_commit() -> str:
    """Short commit id, with "+dirty" when the codec sources differ from it."""
    commit = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--", "../native", "../bindings", "../meson.build")
    return commit + ("+dirty" if changed and commit != "unknown" else "")


def machine_info() -> dict:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "torch": torch_version,
        "geocomm": geocomm.__version__,
        "codec_simd": native.simd(),
        "git_commit": git_commit(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def report(
    cases: list[Case], nbytes: int, info: dict, args: argparse.Namespace
) -> tuple[dict, str]:
    """The JSON document and the markdown table; runs each case's check."""
    by_name = {c.name: gbps(c, nbytes) for c in cases}
    base_ml = by_name.get("ml_dtypes astype e4m3fn")
    base_torch = by_name.get("torch .to(float8_e4m3fn) 1 thread")
    base_copy = by_name.get("numpy copyto")
    rows = []
    lines = [
        f"# geocomm codec throughput ({args.size_mib} MiB fp32, median of {args.repeats})",
        "",
        f"CPU: {info['cpu']}; numpy {info['numpy']}, ml_dtypes {info['ml_dtypes']}, "
        f"torch {info['torch']}; commit {info['git_commit']}; codec vector loops "
        f"{info['codec_simd']}; one thread"
        + (f", and {args.threads} threads where a row says so." if args.threads > 1 else "."),
        "GB/s counts fp32 bytes (4 per element) whichever way a case converts.",
        f"Yardstick: numpy copyto at {base_copy:.2f} GB/s in this run (8 bytes of traffic per "
        "value: 4 read, 4 written)."
        if base_copy
        else "Yardstick: no copy measured.",
        "Limit: the memory-traffic bound relative to copy, 8 / (bytes read + written per "
        "value): encode reads 4 and writes the wire, decode reads the wire and writes 4, "
        'decode+acc also reads the 4 it adds to. "vs limit" is vs copy / limit.',
        "",
        f"Command: `{info['command']}`",
        "",
        "| case | GB/s | ms | vs ml_dtypes | vs torch | vs copy | limit | vs limit | check |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for case in cases:
        rate = by_name[case.name]
        check = case.check()
        traffic = traffic_bytes(case.name)
        limit = 8.0 / traffic if traffic else None
        vs_copy = rate / base_copy if base_copy else None
        vs_limit = vs_copy / limit if vs_copy and limit else None
        rows.append(
            {
                "case": case.name,
                "gbps": rate,
                "median_s": median(case.times),
                "times_s": case.times,
                "check": check,
                "vs_ml_dtypes": rate / base_ml if base_ml else None,
                "vs_torch": rate / base_torch if base_torch else None,
                "vs_copy": vs_copy,
                "traffic_bytes_per_value": traffic,
                "limit_vs_copy": limit,
                "vs_limit": vs_limit,
            }
        )
        lines.append(
            f"| {case.name} | {rate:.2f} | {1e3 * median(case.times):.1f} | "
            f"{ratio(rate, base_ml)} | {ratio(rate, base_torch)} | "
            f"{ratio(rate, base_copy)} | {f'{limit:.2f}' if limit else '-'} | "
            f"{f'{vs_limit:.2f}' if vs_limit else '-'} | {check} |"
        )
    result = {
        "machine": info,
        "size_mib": args.size_mib,
        "repeats": args.repeats,
        "threads": args.threads,
        "seed": SEED,
        "unit": "GB/s of fp32 data (1e9 bytes/s)",
        "copy_gbps": base_copy,
        "results": rows,
    }
    return result, "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=64, help="fp32 input size in MiB")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per case (after warm-up)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="also run the native cases on this many codec threads (1: one thread only)",
    )
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    native.require()
    native.set_threads(1)  # the single-thread rows, whatever the environment says
    n = args.size_mib * (1 << 20) // 4
    x = np.random.default_rng(SEED).standard_normal(n, dtype=np.float32)
    cases = [c for fmt, block in FORMATS for c in native_cases(x, fmt, block)]
    cases += [stochastic_case(x, fmt, block) for fmt, block in FORMATS]
    if args.threads > 1:
        cases += [c for fmt, block in FORMATS for c in native_cases(x, fmt, block, args.threads)]
    cases += baseline_cases(x)
    for case in cases:
        time_case(case, args.repeats)
        print(f"{case.name:<36} {gbps(case, x.nbytes):8.2f} GB/s", flush=True)
    result, table = report(cases, x.nbytes, machine_info(), args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "codec_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "codec_bench.md").write_text(table)
    print()
    print(table)
    failed = [r["case"] for r in result["results"] if not r["check"].startswith(("-", "ok"))]
    if failed:
        print(f"check failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
