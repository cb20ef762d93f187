"""The one GPU check: CuPy kernels and collectives == the CPU path, bit for bit; speed.

    python perf/gpu_check.py --out perf/results/gpu_check.json
    python -m geocomm.launch -n 2 -- python perf/gpu_check.py --out /tmp/gc2.json
    python perf/gpu_check.py --twin --out /tmp/gc.json      # no GPU: the CuPy twin

Writes the JSON and a markdown summary beside it (.md; rank 0 only); prints the
summary. Exit status (the same on every rank: the ranks all-reduce it) 0: every
section that ran passed; 1: a mismatch or a failure (each is printed as a
``FAIL`` line to stderr); 2: nothing to check (no CuPy, no CUDA device, or no
native C core). Sections are independent: one that fails or raises is reported
and the others still run. ``--budget-s`` (default 420 s) skips the sections
that would start after it (rank 0 decides for all), so the run stays under 8
minutes.

Ranks: one process per GPU, on any number of ranks (``geocomm.launch -n N``).
The CPU side is NumPy over MPI.COMM_WORLD, the GPU side CuPy over an
NCCLCommunicator of COMM_WORLD; inputs are seeded per rank. ``nccl``,
``collectives`` (bar its loopback part) and ``geofp8``'s collective run on every
rank with the same calls in the same order: each rank compares its own result
with its MPI result, and the ranks compare checksums of their all-reduce and
all-gather results (identical everywhere). The single-process checks (``bytes``,
the loopback pipeline, the geometry kernels) run on rank 0 while the others
wait; ``errors`` runs on every rank. A section's result is every rank's: it
passes when it passed on all of them, and its failures name the rank.

``--twin``: no GPU needed. tests/twin (a CPU twin of CuPy: device arrays in host
memory, streams on worker threads with a stream-order checker, red-zoned
memory, the project's .cu kernels compiled for the host, cupy.cuda.nccl over
MPI) goes first on sys.path before anything imports cupy; ``torch``, ``ddp``,
``fsdp`` and ``backend`` are reported as skipped (the twin runs no torch CUDA
tensors); ``timing`` runs at 1 MiB and reports its rows, but the twin has no
device clock, so its must-shows are reported and not enforced there; the sizes
shrink where only the count was large, so a run takes about 45 s at 1-3 ranks on
two cores (GEOCOMM_TIMEOUT defaults to 120 s there). Sizes (values) of the two
profiles, gpu / twin:

    bytes: wide input            1,000,003 / 200,003
           edge values              65,537 / 65,537
           random bit patterns     262,147 / 65,539
           subnormal ("tiny")      100,003 / 30,011
           big input             5,000,017 / 500,009
           ragged sizes 0 .. 12,299, every format, fp8 block, batched codec
           and walk: the same in both
    collectives: per rank          100,003 / 60,013  (stages of 4096 values)
                 loopback ranks     60,007 / 20,011
    geofp8: matrix            2048 x 4096 / 512 x 1024, 6 steps in both
    timing: fp32 per call      64 and 256 MiB / 1 MiB

Sections:

bytes       GPU encode == C core encode (== NumPy reference for small inputs)
            byte for byte, and GPU decode / decode+accumulate of the C core's
            bytes == C core decode bit for bit (NaN payloads exempt: only NaN
            positions must agree), for e4m3/e5m2 with blocks 0 (one per
            tensor), 1, 16, 31-33, 128, 1000, 1024/1025 (the team/tile kernel
            switch), 3000, 4096/4097 and 12293/50000 (several tiles per block),
            nvfp4 and bf16; inputs: wide range, edge values, random bit
            patterns (NaN/inf), subnormal and all-zero blocks, odd sizes from 0
            up, a big input, a wire at an odd offset, an explicit stream.
            Then the batched pipeline kernels (native/gc_pipeline.cu) == their
            contract run by the C core (geocomm.engine.device.HostKernels) for every
            format and walk, both roundings: one launch over seven pieces at
            odd offsets (one empty), the multi-piece decode, and the owner's
            sum of its piece and three received bodies, encoded and as fp32.
errors      geocomm.kernels.cuda's argument checks raise like the C core's (an
            unknown format id: one past the largest of the C core's ids).
nccl        NCCLCommunicator over the ranks: alltoallv/allgatherv byte round
            trips, allreduce sum/max, allgather_int64, barrier, and a raw
            grouped ncclSend/ncclRecv around the ring (to self on one rank),
            ordered after the fills by an event.
collectives geocomm.allreduce / reduce_scatter / allgather on CuPy over NCCL
            (the batched pipeline) == on NumPy over MPI, bit for bit: fp32, fp16
            and bf16 (bits widened on the device, as the torch adapter does),
            codecs none, bf16, fp8 e4m3/128, e5m2/0 and e4m3/4097 (team and
            tile walks), nvfp4, mxfp8 (floor, rceil), mxfp4, stochastic fp8,
            nvfp4 and mxfp4, fp8 with error feedback (a map), in place, and
            many pipeline stages. Then the batched pipeline on 3 ranks of
            rank 0's process (loopback copies for NCCL) == the host-driven
            pipeline on the CPU, every codec, all-reduce and reduce-scatter:
            received pieces, multi-piece sends.
torch       torch CUDA tensors (fp32/fp16/bf16, new result and out= in place)
            whose input is produced behind a long kernel on torch's current
            stream and whose result is consumed on a side stream that waits
            for the current stream == the torch CPU tensors over MPI.
geofp8      the geometry kernels on ragged ranges with inf/NaN == the C core;
            geocomm.allreduce(cupy_matrix, codec="geofp8", key=...) over NCCL,
            several steps (the basis refreshed on the way), == the same
            sequence on NumPy over MPI, state checksums included.
timing      the batched fp8 pipeline vs plain NCCL all-reduce vs a CuPy copy
            (the device's copy bandwidth) at 64 and 256 MiB: wall, host and
            device time per steady-state call (perf/gpu_clock.py); must-shows
            (issue 38): the codec throughput reaches 0.7 of the copy's and the
            host spends at most 30 us per call; the cost of a pipeline stage
            against the backend model's; every single-body codec kernel alone,
            its traffic against the copy's.
ddp         geocomm's DDP hook on CUDA gradients over a 1-rank NCCL process
            group (fp32, fp16, bf16 models): every bucket it reduced on its
            worker stream == geocomm.allreduce of the same bucket on the CPU
            over MPI; then docs/torch.md's DDP example, compressed against
            uncompressed (perf/gpu_check_examples.py) (skipped on more than one
            rank).
fsdp        docs/torch.md's FSDP2 example on CUDA over a 1-rank NCCL group,
            compressed (fp8, the replica all-reduce hook): every call == the
            CPU over MPI, bit for bit, the exact calls exact, the losses within
            fp8's bound of the uncompressed run (issue 39; skipped on more
            than one rank).
backend     the geocomm torch.distributed backend's NCCL route, a 1-rank group
            made with new_group(backend="cpu:geocomm,cuda:geocomm"): CUDA
            all_reduce and reduce_scatter_tensor compressed == geocomm's fp8
            on the CPU over MPI, bit for bit; int32 SUM, MAX and small tensors
            exact; DDP with no hook at fp8's error (skipped on more than one
            rank).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: the CuPy twin's package folder (perf/../tests/twin)
TWIN_PATH = HERE.parent / "tests" / "twin"
if str(HERE) not in sys.path:  # the sections' modules beside this file (python -P too)
    sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from gpu_check_backend import check_backend  # noqa: E402
from gpu_check_bytes import check_bytes, check_errors  # noqa: E402
from gpu_check_collectives import check_collectives, check_nccl  # noqa: E402
from gpu_check_common import PROFILES, Sizes  # noqa: E402
from gpu_check_device import check_torch  # noqa: E402
from gpu_check_examples import check_ddp, check_fsdp  # noqa: E402
from gpu_check_geofp8 import check_geofp8  # noqa: E402
from gpu_check_report import markdown, summary_word, write_report  # noqa: E402
from gpu_check_timing import check_timing  # noqa: E402

#: sections the twin cannot run, and why (reported as skipped under --twin)
NEEDS_GPU = ("torch", "ddp", "fsdp", "backend")
TWIN_SKIP_REASON = "needs a real GPU (the twin runs no torch CUDA tensors)"


def fail_exit(message: str, code: int) -> None:
    print(f"gpu_check: {message}", file=sys.stderr)
    sys.exit(code)


def use_twin() -> None:
    """Put the CuPy twin first on sys.path; refuse if a real CuPy was imported already."""
    loaded = sys.modules.get("cupy")
    if loaded is not None and not getattr(loaded, "TWIN", False):
        fail_exit("--twin: a real CuPy was imported before the twin could be put first", 2)
    if not (TWIN_PATH / "cupy" / "__init__.py").exists():
        fail_exit(f"--twin: no CuPy twin at {TWIN_PATH}", 2)
    sys.path.insert(0, str(TWIN_PATH))
    os.environ.setdefault("GEOCOMM_TIMEOUT", "120")


# ---------------------------------------------------------------------------
# context shared by the sections


class Context:
    """CuPy, the arguments, the size profile, the ranks (``world``: mpi4py's
    COMM_WORLD, or None for one process) and the communicators (built on first
    use; a failed NCCL set-up is re-raised by every section that needs it)."""

    def __init__(
        self, cp: Any, args: argparse.Namespace, world: Any = None, sizes: Sizes | None = None
    ):
        self.cp, self.args, self.world = cp, args, world
        self.twin = bool(getattr(args, "twin", False))
        self.sizes = sizes or PROFILES["twin" if self.twin else "gpu"]
        self.rank = world.Get_rank() if world is not None else 0
        self.size = world.Get_size() if world is not None else 1
        self._nccl: Any = None
        self._nccl_error: BaseException | None = None
        self._mpi: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def nccl(self) -> Any:
        if self._nccl_error is not None:
            raise RuntimeError(f"no NCCL communicator: {self._nccl_error!r}")
        if self._nccl is None:
            try:
                from geocomm.comm.nccl import NCCLCommunicator

                self._nccl = NCCLCommunicator(self.world)
            except BaseException as exc:
                self._nccl_error = exc
                raise
        return self._nccl

    def mpi(self) -> Any:
        if self._mpi is None:
            from geocomm.comm.mpi import MPICommunicator

            self._mpi = MPICommunicator(self.world)
        return self._mpi

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()

    # -- ranks -------------------------------------------------------------------
    def quiet_barrier(self) -> None:
        """A barrier that sleeps while it waits: ranks waiting for rank 0's
        single-process work leave it the cores (MPI's blocking calls spin)."""
        if self.size > 1:
            request = self.world.Ibarrier()
            while not request.Test():
                time.sleep(0.005)

    def on_root(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0 (None elsewhere); every rank returns once it is done."""
        try:
            return fn() if self.is_root else None
        finally:
            self.quiet_barrier()

    def root_only(self) -> dict[str, Any]:
        """The result of a rank-0-only section on the other ranks."""
        return {
            "ok": True,
            "status": "ran",
            "note": "single-process: ran on rank 0",
            "failures": [],
        }

    def decide(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        return self.world.bcast(value, root=0) if self.size > 1 else value

    def combine(self, result: dict[str, Any]) -> dict[str, Any]:
        """This rank's section result, with ok, seconds and failures of every rank
        (the same on all ranks)."""
        if self.size == 1:
            return result
        self.quiet_barrier()
        mine = {
            "ok": bool(result["ok"]),
            "status": result["status"],
            "seconds": result["seconds"],
            "failures": list(result.get("failures", []))[:50],
        }
        ranks = self.world.allgather(mine)
        merged = dict(result)
        merged["ok"] = all(r["ok"] for r in ranks)
        merged["seconds"] = max(r["seconds"] for r in ranks)
        merged["per_rank"] = [
            {
                "rank": r,
                "ok": s["ok"],
                "status": s["status"],
                "seconds": s["seconds"],
                "failures": len(s["failures"]),
            }
            for r, s in enumerate(ranks)
        ]
        merged["failures"] = [f"rank {r}: {f}" for r, s in enumerate(ranks) for f in s["failures"]]
        return merged


# ---------------------------------------------------------------------------
# running and reporting


SECTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "bytes": check_bytes,
    "errors": check_errors,
    "nccl": check_nccl,
    "collectives": check_collectives,
    "torch": check_torch,
    "geofp8": check_geofp8,
    "timing": check_timing,
    "ddp": check_ddp,
    "fsdp": check_fsdp,
    "backend": check_backend,
}


def run_sections(ctx: Context, names: list[str], budget_s: float) -> dict[str, dict[str, Any]]:
    """Run each section on its own: an exception fails that section only. Every
    rank runs the same sections (rank 0 applies the budget for all)."""
    results: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    for name in names:
        if ctx.decide(time.monotonic() - start > budget_s):
            results[name] = {
                "ok": False,
                "status": "skipped",
                "reason": f"time budget of {budget_s:.0f} s used up",
                "failures": ["not run: time budget used up"],
            }
            continue
        began = time.monotonic()
        if ctx.twin and name in NEEDS_GPU:
            result = {"ok": True, "status": "skipped", "reason": TWIN_SKIP_REASON, "failures": []}
        else:
            try:
                result = SECTIONS[name](ctx)
            except Exception:
                result = {
                    "ok": False,
                    "status": "failed",
                    "error": traceback.format_exc(),
                    "failures": [traceback.format_exc(limit=3).strip()],
                }
        result.setdefault("status", "ran")
        result["seconds"] = time.monotonic() - began
        result = ctx.combine(result)
        results[name] = result
        if ctx.is_root:
            print(
                f"gpu_check: {name}: {summary_word(result)} ({result['seconds']:.1f} s)", flush=True
            )
    return results


def environment(cp: Any, ctx: Context | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": getattr(cp, "__version__", "?"),
        "ranks": ctx.size if ctx is not None else 1,
    }
    if getattr(cp, "TWIN", False):
        info.update(
            device=f"CuPy twin ({TWIN_PATH}: host memory, kernels compiled for the CPU)",
            twin=True,
            profile="twin",
        )
        return info
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        info.update(
            device=name.decode() if isinstance(name, bytes) else name,
            compute_capability=cp.cuda.Device().compute_capability,
            driver=cp.cuda.runtime.driverGetVersion(),
            runtime=cp.cuda.runtime.runtimeGetVersion(),
        )
    except Exception as exc:  # report, do not fail: the checks say what matters
        info["device_error"] = repr(exc)
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Sections: " + ", ".join(SECTIONS)
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("perf/results/gpu_check.json"),
        help="JSON report; the markdown summary goes beside it (.md)",
    )
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(SECTIONS),
        default=list(SECTIONS),
        help="run only these sections",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no section after this many seconds (default 420)",
    )
    p.add_argument(
        "--twin",
        action="store_true",
        help="run on the CPU twin of CuPy (tests/twin): no GPU, smaller sizes, "
        "torch/ddp/fsdp/backend skipped, timing not enforced",
    )
    return p.parse_args(argv)


def gpu_path(twin: bool, what: str) -> Any:
    """The cupy module geocomm's GPU path runs on (the twin with ``twin``), after
    checking that path and the native C core are there; exit status 2 (nothing to
    ``what``) otherwise."""
    if twin:
        use_twin()
    from geocomm.kernels import cuda, native

    if not cuda.available:
        try:
            cuda.require()
        except ImportError as exc:
            fail_exit(f"no GPU path to {what}: {exc}", 2)
    if not native.available:
        fail_exit("the native C core (geocomm._native) is not built; pip install . first", 2)
    import cupy as cp

    if twin and not getattr(cp, "TWIN", False):
        fail_exit(f"--twin: cupy is {cp.__file__}, not the twin in {TWIN_PATH}", 2)
    return cp


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cp = gpu_path(args.twin, "check")
    from mpi4py import MPI

    t0 = time.monotonic()
    ctx = Context(cp, args, MPI.COMM_WORLD)
    report: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": environment(cp, ctx),
    }
    try:
        report["sections"] = run_sections(ctx, args.only, args.budget_s)
    finally:
        try:
            ctx.close()
        except Exception as exc:
            print(f"gpu_check: closing the NCCL communicator failed: {exc!r}", file=sys.stderr)
    ok = all(r["ok"] for r in report["sections"].values())
    if ctx.size > 1:  # one exit status on every rank
        ok = bool(ctx.world.allreduce(int(ok), op=MPI.MIN))
    report["ok"] = ok
    report["seconds"] = time.monotonic() - t0
    if ctx.is_root:
        write_report(report, args.out)
        print(markdown(report))
        for name, result in report["sections"].items():
            for failure in result.get("failures", []) if not result["ok"] else []:
                print(f"FAIL {name}: {failure}", file=sys.stderr)
        print(
            f"gpu_check: {'PASS' if ok else 'FAIL'} in {report['seconds']:.1f} s on "
            f"{ctx.size} rank(s); wrote {args.out} and {args.out.with_suffix('.md')}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
