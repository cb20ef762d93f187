"""Tables, plots and the alpha-beta model of a ``perf/studies/compare.py`` result.

``write(result, prefix)`` writes PREFIX.json (the result with the fitted model),
PREFIX.md, PREFIX_busbw.png and PREFIX_error.png.

The model. Per rank count, the plain fp32 rows of each link give that link's
fixed cost and effective rate: t = a_L + W / B_L (least squares over sizes),
W the bytes a rank sends. Every other method m is fitted over all links and
sizes as t = alpha_m + max(W_m / B_L, gamma_p * S) + gamma_s * S: the link
term with the method's own wire bytes, a per-byte cost gamma_p that the
pipeline overlaps with it, a per-byte cost gamma_s that adds (S = fp32
payload bytes) and a per-call cost alpha_m. The projection to the paper's
setting replaces the measured link by the target link and the CPU codec cost
by an assumed GPU codec cost; every assumption is printed next to the
numbers.
"""

from __future__ import annotations

import pathlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results, yardstick_line

MIB = 1 << 20
LINK_GBPS = {"1gbit": 0.125, "10gbit": 1.25, "25gbit": 3.125}  # nominal GB/s

#: the paper's setting and the assumptions of the projection
PROJECTION = {
    "params": 600e6,
    "gpus": 64,
    "link_GBps": 25.0,
    # per-GPU compute per step: 6 * params * tokens / (peak * MFU)
    "tokens_per_gpu": 16384,
    "peak_TFLOPs": 989.0,
    "mfu": 0.40,
    # GPU codec: memory-bound passes over HBM; geometry: GEMM flops at an fp32 rate
    "hbm_TBps": 4.0,
    "codec_passes": 4.0,
    "geometry_rank": 64,
    "fp32_TFLOPs": 60.0,
    "nccl_alpha_us": 30.0,
    "bucket_MiB": 25.0,
}


def _fit_link(rows: list[dict]) -> dict[str, float]:
    w = np.array([r["wire_bytes"] for r in rows], float)
    t = np.array([r["time_us"] * 1e-6 for r in rows])
    slope, a = np.polyfit(w, t, 1) if len(rows) > 1 else (t[0] / w[0], 0.0)
    return {"a_s": float(a), "rate_GBps": float(1 / slope / 1e9) if slope > 0 else float("inf")}


def _fit_method(t: np.ndarray, link_t: np.ndarray, s: np.ndarray) -> dict[str, float]:
    """t = alpha + max(link_t, gamma_p * s) + gamma_s * s, relative least squares.

    gamma_p: cost per input byte that the pipeline overlaps with the link (the
    codec); gamma_s: cost that adds to it (work outside the pipeline, such as
    GeoFP8's maps). For each gamma_p on a log grid, (alpha, gamma_s >= 0) come
    from weighted linear least squares; the best fit is kept.
    """
    best: dict[str, float] | None = None
    w = 1 / t
    for gamma_p in np.concatenate([[0.0], np.logspace(-12, -6, 241)]):
        rest = t - np.maximum(link_t, gamma_p * s)
        a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
        (alpha, gamma_s), *_ = np.linalg.lstsq(a, rest * w, rcond=None)
        if gamma_s < 0:
            gamma_s = 0.0
            alpha = float(np.sum(rest * w * w) / np.sum(w * w))
        pred = alpha + np.maximum(link_t, gamma_p * s) + gamma_s * s
        rel = np.abs(pred - t) / t
        score = float(np.sum(rel * rel))
        if best is None or score < best["score"]:
            best = {
                "alpha_s": float(alpha),
                "gamma_p_s_per_byte": float(gamma_p),
                "gamma_s_s_per_byte": float(gamma_s),
                "score": score,
                "max_rel_residual": float(rel.max()),
                "median_rel_residual": float(np.median(rel)),
            }
    return best


def fit_model(rows: list[dict]) -> dict[str, Any]:
    """Link fits per (link, ranks) and method fits per (method, ranks)."""
    model: dict[str, Any] = {"links": {}, "methods": {}}
    for n in sorted({r["ranks"] for r in rows}):
        for link in sorted({r["link"] for r in rows if r["ranks"] == n}):
            base = [
                r for r in rows if r["ranks"] == n and r["link"] == link and r["method"] == "fp32"
            ]
            if base:
                model["links"][f"{link}/n{n}"] = _fit_link(base)
        for method in dict.fromkeys(r["method"] for r in rows):
            if method == "fp32":
                continue
            pts = [
                r
                for r in rows
                if r["ranks"] == n
                and r["method"] == method
                and f"{r['link']}/n{n}" in model["links"]
            ]
            if len(pts) < 3:
                continue
            link_t = np.array(
                [
                    r["wire_bytes"] / model["links"][f"{r['link']}/n{n}"]["rate_GBps"] / 1e9
                    for r in pts
                ]
            )
            t = np.array([r["time_us"] * 1e-6 for r in pts])
            s = np.array([r["size"] for r in pts], float)
            model["methods"][f"{method}/n{n}"] = {
                **_fit_method(t, link_t, s),
                "wire_ratio": float(np.median([r["wire_ratio"] for r in pts])),
            }
    return model


def project(model: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    """Step time of data-parallel training in the paper's setting, per method."""
    p = PROJECTION
    payload = 4 * p["params"]  # fp32 gradient bytes
    ring = 2 * (p["gpus"] - 1) / p["gpus"]
    compute = 6 * p["params"] * p["tokens_per_gpu"] / (p["peak_TFLOPs"] * 1e12 * p["mfu"])
    buckets = payload / (p["bucket_MiB"] * MIB)
    codec_s = p["codec_passes"] * payload / (p["hbm_TBps"] * 1e12)
    # whiten maps, both sides: about 8 k flops per value forward and back
    geometry_s = 8 * p["geometry_rank"] * p["params"] / (p["fp32_TFLOPs"] * 1e12)
    ratios = {}
    for r in rows:
        ratios.setdefault(r["method"], []).append(r["wire_ratio"])
    out: dict[str, Any] = {"assumptions": p, "compute_s": compute, "methods": {}}
    for method, rs in ratios.items():
        if method.startswith("ddp_"):
            continue  # the projection is for the all-reduce codecs
        wire = ring * payload * float(np.median(rs))
        extra = 0.0 if method == "fp32" else codec_s
        extra += geometry_s if method.startswith("geo") else 0.0
        link = buckets * p["nccl_alpha_us"] * 1e-6 + wire / (p["link_GBps"] * 1e9)
        fit = model["methods"].get(f"{method}/n2")
        out["methods"][method] = {
            "comm_s": link + extra,
            "wire_GB": wire / 1e9,
            # the same all-reduce with this CPU's fitted codec costs (one core per rank)
            "comm_s_cpu_codec": (
                max(link, fit["gamma_p_s_per_byte"] * payload) + fit["gamma_s_s_per_byte"] * payload
            )
            if fit
            else link,
        }
    for overlap in (0.0, 0.5):
        for m in out["methods"].values():
            hidden = overlap * compute * 2 / 3  # backward overlaps the all-reduce
            m[f"step_s_overlap{overlap:g}"] = compute + max(m["comm_s"] - hidden, 0.0)
    for m in out["methods"].values():
        for base in ("fp32", "bf16"):
            if base in out["methods"]:
                for overlap in (0.0, 0.5):
                    key = f"step_s_overlap{overlap:g}"
                    m[f"saving_vs_{base}_overlap{overlap:g}"] = (
                        1 - m[key] / out["methods"][base][key]
                    )
    # the compute time per step at which geofp8 saves the paper's 7.6% over bf16 (no overlap)
    if "geofp8" in out["methods"] and "bf16" in out["methods"]:
        diff = out["methods"]["bf16"]["comm_s"] - out["methods"]["geofp8"]["comm_s"]
        out["compute_s_for_7.6pct_vs_bf16"] = diff / 0.076 - out["methods"]["bf16"]["comm_s"]
    return out


# ---------------------------------------------------------------------------
# tables


def _by(rows: list[dict], link: str, n: int) -> dict[tuple[str, int], dict]:
    return {(r["method"], r["size"]): r for r in rows if r["link"] == link and r["ranks"] == n}


def _size(b: int) -> str:
    return f"{b // MIB} MiB" if b >= MIB else f"{b // 1024} KiB"


def speed_table(rows: list[dict], link: str, n: int, methods: list[str]) -> list[str]:
    by = _by(rows, link, n)
    sizes = sorted({s for (_, s) in by})
    lines = [
        f"#### {link}, {n} ranks: ms per all-reduce (speed-up over fp32 MPI)",
        "",
        "| method | " + " | ".join(_size(s) for s in sizes) + " |",
        "| --- |" + " ---: |" * len(sizes),
    ]
    for m in methods:
        cells = []
        for s in sizes:
            r, base = by.get((m, s)), by.get(("fp32", s))
            if r is None:
                cells.append("")
                continue
            cell = f"{r['time_us'] / 1e3:.2f}"
            if base is not None and m != "fp32":
                cell += f" ({base['time_us'] / r['time_us']:.2f}x)"
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def quality_table(rows: list[dict], methods: list[str]) -> list[str]:
    """Wire ratio and relative error per method (they do not depend on the link)."""
    sizes = sorted({r["size"] for r in rows})
    lines = [
        "| method | wire / fp32 ring | "
        + " | ".join(f"rel. error {_size(s)}" for s in sizes)
        + " |",
        "| --- | ---: |" + " ---: |" * len(sizes),
    ]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        if not rs:
            continue
        errs = []
        for s in sizes:
            e = [r["relerr"] for r in rs if r["size"] == s]
            errs.append(f"{np.median(e):.2e}" if e else "")
        lines.append(
            f"| {m} | {np.median([r['wire_ratio'] for r in rs]):.3f} | " + " | ".join(errs) + " |"
        )
    return [*lines, ""]


def targets(rows: list[dict]) -> list[str]:
    """The issue's must-show ratios at >= 16 MiB on the shaped links."""
    lines = [
        "| link | ranks | size | fp8 vs fp32 (>= 3) | fp8 vs bf16 (>= 1.5) "
        "| geofp8 vs fp32 (>= 2.5) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for link in ("1gbit", "10gbit", "25gbit"):
        for n in sorted({r["ranks"] for r in rows}):
            by = _by(rows, link, n)
            for s in sorted({s for (_, s) in by if s >= 16 * MIB}):
                t = {
                    m: by[(m, s)]["time_us"]
                    for m in ("fp32", "bf16", "fp8_e4m3", "geofp8")
                    if (m, s) in by
                }

                def ratio(a: str, b: str, goal: float, t=t) -> str:
                    if a not in t or b not in t:
                        return ""
                    x = t[b] / t[a]
                    return f"{x:.2f}" + ("" if x >= goal else " (below)")

                lines.append(
                    f"| {link} | {n} | {_size(s)} | {ratio('fp8_e4m3', 'fp32', 3)} "
                    f"| {ratio('fp8_e4m3', 'bf16', 1.5)} "
                    f"| {ratio('geofp8', 'fp32', 2.5)} |"
                )
    return [*lines, ""]


def model_lines(model: dict[str, Any], proj: dict[str, Any]) -> list[str]:
    lines = [
        "Links, from the fp32 rows: t = a + W / B (W: bytes a rank sends). All ranks "
        "share the one shaped loopback, so N x B is what the link carried.",
        "",
        "| link / ranks | fixed cost a (ms) | B: GB/s sent per rank | N x B / nominal |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, f in model["links"].items():
        nominal = LINK_GBPS.get(key.split("/")[0])
        n = int(key.split("/n")[1])
        eff = f"{n * f['rate_GBps'] / nominal:.2f}" if nominal else "unshaped"
        lines.append(f"| {key} | {f['a_s'] * 1e3:.2f} | {f['rate_GBps']:.3f} | {eff} |")
    lines += [
        "",
        "Methods, over all links and sizes of a rank count: t = alpha + max(W_m / B, "
        "gamma_p S) + gamma_s S (S: fp32 bytes; the pipeline hides the shorter of link "
        "and codec time; gamma_s is work outside the pipeline).",
    ]
    lines += [
        "",
        "| method / ranks | alpha (ms per call) | gamma_p: overlapped (ms per MiB) "
        "| gamma_s: serial (ms per MiB) | wire ratio | rel. residual (median / max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, f in model["methods"].items():
        per_mib = {k: f[k] * MIB * 1e3 for k in ("gamma_p_s_per_byte", "gamma_s_s_per_byte")}
        lines.append(
            f"| {key} | {f['alpha_s'] * 1e3:.2f} | {per_mib['gamma_p_s_per_byte']:.3f}"
            f" | {per_mib['gamma_s_s_per_byte']:.3f} | {f['wire_ratio']:.3f} "
            f"| {f['median_rel_residual']:.2f} / {f['max_rel_residual']:.2f} |"
        )
    p = proj["assumptions"]
    lines += [
        "",
        f"Projection: {p['params'] / 1e6:.0f}M parameters, {p['gpus']} GPUs, ring all-reduce "
        f"at {p['link_GBps']:.0f} GB/s per GPU, {p['bucket_MiB']:.0f} MiB buckets with "
        f"{p['nccl_alpha_us']:.0f} us fixed cost each. Compute per step "
        f"{proj['compute_s'] * 1e3:.0f} ms = 6 x params x {p['tokens_per_gpu']} tokens per GPU "
        f"/ ({p['peak_TFLOPs']:.0f} TFLOP/s x MFU {p['mfu']}). GPU codec: {p['codec_passes']:.0f} "
        f"passes over the fp32 gradient at {p['hbm_TBps']:.0f} TB/s; geometry maps "
        f"8 x k={p['geometry_rank']} flops per value at {p['fp32_TFLOPs']:.0f} TFLOP/s. Wire "
        "ratios are the measured ones. 'overlap 0.5': half of the backward pass (2/3 of "
        "compute) hides all-reduce time. The last column replaces the GPU codec by the "
        "fitted per-byte costs (gamma_p, gamma_s) of the 2-rank CPU runs, one core per rank: "
        "why the codec has to run on the GPU at this scale.",
        "",
        "| method | wire GB per GPU | all-reduce ms | step ms (no overlap) | saving vs fp32 "
        "| saving vs bf16 | step ms (overlap 0.5) | saving vs bf16 (overlap 0.5) "
        "| all-reduce ms with this CPU's codec cost |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, m in proj["methods"].items():
        lines.append(
            f"| {method} | {m['wire_GB']:.2f} | {m['comm_s'] * 1e3:.1f} | "
            f"{m['step_s_overlap0'] * 1e3:.1f} | {m.get('saving_vs_fp32_overlap0', 0):.1%} | "
            f"{m.get('saving_vs_bf16_overlap0', 0):.1%} | {m['step_s_overlap0.5'] * 1e3:.1f} | "
            f"{m.get('saving_vs_bf16_overlap0.5', 0):.1%} | {m['comm_s_cpu_codec'] * 1e3:.0f} |"
        )
    if "compute_s_for_7.6pct_vs_bf16" in proj:
        ms = proj["compute_s_for_7.6pct_vs_bf16"] * 1e3
        lines += [
            "",
            "Under this model geofp8 saves the paper's 7.6% over a bf16 all-reduce "
            f"(no overlap) when compute takes {ms:.0f} ms per step.",
        ]
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    methods = list(result["methods"])
    lines = [
        "# Compressed all-reduce against the alternatives",
        "",
        f"Command: `{result['command']}` (root; shaped links are tbf on a network "
        "namespace's loopback shared by all ranks, MPI and gloo over TCP). "
        f"{result['host']['cpus']} cores; inputs: fp32 matrices of "
        f"{result['inputs']['cols']} columns, rank-{result['inputs']['signal_rank']} "
        f"common signal + rank-private noise (rms {result['inputs']['noise_rms']}). "
        "Time is the slowest rank's mean per call; DDP rows are the DDP backward minus "
        "the same backward without DDP.",
        "",
        yardstick_line(result.get("yardstick")),
        "",
        "## Must-show ratios (time of the baseline / time of the method)",
        "",
        *targets(rows),
        "## Wire bytes and error",
        "",
        *quality_table(rows, methods),
        "## Time per link and rank count",
        "",
    ]
    links = list(dict.fromkeys(r["link"] for r in rows))
    for link in links:
        for n in sorted({r["ranks"] for r in rows if r["link"] == link}):
            lines += speed_table(rows, link, n, methods)
    lines += [
        "## Alpha-beta model",
        "",
        *model_lines(result["model"], result["projection"]),
        "![bus bandwidth](" + result.get("png_busbw", "") + ")",
        "",
        "![error](" + result.get("png_error", "") + ")",
        "",
    ]
    jobs = ", ".join(f"{j['link']}/n{j['ranks']} {j['wall_s']:.0f} s" for j in result["jobs"])
    lines += [f"Job wall times: {jobs}.", ""]
    return "\n".join(lines)


def plots(result: dict[str, Any], prefix: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    methods = list(result["methods"])
    links = list(dict.fromkeys(r["link"] for r in rows))
    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(
        len(ranks),
        len(links),
        figsize=(4.2 * len(links), 3.4 * len(ranks)),
        squeeze=False,
        sharex=True,
    )
    for i, n in enumerate(ranks):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for m in methods:
                rs = sorted(
                    (r for r in rows if r["link"] == link and r["ranks"] == n and r["method"] == m),
                    key=lambda r: r["size"],
                )
                if rs:
                    ax.plot(
                        [r["size"] / MIB for r in rs],
                        [r["busbw_GBps"] for r in rs],
                        marker="o",
                        ms=3,
                        label=m,
                        ls="--" if m.startswith("ddp") else "-",
                    )
            ax.set(
                xscale="log",
                yscale="log",
                title=f"{link}, {n} ranks",
                xlabel="message (MiB of fp32)",
                ylabel="busbw (GB/s)",
            )
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}_busbw.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        sizes = sorted({r["size"] for r in rows if r["method"] == m})
        errs = [
            np.median([r["relerr"] for r in rows if r["method"] == m and r["size"] == s])
            for s in sizes
        ]
        ax.plot([s / MIB for s in sizes], np.maximum(errs, 1e-9), marker="o", ms=3, label=m)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="message (MiB of fp32)",
        ylabel="relative error vs fp64 sum",
        title="all-reduce error",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}_error.png", dpi=100)
    plt.close(fig)


def write(result: dict[str, Any], prefix: Path) -> None:
    result["model"] = fit_model(result["rows"])
    result["projection"] = project(result["model"], result["rows"])
    result["png_busbw"] = f"{prefix.name}_busbw.png"
    result["png_error"] = f"{prefix.name}_error.png"
    plots(result, prefix)
    write_results(prefix, result, markdown)
