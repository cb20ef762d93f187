"""Markdown for perf/results/two_level.json (perf/two_level.py --study), with the
planning model's prediction of every point (perf/plan_model.py --emulation)."""

from __future__ import annotations

from lab import yardstick_line
from plan_model import emulated


def markdown(report: dict, intra_Bps: float | None = None) -> str:
    rows = emulated(report, intra_Bps)
    intra = rows[0]["intra_Bps"] if rows else 0.0
    by = {(r["nodes"], r["ranks_per_node"], r["codec"], r["topology"]): r
          for r in rows if not r.get("calibration")}  # fmt: skip
    lines = [
        "# Node-aware all-reduce on an emulated two-level machine",
        "",
        f"Command: `{report['command']}` (as root; {report['machine_cores']} cores, "
        f"ranks oversubscribed). {report['size']} of gradient-like fp32 matrices (4096 "
        f"columns), {report['rate']} out of each node (HTB on the namespace's loopback), "
        "intra-node traffic unshaped over TCP on the loopback; plain mpiexec, no thread "
        "variables. Model: perf/plan_model.py --emulation (one NIC per node, "
        f"{intra / 1e9:.2f} GB/s inside a node, calibrated on the unshaped point: "
        "the node-local steps' cost on this machine, CPU shared by every rank; codec "
        "from the yardstick).",
        "",
        "| point | nodes x ranks | time (s) | vs flat fp8 | vs plain fp32 | wire B/rank "
        "| #wrong | relerr | model (s) | model error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        key = (r["nodes"], r["ranks_per_node"])
        same_link = not r.get("calibration")
        flat = by.get((*key, "fp8", "flat")) if same_link else None
        plain = by.get((*key, "none", "flat")) if same_link else None
        vs_flat = f"{flat['time_s'] / r['time_s']:.2f}x" if flat else "-"
        vs_plain = f"{plain['time_s'] / r['time_s']:.2f}x" if plain else "-"
        lines.append(
            f"| {r['label']} | {key[0]} x {key[1]} | {r['time_s']:.3f} | {vs_flat} | "
            f"{vs_plain} | {r['wire_bytes']} | {r['wrong']} | {r['relerr']:.2e} | "
            f"{r['predicted_s']:.3f} | {r['model_error']:+.0%} |"
        )
    lines += ["", yardstick_line(rows[0]["yardstick"] if rows else None), ""]
    return "\n".join(lines)
