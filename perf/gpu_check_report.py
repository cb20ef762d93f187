"""The markdown summary of a gpu_check report (perf/gpu_check.py), written beside its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_check_common import REFERENCE_MAX_N
from gpu_check_timing import KERNEL_BAR, MUST_SHOW_HOST_S, MUST_SHOW_VS_COPY


def summary_word(result: dict[str, Any]) -> str:
    if result["status"] in ("skipped", "unsupported"):
        return f"{result['status']} ({result.get('reason', '')})"
    return "PASS" if result["ok"] else "FAIL"


def markdown(report: dict[str, Any]) -> str:
    sections = report["sections"]
    env = report["environment"]
    lines = [
        f"# GPU check ({env.get('device', '?')}; {env.get('ranks', 1)} rank(s))",
        "",
        f"Result: **{'PASS' if report['ok'] else 'FAIL'}** in {report['seconds']:.0f} s",
        "",
        "| section | result | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {summary_word(r)} | {r.get('seconds', 0):.1f} |"
        for name, r in sections.items()
    ]
    failing = [(name, f) for name, r in sections.items() for f in r.get("failures", [])]
    if failing:
        lines += ["", "## Failures", ""] + [f"- {name}: `{f[:400]}`" for name, f in failing]
    rows = sections.get("bytes", {}).get("rows")
    if rows:
        lines += [
            "",
            f"## Bytes (GPU vs C core; vs NumPy reference up to {REFERENCE_MAX_N} values)",
            "",
            "| format | block | cases | all equal |",
            "| --- | --- | --- | --- |",
        ]
        by_config: dict[tuple[str, int], list[dict]] = {}
        for row in rows:
            by_config.setdefault((row["fmt"], row["block"]), []).append(row)
        lines += [
            f"| {fmt} | {block} | {len(group)} | {'yes' if all(r['ok'] for r in group) else 'NO'} |"
            for (fmt, block), group in by_config.items()
        ]
    batched = sections.get("bytes", {}).get("batched")
    if batched:
        lines += [
            "",
            "## Batched kernels (native/gc_pipeline.cu vs the C core, bitwise)",
            "",
            "| codec | encode | decode | sum + encode | sum |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r['codec']} | "
            + " | ".join(
                "yes" if r.get(k, {}).get("equal") else "NO"
                for k in ("encode", "decode", "sum_encode", "sum")
            )
            + " |"
            for r in batched
        ]
    rows = sections.get("collectives", {}).get("rows")
    if rows:
        lines += [
            "",
            "## Collectives (CuPy over NCCL vs NumPy over MPI, bitwise)",
            "",
            "| collective | dtype | codec | in place | equal |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r['collective']} | {r['dtype']} | {r['codec']} | "
            f"{'yes' if r['in_place'] else 'no'} | {'yes' if r['ok'] else 'NO'} |"
            for r in rows
        ]
    lines += timing_lines(sections.get("timing", {}))
    for name in ("ddp", "fsdp"):
        lines += example_lines([r for r in sections.get(name, {}).get("rows", []) if "losses" in r])
    return "\n".join(lines) + "\n"


def host_bound(row: dict[str, Any]) -> str:
    """A mark for a row whose calls waited for the device (gpu_clock's ``gated``)."""
    return " (host-bound)" if row.get("gated") is False else ""


def kernel_lines(kernels: list[dict[str, Any]]) -> list[str]:
    """The table of the single-body kernels (gpu_check_timing.time_kernels)."""
    lines = [
        "| format | block | kernel | rounding | MiB | device us | fp32 GB/s | traffic / copy's "
        f"| >= {KERNEL_BAR} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    return lines + [
        f"| {r['fmt']} | {r['block']} | {r['op']} | {r['rounding']} | {r['size_MiB']} | "
        f"{r['device_s'] * 1e6:.1f} | {r['device_GBps']:.3g} | "
        f"{r['vs_copy_traffic']:.2f}{host_bound(r)} | {'yes' if r['meets_bar'] else 'no'} |"
        for r in kernels
    ]


def timing_lines(timing: dict[str, Any]) -> list[str]:
    """The ``timing`` section's tables (empty when it did not run)."""
    if not timing.get("pipeline"):
        return []
    lines = [
        "",
        "## Timing (1 rank; GB/s = fp32 tensor bytes / time)",
        "",
        "Per steady-state call (perf/gpu_clock.py): wall, calls queued back to back and "
        "one synchronization; host, the host's own time with the device held; device: "
        f"{timing['device_clock']} around the queued calls. vs copy: device GB/s over "
        f"the copy's; must-shows for fp8: vs copy >= {MUST_SHOW_VS_COPY}, host <= "
        f"{MUST_SHOW_HOST_S * 1e6:.0f} us.",
    ]
    if not timing.get("enforced", True):
        lines += ["", f"**Not enforced**: {timing.get('note', '')}."]
    lines += [
        "",
        "| MiB | operation | stages | wall us | host us | device us | device GB/s | vs copy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['size_MiB']} | {r['op']} | {r['stages'] or ''} | {r['wall_s'] * 1e6:.1f} | "
        f"{r['host_s'] * 1e6:.1f} | {r['device_s'] * 1e6:.1f} | {r['device_GBps']:.3g} | "
        f"{r['vs_copy']:.2f}{host_bound(r)} |"
        for r in timing["pipeline"]
    ]
    stage = timing.get("stage_cost")
    if stage and stage["model_stage_s"]:
        lines += [
            "",
            f"Stage cost: {stage['stage_s'] * 1e6:.0f} us per stage "
            f"({stage['size_MiB']} MiB in 1 and {stage['stages']} stages); "
            f"the backend model assumes {stage['model_stage_s'] * 1e6:.0f} us.",
        ]
    return [*lines, "", *kernel_lines(timing["kernels"])]


def example_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The README examples' rows of ``ddp`` and ``fsdp`` (gpu_check_examples.py)."""
    if not rows:
        return []
    lines = [
        "",
        f"## {rows[0]['example']} on the device (1 rank, fp8 against uncompressed)",
        "",
        "| calls | == CPU over MPI | exact calls exact | within fp8's bound | "
        "largest loss gap (limit) |",
        "| --- | --- | --- | --- | --- |",
    ]

    def yes(field: dict[str, Any] | None) -> str:
        return "yes" if field and field.get("equal") else "NO"

    return lines + [
        f"| {r.get('calls', 0)} | {yes(r.get('vs_cpu_mpi'))} | {yes(r.get('exact_calls_exact'))}"
        f" | {yes(r.get('within_fp8_bound'))} | {r['losses']['largest_relative_gap']:.2%} "
        f"({r['losses']['limit']:.1%}) |"
        for r in rows
    ]


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
