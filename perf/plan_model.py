"""Planning model: where compressed all-reduce pays, flat or node-aware, against NCCL.

    python perf/plan_model.py                          # 8 GPUs per node, 8 .. 1024 GPUs
    python perf/plan_model.py --gpus-per-node 4 --nic-gbit 200 --size-mib 256
    python perf/plan_model.py --emulation              # against perf/results/two_level.json

Every formula is stated in docs/design.md, "Node-aware collectives" (the planning
model). Per rank, for ``B`` fp32 bytes of gradient (``S = B b / 4`` bytes in a dtype
of ``b`` bytes), ``N`` ranks on ``M`` nodes of ``G``, ``r`` wire bytes per fp32 byte:

* NCCL ring all-reduce (``2 (N - 1) / N`` S per rank: Patarasuk and Yuan 2009;
  nccl-tests' doc/PERFORMANCE.md, busbw), its rings crossing each node boundary once
  per channel, one channel per NIC: ``max(2 (N - 1) / N S / (nics * nic),
  2 (N - 1) / N S / intra) + 2 (N - 1) step``;
* geocomm flat and node-aware: :func:`geocomm.engine.costs.flat_seconds` and
  :func:`geocomm.engine.costs.node_seconds` with a rank's share of its node's NICs;
* plain MPI (the emulation's baseline): Open MPI's recursive halving then doubling,
  neighbours first, so each node sends ``2 (M - 1) / M S`` out:
  ``2 (M - 1) / M S / (nics nic) + 2 (G - 1) / G S / intra``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from geocomm.engine.costs import Links, flat_seconds, node_seconds

#: wire bytes per fp32 byte: E4M3 + one fp32 scale per 128; NVFP4: 4 bits + an E4M3
#: scale per 16 + an fp32 scale per 4096
RATIOS = {"fp8": (1 + 4 / 128) / 4, "nvfp4": (0.5 + 1 / 16 + 4 / 4096) / 4}


@dataclass(frozen=True)
class Machine:
    """A cluster: ``gpus`` per node, ``nics`` per node of ``nic_Bps`` each, ``intra_Bps``
    per GPU inside the node, ``latency_s`` per collective phase, ``step_s`` per ring
    step, ``codec_Bps`` fp32 bytes per second through geocomm's codec work per rank."""

    gpus: int
    nics: int
    nic_Bps: float
    intra_Bps: float
    latency_s: float
    step_s: float
    codec_Bps: float

    def links(self) -> Links:
        return Links(self.intra_Bps, self.nic_Bps * self.nics / self.gpus, self.latency_s,
                     self.codec_Bps)  # fmt: skip


def nccl_ring(m: Machine, n: int, nbytes: float, itemsize: int) -> float:
    s = nbytes * itemsize / 4
    ring = 2 * (n - 1) / n * s
    cross = ring / (m.nics * m.nic_Bps) if n > m.gpus else 0.0
    return max(cross, ring / m.intra_Bps) + 2 * (n - 1) * m.step_s


def mpi_halving(m: Machine, n: int, nbytes: float) -> float:
    nodes = max(1, n // m.gpus)
    cross = 2 * (nodes - 1) / nodes * nbytes / (m.nics * m.nic_Bps)
    return cross + 2 * (m.gpus - 1) / m.gpus * nbytes / m.intra_Bps


def geocomm(m: Machine, n: int, nbytes: float, codec: str, topology: str) -> float:
    sizes = [m.gpus] * max(1, n // m.gpus)
    model = flat_seconds if topology == "flat" or len(sizes) == 1 else node_seconds
    return model(m.links(), nbytes, sizes, RATIOS[codec])


def table(m: Machine, size_mib: float, gpus: list[int]) -> str:
    nbytes = size_mib * (1 << 20)
    head = ("| GPUs | NCCL bf16 | NCCL fp32 | fp8 flat | fp8 node | nvfp4 node | "
            "best geocomm vs NCCL bf16 |")  # fmt: skip
    lines = [head, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in gpus:
        times = {
            "bf16": nccl_ring(m, n, nbytes, 2),
            "fp32": nccl_ring(m, n, nbytes, 4),
            "fp8 flat": geocomm(m, n, nbytes, "fp8", "flat"),
            "fp8 node": geocomm(m, n, nbytes, "fp8", "node"),
            "nvfp4 node": geocomm(m, n, nbytes, "nvfp4", "node"),
        }
        best = min(times["fp8 flat"], times["fp8 node"], times["nvfp4 node"])
        cells = " | ".join(f"{t * 1e3:.2f}" for t in times.values())
        lines.append(f"| {n} | {cells} | {times['bf16'] / best:.2f}x |")
    return "\n".join(lines)


def _gbit(rate: str) -> float:
    """Bytes per second of a tc rate such as ``1gbit``."""
    return float(rate.rstrip("gbit")) * 1e9 / 8


def _emulated_machine(report: dict, row: dict, intra_Bps: float) -> Machine:
    """One NIC per node at the row's rate, the codec at the run's yardstick encode speed
    over three passes (encode, decode-add, re-encode and decode), shared by the ranks
    on the machine's cores."""
    ranks = row["nodes"] * row["ranks_per_node"]
    share = min(1.0, report["machine_cores"] / ranks)
    codec = row["yardstick"]["fp8_encode_GBps"] * 1e9 * share / 3
    rate = _gbit(row.get("rate", report["rate"]))
    return Machine(row["ranks_per_node"], 1, rate, intra_Bps, 1e-3, 0.0, codec)


def calibrated_intra(report: dict, nbytes: float) -> float | None:
    """The intra-node rate that makes :func:`geocomm.engine.costs.node_seconds` give the
    study's unshaped node-aware point (perf/two_level.py's CALIBRATION): what the exact
    node-local steps cost on this machine, CPU shared by every rank included. None
    without that point."""
    row = next((r for r in report["rows"] if r.get("calibration")), None)
    if row is None:
        return None
    m = _emulated_machine(report, row, 1.0)
    sizes = [m.gpus] * row["nodes"]
    rest = node_seconds(replace(m, intra_Bps=float("inf")).links(), nbytes, sizes, RATIOS["fp8"])
    inside = 2 * (m.gpus - 1) / m.gpus * nbytes
    return inside / max(row["time_s"] - rest, 1e-9)


def emulated(report: dict, intra_Bps: float | None = None) -> list[dict]:
    """The model's prediction of each point of perf/results/two_level.json
    (:func:`_emulated_machine`), the intra-node rate ``intra_Bps`` or else
    :func:`calibrated_intra`'s (2.6 GB/s, two ranks alone, without that point)."""
    nbytes = float(64 << 20)
    intra = intra_Bps or calibrated_intra(report, nbytes) or 2.6e9
    out = []
    for row in report["rows"]:
        ranks = row["nodes"] * row["ranks_per_node"]
        m = _emulated_machine(report, row, intra)
        if row["codec"] == "none":
            predicted = mpi_halving(m, ranks, nbytes)
        else:
            predicted = geocomm(m, ranks, nbytes, row["codec"], row["topology"])
        out.append({**row, "predicted_s": predicted, "intra_Bps": intra,
                    "model_error": predicted / row["time_s"] - 1})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nics-per-node", type=int, default=None, help="default: one per GPU")
    p.add_argument("--nic-gbit", type=float, default=400, help="Gbit/s per NIC")
    p.add_argument("--intra-gbps", type=float, default=300, help="GB/s per GPU in the node")
    p.add_argument("--latency-us", type=float, default=100, help="per geocomm phase")
    p.add_argument("--step-us", type=float, default=5, help="per NCCL ring step")
    p.add_argument("--codec-gbps", type=float, default=1000, help="GB/s of fp32, geocomm codec")
    p.add_argument("--size-mib", type=float, default=256)
    p.add_argument("--emulation", action="store_true")
    p.add_argument("--intra-emulated-gbps", type=float, default=None,
                   help="rate between ranks of one emulated node (default: calibrated "
                   "on the study's unshaped point)")  # fmt: skip
    args = p.parse_args(argv)
    if args.emulation:
        path = Path(__file__).resolve().parent / "results" / "two_level.json"
        gbps = args.intra_emulated_gbps
        for row in emulated(json.loads(path.read_text()), gbps * 1e9 if gbps else None):
            print(f"{row['label']:<28} {row['nodes']}x{row['ranks_per_node']}: measured "
                  f"{row['time_s']:.3f} s, model {row['predicted_s']:.3f} s "
                  f"({row['model_error']:+.0%})")  # fmt: skip
        return 0
    m = Machine(args.gpus_per_node, args.nics_per_node or args.gpus_per_node,
                args.nic_gbit * 1e9 / 8, args.intra_gbps * 1e9, args.latency_us * 1e-6,
                args.step_us * 1e-6, args.codec_gbps * 1e9)  # fmt: skip
    print(f"# {args.size_mib:g} MiB fp32 gradient, {m.gpus} GPUs per node, {m.nics} NICs of "
          f"{args.nic_gbit:g} Gbit/s per node; times in ms")  # fmt: skip
    print(table(m, args.size_mib, [8, 16, 32, 64, 128, 256, 512, 1024]))
    one_nic = replace(m, nics=1)
    print(f"\n# the same with one NIC per node ({args.nic_gbit:g} Gbit/s)")
    print(table(one_nic, args.size_mib, [8, 16, 32, 64, 128, 256, 512, 1024]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
