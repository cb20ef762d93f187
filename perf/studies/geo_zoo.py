"""GeoFP8 on every gradient of the zoo: error, bytes and time per source, against FP8.

For every source of perf/studies/zoo.py (cached per-rank gradients of
consecutive training steps; by default its tuning half), every variant's
codec, one per simulated rank (as many as the source has),
reduces every parameter of every recorded step with
:func:`geocomm.testing.simulate_allreduce` (the bits of that many real
ranks) with ``key=name``, from a fresh state at the window's first step.
Each result is compared with the exact average:

* per matrix (every parameter with >= 2 dimensions): the error ratio
  ||Q - G|| / ||G|| over FP8's (E4M3 block 128), median over calls 2..W
  (call 1 of a fresh key measures), then the median and p90 over matrices;
* ``fresh``: the median over matrices at each call 2..W (a fresh key);
* whole model: sqrt(sum of squared errors over all parameters) over FP8's,
  median over calls 2..W;
* bytes: what a rank contributes per call, the quantized payload plus the
  side channel at ``side_format``'s bytes a value (bfloat16: 2), over FP8's
  payload (the coefficients with their energies and the power steps' sums;
  an all-reduce measures a cold key from the whole result on every rank,
  sending nothing); over calls 2..W and, with the cold start, over all W;
* time: seconds of all the simulated calls over FP8's (same process, both
  ranks' work and the simulation's; the one-core cost on a 4096 x 4096
  matrix is perf/geo_bench.py's).

    python perf/studies/geo_zoo.py -J perf/results/geo_zoo.json
    python perf/studies/geo_zoo.py --report perf/results/geo_zoo.json   # md + png again
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import zoo  # noqa: E402
from geo_zoo_report import write  # noqa: E402

from geocomm.codecs import TransformingCodec, get_codec  # noqa: E402
from geocomm.testing import simulate_allreduce  # noqa: E402

BASE = "fp8 b128"
VARIANTS: dict[str, dict[str, Any]] = {
    BASE: {"id": "fp8", "fmt": "e4m3", "block": 128},
    "fp8 b32": {"id": "fp8", "fmt": "e4m3", "block": 32},
    "geofp8 (default)": {"id": "geofp8"},
    "geofp8 refresh every call": {"id": "geofp8", "refresh_max": 1},
    "geofp8 refresh every 4": {"id": "geofp8", "refresh": 4, "refresh_max": 4},
    "geofp8 side_budget 0.1": {"id": "geofp8", "side_budget": 0.1},
    "geofp8 no budget (k = cap)": {"id": "geofp8", "side_budget": math.inf},
}


class ByteCount:
    """Counts what one rank's transforming codec adds to the wire: the coefficients
    of every plan and the partial sums of every power step and refresh round."""

    def __init__(self, codec: Any):
        self.side = self.rounds = 0
        per_value = {"fp32": 4, "bf16": 2}[codec.side_format]
        plan, refresh, step = codec.plan, codec.refresh, codec.step

        def counted_plan(*args: Any, **kwargs: Any) -> Any:
            p = plan(*args, **kwargs)
            if getattr(p, "vt", None) is not None:
                # a split (or whitening) plan's coefficients, not read here: its side is
                # made after the step rounds; a step adds a row of energies
                dims = p.map_shape
                self.side += per_value * (dims.m + int(p.steps)) * dims.k
            return p

        def counted(rounds: Any, sent: int) -> Any:
            try:
                value = next(rounds)
                while True:
                    self.rounds += sent * int(value.size)
                    value = rounds.send((yield value))
            except StopIteration:
                return

        def counted_refresh(*args: Any, **kwargs: Any) -> Any:
            sent = 0 if kwargs.get("alone") else per_value  # alone: nothing travels
            return counted(refresh(*args, **kwargs), sent)

        def counted_step(*args: Any) -> Any:
            return counted(step(*args), per_value)  # a power step always sums over ranks

        codec.plan, codec.refresh, codec.step = counted_plan, counted_refresh, counted_step

    def take(self) -> int:
        total, self.side, self.rounds = self.side + self.rounds, 0, 0
        return total


def run_source(
    src: zoo.Source, world_codecs: dict[str, list[Any]], view: Any = None, observe: Any = None
) -> dict[str, Any]:
    """Every variant on one source: per-call errors, bytes and seconds. ``view``: a
    function of (name, array) that gives the array the codecs see instead (a layout
    experiment; default the array as stored). ``observe``: called as (label, name,
    codecs) after each simulated call (to read the codecs' state)."""
    z = zoo.load(src)
    names, steps = z["names"], z["steps"]
    if view is not None:
        steps = [[{n: view(n, g[n]) for n in names} for g in ranks] for ranks in steps]
    shapes = {n: steps[0][0][n].shape for n in names}
    mats = [n for n in names if len(shapes[n]) >= 2]
    payload = sum(world_codecs[BASE][0].wire_size(math.prod(shapes[n])) for n in names)
    out: dict[str, Any] = {}
    for label, codecs in world_codecs.items():
        own = sum(codecs[0].wire_size(math.prod(shapes[n])) for n in names) - payload
        counter = ByteCount(codecs[0]) if isinstance(codecs[0], TransformingCodec) else None
        rel = {n: [] for n in mats}
        sq: dict[str, list[float]] = {n: [] for n in names}  # squared error per call
        model_err, model_ref, extra, seconds = [], [], [], 0.0
        for ranks in steps:
            err2 = ref2 = 0.0
            for n in names:
                xs = [r[n] for r in ranks]
                start = time.perf_counter()
                q = simulate_allreduce(codecs, xs, key=n)
                seconds += time.perf_counter() - start
                if observe is not None:
                    observe(label, n, codecs)
                g = sum(x.astype(np.float64) for x in xs)
                e = float(np.sum((q.astype(np.float64) - g) ** 2))
                total = float(np.sum(g * g))
                err2, ref2 = err2 + e, ref2 + total
                sq[n].append(e)
                if n in rel:
                    rel[n].append(math.sqrt(e / total) if total > 0 else 0.0)
            model_err.append(math.sqrt(err2 / ref2))
            model_ref.append(ref2)
            extra.append(own + (counter.take() if counter else 0))
        out[label] = {
            "rel": rel,
            "sq": sq,
            "model": model_err,
            "extra_bytes": extra,
            "seconds": seconds,
        }
    for codecs in world_codecs.values():
        for c in codecs:
            if isinstance(c, TransformingCodec):
                c.reset_state()
    params = sum(math.prod(s) for s in shapes.values())
    return {
        "source": src.name,
        "params": params,
        "matrices": len(mats),
        "loss": [z["loss"][0], z["loss"][-1]],
        "payload_bytes": payload,
        "shapes": shapes,
        "raw": out,
        "summary": summarize(out, mats, payload),
    }


def summarize(raw: dict[str, Any], mats: list[str], payload: int) -> dict[str, Any]:
    """Per variant: the ratios, bytes and time against the base (see the module docstring)."""
    base = raw[BASE]
    rows = {}
    for label, r in raw.items():
        ratio = {n: [a / b for a, b in zip(r["rel"][n], base["rel"][n], strict=True)] for n in mats}
        per_matrix = [float(np.median(ratio[n][1:])) for n in mats]
        calls = len(r["model"])
        fresh = [float(np.median([ratio[n][c] for n in mats])) for c in range(calls)]
        model = [a / b for a, b in zip(r["model"], base["model"], strict=True)]
        rows[label] = {
            "median": float(np.median(per_matrix)),
            "p90": float(np.percentile(per_matrix, 90)),
            "max": float(np.max(per_matrix)),
            "model": float(np.median(model[1:])),
            "fresh": fresh,
            "bytes_steady": 1 + float(np.mean(r["extra_bytes"][1:])) / payload,
            "bytes_all": 1 + float(np.mean(r["extra_bytes"])) / payload,
            "time": r["seconds"] / base["seconds"],
        }
    return rows


def yardstick() -> dict[str, float]:
    """np.copyto GB/s and FP8's encode time of 4M values, measured now (one core)."""
    x = np.random.default_rng(0).standard_normal(1 << 22, np.float32)
    y = np.empty_like(x)
    fp8 = get_codec("fp8")
    wire = np.empty(fp8.wire_size(x.size), np.uint8)

    def best(fn: Any) -> float:
        times = []
        for _ in range(9):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    copy_s = best(lambda: np.copyto(y, x))
    enc_s = best(lambda: fp8.encode_wire(x, wire))
    return {"copyto_GBps": x.nbytes / copy_s / 1e9, "fp8_encode_ms_4M": enc_s * 1e3}


def codecs_for(variants: dict[str, dict[str, Any]], world: int) -> dict[str, list[Any]]:
    """One codec per simulated rank for every variant."""
    return {label: [get_codec(cfg) for _ in range(world)] for label, cfg in variants.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    before = yardstick()
    sources = []
    for src in zoo.select(args.only):
        start = time.perf_counter()
        result = run_source(src, codecs_for(VARIANTS, src.world))
        result.pop("shapes")
        if not args.keep_raw:
            result.pop("raw")
        sources.append(result)
        d = result["summary"]["geofp8 (default)"]
        print(
            f"{src.name:24s} median {d['median']:.3f} p90 {d['p90']:.3f} model {d['model']:.3f} "
            f"bytes {d['bytes_steady']:.3f} time {d['time']:.2f}x "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return {
        "command": "python " + " ".join(sys.argv),
        "world": sorted({src.world for src in zoo.select(args.only)}),
        "variants": VARIANTS,
        "base": BASE,
        "yardstick": {"before": before, "after": yardstick()},
        "sources": sources,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="tuning", help="comma-separated zoo source names or halves")
    p.add_argument("--keep-raw", action="store_true", help="keep per-call errors in the JSON")
    p.add_argument("-J", "--json", default="perf/results/geo_zoo.json")
    p.add_argument("--report", default=None, help="re-render md and png from this JSON")
    args = p.parse_args(argv)
    if args.report:
        write(json.loads(Path(args.report).read_text()), Path(args.report))
        return 0
    write(run(args), Path(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
