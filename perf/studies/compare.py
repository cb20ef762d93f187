"""Comparison suite: geocomm's compressed all-reduce against what users have today.

    python perf/studies/compare.py                  # all links, 2 and 4 ranks (root)
    python perf/studies/compare.py --links 10gbit --ranks 2 -b 16M -e 64M
    python perf/studies/compare.py --report perf/results/compare.json   # tables, plots, model

One MPI job per (link, rank count) runs this file with ``--worker``: through
``perf/emulated_link.py`` for a shaped link (1gbit, 10gbit, 25gbit: ranks in a
network namespace, MPI and gloo over its tbf-shaped loopback) or through
``geocomm.launch`` for ``shm`` (unshaped shared memory). The jobs' rows are
merged into ``OUT.json``; ``OUT.md`` holds the tables, the must-show ratios
and the alpha-beta model, ``OUT_busbw.png`` and ``OUT_error.png`` the plots.
Before the jobs the machine's yardstick (copy and fp8 encode GB/s,
:func:`geocomm.testing.yardstick`) is measured and stated with the tables.

Every method all-reduces the same tensors: per rank an fp32 matrix of
``COLS`` columns, a common rank-16 signal with a 1/i spectrum plus
rank-private noise (anisotropic, like a weight gradient; docs/design.md, "GeoFP8").
Methods:

* ``fp32``: plain ``MPI_Allreduce`` (mpi4py, Open MPI's own algorithm);
* ``bf16``: geocomm codec ``bf16`` (cast, reduce-scatter with fp32 sums,
  cast, all-gather): the bf16 cast + all-reduce baseline (MPI cannot sum
  bf16 itself);
* ``fp8_e4m3``, ``fp8_e5m2`` (block 128), ``nvfp4``, ``geofp8``,
  ``geonvfp4``: geocomm codecs with their defaults;
* ``ddp_fp16``, ``ddp_powersgd4``: PyTorch DDP on gloo with
  ``fp16_compress_hook`` / ``powerSGD_hook`` (rank 4, error feedback, warm
  start, compressing from the third step). DDP is driven by a module whose
  gradient is exactly the tensor; its time is the DDP forward+backward minus
  the same forward+backward without DDP, measured in the same job.

Time: mean per call over ``iters`` calls after warm-up, the slowest rank's
(nccl-tests convention). Wire: bytes this rank sends per call (geocomm:
counted on the communicator; MPI and gloo: the ring's 2(N-1)/N of the
payload, PowerSGD's payload being its P and Q factors). Error: ||result -
exact|| / ||exact|| against the fp64 sum (avg for DDP) of all ranks' inputs.
"""

from __future__ import annotations

import os
import pathlib
import sys

# One BLAS/OpenMP thread per rank before NumPy and torch load: the ranks fill the cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import geocomm  # noqa: E402
from geocomm.testing import MeteredComm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import emulated_link, parse_size, ring_bytes, slowest, timed, yardstick  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COLS = 1024
SIGNAL_RANK = 16
NOISE = 0.3  # rms of the rank-private noise relative to the signal's rms

#: label -> how to run it; the order is the order of tables and plots
METHODS: dict[str, dict[str, Any]] = {
    "fp32": {"kind": "mpi"},
    "bf16": {"kind": "geocomm", "codec": {"id": "bf16"}},
    "fp8_e4m3": {"kind": "geocomm", "codec": {"id": "fp8", "fmt": "e4m3"}},
    "fp8_e5m2": {"kind": "geocomm", "codec": {"id": "fp8", "fmt": "e5m2"}},
    "nvfp4": {"kind": "geocomm", "codec": {"id": "nvfp4"}},
    "geofp8": {"kind": "geocomm", "codec": {"id": "geofp8"}},
    "geonvfp4": {"kind": "geocomm", "codec": {"id": "geonvfp4"}},
    "ddp_fp16": {"kind": "ddp", "hook": "fp16"},
    "ddp_powersgd4": {"kind": "ddp", "hook": "powersgd", "rank": 4},
}
LINKS = ("shm", "1gbit", "10gbit", "25gbit")


# ---------------------------------------------------------------------------
# inputs


def _signal(rows: int, seed: int) -> np.ndarray:
    """The common part of every rank's gradient: rank 16, singular values 1/i, rms 1."""
    rng = np.random.default_rng([seed, rows, 0x5157])
    u = rng.standard_normal((rows, SIGNAL_RANK), np.float32)
    v = rng.standard_normal((COLS, SIGNAL_RANK), np.float32)
    s = (1.0 / np.arange(1, SIGNAL_RANK + 1)).astype(np.float32)
    sig = (u * s) @ v.T
    sig *= np.float32(1.0 / np.sqrt(np.mean(sig.astype(np.float64) ** 2)))
    return sig


def _noise(rows: int, seed: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rows, rank, 0x4E53])
    return rng.standard_normal((rows, COLS), np.float32) * np.float32(NOISE)


def gradients(rows: int, seed: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(this rank's fp32 gradient, the fp64 sum of all ranks' gradients)."""
    signal = _signal(rows, seed)
    exact = signal.astype(np.float64) * size
    mine = None
    for r in range(size):
        noise = _noise(rows, seed, r)
        exact += noise
        if r == rank:
            mine = signal + noise
    return mine, exact


# ---------------------------------------------------------------------------
# methods: each is prepared once per size and returns (call, result getter, wire bytes)


def _relerr(got: np.ndarray, exact: np.ndarray) -> float:
    diff = got.astype(np.float64) - exact
    return float(np.sqrt(np.sum(diff * diff) / np.sum(exact * exact)))


class GeocommMethod:
    def __init__(self, codec: dict[str, Any], comm: Any, x: np.ndarray):
        self.codec = geocomm.get_codec(codec)
        self.comm = MeteredComm(comm)
        self.x, self.out = x, np.empty_like(x)

    def __call__(self) -> None:
        geocomm.allreduce(
            self.x, codec=self.codec, out=self.out, key="grad", comm=self.comm, check=False
        )

    def result(self, exact: np.ndarray, size: int) -> tuple[float, int]:
        before = self.comm.sent
        self()
        return _relerr(self.out, exact), self.comm.sent - before


class MPIMethod:
    def __init__(self, x: np.ndarray):
        from mpi4py import MPI

        self.world, self.sum = MPI.COMM_WORLD, MPI.SUM
        self.x, self.out = x, np.empty_like(x)

    def __call__(self) -> None:
        self.world.Allreduce(self.x, self.out, op=self.sum)

    def result(self, exact: np.ndarray, size: int) -> tuple[float, int]:
        self()
        return _relerr(self.out, exact), ring_bytes(self.x.nbytes, size)


class DDPMethod:
    """PyTorch DDP on gloo with a built-in compression hook, gradient = ``x``."""

    def __init__(self, spec: dict[str, Any], x: np.ndarray):
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        class Probe(torch.nn.Module):
            """loss = sum(w * g): its gradient with respect to w is g."""

            def __init__(self, shape: tuple[int, ...]):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(shape))

            def forward(self, g: torch.Tensor) -> torch.Tensor:
                return (self.w * g).sum()

        self.torch, self.spec = torch, spec
        self.g = torch.from_numpy(x)
        self.local = Probe(x.shape)
        self.ddp = DistributedDataParallel(
            Probe(x.shape), bucket_cap_mb=max(25, x.nbytes / 2**20 + 1)
        )
        if spec["hook"] == "fp16":
            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=spec["rank"],
                start_powerSGD_iter=2,
                use_error_feedback=True,
                warm_start=True,
            )
            self.ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def _step(self, module: Any) -> None:
        for p in module.parameters():
            p.grad = None
        module(self.g).backward()

    def __call__(self) -> None:
        self._step(self.ddp)

    def local_step(self) -> None:
        self._step(self.local)

    def result(self, exact: np.ndarray, size: int) -> tuple[float, int]:
        self()
        got = self.ddp.module.w.grad.numpy()
        rows, cols = self.g.shape
        if self.spec["hook"] == "fp16":
            wire = ring_bytes(self.g.numel() * 2, size)
        else:  # P (rows x r) and Q (cols x r) in fp32, each all-reduced
            wire = ring_bytes((rows + cols) * self.spec["rank"] * 4, size)
        return _relerr(got, exact / size), wire


# ---------------------------------------------------------------------------
# worker (runs under MPI)


def _iterations(
    comm: Any, fn: Callable[[], None], warmup: int, budget_s: float, max_iters: int
) -> int:
    """Run ``warmup`` calls; the same iteration count on every rank, so that the
    timed loop takes about ``budget_s``."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    per_call = slowest(comm, (time.perf_counter() - start) / max(warmup, 1))
    return int(np.clip(round(budget_s / max(per_call, 1e-6)), 2, max_iters))


def build(label: str, comm: Any, x: np.ndarray) -> Any:
    spec = METHODS[label]
    if spec["kind"] == "mpi":
        return MPIMethod(x)
    if spec["kind"] == "geocomm":
        return GeocommMethod(spec["codec"], comm, x)
    return DDPMethod(spec, x)


def worker(args: argparse.Namespace) -> int:
    comm = geocomm.init()
    rank, size = comm.rank, comm.size
    labels = args.methods.split(",")
    if any(METHODS[m]["kind"] == "ddp" for m in labels):
        import torch

        from geocomm.adapters.torch import init_distributed_from_mpi

        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the (shaped) loopback
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        init_distributed_from_mpi("gloo")
    link = (emulated_link() or "shm").split()[0]
    rows_out = []
    nbytes = args.minbytes
    while nbytes <= args.maxbytes:
        rows = max(nbytes // (4 * COLS), 1)
        x, exact = gradients(rows, args.seed, rank, size)
        for label in labels:
            method = build(label, comm, x)
            warmup = args.warmup + (1 if METHODS[label].get("hook") == "powersgd" else 0)
            iters = _iterations(comm, method, warmup, args.budget, args.iters)
            seconds = timed(comm, method, iters)
            if isinstance(method, DDPMethod):
                local = timed(comm, method.local_step, iters)
                seconds = seconds - local
            relerr, wire = method.result(exact, size)
            wire = int(slowest(comm, wire))
            algbw = x.nbytes / seconds / 1e9
            row = {
                "link": link,
                "ranks": size,
                "method": label,
                "size": x.nbytes,
                "shape": list(x.shape),
                "iters": iters,
                "time_us": seconds * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (size - 1) / size,
                "wire_bytes": wire,
                "wire_ratio": wire / ring_bytes(x.nbytes, size),
                "relerr": relerr,
            }
            if isinstance(method, DDPMethod):
                row["local_step_us"] = local * 1e6
            rows_out.append(row)
            if rank == 0:
                print(
                    f"{link:>7} n={size} {label:>14} {x.nbytes:>10} B {seconds * 1e3:9.2f} ms "
                    f"busbw {row['busbw_GBps']:6.3f} wire {row['wire_ratio']:.3f} "
                    f"err {relerr:.2e} ({iters} it)",
                    flush=True,
                )
            del method
        nbytes *= args.stepfactor
    if rank == 0:
        Path(args.worker_json).write_text(json.dumps(rows_out) + "\n")
    if any(METHODS[m]["kind"] == "ddp" for m in labels):
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------
# orchestration


def run_jobs(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """One MPI job per (link, ranks); returns the merged result."""
    ruler = yardstick()  # before the jobs, on the otherwise idle machine
    rows, jobs = [], []
    common = [
        "-b",
        str(args.minbytes),
        "-e",
        str(args.maxbytes),
        "-f",
        str(args.stepfactor),
        "--methods",
        args.methods,
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--budget",
        str(args.budget),
        "--seed",
        str(args.seed),
    ]
    for link in args.links.split(","):
        for n in [int(r) for r in args.ranks.split(",")]:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            inner = [sys.executable, str(Path(__file__).resolve()), "--worker", out, *common]
            if link == "shm":
                cmd = [
                    sys.executable,
                    "-m",
                    "geocomm.launch",
                    "-n",
                    str(n),
                    "--timeout",
                    str(args.timeout),
                    "--",
                    *inner,
                ]
            else:
                cmd = [
                    sys.executable,
                    str(ROOT / "perf" / "emulated_link.py"),
                    "--rate",
                    link,
                    "-n",
                    str(n),
                    "--timeout",
                    str(args.timeout),
                    "--",
                    *inner,
                ]
            print(f"# {link}, {n} ranks: {shlex.join(cmd)}", flush=True)
            start = time.perf_counter()
            code = subprocess.run(cmd).returncode
            if code != 0:
                raise SystemExit(f"compare: job {link} n={n} failed with exit code {code}")
            rows += json.loads(Path(out).read_text())
            os.unlink(out)
            jobs.append({"link": link, "ranks": n, "wall_s": time.perf_counter() - start})
    return {
        "command": "python perf/studies/compare.py " + shlex.join(argv),
        "rows": rows,
        "jobs": jobs,
        "yardstick": dataclasses.asdict(ruler),
        "methods": {m: METHODS[m] for m in args.methods.split(",")},
        "inputs": {"cols": COLS, "signal_rank": SIGNAL_RANK, "noise_rms": NOISE, "seed": args.seed},
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "load_after": os.getloadavg(),
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--links",
        default=",".join(LINKS),
        help="comma-separated: shm and/or tc rates (1gbit, 10gbit, 25gbit)",
    )
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="most timed calls per point")
    p.add_argument(
        "--budget",
        type=float,
        default=1.5,
        help="seconds of timed calls aimed at per point (at least 2 calls)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per MPI job")
    p.add_argument("--out", default="perf/results/compare", help="output prefix")
    p.add_argument("--report", metavar="JSON", help="only rewrite tables/plots/model")
    p.add_argument("--worker", metavar="JSON", dest="worker_json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker_json:
        return worker(args)
    import compare_report  # matplotlib loads only where reports are written

    if args.report:
        result = json.loads(Path(args.report).read_text())
        prefix = Path(args.report).with_suffix("")
    else:
        result = run_jobs(args, argv)
        prefix = ROOT / args.out
        prefix.parent.mkdir(parents=True, exist_ok=True)
    compare_report.write(result, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
