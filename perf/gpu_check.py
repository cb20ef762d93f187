"""One-shot GPU check: CuPy kernels == native C core == NumPy reference, speed, NCCL smoke test.

    python perf/gpu_check.py --out perf/results/gpu_check.json
    mpirun -n 1 python perf/gpu_check.py --out perf/results/gpu_check.json

1. Bytes. For every format (e4m3/e5m2 with blocks 0, 1, 16, 128, 1000, 3000
   -- team and tile kernels, single- and multi-tile --, nvfp4, bf16) and every
   input case (wide dynamic range, edge values, random bit patterns with
   NaN/inf, subnormal and all-zero blocks, odd sizes from 0 up, a 5M-value
   tensor, a wire at an odd byte offset, an explicit stream), the GPU encode
   must equal the native encode and the reference encode byte for byte;
   decode and decode+accumulate (of the native wire) must equal the native
   core bit for bit. NaN payloads are exempt: GPU arithmetic returns the
   canonical NaN, so for NaNs only the positions must agree.
2. Speed. Encode, decode and decode+accumulate of a --size-mib buffer
   (default 256 MiB of fp32), timed with CUDA events over --repeats launches,
   against a device-to-device memcpy of the same buffer.
3. NCCL. An NCCLCommunicator over MPI.COMM_WORLD: alltoallv / allgatherv
   byte round trips, allreduce sum/max, allgather_int64, barrier, and a raw
   grouped ncclSend/ncclRecv to self (a 1-rank job never sends to a peer).

Writes --out (JSON) and the same path with .md (tables). Exit status: 0 all
equal, 1 any mismatch or failure, 2 no CuPy/GPU (or no native core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

F32 = np.float32
FP8_BLOCKS = (0, 1, 16, 128, 1000, 3000)
EDGES = np.array([0.0, -0.0, 448.0, -448.0, 464.0, 465.0, -465.0, 480.0, 57344.0, 61440.0,
                  -61441.0, 6.0, 5.0, 0.25, 1e-45, -3e-39, 1e-40, 2.0**-100, 2.0**-126,
                  2.0**-149, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan, -np.nan], F32)


def fail_exit(message: str, code: int) -> None:
    print(f"gpu_check: {message}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------------------
# inputs


def wide(rng: np.random.Generator, n: int, lo: int = -60, hi: int = 60) -> np.ndarray:
    """Random signs and mantissas over 2^lo .. 2^hi."""
    mant = rng.uniform(1.0, 2.0, n)
    sign = rng.choice([-1.0, 1.0], n)
    return (sign * mant * np.exp2(rng.integers(lo, hi, n))).astype(F32)


def cases(rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    out = [("wide", wide(rng, 1_000_003))]
    edges = rng.choice(EDGES, 65_537) * rng.choice(np.array([1.0, 2.0**-20, 2.0**-130], F32),
                                                    65_537)
    out.append(("edges", edges.astype(F32)))
    out.append(("bits", rng.integers(0, 2**32, 262_147, dtype=np.uint64).astype(np.uint32)
                .view(F32)))
    tiny = wide(rng, 100_003, -149, -120)
    tiny[(np.arange(tiny.size) // 40) % 3 == 0] = 0.0  # all-zero blocks among subnormal ones
    out.append(("tiny", tiny))
    for n in (0, 1, 2, 15, 16, 17, 31, 33, 127, 129, 1000, 4097):
        out.append((f"n={n}", wide(rng, n)))
    out.append(("big", wide(rng, 5_000_017, -20, 20)))
    return out


def configs() -> list[tuple[str, int]]:
    return ([(f, b) for f in ("e4m3", "e5m2") for b in FP8_BLOCKS]
            + [("nvfp4", 0), ("bf16", 0)])


# ---------------------------------------------------------------------------
# comparisons


def byte_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    if a.shape != b.shape:
        return {"equal": False, "why": f"sizes {a.size} != {b.size}"}
    bad = np.flatnonzero(a != b)
    return {"equal": bad.size == 0, "mismatches": int(bad.size),
            **({"first": int(bad[0]), "got": int(a[bad[0]]), "want": int(b[bad[0]])}
               if bad.size else {})}


def value_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Bitwise equality of fp32 values, any NaN equal to any NaN."""
    if a.shape != b.shape:
        return {"equal": False, "why": f"sizes {a.size} != {b.size}"}
    both_nan = np.isnan(a) & np.isnan(b)
    bad = np.flatnonzero((a.view(np.uint32) != b.view(np.uint32)) & ~both_nan)
    return {"equal": bad.size == 0, "mismatches": int(bad.size),
            **({"first": int(bad[0]), "got": float(a[bad[0]]), "want": float(b[bad[0]])}
               if bad.size else {})}


# ---------------------------------------------------------------------------
# 1. bytes


def after_current(cp: Any, stream: Any) -> None:
    """Order ``stream`` after the copies queued on the current stream (it does not sync itself)."""
    if stream is not None:
        stream.wait_event(cp.cuda.get_current_stream().record())


def check_case(cp: Any, fmt: str, block: int, name: str, x: np.ndarray,
               base: np.ndarray, variant: str = "") -> dict[str, Any]:
    from geocomm import _nativecodec as native
    from geocomm import cuda
    from geocomm.codecs import _reference as ref

    code = native.FORMATS[fmt]
    n = x.size
    size = native.wire_size(code, n, block)
    assert cuda.wire_size(fmt, n, block) == size
    row: dict[str, Any] = {"fmt": fmt, "block": block, "case": name + variant, "n": n}

    cpu_wire = np.zeros(size, np.uint8)
    native.encode(code, x, block, cpu_wire)
    with np.errstate(all="ignore"):  # the reference casts NaN/inf on purpose
        ref_wire = ref.encode(fmt, x, block)
    stream = cp.cuda.Stream(non_blocking=True) if variant == " stream" else None
    offset = 1 if variant == " offset" else 0
    x_dev = cp.asarray(x)
    store = cp.full(size + offset, 0xA5, dtype=cp.uint8)
    wire_dev = store[offset:]
    after_current(cp, stream)
    cuda.encode(fmt, x_dev, block, wire_dev, stream=stream)
    if stream is not None:
        stream.synchronize()
    gpu_wire = cp.asnumpy(wire_dev)
    row["encode_vs_native"] = byte_diff(gpu_wire, cpu_wire)
    row["encode_vs_reference"] = byte_diff(gpu_wire, ref_wire)

    cpu_wire_dev = store.copy()
    cpu_wire_dev[offset:] = cp.asarray(cpu_wire)
    for acc in (False, True):
        want = base.copy() if acc else np.zeros(n, F32)
        native.decode(code, cpu_wire, block, want, accumulate=acc)
        out_dev = cp.asarray(base) if acc else cp.full(n, np.nan, dtype=cp.float32)
        after_current(cp, stream)
        cuda.decode(fmt, cpu_wire_dev[offset:], block, out_dev, accumulate=acc, stream=stream)
        if stream is not None:
            stream.synchronize()
        got = cp.asnumpy(out_dev)
        key = "accumulate" if acc else "decode"
        row[f"{key}_vs_native"] = value_diff(got, want)
        with np.errstate(all="ignore"):
            ref_vals = ref.decode(fmt, cpu_wire, n, block)
            row[f"{key}_vs_reference"] = value_diff(got, (base + ref_vals) if acc else ref_vals)
    row["ok"] = all(v["equal"] for k, v in row.items() if k.endswith(("_native", "_reference")))
    return row


def check_bytes(cp: Any, rng: np.random.Generator) -> list[dict[str, Any]]:
    rows = []
    inputs = cases(rng)
    for fmt, block in configs():
        variants = [(name, x, "") for name, x in inputs]
        by_name = dict(inputs)
        variants += [(name, by_name[name], variant)
                     for name, variant in (("wide", " offset"), ("edges", " stream"))
                     if name in by_name]
        for name, x, variant in variants:
            base = wide(np.random.default_rng(x.size), x.size, -10, 10)
            try:
                row = check_case(cp, fmt, block, name, x, base, variant)
            except Exception:
                row = {"fmt": fmt, "block": block, "case": name + variant, "n": x.size,
                       "ok": False, "error": traceback.format_exc()}
            rows.append(row)
            if not row["ok"]:
                print(f"MISMATCH {fmt} block={block} {name}{variant}: "
                      f"{ {k: v for k, v in row.items() if k not in ('fmt', 'block', 'case')} }",
                      file=sys.stderr)
    return rows


def check_errors(cp: Any) -> list[dict[str, Any]]:
    """The argument checks of geocomm.cuda raise like geocomm._nativecodec."""
    from geocomm import cuda

    x = cp.zeros(100, cp.float32)
    wire = cp.zeros(cuda.wire_size("e4m3", 100, 16), cp.uint8)
    calls = {
        "float64 x -> TypeError": (TypeError, lambda: cuda.encode("e4m3", x.astype(cp.float64),
                                                                  16, wire)),
        "strided x -> TypeError": (TypeError, lambda: cuda.encode("e4m3", x[::2], 16, wire)),
        "numpy x -> TypeError": (TypeError, lambda: cuda.encode("e4m3", cp.asnumpy(x), 16,
                                                                wire)),
        "int8 wire -> TypeError": (TypeError, lambda: cuda.encode("e4m3", x, 16,
                                                                  wire.view(cp.int8))),
        "short wire -> ValueError": (ValueError, lambda: cuda.encode("e4m3", x, 16, wire[:-1])),
        "short wire decode -> ValueError": (ValueError, lambda: cuda.decode("e4m3", wire[:-1],
                                                                            16, x)),
        "unknown format -> ValueError": (ValueError, lambda: cuda.encode(7, x, 16, wire)),
        "negative block -> ValueError": (ValueError, lambda: cuda.encode("e4m3", x, -1, wire)),
    }
    rows = []
    for name, (exc, call) in calls.items():
        try:
            call()
            rows.append({"check": name, "ok": False, "why": "no exception"})
        except exc:
            rows.append({"check": name, "ok": True})
        except Exception as other:
            rows.append({"check": name, "ok": False, "why": repr(other)})
    return rows


# ---------------------------------------------------------------------------
# 2. speed


def time_op(cp: Any, op, repeats: int) -> float:
    """Mean seconds per call of op() on the current stream (CUDA events)."""
    for _ in range(3):
        op()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        op()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def codec_speed(cp: Any, x: Any, fmt: str, block: int, repeats: int,
                copy_gbs: float) -> list[dict[str, Any]]:
    """Encode, decode and decode+accumulate timings of one format on buffer x."""
    from geocomm import cuda

    size = cuda.wire_size(fmt, x.size, block)
    wire = cp.empty(size, cp.uint8)
    out = cp.zeros(x.size, cp.float32)
    ops = {
        "encode": (lambda: cuda.encode(fmt, x, block, wire), x.nbytes + size),
        "decode": (lambda: cuda.decode(fmt, wire, block, out), size + out.nbytes),
        "accumulate": (lambda: cuda.decode(fmt, wire, block, out, accumulate=True),
                       size + 2 * out.nbytes),
    }
    rows = []
    for op_name, (op, traffic) in ops.items():
        seconds = time_op(cp, op, repeats)
        rows.append({"fmt": fmt, "block": block, "op": op_name, "seconds": seconds,
                     "values_GBps": x.nbytes / seconds / 1e9,
                     "traffic_GBps": traffic / seconds / 1e9,
                     "vs_memcpy": traffic / seconds / 1e9 / copy_gbs})
    return rows


def memcpy_seconds(cp: Any, x: Any, repeats: int) -> float:
    """Seconds per device-to-device copy of x into a fresh buffer (the bandwidth yardstick)."""
    dst = cp.empty_like(x)
    return time_op(cp, lambda: dst.data.copy_from_device_async(x.data, x.nbytes), repeats)


def check_speed(cp: Any, size_mib: int, repeats: int) -> dict[str, Any]:
    """GB/s of the kernels on one buffer, next to a device-to-device memcpy of it.

    values_GBps counts the fp32 bytes of the tensor; traffic_GBps the bytes a
    kernel must read and write at least (fp32 values + wire, + fp32 read when
    accumulating), comparable with the memcpy's read + write.
    """
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(1).standard_normal(n, dtype=cp.float32)
    copy_s = memcpy_seconds(cp, x, repeats)
    copy_gbs = 2 * x.nbytes / copy_s / 1e9
    codecs = []
    for fmt, block in (("e4m3", 0), ("e4m3", 16), ("e4m3", 128), ("e5m2", 128),
                       ("nvfp4", 0), ("bf16", 0)):
        codecs += codec_speed(cp, x, fmt, block, repeats, copy_gbs)
    return {"n": n, "bytes": x.nbytes,
            "memcpy_d2d": {"seconds": copy_s, "traffic_GBps": copy_gbs}, "codecs": codecs}


# ---------------------------------------------------------------------------
# 3. NCCL


def pattern(cp: Any, a: int, b: int, length: int) -> Any:
    return ((cp.arange(length, dtype=cp.int64) + 31 * a + 17 * b) % 251).astype(cp.uint8)


def check_nccl(cp: Any) -> dict[str, Any]:
    from geocomm.comm import nccl as gnccl

    if not gnccl.available:
        try:
            gnccl.require_nccl()
        except ImportError as exc:
            return {"status": "skipped", "reason": str(exc), "ok": True}
    try:
        comm = gnccl.NCCLCommunicator()
    except ImportError as exc:
        return {"status": "skipped", "reason": str(exc), "ok": True}
    r, size = comm.rank, comm.size
    checks: dict[str, bool] = {}

    def seg(a: int, b: int) -> int:
        return 100 + 7 * a + 3 * b

    send_counts = np.array([seg(r, p) for p in range(size)])
    recv_counts = np.array([seg(p, r) for p in range(size)])
    send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
    recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
    send = cp.concatenate([pattern(cp, r, p, seg(r, p)) for p in range(size)])
    recv = cp.zeros(int(recv_counts.sum()), cp.uint8)
    req = comm.alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs)
    deadline = time.monotonic() + 60
    while not req.test() and time.monotonic() < deadline:
        time.sleep(1e-4)
    req.wait()
    want = cp.concatenate([pattern(cp, p, r, seg(p, r)) for p in range(size)])
    checks["alltoallv"] = bool((recv == want).all())

    counts = np.array([50 + 13 * p for p in range(size)])
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    gathered = cp.zeros(int(counts.sum()), cp.uint8)
    comm.allgatherv(pattern(cp, r, 0, int(counts[r])), gathered, counts, displs).wait()
    want = cp.concatenate([pattern(cp, p, 0, int(counts[p])) for p in range(size)])
    checks["allgatherv"] = bool((gathered == want).all())

    for dtype in (cp.float32, cp.float64):
        values = cp.arange(1000, dtype=dtype) * (r + 1)
        total = cp.empty_like(values)
        comm.allreduce(values, total, "sum")
        checks[f"allreduce sum {np.dtype(dtype).name}"] = bool(
            (total == cp.arange(1000, dtype=dtype) * (size * (size + 1) // 2)).all())
        comm.allreduce(values, total, "max")
        checks[f"allreduce max {np.dtype(dtype).name}"] = bool(
            (total == cp.arange(1000, dtype=dtype) * size).all())
    rows = comm.allgather_int64(np.array([r, 2 * r]))
    checks["allgather_int64"] = bool((rows == np.array([[p, 2 * p] for p in range(size)])).all())
    comm.barrier()

    # grouped ncclSend/ncclRecv to self: the call path alltoallv uses for peers
    data, back = pattern(cp, r, 9, 4099), cp.zeros(4099, cp.uint8)
    nccl = comm._nccl
    nccl.groupStart()
    comm.nccl_comm.send(data.data.ptr, data.size, nccl.NCCL_UINT8, r, comm.stream.ptr)
    comm.nccl_comm.recv(back.data.ptr, back.size, nccl.NCCL_UINT8, r, comm.stream.ptr)
    nccl.groupEnd()
    comm.stream.synchronize()
    checks["ncclSend/ncclRecv to self"] = bool((back == data).all())
    comm.close()
    return {"status": "ran", "rank": r, "size": size, "checks": checks,
            "ok": all(checks.values())}


# ---------------------------------------------------------------------------
# report


def environment(cp: Any) -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    info = {"device": name.decode() if isinstance(name, bytes) else name,
            "compute_capability": cp.cuda.Device().compute_capability,
            "cupy": cp.__version__, "driver": cp.cuda.runtime.driverGetVersion(),
            "runtime": cp.cuda.runtime.runtimeGetVersion(), "python": platform.python_version(),
            "numpy": np.__version__}
    try:
        info["nvrtc"] = list(cp.cuda.nvrtc.getVersion())
    except Exception:  # older CuPy layouts
        pass
    return info


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check ({report['environment'].get('device', '?')})", "",
             f"Result: **{'PASS' if report['ok'] else 'FAIL'}**", "",
             "## Bytes (GPU vs native C core vs NumPy reference)", "",
             "| format | block | cases | all equal | failing cases |",
             "| --- | --- | --- | --- | --- |"]
    by_config: dict[tuple[str, int], list[dict]] = {}
    for row in report["bytes"]:
        by_config.setdefault((row["fmt"], row["block"]), []).append(row)
    for (fmt, block), rows in by_config.items():
        failing = ", ".join(r["case"] for r in rows if not r["ok"]) or "-"
        lines.append(f"| {fmt} | {block} | {len(rows)} | "
                     f"{'yes' if all(r['ok'] for r in rows) else 'NO'} | {failing} |")
    lines += ["", "## Argument checks", "", "| check | ok |", "| --- | --- |"]
    lines += [f"| {r['check']} | {'yes' if r['ok'] else 'NO: ' + r.get('why', '')} |"
              for r in report["errors"]]
    speed = report.get("speed")
    if speed:
        copy = speed["memcpy_d2d"]
        lines += ["", f"## Speed ({speed['bytes'] / 2**20:.0f} MiB of fp32, "
                  f"{report['args']['repeats']} repeats)", "",
                  f"memcpy device-to-device: {copy['seconds'] * 1e3:.3f} ms, "
                  f"{copy['traffic_GBps']:.0f} GB/s (read + write)", "",
                  "| format | block | op | ms | fp32 GB/s | traffic GB/s | of memcpy |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c['fmt']} | {c['block']} | {c['op']} | {c['seconds'] * 1e3:.3f} | "
                  f"{c['values_GBps']:.0f} | {c['traffic_GBps']:.0f} | {c['vs_memcpy']:.0%} |"
                  for c in speed["codecs"]]
    nccl = report.get("nccl")
    if nccl:
        lines += ["", "## NCCL", ""]
        if nccl["status"] == "ran":
            lines += [f"{nccl['size']} rank(s)", "", "| check | ok |", "| --- | --- |"]
            lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in nccl["checks"].items()]
        else:
            lines.append(f"{nccl['status']}: {nccl.get('reason', nccl.get('error', ''))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("perf/results/gpu_check.json"))
    p.add_argument("--size-mib", type=int, default=256, help="speed test buffer (fp32 MiB)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--no-nccl", action="store_true")
    args = p.parse_args(argv)

    from geocomm import _nativecodec as native
    from geocomm import cuda

    if not cuda.available:
        try:
            cuda.require()
        except ImportError as exc:
            fail_exit(f"no GPU path to check: {exc}", 2)
    if not native.available:
        fail_exit("the native C core (geocomm._native) is not built; pip install . first", 2)
    import cupy as cp

    t0 = time.monotonic()
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()},
                              "environment": environment(cp)}
    report["bytes"] = check_bytes(cp, np.random.default_rng(args.seed))
    report["errors"] = check_errors(cp)
    ok = all(r["ok"] for r in report["bytes"]) and all(r["ok"] for r in report["errors"])
    if not args.no_speed:
        report["speed"] = check_speed(cp, args.size_mib, args.repeats)
    if not args.no_nccl:
        try:
            report["nccl"] = check_nccl(cp)
        except Exception:
            report["nccl"] = {"status": "failed", "error": traceback.format_exc(), "ok": False}
        ok = ok and report["nccl"]["ok"]
    report["ok"] = ok
    report["seconds"] = time.monotonic() - t0

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if rank:  # under mpirun -n N > 1 every rank checks its own GPU; rank 0 keeps the name
        args.out = args.out.with_name(f"{args.out.stem}.rank{rank}{args.out.suffix}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} in {report['seconds']:.1f} s; "
          f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
