"""The convergence study's plot: loss curves and each codec's smoothed gap to fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def smooth(y: np.ndarray, w: int) -> np.ndarray:
    if w <= 1 or y.size < w:
        return y
    return np.convolve(y, np.ones(w) / w, mode="valid")


def _gap_panel(
    ax: Any, by: dict, label: str, seeds: list[int], w: int, color: str, **style: Any
) -> None:
    """Mean over seeds of the smoothed paired gap to ``none``, band from min to max."""
    paired = [s for s in seeds if (label, s) in by and ("none", s) in by]
    if not paired:
        return
    gaps = np.stack([smooth(by[(label, s)] - by[("none", s)], w) for s in paired])
    x = np.arange(gaps.shape[1]) + w
    ax.plot(
        x, gaps.mean(0), label=label, color=color, lw=style.get("lw", 1.3), ls=style.get("ls", "-")
    )
    ax.fill_between(x, gaps.min(0), gaps.max(0), color=color, alpha=style.get("alpha", 0.15))


def plot(result: dict[str, Any], path: Path) -> None:
    """Loss curves, gap to fp32 (8/16-bit and 4-bit codecs apart; bf16's band,
    a near-exact perturbation, marks the seed-to-seed noise in both), the
    communication error and its component along the gradient over steps.
    Stochastic-rounding rows are dashed, error-feedback rows dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = list(result["summary"]["codecs"])
    seeds = sorted({r["seed"] for r in runs})
    by = {(r["codec"], r["seed"]): np.asarray(r["loss"]) for r in runs}
    w = max(1, result["steps"] // 20)
    fig, axes = plt.subplots(2, 3, figsize=(18, 8.5))
    (ax_loss, ax_gap8, ax_drift), (ax_gap4, ax_err, ax_spare) = axes
    ax_along = ax_spare
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(labels) > len(cycle):
        cycle = [plt.get_cmap("tab20")(i) for i in range(20)]
    colors = {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}

    def dashes(label: str) -> str:
        config = result["codecs"][label]
        return (
            ":"
            if config.get("error_feedback")
            else "--"
            if config.get("rounding") == "stochastic"
            else "-"
        )

    for label in labels:
        have = [s for s in seeds if (label, s) in by]
        curves = np.stack([smooth(by[(label, s)], w) for s in have])
        ls = dashes(label)
        ax_loss.plot(
            np.arange(curves.shape[1]) + w,
            curves.mean(0),
            label=label,
            color=colors[label],
            lw=1.2,
            ls=ls,
        )
        if label == "none":
            continue
        four_bit = "fp4" in str(result["codecs"][label].get("id", ""))
        _gap_panel(ax_gap4 if four_bit else ax_gap8, by, label, seeds, w, colors[label], ls=ls)
        mine = [next(r for r in runs if r["codec"] == label and r["seed"] == s) for s in have]
        errs = np.stack([np.asarray(r["err"], float) for r in mine])
        steps = np.flatnonzero(np.isfinite(errs[0]))
        ax_err.plot(
            steps, np.nanmean(errs[:, steps], 0), label=label, color=colors[label], lw=1, ls=ls
        )
        if all(len(r.get("err_align", [])) == steps.size for r in mine) and steps.size:
            # (e . g) / ||g||^2 = cos(e, g) ||e|| / ||g||, smoothed
            along = np.stack(
                [np.asarray(r["err_align"]) * errs[i, steps] for i, r in enumerate(mine)]
            ).mean(0)
            wa = max(1, steps.size // 20)
            ax_along.plot(
                steps[wa - 1 :] if wa > 1 and steps.size >= wa else steps,
                smooth(along, wa),
                label=label,
                color=colors[label],
                lw=1,
                ls=ls,
            )
        drifts = [r["drift"] for r in mine if r.get("drift")]
        if drifts:
            d = np.stack(drifts)
            at = (np.arange(d.shape[1]) + 1) * result.get("drift_every", 10)
            ax_drift.plot(at, d.mean(0), label=label, color=colors[label], lw=1.2, ls=ls)
            ax_drift.fill_between(at, d.min(0), d.max(0), color=colors[label], alpha=0.15)
    if "bf16" in labels:
        _gap_panel(ax_gap4, by, "bf16", seeds, w, "0.6", lw=0.8, alpha=0.2)
    lo = min(float(np.mean(by[k][-result["tail"] :])) for k in by)
    ax_loss.set(
        title=f"train loss (mean over {len(seeds)} seeds, moving average of {w})",
        xlabel="step",
        ylabel="loss (nats/byte)",
    )
    if result.get("regime") == "noise-free":  # memorization: the floor is far below the start
        ax_loss.set_yscale("log")
    else:
        ax_loss.set_ylim(lo - 0.2, lo + 2.0)
    for ax, what in ((ax_gap8, "16/8-bit codecs"), (ax_gap4, "4-bit codecs")):
        ax.axhline(0, color="k", lw=0.6)
        ax.set(
            title=f"train-loss gap to fp32, {what} (band: seed min..max)",
            xlabel="step",
            ylabel="loss - loss(none)",
        )
    ax_err.set(title="all-reduce relative error (mean over seeds)", xlabel="step", yscale="log")
    ax_along.axhline(0, color="k", lw=0.6)
    ax_along.set(
        title="error along the gradient, (e . g) / ‖g‖² (seed mean, smoothed)",
        xlabel="step",
        ylabel="negative: the codec shrinks the update",
    )
    ax_drift.set(
        title="parameter drift from the fp32 run (band: seed min..max)",
        xlabel="step",
        ylabel="||θ - θ_fp32|| / ||θ_fp32 - θ_0||",
        yscale="log",
    )
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7 if len(labels) > 8 else 8)
    fig.suptitle(result["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
