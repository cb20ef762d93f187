"""Run an MPI job over an emulated network link of known bandwidth.

    python perf/emulated_link.py --rate 10gbit -n 2 -- python perf/all_reduce_perf.py -b 1M -e 64M

Creates a network namespace, shapes its loopback with a token bucket
(``tc qdisc ... tbf rate R``, plus ``netem delay`` when --delay is given),
and runs the ranks inside it with Open MPI forced onto TCP over that
loopback, so every byte between ranks crosses the shaped link. The loopback
is one link shared by all ranks: R is the aggregate rate of all traffic
(a 2-rank all-reduce moves twice its per-rank bytes through it). The namespace
is removed afterwards, also when the job fails or is interrupted. Needs root
(namespaces and tc); without it, says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import uuid

from geocomm.launch import mpiexec_command

# Open MPI: TCP transport only, over the namespace's loopback
TCP_ARGS = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def setup_namespace(name: str, rate: str, delay: str | None, burst: str) -> None:
    """Namespace ``name`` with its loopback up and shaped to ``rate``."""
    _run(["ip", "netns", "add", name])
    _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
    tc = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo"]
    if delay:
        # netem adds the one-way delay; tbf below it limits the rate
        _run([*tc, "root", "handle", "1:", "netem", "delay", delay])
        _run(
            [
                *tc,
                "parent",
                "1:1",
                "handle",
                "10:",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                "100ms",
            ]
        )
    else:
        _run([*tc, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms"])


def remove_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def namespace_problem() -> str | None:
    """Why this machine cannot run an emulated link (not root, no ``ip``/``tc``, no
    namespaces or no tbf in this kernel or container); None when it can: a probe
    namespace is made, shaped and removed."""
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need root)"
    name = f"geocomm-probe-{uuid.uuid4().hex[:8]}"
    try:
        setup_namespace(name, "10gbit", None, "128kb")
    except FileNotFoundError as exc:
        return f"{exc.filename} is not installed"
    except subprocess.CalledProcessError as exc:
        return f"`{shlex.join(exc.cmd)}` failed: {exc.stderr.strip()}"
    finally:
        remove_namespace(name)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="10gbit", help="link rate in tc units (1gbit, 10gbit...)")
    p.add_argument("--delay", default=None, help="one-way latency in tc units (e.g. 50us)")
    p.add_argument(
        "--burst",
        default="128kb",
        help="token bucket size (default 128kb: two 64 KiB loopback packets; a "
        "larger bucket lets traffic that follows a pause run above the rate)",
    )
    p.add_argument("-n", "--nranks", type=int, default=2)
    p.add_argument(
        "--plain",
        action="store_true",
        help="leave thread variables alone, as a plain mpirun would (geocomm.launch "
        "gives each rank its share of the cores for BLAS/OpenMP threads)",
    )
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (put it after --)")
    if os.geteuid() != 0:
        print(
            "emulated_link: needs root for network namespaces and tc; run it as root",
            file=sys.stderr,
        )
        return 2
    name = f"geocomm-{uuid.uuid4().hex[:8]}"
    mpi_argv, env = mpiexec_command(args.nranks, command, TCP_ARGS)
    if args.plain:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            if var not in os.environ:
                env.pop(var, None)
    env["GEOCOMM_LINK"] = (
        f"{args.rate}"
        + (f" delay {args.delay}" if args.delay else "")
        + (" plain" if args.plain else "")
    )

    def cleanup(*_: object) -> None:
        remove_namespace(name)
        raise SystemExit(130)

    previous = signal.signal(signal.SIGTERM, cleanup)
    try:
        setup_namespace(name, args.rate, args.delay, args.burst)
        print(
            f"# emulated link: {env['GEOCOMM_LINK']} in netns {name}; {shlex.join(mpi_argv)}",
            flush=True,
        )
        job = subprocess.run(
            ["ip", "netns", "exec", name, *mpi_argv], env=env, timeout=args.timeout
        )
        return job.returncode
    except subprocess.CalledProcessError as exc:
        print(f"emulated_link: {shlex.join(exc.cmd)} failed: {exc.stderr.strip()}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"emulated_link: job exceeded {args.timeout} s", file=sys.stderr)
        return 124
    finally:
        remove_namespace(name)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
