"""Run an MPI job on an emulated two-level machine: nodes of ranks, a shaped link between.

    python perf/two_level.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        python perf/all_reduce_perf.py -b 64M -e 64M --input gradient
    python perf/two_level.py --study      # the node-aware study: perf/results/two_level.*

One network namespace holds every rank. Node ``i`` gets an address of its own,
10.231.i.1, on a device of its own (a veth end, used only as the address holder);
rank ``r`` is on node ``r // G`` (``GEOCOMM_RANKS_PER_NODE=G`` tells geocomm) and
Open MPI's TCP transport binds it to its node's address
(``OMPI_MCA_btl_tcp_if_include``, set per rank by a ``sh`` wrapper). All traffic
between local addresses runs over the namespace's loopback, where an HTB qdisc
sends the packets from node i to any other node through node i's class, rate
``--rate`` (its NIC's egress), and everything inside a node unshaped. Plain
``mpiexec`` (``--oversubscribe --bind-to none``, TCP and self only) with no thread
variables set. The namespace is removed afterwards. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from lab import write_results

from geocomm.launch import mpiexec_command

TCP_ARGS = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def setup(name: str, nodes: int, rate: str, burst: str) -> None:
    """Namespace ``name``: node addresses and the shaped loopback."""
    _run(["ip", "netns", "add", name])
    ns = ["ip", "-n", name]
    _run([*ns, "link", "set", "lo", "up"])
    for i in range(nodes):
        _run([*ns, "link", "add", f"gcnode{i}", "type", "veth", "peer", "name", f"gcpeer{i}"])
        _run([*ns, "addr", "add", f"10.231.{i}.1/32", "dev", f"gcnode{i}"])
        _run([*ns, "link", "set", f"gcpeer{i}", "up"])
        _run([*ns, "link", "set", f"gcnode{i}", "up"])
    tc = ["ip", "netns", "exec", name, "tc"]
    # unclassified traffic (inside a node) goes straight through (no default class)
    _run([*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "999"])
    for i in range(nodes):
        _run([*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{i + 1}",
              "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst])  # fmt: skip
        for j in range(nodes):
            if j != i:
                match = ["match", "ip", "src", f"10.231.{i}.0/24",
                         "match", "ip", "dst", f"10.231.{j}.0/24"]  # fmt: skip
                _run([*tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip",
                      "prio", "1", "u32", *match, "flowid", f"1:{i + 1}"])  # fmt: skip


def remove(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_job(nodes: int, per_node: int, rate: str, command: list[str], burst: str = "128kb",
            timeout: float = 3600, env_extra: dict[str, str] | None = None) -> int:  # fmt: skip
    """Run ``command`` on ``nodes * per_node`` ranks of the emulated machine."""
    if os.geteuid() != 0:
        print("two_level: needs root for network namespaces and tc", file=sys.stderr)
        return 2
    name = f"geocomm2l-{uuid.uuid4().hex[:8]}"
    wrapper = [
        "sh",
        "-c",
        f"export OMPI_MCA_btl_tcp_if_include=gcnode$((OMPI_COMM_WORLD_RANK / {per_node})); "
        'exec "$@"',
        "sh",
    ]
    argv, env = mpiexec_command(nodes * per_node, [*wrapper, *command], TCP_ARGS)
    for var in THREAD_VARS:  # plain mpiexec: thread variables as the caller has them
        if var not in os.environ:
            env.pop(var, None)
    env["GEOCOMM_RANKS_PER_NODE"] = str(per_node)
    env.update(env_extra or {})
    try:
        setup(name, nodes, rate, burst)
        print(f"# two-level machine: {nodes} nodes x {per_node} ranks, {rate} out of each "
              f"node, netns {name}; {shlex.join(argv)}", flush=True)  # fmt: skip
        return subprocess.run(["ip", "netns", "exec", name, *argv], env=env,
                              timeout=timeout).returncode  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        timed_out = isinstance(exc, subprocess.TimeoutExpired)
        why = f"job exceeded {timeout} s" if timed_out else f"{shlex.join(exc.cmd)} failed"
        print(f"two_level: {why}: {(exc.stderr or '').strip()}", file=sys.stderr)
        return 124 if timed_out else 2
    finally:
        remove(name)


#: The study's points: (name, nodes, ranks per node, codec, GEOCOMM_TOPOLOGY, rate or
#: None for --rate). The unshaped point measures what the node-local steps and the
#: codec cost on this machine: the planning model's intra-node rate comes from it.
CALIBRATION = "node-aware fp8, link unshaped"
POINTS = [
    ("plain fp32 MPI all-reduce", 2, 2, "none", "flat", None),
    ("flat fp8", 2, 2, "fp8", "flat", None),
    ("node-aware fp8", 2, 2, "fp8", "node", None),
    ("flat fp8", 2, 1, "fp8", "flat", None),
    ("node-aware fp8", 2, 1, "fp8", "node", None),
    (CALIBRATION, 2, 2, "fp8", "node", "100gbit"),
]


def study(args: argparse.Namespace) -> int:
    here = Path(__file__).resolve().parent
    rows = []
    for label, nodes, per_node, codec, topology, rate in POINTS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "point.json"
            cmd = [sys.executable, str(here / "all_reduce_perf.py"), "-b", args.size,
                   "-e", args.size, "-n", str(args.iters), "-w", "2", "--codec", codec,
                   "--input", "gradient", "-J", str(out)]  # fmt: skip
            rc = run_job(nodes, per_node, rate or args.rate, cmd,
                         env_extra={"GEOCOMM_TOPOLOGY": topology})  # fmt: skip
            if rc != 0:
                return rc
            point = json.loads(out.read_text())
        row = point["rows"][-1]
        rows.append({"label": label, "nodes": nodes, "ranks_per_node": per_node, "codec": codec,
                     "topology": topology, "rate": rate or args.rate,
                     "calibration": label == CALIBRATION, "time_s": row["time_us"] / 1e6,
                     "wire_bytes": row["wire_bytes"], "wrong": row["wrong"],
                     "relerr": row["relerr"], "yardstick": point["yardstick"]})  # fmt: skip
    command = "python perf/two_level.py --study " + shlex.join(
        ["--rate", args.rate, "--size", args.size, "--iters", str(args.iters)]
    )
    report = {"tool": "two_level", "command": command, "rate": args.rate, "size": args.size,
              "machine_cores": os.cpu_count(), "rows": rows}  # fmt: skip
    from two_level_report import markdown

    write_results(here / "results" / "two_level", report, markdown)
    print(markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="egress rate of each node (tc units)")
    p.add_argument("--burst", default="128kb")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--study", action="store_true", help="run the node-aware study")
    p.add_argument("--size", default="64M", help="study: all-reduce size")
    p.add_argument("--iters", type=int, default=5, help="study: timed iterations per point")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.study:
        return study(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (put it after --)")
    return run_job(args.nodes, args.ranks_per_node, args.rate, command, args.burst, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
