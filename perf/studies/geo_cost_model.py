"""A MODEL of GeoFP8's cost on a GPU, against FP8's call (nothing here ran on a GPU).

No GPU was lent to the session that wrote this, so the GPU's numbers are a
model, from FLOPs and bytes at stated rates (:data:`GPU`), not a
measurement; the host's orthonormalizations, which a GPU call runs on its
host, are timed here on this CPU. Per tensor of m x n fp32 values on N
ranks:

* FP8's call: geocomm.engine.costs' model of a compressed all-reduce
  (codec at the ``nccl`` profile's rate, the link at each of
  :data:`LINKS`, its best stage count);
* a geometry's device work, unfused (the CuPy path maps, then encodes):
  every pass reads the tensor's 4 bytes a value (an expansion also writes
  them), every multiply-add runs in the fixed-order kernels on CUDA cores
  (no FMA), so a pass costs max(bytes / HBM, multiply-adds / rate). The
  split at its default rank k (stepping every call, the zoo's usual
  geometry): project, step (project, accumulate), expand, expand back; the
  whitening adds, for r whitened directions chosen from a basis of r_b
  rows: project and expand forward, project and expand back, and the
  measure (project, accumulate);
* host work: the orthonormalizations (fp64 Gram-Schmidt in C) of each call,
  timed here, and the copies of those rows between device and host.

GeoFP8's time is FP8's plus the geometry's, with no overlap (an upper
bound); the ratio against FP8's call is what the issue's <= 1.5x target
reads.

    python perf/studies/geo_cost_model.py -J perf/results/geo_cost_model.json
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # perf/lab.py
from lab import write_results

from geocomm.codecs.geo import DEFAULTS, kernels
from geocomm.codecs.geo.policy import MapShape, rank_for_budget, whiten_rows
from geocomm.engine import costs

#: The GPU the model assumes: an H200's HBM bandwidth (bytes/s, its data sheet),
#: the fixed-order kernels' multiply-adds per second (a quarter of the FP32 peak of
#: about 67 TFLOP/s, each multiply-add two instructions without FMA: an
#: assumption, not a measurement), host <-> device copies (bytes/s, PCIe 5).
GPU = {"hbm_Bps": 4.8e12, "mac_per_s": 67e12 / 2 / 4, "pcie_Bps": 50e9}
#: Links per rank (bytes/s): the nccl profile's NVLink, and two network speeds.
LINKS = {
    "NVLink (nccl profile)": costs.DEVICE["nccl"].link_Bps,
    "400 Gbit/s": 50e9,
    "100 Gbit/s": 12.5e9,
}
SHAPES = ((4096, 4096), (11008, 4096), (1024, 1024), (256, 256))
RANKS = 8


def host_orthonormalize_s(rows: int, n: int, repeats: int = 5) -> float:
    """Median seconds of one fixed-order orthonormalization of rows x n here."""
    w = np.random.default_rng(0).standard_normal((rows, n)).astype(np.float32)
    kernels.orthonormalize(w, 0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.orthonormalize(w, 0)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def passes_s(count: int, reads: int, writes: int, macs: float) -> float:
    """Seconds of device passes over ``count`` values: bytes or multiply-adds, the larger."""
    return max(4.0 * count * (reads + writes) / GPU["hbm_Bps"], count * macs / GPU["mac_per_s"])


def geometry_s(m: int, n: int) -> dict[str, float]:
    """Device and host seconds of the split and of the whitening's extra, per call."""
    k = min(DEFAULTS["k"], min(m, n) // 2, rank_for_budget(DEFAULTS["budget"], 1))
    r, basis = whiten_rows(MapShape(m, n, k), DEFAULTS["whiten"])
    count = m * n
    split = passes_s(count, 5, 2, 5 * k)  # project, step (project, accumulate), 2 expansions
    white = passes_s(count, 6, 2, 4 * r + 2 * basis)
    # the split's step orthonormalizes k rows; the whitening k + basis and basis rows
    split_host = host_orthonormalize_s(k, n) + 2 * 4 * k * n / GPU["pcie_Bps"]
    white_host = host_orthonormalize_s(k + basis, n) + host_orthonormalize_s(basis, n)
    white_host += 2 * 4 * (k + 2 * basis) * n / GPU["pcie_Bps"]
    return {
        "k": k,
        "r": r,
        "basis": basis,
        "split_device": split,
        "split_host": split_host,
        "whiten_device": white,
        "whiten_host": white_host,
    }


def fp8_s(m: int, n: int, link_Bps: float) -> float:
    profile = costs.Profile(
        costs.DEVICE["nccl"].stage_s, costs.DEVICE["nccl"].call_s, link_Bps,
        costs.DEVICE["nccl"].codec_Bps,
    )  # fmt: skip
    nbytes = 4.0 * m * n
    stages = costs.best_stages(profile, nbytes, RANKS, costs.FP8_RATIO)
    return costs.compressed_seconds(profile, nbytes, RANKS, costs.FP8_RATIO, stages)


def run() -> dict[str, Any]:
    rows = []
    for m, n in SHAPES:
        geo = geometry_s(m, n)
        for link, rate in LINKS.items():
            base = fp8_s(m, n, rate)
            split = base + geo["split_device"] + geo["split_host"]
            white = split + geo["whiten_device"] + geo["whiten_host"]
            rows.append(
                {
                    "shape": [m, n],
                    "link": link,
                    "fp8_ms": base * 1e3,
                    **{f"{key}_ms": value * 1e3 for key, value in geo.items() if key[0] in "sw"},
                    "k": geo["k"],
                    "r": geo["r"],
                    "basis": geo["basis"],
                    "split_ratio": split / base,
                    "whiten_ratio": white / base,
                    "whiten_device_only_ratio": (split + geo["whiten_device"] - geo["split_host"])
                    / base,
                }
            )
    return {"command": "python " + " ".join(sys.argv), "gpu": GPU, "ranks": RANKS, "rows": rows}


def markdown(r: dict[str, Any]) -> str:
    g = r["gpu"]
    lines = [
        "# A model of GeoFP8's cost on a GPU (not a measurement)",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Assumed GPU: HBM {g['hbm_Bps'] / 1e12:.1f} TB/s, fixed-order kernels at "
        f"{g['mac_per_s'] / 1e12:.1f} T multiply-adds/s (a quarter of an H200's FP32 peak "
        f"without FMA), host copies at {g['pcie_Bps'] / 1e9:.0f} GB/s; {r['ranks']} ranks; "
        "FP8's call from geocomm.engine.costs at each link. Host orthonormalizations timed on "
        "this CPU. Geometry unfused and not overlapped with the call: an upper bound. "
        "`device only`: the whitening's ratio were its orthonormalizations run on the device "
        "(their host time left out).",
        "",
        "| shape | link | fp8 call ms | split device + host ms | whitening device + host ms "
        "| split / fp8 | split + whitening / fp8 | device only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        m, n = row["shape"]
        lines.append(
            f"| {m} x {n} (k {row['k']}, r {row['r']}) | {row['link']} | {row['fp8_ms']:.3f} | "
            f"{row['split_device_ms']:.3f} + {row['split_host_ms']:.3f} | "
            f"{row['whiten_device_ms']:.3f} + {row['whiten_host_ms']:.3f} | "
            f"{row['split_ratio']:.2f} | {row['whiten_ratio']:.2f} | "
            f"{row['whiten_device_only_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-J", "--json", default="perf/results/geo_cost_model.json")
    args = p.parse_args(argv)
    result = run()
    write_results(args.json, result, markdown)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
