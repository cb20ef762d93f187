"""The one GPU check: CuPy kernels and collectives == the CPU path, bit for bit; speed.

    python perf/gpu_check.py --out perf/results/gpu_check.json

Writes the JSON and a markdown summary beside it (.md); prints the summary.
Exit status 0: every section passed; 1: a mismatch or a failure (each is
printed as a ``FAIL`` line to stderr); 2: nothing to check (no CuPy, no CUDA
device, or no native C core). Sections are independent: one that fails or
raises is reported and the others still run. ``--budget-s`` (default 420 s)
skips the sections that would start after it, so the run stays under 8
minutes.

Sections (1 process, 1 GPU; the CPU side uses MPI.COMM_WORLD of 1 rank):

bytes       GPU encode == C core encode (== NumPy reference for small inputs)
            byte for byte, and GPU decode / decode+accumulate of the C core's
            bytes == C core decode bit for bit (NaN payloads exempt: only NaN
            positions must agree), for e4m3/e5m2 with blocks 0 (one per
            tensor), 1, 16, 31-33, 128, 1000, 1024/1025 (the team/tile kernel
            switch), 3000, 4096/4097 and 12293/50000 (several tiles per block),
            nvfp4 and bf16; inputs: wide range, edge values, random bit
            patterns (NaN/inf), subnormal and all-zero blocks, odd sizes from 0
            up, 5M values, a wire at an odd offset, an explicit stream.
            Then the batched pipeline kernels (native/gc_pipeline.cu) == their
            contract run by the C core (gpu_pipeline.HostKernels) for every
            format and walk, both roundings: one launch over seven pieces at
            odd offsets (one empty), the multi-piece decode, and the owner's
            sum of its piece and three received bodies, encoded and as fp32.
errors      geocomm.cuda's argument checks raise like the C core's.
nccl        NCCLCommunicator on 1 rank: alltoallv/allgatherv byte round trips,
            allreduce sum/max, allgather_int64, barrier, and a raw grouped
            ncclSend/ncclRecv to self, ordered after the fills by an event.
collectives geocomm.allreduce / reduce_scatter / allgather on CuPy over NCCL
            (the batched pipeline) == on NumPy over MPI, bit for bit: fp32, fp16
            and bf16 (bits widened on the device, as the torch adapter does),
            codecs none, bf16, fp8 e4m3/128, e5m2/0 and e4m3/4097 (team and
            tile walks), nvfp4, mxfp8 (floor, rceil), mxfp4, stochastic fp8,
            nvfp4 and mxfp4, fp8 with error feedback (a map), in place, and
            many pipeline stages (chunk_elems 4096 on 100,003 values). Then
            the batched pipeline on 3 ranks of this process (loopback copies
            for NCCL) == the host-driven pipeline on the CPU, every codec,
            all-reduce and reduce-scatter: received pieces, multi-piece sends.
torch       torch CUDA tensors (fp32/fp16/bf16, new result and out= in place)
            whose input is produced behind a long kernel on torch's current
            stream and whose result is consumed on a side stream that waits
            for the current stream == the torch CPU tensors over MPI.
geofp8      the geometry kernels on ragged ranges with inf/NaN == the C core;
            geocomm.allreduce(cupy_matrix, codec="geofp8", key=...) over NCCL,
            several steps (the basis refreshed on the way), == the same
            sequence on NumPy over MPI, state checksums included.
timing      the batched fp8 pipeline vs plain NCCL all-reduce vs a CuPy copy
            (the device's copy bandwidth) at 64 and 256 MiB: wall time and
            device time (calls queued ahead of the device), and the codec
            throughput against the copy's, which must reach 0.5 (issue #14);
            the cost of a pipeline stage against the backend model's; the
            single-body codec kernels alone.
ddp         geocomm's DDP hook on CUDA gradients over a NCCL process group
            (fp32, fp16, bf16 models): every bucket it reduced on its worker
            stream == geocomm.allreduce of the same bucket on the CPU over MPI.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

F32 = np.float32
#: team kernel up to TEAM_MAX = 1024 values per block, tile kernel above;
#: tiles of TILE = 4096 values, so blocks > 4096 span several tiles
FP8_BLOCKS = (0, 1, 16, 31, 32, 33, 128, 1000, 1024, 1025, 3000, 4096, 4097, 3 * 4096 + 5,
              50_000)
ODD_SIZES = (0, 1, 2, 15, 16, 17, 31, 33, 127, 129, 1000, 1023, 1024, 1025, 4095, 4097, 8193,
             12_299)
#: inputs up to this size are also compared with the (slow) NumPy reference
REFERENCE_MAX_N = 70_000
EDGES = np.array([0.0, -0.0, 448.0, -448.0, 464.0, 465.0, -465.0, 480.0, 57344.0, 61440.0,
                  -61441.0, 6.0, 5.0, 0.25, 1e-45, -3e-39, 1e-40, 2.0**-100, 2.0**-126,
                  2.0**-149, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan, -np.nan], F32)
#: The collectives' codecs: every format, both fp8 walks, stochastic rounding and
#: error feedback (whose map takes the pipeline's unfused path).
COLLECTIVE_CODECS = {"none": "none", "bf16": "bf16", "fp8-e4m3-128": "fp8",
                     "fp8-e5m2-0": {"id": "fp8", "fmt": "e5m2", "block": 0},
                     "fp8-e4m3-4097": {"id": "fp8", "fmt": "e4m3", "block": 4097},
                     "nvfp4": "nvfp4", "mxfp8": "mxfp8",
                     "mxfp8-e5m2-rceil": {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
                     "mxfp4": "mxfp4",
                     "fp8 stochastic": {"id": "fp8", "rounding": "stochastic", "seed": 3},
                     "nvfp4 stochastic": {"id": "nvfp4", "rounding": "stochastic", "seed": 3},
                     "mxfp4 stochastic": {"id": "mxfp4", "rounding": "stochastic", "seed": 3},
                     "fp8 error feedback": {"id": "fp8", "error_feedback": True}}
DTYPES = ("float32", "float16", "bfloat16")


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


def cases(rng: np.random.Generator, big: int = 5_000_017) -> list[tuple[str, np.ndarray]]:
    """(name, float32 input) for the bytes section."""
    out = [("wide", wide(rng, 1_000_003))]
    scale = rng.choice(np.array([1.0, 2.0**-20, 2.0**-130], F32), 65_537)
    out.append(("edges", (rng.choice(EDGES, 65_537) * scale).astype(F32)))
    out.append(("bits", rng.integers(0, 2**32, 262_147, dtype=np.uint64).astype(np.uint32)
                .view(F32)))
    tiny = wide(rng, 100_003, -149, -120)
    tiny[(np.arange(tiny.size) // 40) % 3 == 0] = 0.0  # all-zero blocks among subnormal ones
    out.append(("tiny", tiny))
    out += [(f"n={n}", wide(rng, n)) for n in ODD_SIZES]
    if big:
        out.append(("big", wide(rng, big, -20, 20)))
    return out


def configs() -> list[tuple[str, int]]:
    return ([(f, b) for f in ("e4m3", "e5m2") for b in FP8_BLOCKS]
            + [("nvfp4", 0), ("bf16", 0)])


def gradient(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Gradient-like float32 values: a rank-4 signal plus noise (anisotropic, as
    GeoFP8 expects), scaled to typical gradient magnitudes."""
    m = shape[0]
    n = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    signal = rng.standard_normal((m, 4)) @ rng.standard_normal((4, n)) * 3.0
    return ((signal + rng.standard_normal((m, n))) * 1e-3).astype(F32).reshape(shape)


# ---------------------------------------------------------------------------
# comparisons


def byte_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Byte equality of two uint8 arrays."""
    if a.shape != b.shape:
        return {"equal": False, "why": f"shapes {a.shape} != {b.shape}"}
    bad = np.flatnonzero(a != b)
    return {"equal": bad.size == 0, "mismatches": int(bad.size),
            **({"first": int(bad[0]), "got": int(a.flat[bad[0]]), "want": int(b.flat[bad[0]])}
               if bad.size else {})}


def value_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Bit equality of two float arrays of one dtype (float32, float16 or
    ml_dtypes bfloat16), any NaN equal to any NaN (GPU arithmetic returns the
    canonical NaN, the C core may keep a payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal": False, "why": f"{a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"}
    uint = np.dtype(f"u{a.dtype.itemsize}")
    wa, wb = a.astype(F32).ravel(), b.astype(F32).ravel()  # exact for all three dtypes
    both_nan = np.isnan(wa) & np.isnan(wb)
    bad = np.flatnonzero((a.view(uint).ravel() != b.view(uint).ravel()) & ~both_nan)
    return {"equal": bad.size == 0, "mismatches": int(bad.size),
            **({"first": int(bad[0]), "got": float(wa[bad[0]]), "want": float(wb[bad[0]])}
               if bad.size else {})}


def all_equal(row: dict[str, Any]) -> bool:
    """Every comparison in ``row`` (values that are dicts with "equal") holds."""
    diffs = [v for v in row.values() if isinstance(v, dict) and "equal" in v]
    return bool(diffs) and all(d["equal"] for d in diffs)


# ---------------------------------------------------------------------------
# context shared by the sections


class Context:
    """CuPy, the arguments, and the communicators (built on first use; a
    failed NCCL set-up is re-raised by every section that needs it)."""

    def __init__(self, cp: Any, args: argparse.Namespace):
        self.cp, self.args = cp, args
        self._nccl: Any = None
        self._nccl_error: BaseException | None = None
        self._mpi: Any = None

    def nccl(self) -> Any:
        if self._nccl_error is not None:
            raise RuntimeError(f"no NCCL communicator: {self._nccl_error!r}")
        if self._nccl is None:
            try:
                from geocomm.comm.nccl import NCCLCommunicator

                self._nccl = NCCLCommunicator()
            except BaseException as exc:
                self._nccl_error = exc
                raise
        return self._nccl

    def mpi(self) -> Any:
        if self._mpi is None:
            from geocomm.comm.mpi import MPICommunicator

            self._mpi = MPICommunicator()
        return self._mpi

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()


# ---------------------------------------------------------------------------
# bytes


def after_current(cp: Any, stream: Any) -> None:
    """Order ``stream`` after the work queued on the current stream (the
    copies that filled its inputs): a non-blocking stream does not wait for
    the legacy default stream by itself."""
    if stream is not None:
        stream.wait_event(cp.cuda.get_current_stream().record())


def check_case(cp: Any, fmt: str, block: int, name: str, x: np.ndarray,
               base: np.ndarray, variant: str = "") -> dict[str, Any]:
    """One format/block/input: GPU vs C core (vs reference for small inputs)."""
    from geocomm import cuda, native
    from geocomm.codecs import reference as ref

    code = native.FORMATS[fmt]
    n = x.size
    size = native.wire_size(code, n, block)
    use_ref = n <= REFERENCE_MAX_N
    row: dict[str, Any] = {"fmt": fmt, "block": block, "case": name + variant, "n": n,
                           "wire_size": {"equal": cuda.wire_size(fmt, n, block) == size}}
    cpu_wire = np.zeros(size, np.uint8)
    native.encode(code, x, block, cpu_wire)
    stream = cp.cuda.Stream(non_blocking=True) if variant == " stream" else None
    offset = 1 if variant == " offset" else 0
    x_dev = cp.asarray(x)
    store = cp.full(size + offset, 0xA5, dtype=cp.uint8)  # poison: unwritten bytes show
    after_current(cp, stream)
    cuda.encode(fmt, x_dev, block, store[offset:], stream=stream)
    if stream is not None:
        stream.synchronize()
    gpu_wire = cp.asnumpy(store[offset:])
    row["encode_vs_native"] = byte_diff(gpu_wire, cpu_wire)
    if use_ref:
        with np.errstate(all="ignore"):  # the reference casts NaN/inf on purpose
            row["encode_vs_reference"] = byte_diff(gpu_wire, ref.encode(fmt, x, block))

    wire_dev = cp.full(size + offset, 0xA5, dtype=cp.uint8)
    wire_dev[offset:] = cp.asarray(cpu_wire)
    for acc in (False, True):
        want = base.copy() if acc else np.zeros(n, F32)
        native.decode(code, cpu_wire, block, want, accumulate=acc)
        out_dev = cp.asarray(base) if acc else cp.full(n, np.nan, dtype=cp.float32)
        after_current(cp, stream)
        cuda.decode(fmt, wire_dev[offset:], block, out_dev, accumulate=acc, stream=stream)
        if stream is not None:
            stream.synchronize()
        got = cp.asnumpy(out_dev)
        key = "accumulate" if acc else "decode"
        row[f"{key}_vs_native"] = value_diff(got, want)
        if use_ref:
            with np.errstate(all="ignore"):
                ref_vals = ref.decode(fmt, cpu_wire, n, block)
                row[f"{key}_vs_reference"] = value_diff(got, (base + ref_vals) if acc
                                                        else ref_vals)
    row["ok"] = all_equal(row)
    return row


#: Codecs the batched kernels (native/gc_pipeline.cu) are checked with: every format,
#: both sides of every walk switch (fp8 teams up to 1024 values, tiles above and for
#: block 0), both scale rules; each also with stochastic rounding (bar "none").
BATCHED_CODECS: dict[str, Any] = {
    "none": "none", "bf16": "bf16", "nvfp4": "nvfp4",
    **{f"fp8-{f}-{b}": {"id": "fp8", "fmt": f, "block": b} for f in ("e4m3", "e5m2")
       for b in (0, 1, 16, 33, 128, 1000, 1024, 1025, 4096, 5000)},
    "mxfp8-e4m3": {"id": "mxfp8", "fmt": "e4m3"},
    "mxfp8-e5m2-rceil": {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
    "mxfp4": "mxfp4", "mxfp4-rceil": {"id": "mxfp4", "scale_rule": "rceil"},
}
STOCHASTIC = {"rounding": "stochastic", "seed": 11}
#: Pieces of one batched launch: odd sizes, an empty piece, a superblock and more.
BATCHED_COUNTS = (5000, 0, 4097, 1, 12_299, 3 * 4096 + 5, 33)


def batched_configs() -> list[tuple[str, Any]]:
    """(name, codec config) of every batched check, nearest and stochastic."""
    out = []
    for name, config in BATCHED_CODECS.items():
        config = {"id": config} if isinstance(config, str) else config
        out.append((name, config))
        if name != "none":
            out.append((name + " stochastic", {**config, **STOCHASTIC}))
    return out


def batched_pieces(fmt: Any, counts: tuple[int, ...]) -> tuple[list[Any], int, int]:
    """Pieces at odd value and byte offsets with a large rounding index; (pieces,
    values needed, wire bytes needed)."""
    from geocomm.gpu_pipeline import Piece

    pieces, at, byte = [], 3, 1
    for n in counts:
        pieces.append(Piece(at, n, byte, 10**12 + 7 * at))
        at, byte = at + n + 7, byte + fmt.wire_size(n)
    return pieces, at, byte


def check_batched(cp: Any, name: str, config: Any, x: np.ndarray, others: list[np.ndarray]
                  ) -> dict[str, Any]:
    """The batched kernels (CudaKernels) == their contract run by the C core
    (HostKernels), bit for bit: a multi-piece encode (bytes), a multi-piece decode,
    the owner's encode of its piece plus the bodies of ``others`` (the fused sum;
    compared decoded) and the same sum as fp32 (NaN payloads exempt throughout)."""
    import geocomm
    from geocomm import gpu_pipeline as gp

    fmt = gp.wire_format(geocomm.get_codec(config))
    host, device = gp.HostKernels(), gp.CudaKernels()
    pieces, nvalues, nbytes = batched_pieces(fmt, BATCHED_COUNTS)
    rows, amax = gp.segment_rows(fmt, pieces)
    on_host, on_device = gp.Segments(rows, rows), gp.Segments(rows, cp.asarray(rows))
    values = np.resize(x, nvalues)
    row: dict[str, Any] = {"codec": name, "pieces": len(pieces)}

    def both(run_host: Callable, run_device: Callable, empty: Callable) -> tuple:
        want, got = empty(np), empty(cp)
        run_host(want)
        run_device(got)
        return cp.asnumpy(got), want

    def wire(xp: Any) -> Any:
        return xp.full(nbytes, 0xA5, dtype=np.uint8)  # poison: unwritten bytes show

    scratch = cp.zeros(max(amax, 1), cp.uint32)
    got, want = both(lambda w: host.encode(fmt, values, on_host, w, None, stream=5),
                     lambda w: device.encode(fmt, cp.asarray(values), on_device, w, scratch,
                                             stream=5), wire)
    row["encode"] = byte_diff(got, want)
    encoded = want
    got, want = both(lambda o: host.decode(fmt, encoded, on_host, o),
                     lambda o: device.decode(fmt, cp.asarray(encoded), on_device, o),
                     lambda xp: xp.full(nvalues, np.nan, dtype=np.float32))
    row["decode"] = value_diff(got, want)

    # the owner: its piece plus the others' bodies of the same piece, in order
    n = 3 * 4096 + 5
    own_rows, own_amax = gp.segment_rows(fmt, [gp.Piece(0, n, 0, 12_345)])
    own_host, own_device = gp.Segments(own_rows, own_rows), gp.Segments(own_rows,
                                                                         cp.asarray(own_rows))
    stride = fmt.wire_size(n)
    bodies = np.zeros(len(others) * stride, np.uint8)
    for r, other in enumerate(others):
        host.encode(fmt, np.resize(other, n), own_host, bodies[r * stride:], None, stream=r)
    incoming_host = gp.Incoming(bodies, len(others), stride)
    incoming_device = gp.Incoming(cp.asarray(bodies), len(others), stride)
    own = np.resize(x[::-1], n)
    scratch = cp.zeros(max(own_amax, 1), cp.uint32)
    got, want = both(
        lambda w: host.encode(fmt, own, own_host, w, None, incoming_host, stream=9),
        lambda w: device.encode(fmt, cp.asarray(own), own_device, w, scratch, incoming_device,
                                stream=9),
        lambda xp: xp.full(stride, 0xA5, dtype=np.uint8))
    # compared decoded: a sum that is NaN is the canonical NaN on the GPU and keeps an
    # operand's sign on the CPU, which an fp8 code keeps (only NaN positions must agree)
    decoded = [np.empty(n, np.float32) for _ in range(2)]
    for body, out in zip((got, want), decoded, strict=True):
        host.decode(fmt, body, own_host, out)
    row["sum_encode"] = value_diff(*decoded)
    got, want = both(lambda o: host.reduce(fmt, own, own_host, incoming_host, o),
                     lambda o: device.reduce(fmt, cp.asarray(own), own_device, incoming_device,
                                             o),
                     lambda xp: xp.full(n, np.nan, dtype=np.float32))
    row["sum"] = value_diff(got, want)
    row["ok"] = all_equal(row)
    return row


def check_bytes(ctx: Context, config_list: list | None = None,
                inputs: list | None = None) -> dict[str, Any]:
    rows = []
    inputs = cases(np.random.default_rng(ctx.args.seed)) if inputs is None else inputs
    by_name = dict(inputs)
    # what decode+accumulate adds onto, one per input
    bases = {name: wide(np.random.default_rng(x.size), x.size, -10, 10) for name, x in inputs}
    variants = [(name, x, "") for name, x in inputs]
    variants += [(name, by_name[name], v) for name, v in (("wide", " offset"),
                                                         ("edges", " stream")) if name in by_name]
    for fmt, block in configs() if config_list is None else config_list:
        for name, x, variant in variants:
            try:
                row = check_case(ctx.cp, fmt, block, name, x, bases[name], variant)
            except Exception:
                row = {"fmt": fmt, "block": block, "case": name + variant, "n": x.size,
                       "ok": False, "error": traceback.format_exc()}
            rows.append(row)
    batched = []
    rng = np.random.default_rng([ctx.args.seed, 14])
    source = by_name.get("edges", wide(rng, 65_537))
    others = [by_name.get("wide", wide(rng, 70_000))[r::3] for r in range(3)]
    for name, config in batched_configs() if config_list is None else []:
        try:
            batched.append(check_batched(ctx.cp, name, config, source, others))
        except Exception:
            batched.append({"codec": name, "ok": False, "error": traceback.format_exc()})
    failing = [r for r in rows if not r["ok"]]
    return {"ok": not failing and all(r["ok"] for r in batched), "rows": rows,
            "batched": batched,
            "failures": [f"{r['fmt']} block={r['block']} {r['case']}: "
                         f"{ {k: v for k, v in r.items() if k not in ('fmt', 'block', 'case')} }"
                         for r in failing]
            + [f"batched {r['codec']}: { {k: v for k, v in r.items() if k != 'codec'} }"
               for r in batched if not r["ok"]]}


def check_errors(ctx: Context) -> dict[str, Any]:
    """The argument checks of geocomm.cuda raise like geocomm.native."""
    from geocomm import cuda

    cp = ctx.cp
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
    return {"ok": all(r["ok"] for r in rows), "rows": rows,
            "failures": [f"{r['check']}: {r['why']}" for r in rows if not r["ok"]]}


# ---------------------------------------------------------------------------
# nccl


def pattern(cp: Any, a: int, b: int, length: int) -> Any:
    return ((cp.arange(length, dtype=cp.int64) + 31 * a + 17 * b) % 251).astype(cp.uint8)


def check_nccl(ctx: Context) -> dict[str, Any]:
    """The NCCL communicator's byte moves and reductions (1 rank: the own segment
    is a device copy), plus a raw grouped send/recv to self."""
    cp, comm = ctx.cp, ctx.nccl()
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
    comm.alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs).wait()
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

    # grouped ncclSend/ncclRecv to self: the call path alltoallv uses for peers.
    # The fills run on the current stream, NCCL on the communicator's own
    # non-blocking stream: order NCCL after the fills with an event, and the
    # comparison after NCCL by synchronizing its stream.
    data, back = pattern(cp, r, 9, 4099), cp.zeros(4099, cp.uint8)
    nccl = comm._nccl
    after_current(cp, comm.stream)
    nccl.groupStart()
    try:
        comm.nccl_comm.send(data.data.ptr, data.size, nccl.NCCL_UINT8, r, comm.stream.ptr)
        comm.nccl_comm.recv(back.data.ptr, back.size, nccl.NCCL_UINT8, r, comm.stream.ptr)
    finally:
        nccl.groupEnd()
    comm.stream.synchronize()
    checks["ncclSend/ncclRecv to self"] = bool((back == data).all())
    return {"ok": all(checks.values()), "rank": r, "size": size, "checks": checks,
            "failures": [name for name, good in checks.items() if not good]}


# ---------------------------------------------------------------------------
# collectives: CuPy over NCCL == NumPy over MPI


def _host_input(dtype: str, values: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _to_device(cp: Any, host: np.ndarray) -> Any:
    """The device operand the collective sees: the array itself, or for
    bfloat16 (no CuPy dtype) its bits widened to float32, as the torch adapter does."""
    from geocomm.adapters.arrays import bf16_bits_to_float32

    if host.dtype.name == "bfloat16":
        return bf16_bits_to_float32(cp.asarray(host.view(np.uint16)))
    return cp.asarray(host)


def _to_host(cp: Any, result: Any, dtype: str) -> np.ndarray:
    """A device result as a host array of ``dtype`` (bfloat16: rounded like the adapter)."""
    import ml_dtypes

    from geocomm.adapters.arrays import float32_to_bf16_bits

    if dtype == "bfloat16":
        return cp.asnumpy(float32_to_bf16_bits(result)).view(ml_dtypes.bfloat16)
    return cp.asnumpy(result)


def run_collective(kind: str, x: Any, codec: Any, comm: Any, chunk: int,
                   in_place: bool) -> Any:
    """One geocomm collective through the public API (adapters included), as the
    first call with its codec and key (stochastic rounding counts the calls)."""
    import geocomm
    from geocomm import collectives

    collectives._calls.clear()
    fn = {"allreduce": geocomm.allreduce, "reduce_scatter": geocomm.reduce_scatter,
          "allgather": geocomm.allgather}[kind]
    kwargs: dict[str, Any] = {"codec": codec, "comm": comm}
    if kind != "allgather":
        kwargs["chunk_elems"] = chunk
    if in_place:
        fn(x, out=x, **kwargs)
        return x
    return fn(x, **kwargs)


def collective_cases() -> list[tuple[str, str, str, bool]]:
    """(collective, dtype, codec name, in place)."""
    out = []
    for kind in ("allreduce", "reduce_scatter", "allgather"):
        for dtype in DTYPES:
            for codec in COLLECTIVE_CODECS:
                for in_place in ((False, True) if kind == "allreduce" else (False,)):
                    out.append((kind, dtype, codec, in_place))
    return out


def lockstep(cp: Any, codec: Any, xs: list[np.ndarray], chunk: int, gather: bool
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(batched on the device, host-driven on the CPU) results of every rank of one call
    on len(xs) ranks of this process (geocomm.testing.loopback): the batched kernels
    with N - 1 incoming pieces and multi-piece tables, which one NCCL rank never has."""
    from geocomm import gpu_pipeline
    from geocomm.pipeline import Pieces, Pipeline
    from geocomm.testing import loopback, run_lockstep

    size, count = len(xs), xs[0].size
    pieces = Pieces.plan(count, size, chunk)
    fmt = gpu_pipeline.wire_format(codec)
    results = []
    for xp in (cp, np):
        pipes, outs = [], []
        for r, comm in enumerate(loopback(size, "nccl")):
            lo, hi = int(pieces.bounds[r]), int(pieces.bounds[r + 1])
            out = xp.full(count if gather else hi - lo, np.nan, dtype=np.float32)
            args = (pieces, xp.asarray(xs[r]), out, 0 if gather else lo, gather)
            pipes.append(gpu_pipeline.BatchedPipeline(comm, fmt, *args, stream=17) if xp is cp
                         else Pipeline(comm, codec, *args, stream=17))
            outs.append(out)
        run_lockstep(pipes)
        results.append([cp.asnumpy(o) if xp is cp else o for o in outs])
    return list(zip(*results, strict=True))


def check_lockstep(ctx: Context, n: int = 60_007, size: int = 3) -> list[dict[str, Any]]:
    """Rows of the batched pipeline on ``size`` loopback ranks == the host-driven one."""
    import geocomm

    rows = []
    for codec_name, config in COLLECTIVE_CODECS.items():
        if "feedback" in codec_name:
            continue  # a map: covered through the public collectives
        codec = geocomm.get_codec(config)
        xs = [gradient(np.random.default_rng([ctx.args.seed, r, 3]), (n,)) for r in range(size)]
        for gather in (True, False):
            row: dict[str, Any] = {"collective": f"{'allreduce' if gather else 'reduce_scatter'}"
                                                 f" x{size} loopback", "dtype": "float32",
                                   "codec": codec_name, "in_place": False}
            try:
                for r, (got, want) in enumerate(lockstep(ctx.cp, codec, xs, 4096 * size,
                                                         gather)):
                    row[f"rank{r}"] = value_diff(got, want)
                row["ok"] = all_equal(row)
            except Exception:
                row.update(ok=False, error=traceback.format_exc())
            rows.append(row)
    return rows


def check_collectives(ctx: Context, n: int = 100_003, chunk: int = 4096) -> dict[str, Any]:
    """The public collectives on CuPy over NCCL == on NumPy over MPI (one rank, many
    stages), then the batched pipeline on three loopback ranks (check_lockstep)."""
    from geocomm import get_codec

    cp, nccl, mpi = ctx.cp, ctx.nccl(), ctx.mpi()
    rng = np.random.default_rng([ctx.args.seed, nccl.rank])
    values = gradient(rng, (n,))
    values[::97] *= 1e4  # a spread of block scales
    rows = []
    for kind, dtype, codec_name, in_place in collective_cases():
        row: dict[str, Any] = {"collective": kind, "dtype": dtype, "codec": codec_name,
                               "in_place": in_place}
        codec = COLLECTIVE_CODECS[codec_name]
        try:
            host = _host_input(dtype, values)
            # a fresh codec each: error feedback's residuals start alike
            want = run_collective(kind, host.copy(), get_codec(codec), mpi, chunk, in_place)
            got = run_collective(kind, _to_device(cp, host), get_codec(codec), nccl, chunk,
                                 in_place)
            row["vs_numpy_mpi"] = value_diff(_to_host(cp, got, dtype), want)
            row["ok"] = all_equal(row)
        except Exception:
            row.update(ok=False, error=traceback.format_exc())
        rows.append(row)
    rows += check_lockstep(ctx)
    return {"ok": all(r["ok"] for r in rows), "n": n, "chunk_elems": chunk, "rows": rows,
            "failures": [f"{r['collective']} {r['dtype']} {r['codec']} "
                         f"{'in place ' if r['in_place'] else ''}"
                         f"{r.get('vs_numpy_mpi', r.get('error'))}"
                         for r in rows if not r["ok"]]}


# ---------------------------------------------------------------------------
# torch CUDA round trip


def _torch_bits(t: Any) -> np.ndarray:
    """The host values of a torch tensor as a NumPy array of the same dtype
    (bfloat16 through its int16 bits)."""
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def torch_cuda_missing() -> dict[str, Any] | None:
    """The "skipped" result when torch or its CUDA device is missing, else None."""
    try:
        import torch
    except ImportError as exc:
        return {"ok": True, "status": "skipped", "reason": f"torch is not installed ({exc})"}
    if not torch.cuda.is_available():
        return {"ok": True, "status": "skipped",
                "reason": f"torch {torch.__version__} has no CUDA device (a CPU build?)"}
    return None


def check_torch(ctx: Context, n: int = 300_001, chunk: int = 65_536) -> dict[str, Any]:
    if (missing := torch_cuda_missing()) is not None:
        return missing
    import torch

    import geocomm

    nccl, mpi = ctx.nccl(), ctx.mpi()
    device = torch.device("cuda", ctx.cp.cuda.Device().id)
    values = torch.from_numpy(gradient(np.random.default_rng([ctx.args.seed, 7]), (n,)))
    busy = torch.randn(4096, 4096, device=device)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for in_place in (False, True):
            row: dict[str, Any] = {"dtype": str(dtype), "in_place": in_place}
            try:
                host = values.to(dtype)
                want = geocomm.allreduce(host.clone(), codec="fp8", op="avg", comm=mpi,
                                         chunk_elems=chunk)
                staged = host.to(device)
                torch.cuda.synchronize(device)
                # the input is written behind a long kernel on torch's current
                # stream: geocomm must read it in that stream's order
                for _ in range(4):
                    busy = busy @ busy / 64.0  # entries keep variance ~1
                x = staged.clone()
                out = x if in_place else None
                result = geocomm.allreduce(x, codec="fp8", op="avg", comm=nccl, out=out,
                                           chunk_elems=chunk)
                # a consumer on a side stream waits for the current stream only
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    consumed = result * 1
                side.synchronize()
                row["kind"] = {"equal": isinstance(result, torch.Tensor)
                               and result.dtype == dtype and result.device == device
                               and result.shape == host.shape}
                if in_place:
                    row["same_storage"] = {"equal": result is x}
                row["vs_cpu_mpi"] = value_diff(_torch_bits(consumed), _torch_bits(want))
                row["ok"] = all_equal(row)
            except Exception:
                row.update(ok=False, error=traceback.format_exc())
            rows.append(row)
    return {"ok": all(r["ok"] for r in rows), "status": "ran", "rows": rows,
            "failures": [f"{r['dtype']} {'in place' if r['in_place'] else 'new result'}: "
                         f"{ {k: v for k, v in r.items() if k not in ('dtype', 'in_place')} }"
                         for r in rows if not r["ok"]]}


# ---------------------------------------------------------------------------
# GeoFP8 over NCCL


def check_geofp8(ctx: Context, shape: tuple[int, int] = (2048, 4096),
                 steps: int = 6) -> dict[str, Any]:
    """GeoFP8's kernels and collective on CuPy == on NumPy, bit for bit.

    The geometry kernels (native/gc_geometry.cu vs native/geometry.c) on flat
    ranges that start and end inside rows, with inf/NaN inputs; then the same
    sequence of GeoFP8 all-reduces (state carried across steps by key, the
    basis refreshed on the way) on CuPy over NCCL and on NumPy over MPI.
    """
    import geocomm
    from geocomm.codecs.geo import kernels

    cp, nccl, mpi = ctx.cp, ctx.nccl(), ctx.mpi()
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(ctx.args.seed)
    for m, n, k, lo, length in ((64, 4099, 12, 0, 64 * 4099), (33, 1000, 5, 517, 20_000),
                                (9, 77, 1, 76, 78)):
        x = rng.standard_normal(length).astype(np.float32)
        x[length // 2] = np.nan
        vt = kernels.orthonormalize(rng.standard_normal((k, n)).astype(np.float32), 1)
        want_coef = kernels.project(x, lo, n, vt)
        got_coef = kernels.project(cp.asarray(x), lo, n, cp.asarray(vt))
        want_out = np.empty_like(x)
        kernels.expand(x, lo, n, want_coef, vt, -1.0, want_out)
        got_out = cp.empty(length, cp.float32)
        kernels.expand(cp.asarray(x), lo, n, cp.asarray(want_coef), cp.asarray(vt), -1.0,
                       got_out)
        x[length // 2] = 0.25  # accumulation is defined on finite values
        want_acc = np.zeros((k, n), np.float32)
        kernels.accumulate(x, lo, n, want_coef, want_acc)
        got_acc = cp.zeros((k, n), cp.float32)
        kernels.accumulate(cp.asarray(x), lo, n, cp.asarray(want_coef), got_acc)
        row = {"kernels": f"{m}x{n} k={k} range [{lo}, {lo + length})",
               "project": value_diff(cp.asnumpy(got_coef), want_coef),
               "expand": value_diff(cp.asnumpy(got_out), want_out),
               "accumulate": value_diff(cp.asnumpy(got_acc), want_acc)}
        row["ok"] = all_equal(row)
        rows.append(row)
    on_gpu, on_cpu = geocomm.get_codec("geofp8"), geocomm.get_codec("geofp8")
    for step in range(steps):
        g = gradient(np.random.default_rng([ctx.args.seed, nccl.rank, step]), shape)
        want = geocomm.allreduce(g.copy(), codec=on_cpu, key="layer.w", comm=mpi)
        got = geocomm.allreduce(cp.asarray(g), codec=on_gpu, key="layer.w", comm=nccl)
        rows.append({"step": step, "vs_numpy_mpi": value_diff(cp.asnumpy(got), want),
                     "state_equal": on_gpu.state_checksum() == on_cpu.state_checksum()})
        rows[-1]["ok"] = all_equal(rows[-1]) and rows[-1]["state_equal"]
    return {"ok": all(r["ok"] for r in rows), "status": "ran", "shape": list(shape),
            "rows": rows, "failures": [str(r) for r in rows if not r["ok"]]}


# ---------------------------------------------------------------------------
# timing


def median_seconds(ctx: Context, op: Callable[[], Any], repeats: int) -> float:
    """Median wall time of op() between device synchronizations: what a caller that
    waits for the result sees, host overhead included."""
    for _ in range(2):
        op()
    ctx.sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


#: Holds a stream for a number of clock cycles (gpu_seconds queues work behind it).
SPIN_SOURCE = r"""
extern "C" __global__ void gc_spin(long long cycles)
{
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


def gpu_seconds(ctx: Context, op: Callable[[], Any], repeats: int) -> tuple[float, bool]:
    """(device seconds per call of op(), whether the host was out of the way).

    The calls are queued behind a kernel that holds the current stream for twice
    as long as the host takes to queue them, and timed by events on that stream
    around them: what the device spends on the work itself (kernels, transfers and
    the gaps between them), not Python's launch overhead. The second value is False
    if the hold ended before the host had queued every call (then host time leaked
    in). Work that waits on the host inside a call could not be queued ahead, so
    this also shows that a call does not.
    """
    cp = ctx.cp
    op()
    ctx.sync()
    began = time.perf_counter()
    for _ in range(repeats):
        op()
    enqueue = time.perf_counter() - began
    ctx.sync()
    try:
        clock_hz = 1e3 * cp.cuda.Device().attributes["ClockRate"]  # kHz
    except Exception:  # an attribute this CUDA no longer reports: assume 2 GHz
        clock_hz = 2e9
    spin = cp.RawKernel(SPIN_SOURCE, "gc_spin")
    start, end = cp.cuda.Event(), cp.cuda.Event()
    spin((1,), (1,), (np.int64((2 * enqueue + 0.02) * clock_hz),))
    start.record()
    for _ in range(repeats):
        op()
    gated = not start.done
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats, gated


#: The must-show of issue #14: the fp8 all-reduce's codec throughput (device time)
#: reaches this share of the device's copy bandwidth.
MUST_SHOW_VS_COPY = 0.5


def time_pipeline(ctx: Context, size_mib: int, repeats: int) -> list[dict[str, Any]]:
    """Copy, plain NCCL all-reduce and the batched fp8 pipeline on ``size_mib`` of fp32.

    GB/s is the algorithm bandwidth: tensor bytes / time (for the copy that is
    half its read + write traffic). ``seconds``/``GBps``: wall time per call,
    host included; ``gpu_seconds``/``gpu_GBps``: device time per call
    (:func:`gpu_seconds`); ``vs_copy``: gpu_GBps over the copy's: on one rank the
    pipeline moves nothing over a link, so this is its codec throughput against
    the device's copy bandwidth. ``stages``: the pipeline stages the backend's
    model chose (geocomm.backends).
    """
    import geocomm
    from geocomm.pipeline import Pieces, stage_values

    cp, nccl = ctx.cp, ctx.nccl()
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(1).standard_normal(n, dtype=cp.float32)
    y = cp.empty_like(x)
    chunk = stage_values(nccl.backend, n, nccl.size)
    ops = {
        "cupy copy": (lambda: cp.copyto(y, x), None),
        "NCCL all-reduce (fp32)": (lambda: nccl.allreduce(x, y, "sum"), None),
        "geocomm fp8 pipeline": (lambda: geocomm.allreduce(x, codec="fp8", out=y, comm=nccl),
                                 Pieces.plan(n, nccl.size, chunk).stages),
    }
    rows = []
    for name, (op, stages) in ops.items():
        seconds = median_seconds(ctx, op, repeats)
        device, gated = gpu_seconds(ctx, op, repeats)
        rows.append({"size_MiB": size_mib, "op": name, "stages": stages, "seconds": seconds,
                     "GBps": x.nbytes / seconds / 1e9, "gpu_seconds": device,
                     "gpu_GBps": x.nbytes / device / 1e9, "host_out_of_the_way": gated})
    copy = rows[0]["gpu_GBps"]
    for row in rows:
        row["vs_copy"] = row["gpu_GBps"] / copy
    return rows


def time_stage_cost(ctx: Context, size_mib: int = 64, stages: int = 8,
                    repeats: int = 10) -> dict[str, Any]:
    """The cost of one pipeline stage, as the backend model assumes it (``stage_s``):
    the fp8 all-reduce's wall time in ``stages`` stages against one stage."""
    import geocomm
    from geocomm import backends

    cp, nccl = ctx.cp, ctx.nccl()
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(3).standard_normal(n, dtype=cp.float32)
    y = cp.empty_like(x)
    times = [median_seconds(ctx, lambda c=c: geocomm.allreduce(
        x, codec="fp8", out=y, comm=nccl, chunk_elems=c), repeats) for c in (n, -(-n // stages))]
    profile = backends.profile(nccl.backend)
    return {"size_MiB": size_mib, "stages": stages, "one_stage_s": times[0],
            "many_stages_s": times[1], "stage_s": (times[1] - times[0]) / (stages - 1),
            "model_stage_s": profile.stage_s if profile else None}


def time_kernels(ctx: Context, size_mib: int, repeats: int) -> list[dict[str, Any]]:
    """Encode, decode and decode+accumulate alone (CUDA events on one stream)."""
    from geocomm import cuda

    cp = ctx.cp
    n = size_mib * (1 << 20) // 4
    x = cp.random.default_rng(2).standard_normal(n, dtype=cp.float32)
    out = cp.zeros(n, cp.float32)
    rows = []
    for fmt, block in (("e4m3", 128), ("e4m3", 0), ("e5m2", 128), ("nvfp4", 0), ("bf16", 0)):
        wire = cp.empty(cuda.wire_size(fmt, n, block), cp.uint8)
        ops = {"encode": functools.partial(cuda.encode, fmt, x, block, wire),
               "decode": functools.partial(cuda.decode, fmt, wire, block, out),
               "accumulate": functools.partial(cuda.decode, fmt, wire, block, out,
                                               accumulate=True)}
        for name, op in ops.items():
            for _ in range(3):
                op()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(repeats):
                op()
            end.record()
            end.synchronize()
            seconds = cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats
            rows.append({"fmt": fmt, "block": block, "op": name, "seconds": seconds,
                         "fp32_GBps": x.nbytes / seconds / 1e9})
    return rows


def check_timing(ctx: Context, sizes_mib: tuple[int, ...] = (64, 256),
                 repeats: int = 10) -> dict[str, Any]:
    """Timings, and the issue's must-show: the fp8 pipeline's codec throughput reaches
    MUST_SHOW_VS_COPY of the copy bandwidth at every size (a failure otherwise)."""
    pipeline = [row for size in sizes_mib for row in time_pipeline(ctx, size, repeats)]
    kernels = time_kernels(ctx, max(sizes_mib), 2 * repeats)
    stage = time_stage_cost(ctx, min(sizes_mib), repeats=repeats)
    failures = [f"fp8 pipeline at {r['size_MiB']} MiB: codec throughput {r['vs_copy']:.2f} of "
                f"the copy bandwidth (must be >= {MUST_SHOW_VS_COPY})"
                for r in pipeline if r["op"] == "geocomm fp8 pipeline"
                and r["vs_copy"] < MUST_SHOW_VS_COPY]
    return {"ok": not failures, "pipeline": pipeline, "kernels": kernels, "stage_cost": stage,
            "failures": failures}


# ---------------------------------------------------------------------------
# the DDP hook on CUDA gradients


def check_ddp(ctx: Context, steps: int = 3) -> dict[str, Any]:
    """geocomm_hook in a 1-rank DDP over a NCCL process group: see :func:`ddp_rows`."""
    if (missing := torch_cuda_missing()) is not None:
        return missing
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", ctx.cp.cuda.Device().id)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = ddp_rows(device, ctx.mpi(), ctx.args.seed, steps)
    return {"ok": all(r["ok"] for r in rows), "status": "ran", "rows": rows,
            "failures": [f"{r['dtype']}: { {k: v for k, v in r.items() if k != 'dtype'} }"
                         for r in rows if not r["ok"]]}


def ddp_rows(device: Any, mpi: Any, seed: int, steps: int) -> list[dict[str, Any]]:
    """For fp32, fp16 and bf16 models on ``device`` (torch.distributed initialised
    with one rank): each bucket, copied as DDP hands it over (on the gradients'
    stream, behind a long kernel), is reduced by the hook's worker on its own
    stream; the gradients DDP writes back must equal geocomm.allreduce of the copy
    on the CPU over ``mpi``, bit for bit, with one collective per bucket."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm
    import geocomm.adapters.torch as gt

    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        row: dict[str, Any] = {"dtype": str(dtype)}
        state = None
        try:
            torch.manual_seed(seed % 2**31)
            net = torch.nn.Sequential(
                torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                torch.nn.GELU(), torch.nn.Linear(1024, 16)).to(device, dtype)
            model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None,
                        bucket_cap_mb=1)
            state = gt.GeocommHookState(net, codec="fp8")
            seen: list[tuple[Any, list[Any], int]] = []

            def hook(state, bucket, seen=seen):  # no annotation: DDP checks it
                seen.append((bucket.buffer().clone(), bucket.parameters(), bucket.index()))
                return gt.geocomm_hook(state, bucket)

            model.register_comm_hook(state, hook)
            busy = torch.randn(1024, 1024, device=device)
            diffs, buckets = [], 0
            for _ in range(steps):
                seen.clear()
                for _ in range(4):  # the gradients come behind a long kernel
                    busy = busy @ busy / 32.0  # entries keep variance ~1
                x = torch.randn(256, 512, device=device, dtype=dtype)
                model(x).float().pow(2).mean().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                for buffer, params, _ in seen:
                    want = geocomm.allreduce(buffer.cpu(), codec="fp8", op="avg", comm=mpi,
                                             chunk_elems=state.reducer.chunk_elems)
                    got = torch.cat([p.grad.reshape(-1) for p in params])
                    diffs.append(value_diff(_torch_bits(got), _torch_bits(want)))
                buckets += len(seen)
                model.zero_grad()
            row["buckets"] = buckets
            row["vs_cpu_mpi"] = next((d for d in diffs if not d["equal"]), diffs[0])
            row["one_collective_per_bucket"] = {"equal": all(
                b.collectives == 1 for step in state.telemetry.history for b in step.buckets)}
            row["ok"] = all_equal(row)
        except Exception:
            row.update(ok=False, error=traceback.format_exc())
        finally:
            if state is not None:
                state.close()
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# running and reporting


SECTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "bytes": check_bytes, "errors": check_errors, "nccl": check_nccl,
    "collectives": check_collectives, "torch": check_torch, "geofp8": check_geofp8,
    "timing": check_timing, "ddp": check_ddp,
}


def run_sections(ctx: Context, names: list[str], budget_s: float) -> dict[str, dict[str, Any]]:
    """Run each section on its own: an exception fails that section only."""
    results: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    for name in names:
        if time.monotonic() - start > budget_s:
            results[name] = {"ok": False, "status": "skipped",
                             "reason": f"time budget of {budget_s:.0f} s used up", "failures": [
                                 "not run: time budget used up"]}
            continue
        began = time.monotonic()
        try:
            result = SECTIONS[name](ctx)
        except Exception:
            result = {"ok": False, "status": "failed", "error": traceback.format_exc(),
                      "failures": [traceback.format_exc(limit=3).strip()]}
        result.setdefault("status", "ran")
        result["seconds"] = time.monotonic() - began
        results[name] = result
        print(f"gpu_check: {name}: {summary_word(result)} ({result['seconds']:.1f} s)",
              flush=True)
    return results


def summary_word(result: dict[str, Any]) -> str:
    if result["status"] in ("skipped", "unsupported"):
        return f"{result['status']} ({result.get('reason', '')})"
    return "PASS" if result["ok"] else "FAIL"


def environment(cp: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                            "cupy": getattr(cp, "__version__", "?")}
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        info.update(device=name.decode() if isinstance(name, bytes) else name,
                    compute_capability=cp.cuda.Device().compute_capability,
                    driver=cp.cuda.runtime.driverGetVersion(),
                    runtime=cp.cuda.runtime.runtimeGetVersion())
    except Exception as exc:  # report, do not fail: the checks say what matters
        info["device_error"] = repr(exc)
    return info


def markdown(report: dict[str, Any]) -> str:
    sections = report["sections"]
    lines = [f"# GPU check ({report['environment'].get('device', '?')})", "",
             f"Result: **{'PASS' if report['ok'] else 'FAIL'}** in {report['seconds']:.0f} s", "",
             "| section | result | seconds |", "| --- | --- | --- |"]
    lines += [f"| {name} | {summary_word(r)} | {r.get('seconds', 0):.1f} |"
              for name, r in sections.items()]
    failing = [(name, f) for name, r in sections.items() for f in r.get("failures", [])]
    if failing:
        lines += ["", "## Failures", ""] + [f"- {name}: `{f[:400]}`" for name, f in failing]
    rows = sections.get("bytes", {}).get("rows")
    if rows:
        lines += ["", "## Bytes (GPU vs C core; vs NumPy reference up to "
                  f"{REFERENCE_MAX_N} values)", "",
                  "| format | block | cases | all equal |", "| --- | --- | --- | --- |"]
        by_config: dict[tuple[str, int], list[dict]] = {}
        for row in rows:
            by_config.setdefault((row["fmt"], row["block"]), []).append(row)
        lines += [f"| {fmt} | {block} | {len(group)} | "
                  f"{'yes' if all(r['ok'] for r in group) else 'NO'} |"
                  for (fmt, block), group in by_config.items()]
    batched = sections.get("bytes", {}).get("batched")
    if batched:
        lines += ["", "## Batched kernels (native/gc_pipeline.cu vs the C core, bitwise)", "",
                  "| codec | encode | decode | sum + encode | sum |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['codec']} | " + " | ".join(
            "yes" if r.get(k, {}).get("equal") else "NO"
            for k in ("encode", "decode", "sum_encode", "sum")) + " |" for r in batched]
    rows = sections.get("collectives", {}).get("rows")
    if rows:
        lines += ["", "## Collectives (CuPy over NCCL vs NumPy over MPI, bitwise)", "",
                  "| collective | dtype | codec | in place | equal |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['collective']} | {r['dtype']} | {r['codec']} | "
                  f"{'yes' if r['in_place'] else 'no'} | {'yes' if r['ok'] else 'NO'} |"
                  for r in rows]
    timing = sections.get("timing", {})
    if timing.get("pipeline"):
        lines += ["", "## Timing (1 rank; GB/s = fp32 tensor bytes / time)", "",
                  "Wall: per call, host included. Device: per call queued ahead of the device "
                  "(gpu_check.gpu_seconds); vs copy: device GB/s over the copy's, the codec "
                  f"throughput (must reach {MUST_SHOW_VS_COPY} for fp8).", "",
                  "| MiB | operation | stages | wall ms | wall GB/s | device ms | device GB/s "
                  "| vs copy |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['size_MiB']} | {r['op']} | {r['stages'] or ''} | "
                  f"{r['seconds'] * 1e3:.3f} | {r['GBps']:.0f} | {r['gpu_seconds'] * 1e3:.3f} | "
                  f"{r['gpu_GBps']:.0f} | {r['vs_copy']:.2f}"
                  f"{'' if r['host_out_of_the_way'] else ' (host-bound)'} |"
                  for r in timing["pipeline"]]
        stage = timing.get("stage_cost")
        if stage:
            model = stage["model_stage_s"]
            lines += ["", f"Stage cost: {stage['stage_s'] * 1e6:.0f} us per stage "
                      f"({stage['size_MiB']} MiB in 1 and {stage['stages']} stages); "
                      f"the backend model assumes {model * 1e6:.0f} us." if model else ""]
        lines += ["", "| format | block | kernel | ms | fp32 GB/s |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['fmt']} | {r['block']} | {r['op']} | {r['seconds'] * 1e3:.3f} | "
                  f"{r['fp32_GBps']:.0f} |" for r in timing["kernels"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Sections: " + ", ".join(SECTIONS))
    p.add_argument("--out", type=Path, default=Path("perf/results/gpu_check.json"),
                   help="JSON report; the markdown summary goes beside it (.md)")
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                   help="run only these sections")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no section after this many seconds (default 420)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from geocomm import cuda, native

    if not cuda.available:
        try:
            cuda.require()
        except ImportError as exc:
            fail_exit(f"no GPU path to check: {exc}", 2)
    if not native.available:
        fail_exit("the native C core (geocomm._native) is not built; pip install . first", 2)
    import cupy as cp

    t0 = time.monotonic()
    ctx = Context(cp, args)
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()},
                              "environment": environment(cp)}
    try:
        report["sections"] = run_sections(ctx, args.only, args.budget_s)
    finally:
        try:
            ctx.close()
        except Exception as exc:
            print(f"gpu_check: closing the NCCL communicator failed: {exc!r}", file=sys.stderr)
    report["ok"] = all(r["ok"] for r in report["sections"].values())
    report["seconds"] = time.monotonic() - t0
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    out = args.out if not rank else args.out.with_name(f"{args.out.stem}.rank{rank}.json")
    write_report(report, out)
    print(markdown(report))
    for name, result in report["sections"].items():
        for failure in result.get("failures", []) if not result["ok"] else []:
            print(f"FAIL {name}: {failure}", file=sys.stderr)
    print(f"gpu_check: {'PASS' if report['ok'] else 'FAIL'} in {report['seconds']:.1f} s; "
          f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
