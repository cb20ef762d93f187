"""How often GeoFP8's mapped calls take a power step on the gradient zoo, and what that costs a GPU.

A GeoFP8 call between power steps moves, by the device model of
docs/results.md ("Host work per call"), 14 bytes per value against fp8's 10;
a call with a power step moves 26. On the GPU path either replays one CUDA
graph once the same keys took the same kind of call at the same ranks
twice before (geocomm.engine.graphs.Graphs), and runs eagerly otherwise.
How they mix is the gradients' business: a key's period doubles (up to
``refresh_max``) only while its steps find the geometry standing still
(policy.STABLE_OVERLAP). This study
runs GeoFP8 under several refresh policies (:data:`POLICIES`, the default
first) and fp8 over every zoo source (perf/studies/zoo.py: one codec per
simulated rank, every parameter of every recorded step with ``key=name``,
as perf/studies/geo_heldout.py does) and reads each key's state after
every call.

Per source and policy, over calls 2..W of the keys mapped at least once
(the first call measures the basis): ``step`` the share of calls with a
power step; ``measure`` re-measures of keys the budget left flat; ``rank
moved`` calls whose rank differs from the key's previous call (a new side
layout: an eager call, then a new capture); ``graph`` calls between steps
at the rank of the previous call (what a graph can replay); ``all steady``
the share of training steps in which no mapped key stepped or re-measured
(a DDP bucket holding every tensor replays only then, before calls with
power steps were captured); ``replay``: the share of calls that replay a
graph under Graphs' policy (a pattern of keys, kinds and ranks eager at its
first sighting, captured at its second, replayed while it stays among the
graphs kept), each tensor its own call (``tensor``) or in DDP's buckets of
25 MB of fp32 in reverse parameter order (``bucket``; every bucket-call
counted; a re-measure runs eagerly). ``traffic`` is the
whole model's modelled device traffic per call over fp8's, mean over calls
2..W: a stepped call 26 bytes per value, a call between steps 14, a
re-measure 22 (the plain call's 10 and its three passes over the result), a
plain tensor 10; a model, not a measurement: what the bytes cost is for a
GPU to time. ``error``: geo_heldout's ``median``, the median over matrices
of each matrix's median over calls 2..W of its error over E4M3 block 128's
(geo_zoo.run_source measures the errors; this study reads the states beside).

    python perf/studies/geo_steps.py -J perf/results/geo_steps.json
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import geo_zoo  # noqa: E402
import numpy as np  # noqa: E402
import zoo  # noqa: E402
from geo_zoo import BASE  # noqa: E402

from geocomm.engine.graphs import Graphs  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results  # noqa: E402

#: Modelled device bytes per value of one call (fp8 e4m3/128 at 1 rank, reads +
#: writes; docs/results.md, "Host work per call").
TRAFFIC = {"plain": 10, "between": 14, "step": 26, "measure": 22}
#: The refresh policies compared: the default (a period doubling up to 8 while the
#: steps find the geometry standing still), a step every call, fixed periods.
POLICIES: dict[str, dict[str, Any]] = {
    "default (adaptive, up to 8)": {"id": "geofp8"},
    "every call": {"id": "geofp8", "refresh_max": 1},
    "every 2": {"id": "geofp8", "refresh": 2, "refresh_max": 2},
    "every 4": {"id": "geofp8", "refresh": 4, "refresh_max": 4},
}
DEFAULT = next(iter(POLICIES))
MEASURES = (
    "step", "measure", "rank_moved", "graph", "all_steady", "replay_tensor", "replay_bucket",
    "traffic", "error",
)  # fmt: skip
#: DDP's default bucket (``bucket_cap_mb=25``), of fp32 gradients
BUCKET_BYTES = 25 * 2**20


def kind_of(info: dict[str, Any] | None) -> str:
    """What the call that left ``info`` (a key's state_info; None: no state) did: a
    basis update of a mapped call is a power step, of a plain one a measure."""
    if info is None:
        return "plain"
    if info["refreshed"] == info["calls"]:
        return "step" if info["use"] > 0 else "measure"
    return "between" if info["use"] > 0 else "plain"


def replays(patterns: list[Any]) -> list[bool]:
    """Whether each call of one signature replays a CUDA graph under
    geocomm.engine.graphs.Graphs' policy: a pattern is eager at its first sighting,
    captured at its second and replayed after, with Graphs.KEPT graphs kept and as many
    patterns remembered, the least recent dropped first. None: a call that cannot be
    captured (it runs eagerly); "plain": no mapped tensor (the unmapped plan's graphs,
    kept apart)."""
    history: dict[bool, tuple[dict[Any, None], dict[Any, None]]] = {}
    out = []
    for p in patterns:
        if p is None:
            out.append(False)
            continue
        seen, kept = history.setdefault(p == "plain", ({}, {}))
        if p in kept:
            kept[p] = kept.pop(p)  # the most recently launched
            out.append(True)
            continue
        out.append(False)
        if p in seen:  # captured now
            del seen[p]
            kept[p] = None
            if len(kept) > Graphs.KEPT:
                kept.pop(next(iter(kept)))
        else:
            seen[p] = None
            if len(seen) > Graphs.KEPT:
                seen.pop(next(iter(seen)))
    return out


def buckets(sizes: dict[str, int]) -> list[list[str]]:
    """DDP's buckets of the keys: reverse parameter order, a new bucket where the next
    gradient would take one past BUCKET_BYTES of fp32."""
    out: list[list[str]] = [[]]
    filled = 0
    for name in reversed(list(sizes)):
        if out[-1] and filled + 4 * sizes[name] > BUCKET_BYTES:
            out.append([])
            filled = 0
        out[-1].append(name)
        filled += 4 * sizes[name]
    return out


def pattern(
    keys: list[str], kinds: dict[str, list[str]], ranks: dict[str, list[int]], c: int
) -> Any:
    """The graph key of call ``c`` of a signature of ``keys`` (see :func:`replays`)."""
    if any(kinds[n][c] == "measure" for n in keys):
        return None
    mapped = tuple((n, kinds[n][c], ranks[n][c]) for n in keys if kinds[n][c] != "plain")
    return mapped or "plain"


def policy_row(infos: dict[str, list[Any]], sizes: dict[str, int], error: float) -> dict[str, Any]:
    """One policy's measures on one source, over calls 2..W (see the module's doc), from
    the first codec's key states after every call; ``error``: geo_zoo's ``median``."""
    names = list(sizes)
    calls = len(infos[names[0]])
    kinds = {n: [kind_of(i) for i in infos[n]] for n in names}
    ranks = {n: [0 if i is None else int(i["use"]) for i in infos[n]] for n in names}
    mapped = [n for n in names if any(ranks[n])]
    counted = [(n, c) for n in mapped for c in range(1, calls)]

    def share(test: Any) -> float:
        return sum(bool(test(n, c)) for n, c in counted) / max(len(counted), 1)

    total = sum(sizes.values())
    traffic = [
        sum(TRAFFIC[kinds[n][c]] * sizes[n] for n in names) / (TRAFFIC["plain"] * total)
        for c in range(1, calls)
    ]
    steady = [all(kinds[n][c] in ("between", "plain") for n in mapped) for c in range(1, calls)]
    tensor = {n: replays([pattern([n], kinds, ranks, c) for c in range(calls)]) for n in names}
    bucket = [
        replays([pattern(keys, kinds, ranks, c) for c in range(calls)])[1:]
        for keys in buckets(sizes)
    ]
    return {
        "mapped_keys": len(mapped),
        "mapped_share_of_values": sum(sizes[n] for n in mapped) / total,
        "step": share(lambda n, c: kinds[n][c] == "step"),
        "measure": share(lambda n, c: kinds[n][c] == "measure"),
        "rank_moved": share(lambda n, c: ranks[n][c] != ranks[n][c - 1]),
        "graph": share(lambda n, c: kinds[n][c] == "between" and ranks[n][c] == ranks[n][c - 1]),
        "all_steady": sum(steady) / max(len(steady), 1),
        "replay_tensor": share(lambda n, c: tensor[n][c]),
        "replay_bucket": float(np.mean([r for calls_ in bucket for r in calls_])),
        "buckets": len(bucket),
        "traffic": float(np.mean(traffic)),
        "error": error,
        "kinds": {n: "".join(k[0] for k in kinds[n]) for n in mapped},
    }


def run_source(src: zoo.Source) -> dict[str, Any]:
    """Every policy, and fp8, over one source (geo_zoo.run_source), reading the first
    codec's key states after every call."""
    infos: dict[str, dict[str, list[Any]]] = {label: {} for label in POLICIES}

    def observe(label: str, name: str, codecs: list[Any]) -> None:
        if label in infos:
            infos[label].setdefault(name, []).append(codecs[0].state_info(name))

    variants = {BASE: geo_zoo.VARIANTS[BASE], **POLICIES}
    result = geo_zoo.run_source(src, geo_zoo.codecs_for(variants, src.world), observe=observe)
    sizes = {n: math.prod(shape) for n, shape in result["shapes"].items()}
    policies = {
        label: policy_row(infos[label], sizes, result["summary"][label]["median"])
        for label in POLICIES
    }
    return {
        "source": src.name,
        "half": "heldout" if src in zoo.HELDOUT else "tuning",
        "ranks": src.world,
        "calls": len(next(iter(infos[DEFAULT].values()))),
        "keys": len(sizes),
        "policies": policies,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# How often GeoFP8's mapped calls take a power step, on the gradient zoo",
        "",
        f"Command: `{result['command']}` ({result['seconds']:.0f} s).",
        "",
        "Over calls 2..W of the keys mapped at least once: the share of calls with a power "
        "step, with a re-measure of a flat key, whose rank moved from the key's previous call, "
        "and between steps at an unchanged rank (what a CUDA graph replays); `all steady` the "
        "share of training steps in which no mapped key stepped or re-measured (when a DDP "
        "bucket of every tensor could replay before calls with power steps were captured); "
        "`replay`: the share of calls that replay a CUDA graph (a pattern of keys, kinds and "
        "ranks seen twice before, still kept), each tensor its own call or in DDP buckets of "
        "25 MB. `traffic`: the whole model's modelled device "
        "bytes per call over fp8's, mean over calls 2..W (per value: "
        + ", ".join(f"{k} {v}" for k, v in TRAFFIC.items())
        + "; a model, docs/results.md). `error`: the median over matrices of each matrix's "
        "median over calls 2..W of its error over E4M3 block 128's (geo_heldout's `median`).",
        "",
        f"## Per source, {DEFAULT}",
        "",
        "| half | source | mapped keys | their share of values | step | re-measure | rank moved "
        "| graph | all steady | replay (tensor) | replay (bucket) | traffic / fp8 | error / fp8 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for s in result["sources"]:
        d = s["policies"][DEFAULT]
        lines.append(
            f"| {s['half']} | {s['source']} ({s['ranks']} ranks, {s['calls']} calls) "
            f"| {d['mapped_keys']} of {s['keys']} ({d['buckets']} buckets) "
            f"| {d['mapped_share_of_values']:.2f} | "
            + " | ".join(f"{d[k]:.2f}" for k in MEASURES)
            + " |"
        )
    lines += [
        "",
        "## Refresh policies, median over each half's sources",
        "",
        "| policy | half | step | re-measure | rank moved | graph | all steady "
        "| replay (tensor) | replay (bucket) | traffic / fp8 | error / fp8 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label in POLICIES:
        for half in ("tuning", "heldout"):
            rows = [s["policies"][label] for s in result["sources"] if s["half"] == half]
            if rows:
                lines.append(
                    f"| {label} | {half} | "
                    + " | ".join(f"{np.median([r[k] for r in rows]):.2f}" for k in MEASURES)
                    + " |"
                )
    lines += [
        "",
        "Each key's calls in order (`s` power step, `b` between steps, `m` measure, `p` plain) "
        "are in the JSON.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Error against modelled traffic, both over fp8's: a point per source and policy
    (filled: held out), each policy's held-out median ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for i, label in enumerate(result["policies"]):
        color = f"C{i}"
        for half, fill in (("tuning", "none"), ("heldout", color)):
            rows = [s["policies"][label] for s in result["sources"] if s["half"] == half]
            ax.scatter(
                [r["traffic"] for r in rows],
                [r["error"] for r in rows],
                edgecolors=color,
                facecolors=fill,
                s=22,
                label=f"{label} ({half})",
            )
        held = [s["policies"][label] for s in result["sources"] if s["half"] == "heldout"]
        ax.scatter(
            [np.median([r["traffic"] for r in held])],
            [np.median([r["error"] for r in held])],
            s=220,
            facecolors="none",
            edgecolors=color,
            linewidths=2,
        )
    ax.axvline(1.5, color="grey", linestyle=":", linewidth=1)
    ax.text(1.51, ax.get_ylim()[1] * 0.97, "1.5x fp8", color="grey", va="top", fontsize=8)
    ax.set_xlabel("modelled device traffic per call / fp8's")
    ax.set_ylabel("error / fp8's (median over matrices)")
    ax.set_title(
        "GeoFP8 refresh policies on the gradient zoo (rings: held-out medians)", fontsize=10
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="a source name, a half (tuning, heldout) or a comma list")
    p.add_argument("-J", "--json", help="write the record here (and the table beside it)")
    args = p.parse_args()
    start = time.perf_counter()
    sources = []
    for src in zoo.select(args.only):
        row = run_source(src)
        sources.append(row)
        d = row["policies"][DEFAULT]
        print(
            f"{src.name:28s} step {d['step']:.2f} graph {d['graph']:.2f} "
            f"traffic {d['traffic']:.2f} error {d['error']:.3f}",
            flush=True,
        )
    result = {
        "command": "python " + " ".join(sys.argv),
        "seconds": time.perf_counter() - start,
        "traffic_model": TRAFFIC,
        "policies": POLICIES,
        "sources": sources,
    }
    if args.json:
        write_results(args.json, result, markdown, plot)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
