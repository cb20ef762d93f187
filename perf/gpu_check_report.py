"""The markdown summary of a gpu_check report (perf/gpu_check.py), written beside its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_check_common import REFERENCE_MAX_N
from gpu_check_device import MUST_SHOW_VS_COPY


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
    timing = sections.get("timing", {})
    if timing.get("pipeline"):
        lines += [
            "",
            "## Timing (1 rank; GB/s = fp32 tensor bytes / time)",
            "",
            "Wall: per call, host included. Device: per call queued ahead of the device "
            "(gpu_check.gpu_seconds); vs copy: device GB/s over the copy's, the codec "
            f"throughput (must reach {MUST_SHOW_VS_COPY} for fp8).",
            "",
            "| MiB | operation | stages | wall ms | wall GB/s | device ms | device GB/s "
            "| vs copy |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r['size_MiB']} | {r['op']} | {r['stages'] or ''} | "
            f"{r['seconds'] * 1e3:.3f} | {r['GBps']:.0f} | {r['gpu_seconds'] * 1e3:.3f} | "
            f"{r['gpu_GBps']:.0f} | {r['vs_copy']:.2f}"
            f"{'' if r['host_out_of_the_way'] else ' (host-bound)'} |"
            for r in timing["pipeline"]
        ]
        stage = timing.get("stage_cost")
        if stage:
            model = stage["model_stage_s"]
            lines += [
                "",
                f"Stage cost: {stage['stage_s'] * 1e6:.0f} us per stage "
                f"({stage['size_MiB']} MiB in 1 and {stage['stages']} stages); "
                f"the backend model assumes {model * 1e6:.0f} us."
                if model
                else "",
            ]
        lines += [
            "",
            "| format | block | kernel | ms | fp32 GB/s |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r['fmt']} | {r['block']} | {r['op']} | {r['seconds'] * 1e3:.3f} | "
            f"{r['fp32_GBps']:.0f} |"
            for r in timing["kernels"]
        ]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
