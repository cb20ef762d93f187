"""GeoFP8 on real gradients: error versus wire bytes of every codec variant.

Trains the byte-level Llama of ``perf/llama.py`` data-parallel with the exact
average (``codec="none"``). Every step, each rank's local gradient of every
weight matrix also goes through the real collective
``geocomm.allreduce(g, codec=variant, op="avg", key=name)`` for every
stateful variant (geofp8, geonvfp4: their per-key state evolves over every
step in order, as in training); stateless variants run on the measured steps
only. On measured steps (``--start``, then every ``--every``) rank 0 compares
each result Q with the exact average G:

* ``rel``: ||Q - G|| / ||G||;
* ``in`` / ``out``: the error inside the top-4 singular subspace of G
  (U4^T E V4, relative to ||G_4||) and outside it (the rest of E, relative
  to ||G - G_4||), G_4 the best rank-4 approximation;
* ``cos``: cosine between Q and G;
* ``adam``: ||E / (sqrt(v) + eps)|| / ||G / (sqrt(v) + eps)||, v the
  bias-corrected AdamW second moment after this step's update;
* bytes: the quantized payload a rank sends (``collectives.wire_bytes``,
  scales included) plus the side channel it passes to the codec's
  ``allreduce_sum`` (metered around ``codec.begin``).

Ratios are taken per tensor and step against the variant's base quantizer
(E4M3 block 128, or NVFP4), reduced by the median over steps and then over
the weight matrices. Extra bytes are relative to the base quantizer's payload
for the whole model (every parameter, norms included), for one 4096 x 4096
gradient, and for every matrix of the ``medium`` and ``7b`` shapes (side
channels counted as if every eligible matrix were transformed: an upper bound).

Variants tagged ``bf16 side`` round each rank's side-channel contribution to
bfloat16 before the fp32 sum and count 2 bytes per value: what a bf16
transport of the side channel would give (every rank still decodes the same
bytes, so results stay bitwise identical). The geocomm collectives send the
side channel in fp32 today; these rows measure what adding it would buy.

    python -m geocomm.launch -n 2 --timeout 3600 -- python perf/geo_real_gradients.py \\
        --steps 150 -J perf/results/geo_real_gradients.json
    python perf/geo_real_gradients.py --part overhead -J perf/results/geo_real_gradients.json
    python perf/geo_real_gradients.py --part report    # re-render md and png from the JSON
"""

from __future__ import annotations

import os

# one BLAS and torch thread per rank: the ranks share the machine's cores
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import (  # noqa: E402
    CONFIGS,
    LlamaConfig,
    TextData,
    TrainConfig,
    apply_update,
    build_model,
    heldout_loss,
    make_optimizer,
    named_grads,
    train_step,
)

from geocomm.codecs import Codec, get_codec  # noqa: E402
from geocomm.codecs.geometry import GeoCodec  # noqa: E402
from geocomm.collectives import Layout, wire_bytes  # noqa: E402

FP8 = {"id": "fp8", "fmt": "e4m3", "block": 128}
NVFP4 = {"id": "nvfp4"}
# opened up so the variant applies to every matrix: selection is judged separately
OPEN = {"max_side": 1e9, "min_share": 0.0}
BIG = (4096, 4096)


def _variant(label: str, codec: dict[str, Any], base: str = "fp8", side: str = "fp32"
             ) -> dict[str, Any]:
    return {"label": label, "codec": codec, "base": base, "side": side}


def _geo(transform: str, refresh: str, k: int, sides: str = "both", codec: str = "geofp8",
         **extra: Any) -> dict[str, Any]:
    return {"id": codec, "transform": transform, "refresh": refresh, "k": k, "sides": sides,
            **OPEN, **extra}


def _name(transform: str, refresh: str, k: int, sides: str) -> str:
    tag = {"both": "", "right": "-R", "left": "-L"}[sides]
    return f"{transform}{tag} {refresh} k={k}"


SWEEPS: dict[str, list[dict[str, Any]]] = {
    "full": [
        _variant("fp8 b128", FP8),
        _variant("fp8 b32", {**FP8, "block": 32}),
        _variant("hadamard", {"id": "hadamard"}),
        _variant("geofp8 (default)", {"id": "geofp8"}),
        _variant("previous default: split current k=16 side<=0.1",
                 {"id": "geofp8", "transform": "split", "refresh": "current", "k": 16,
                  "max_side": 0.1}),
        # the issue's grid: two-sided maps, both refresh policies, k = 8, 16, 32
        *[_variant(_name(t, r, k, "both"), _geo(t, r, k))
          for t in ("whiten", "split") for r in ("current", "past") for k in (8, 16, 32)],
        # whitening with the past basis (no side channel): rank, exponent, one side
        _variant(_name("whiten", "past", 128, "both"), _geo("whiten", "past", 128)),
        *[_variant(_name("whiten", "past", 64, "both") + f" a={a:g} dmin={label}",
                   _geo("whiten", "past", 64, alpha=a, d_min=d))
          for a, d, label in ((1 / 16, 0.125, "1/8"), (0.25, 0.125, "1/8"),
                              (0.5, 1 / 32, "1/32"))],
        _variant(_name("whiten", "past", 64, "right"), _geo("whiten", "past", 64, "right")),
        # one-sided split: exact coefficients on one side, basis from past results
        *[_variant(_name("split", "past", k, "right"), _geo("split", "past", k, "right"))
          for k in (4, 8, 16, 32)],
        _variant(_name("split", "past", 8, "left"), _geo("split", "past", 8, "left")),
        _variant(_name("split", "current", 16, "right"), _geo("split", "current", 16, "right")),
        # the codec's own byte budget at 5%
        _variant("split past k=64 side<=0.05",
                 {"id": "geofp8", "transform": "split", "refresh": "past", "k": 64,
                  "max_side": 0.05}),
        _variant("split-R past k=32 side<=0.05",
                 {"id": "geofp8", "transform": "split", "refresh": "past", "sides": "right",
                  "k": 32, "max_side": 0.05}),
        # side channel in bf16 (needs collective support; see the module docstring)
        *[_variant(_name("split", "past", k, "right") + " bf16", _geo("split", "past", k, "right"),
                   side="bf16") for k in (8, 16)],
        _variant(_name("split", "current", 16, "both") + " bf16",
                 _geo("split", "current", 16), side="bf16"),
        _variant("nvfp4", NVFP4, base="nvfp4"),
        _variant("geonvfp4 (default)", {"id": "geonvfp4"}, base="nvfp4"),
        _variant("geonvfp4 " + _name("whiten", "past", 128, "both"),
                 _geo("whiten", "past", 128, codec="geonvfp4"), base="nvfp4"),
        *[_variant("geonvfp4 " + _name("split", "past", k, "right"),
                   _geo("split", "past", k, "right", codec="geonvfp4"), base="nvfp4")
          for k in (16, 32)],
        _variant("geonvfp4 " + _name("split", "current", 16, "both"),
                 _geo("split", "current", 16, codec="geonvfp4"), base="nvfp4"),
    ],
    "quick": [
        _variant("fp8 b128", FP8),
        _variant("geofp8 (default)", {"id": "geofp8"}),
        _variant(_name("split", "past", 8, "right"), _geo("split", "past", 8, "right")),
        _variant("nvfp4", NVFP4, base="nvfp4"),
        _variant("geonvfp4 (default)", {"id": "geonvfp4"}, base="nvfp4"),
    ],
}
BASES = {"fp8": "fp8 b128", "nvfp4": "nvfp4"}


# ---------------------------------------------------------------------------
# codecs with a metered (optionally bf16) side channel


class MeteredCodec:
    """A codec instance whose ``begin`` counts the bytes passed to ``allreduce_sum``.

    ``side="bf16"``: each contribution is rounded to bfloat16 first and counted
    at 2 bytes per value (the sum itself stays the collective's fp32 sum).
    """

    def __init__(self, variant: dict[str, Any]):
        self.variant = variant
        self.codec: Codec = get_codec(variant["codec"])
        self.stateful = isinstance(self.codec, GeoCodec) and self.codec.transform != "hadamard"
        self.sent = 0
        width = 2 if variant["side"] == "bf16" else 4
        original = self.codec.begin

        def begin(x: np.ndarray, key: Any, reduce: Any) -> Any:
            if reduce is None:
                return original(x, key, None)

            def metered(values: np.ndarray) -> np.ndarray:
                values = np.asarray(values, np.float32)
                self.sent += width * values.size
                if width == 2:
                    values = values.astype(ml_dtypes.bfloat16).astype(np.float32)
                return reduce(values)

            return original(x, key, metered)

        self.codec.begin = begin  # instance attribute: the collective calls this one

    def side_fraction(self, shape: tuple[int, ...], world: int) -> float:
        """Steady-state side bytes / own payload for a matrix of ``shape`` (0 if plain)."""
        codec = self.codec
        if not self.stateful:
            return 0.0
        lay = codec.layout(shape)
        if lay is None:
            return 0.0
        scale = 0.5 if self.variant["side"] == "bf16" else 1.0
        return scale * codec.side_bytes(*lay) / payload_bytes(codec, math.prod(shape), world)


def payload_bytes(codec: Codec, count: int, world: int, rank: int = 0) -> int:
    """Quantized bytes ``rank`` sends in one all-reduce of ``count`` values."""
    return wire_bytes(codec, Layout.plan(count, world), rank)


# ---------------------------------------------------------------------------
# metrics


def top_subspace(g: np.ndarray, k: int = 4) -> tuple[np.ndarray, np.ndarray, float]:
    """Top-k left/right singular vectors of g and the energy of its rank-k part."""
    u, s, vt = np.linalg.svd(g, full_matrices=False)
    return u[:, :k], vt[:k].T, float(np.sum(s[:k] ** 2))


def metrics(q: np.ndarray, g: np.ndarray, sub: tuple[np.ndarray, np.ndarray, float],
            precond: np.ndarray) -> dict[str, float]:
    """Error metrics of q against the exact average g (both float64, same shape)."""
    u, v, top = sub
    e = q - g
    total, err = float(np.sum(g * g)), float(np.sum(e * e))
    inside = float(np.sum((u.T @ e @ v) ** 2))
    cos = float(np.sum(q * g) / math.sqrt(max(float(np.sum(q * q)) * total, 1e-300)))
    return {"rel": math.sqrt(err / total),
            "in": math.sqrt(inside / top),
            "out": math.sqrt(max(err - inside, 0.0) / max(total - top, 1e-300)),
            "cos": cos,
            "adam": float(np.linalg.norm(e * precond) / np.linalg.norm(g * precond))}


def adam_preconditioner(opt: Any, param: Any) -> np.ndarray:
    """1 / (sqrt(v_hat) + eps) of AdamW's state for ``param`` after its step."""
    state = opt.state[param]
    group = next(gr for gr in opt.param_groups if any(p is param for p in gr["params"]))
    beta2, eps = group["betas"][1], group["eps"]
    v = state["exp_avg_sq"].double().numpy() / (1 - beta2 ** float(state["step"]))
    return 1.0 / (np.sqrt(v) + eps)


# ---------------------------------------------------------------------------
# the training run


def run_training(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import geocomm

    torch.set_num_threads(1)
    comm = geocomm.init()
    rank, world = comm.rank, comm.size
    overrides = {"batch": args.batch, "n_layers": args.layers}
    cfg = replace(CONFIGS[args.config], **{k: v for k, v in overrides.items() if v})
    tc = TrainConfig()
    model = build_model(cfg, args.seed)
    opt = make_optimizer(model, tc)
    data = TextData(cfg, args.seed)
    params = dict(model.named_parameters())
    matrices = [n for n, p in params.items() if p.ndim == 2]
    variants = [MeteredCodec(v) for v in SWEEPS[args.sweep]]
    measured = [s for s in range(args.start, args.steps, args.every)]
    # raw[label][name] -> list over measured steps of metric dicts
    raw: dict[str, dict[str, list[dict[str, float]]]] = {
        v.variant["label"]: {n: [] for n in matrices} for v in variants}
    consistent = {v.variant["label"]: True for v in variants}
    spectra: dict[str, list[list[float]]] = {n: [] for n in matrices}
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        local_loss = train_step(model, opt, *data.batches("train", rank, world, step))
        local = {n: g.copy() for n, g in named_grads(model)}
        for _, g in named_grads(model):  # the exact average: what training applies
            geocomm.allreduce(g, codec="none", op="avg", out=g)
        exact = {n: params[n].grad.detach().numpy().astype(np.float64) for n in matrices}
        measure = step in measured
        results: dict[str, dict[str, np.ndarray]] = {}
        for mc in variants:
            if not (mc.stateful or measure):
                continue
            out = results[mc.variant["label"]] = {}
            for name in matrices:
                mc.sent = 0
                out[name] = geocomm.allreduce(local[name], codec=mc.codec, op="avg", key=name)
                out[name + "/side"] = mc.sent
        apply_update(model, opt, tc, step)
        losses.append(comm_mean(comm, local_loss))
        if not measure:
            continue
        for label, out in results.items():  # every rank must hold the same bits
            crc = np.array([zlib.crc32(b"".join(out[n].tobytes() for n in matrices))], np.int64)
            consistent[label] &= len(set(comm.allgather_int64(crc).ravel())) == 1
        if rank != 0:
            continue
        for name in matrices:
            g = exact[name]
            sub = top_subspace(g)
            s2 = np.linalg.svd(g, compute_uv=False) ** 2
            spectra[name].append([float(s2[:k].sum() / s2.sum()) for k in (4, 8, 16, 32)])
            precond = adam_preconditioner(opt, params[name])
            for label, out in results.items():
                row = metrics(out[name].astype(np.float64), g, sub, precond)
                row["side"] = out[name + "/side"]
                raw[label][name].append(row)
        print(f"step {step:4d} loss {losses[-1]:.4f} "
              f"{(time.perf_counter() - t0) / (step + 1):.2f} s/step", flush=True)
    for mc in variants:
        if mc.stateful:
            crc = np.array([mc.codec.state_checksum()], np.int64)
            consistent[mc.variant["label"]] &= len(set(comm.allgather_int64(crc).ravel())) == 1
    heldout = heldout_loss(model, data, rank=rank, world=world)
    if rank != 0:
        return {}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    return {
        "world": world, "model": {"name": args.config, **asdict(cfg),
                                  "params": cfg.n_params()},
        "train": asdict(tc) | {"loss": losses, "heldout_loss": heldout,
                               "seconds": time.perf_counter() - t0},
        "measured_steps": measured,
        "spectra": {n: np.median(np.array(s), axis=0).tolist() for n, s in spectra.items()},
        "variants": summarize(variants, raw, shapes, matrices, world, consistent),
    }


def comm_mean(comm: Any, value: float) -> float:
    import geocomm

    x = np.array([value], np.float64)
    return float(geocomm.allreduce(x, codec="none", op="avg", comm=comm)[0])


# ---------------------------------------------------------------------------
# aggregation


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def model_bytes(mc: MeteredCodec, shapes: dict[str, tuple[int, ...]], world: int) -> int:
    """Quantized payload bytes of every parameter of the model (no side channel)."""
    return sum(payload_bytes(mc.codec, math.prod(s), world) for s in shapes.values())


def shape_extra(mc: MeteredCodec, base: MeteredCodec, shapes: list[tuple[int, ...]],
                world: int) -> float:
    """Extra bytes over ``base`` of all ``shapes`` (side channels at their layout k)."""
    own = sum(payload_bytes(mc.codec, math.prod(s), world) * (1 + mc.side_fraction(s, world))
              for s in shapes)
    ref = sum(payload_bytes(base.codec, math.prod(s), world) for s in shapes)
    return own / ref - 1


def summarize(variants: list[MeteredCodec], raw: dict[str, Any],
              shapes: dict[str, tuple[int, ...]], matrices: list[str], world: int,
              consistent: dict[str, bool]) -> list[dict[str, Any]]:
    by_label = {mc.variant["label"]: mc for mc in variants}
    rows = []
    for mc in variants:
        label = mc.variant["label"]
        base = by_label[BASES[mc.variant["base"]]]
        blabel = base.variant["label"]
        per_tensor: dict[str, dict[str, float]] = {}
        for name in matrices:
            mine, ref = raw[label][name], raw[blabel][name]
            entry = {key: _median([r[key] for r in mine])
                     for key in ("rel", "in", "out", "cos", "adam", "side")}
            for key in ("rel", "in", "out", "adam"):
                entry[key + "_ratio"] = _median([a[key] / b[key] for a, b in
                                                 zip(mine, ref, strict=True)])
            entry["payload"] = payload_bytes(mc.codec, math.prod(shapes[name]), world)
            entry["base_payload"] = payload_bytes(base.codec, math.prod(shapes[name]), world)
            entry["extra"] = (entry["payload"] + entry["side"]) / entry["base_payload"] - 1
            per_tensor[name] = entry
        every = [a["rel"] / b["rel"] for name in matrices
                 for a, b in zip(raw[label][name], raw[blabel][name], strict=True)]
        side = sum(e["side"] for e in per_tensor.values())
        payload, ref_payload = model_bytes(mc, shapes, world), model_bytes(base, shapes, world)
        summary = {key: _median([e[key] for e in per_tensor.values()])
                   for key in ("rel", "out", "cos", "adam", "rel_ratio", "in_ratio",
                               "out_ratio", "adam_ratio")}
        summary |= {
            "rel_ratio_p90": float(np.percentile(every, 90)), "rel_ratio_max": max(every),
            "extra_model": (payload + side) / ref_payload - 1,
            "side_model": side / ref_payload,
            "bytes_per_value": (payload + side) / sum(math.prod(s) for s in shapes.values()),
            "extra_4096": shape_extra(mc, base, [BIG], world),
            **{f"extra_{c}": shape_extra(mc, base, _matrix_shapes(CONFIGS[c]), world)
               for c in ("medium", "7b")},
        }
        rows.append({**mc.variant, "config": mc.codec.get_config(), "base_label": blabel,
                     "consistent": consistent[label], "summary": summary,
                     "per_tensor": per_tensor})
    return rows


def _matrix_shapes(cfg: LlamaConfig) -> list[tuple[int, ...]]:
    return list(cfg.weight_shapes().values())


# ---------------------------------------------------------------------------
# overhead on one 4096 x 4096 gradient


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per call: fp8 encode+decode against geofp8 begin+forward+encode+decode+
    inverse+end (warm state, one process: no communication), median of ``--reps``."""
    m, n = BIG
    rng = np.random.default_rng(args.seed)
    # a gradient-like matrix: decaying spectrum over 64 directions plus noise
    low = (rng.standard_normal((m, 64)) / np.arange(1, 65)) @ rng.standard_normal((64, n))
    x = (low / math.sqrt(64) + 0.05 * rng.standard_normal((m, n))).astype(np.float32)
    flat = x.reshape(-1)
    rows = {}
    configs = {"fp8 b128": FP8, "nvfp4": NVFP4, "geofp8 (default)": {"id": "geofp8"},
               "geonvfp4 (default)": {"id": "geonvfp4"},
               "whiten past k=32": {"id": "geofp8", "transform": "whiten", "k": 32,
                                    "refresh": "past"},
               "split current k=16": {"id": "geofp8", "transform": "split", "k": 16,
                                      "refresh": "current", "sides": "both"}}
    for label, config in configs.items():
        codec = get_codec(config)
        wire = np.empty(codec.wire_size(flat.size), np.uint8)
        out = np.empty(flat.size, np.float32)
        phases: dict[str, list[float]] = {"begin": [], "forward": [], "encode": [],
                                          "decode": [], "inverse": [], "end": []}
        for rep in range(args.reps + 2):
            times = {}
            t = time.perf_counter()
            plan = codec.begin(x, "w", None)
            times["begin"] = time.perf_counter() - t
            t = time.perf_counter()
            y = flat if plan is None else plan.forward(flat)
            times["forward"] = time.perf_counter() - t
            t = time.perf_counter()
            codec.encode_wire(np.ascontiguousarray(y), wire)
            times["encode"] = time.perf_counter() - t
            t = time.perf_counter()
            codec.decode_wire(wire, out)
            times["decode"] = time.perf_counter() - t
            t = time.perf_counter()
            result = out if plan is None else plan.inverse(out)
            times["inverse"] = time.perf_counter() - t
            t = time.perf_counter()
            codec.end("w", plan, result)
            times["end"] = time.perf_counter() - t
            if rep >= 2:  # the first calls build the state (cold refresh)
                for key, value in times.items():
                    phases[key].append(value)
        med = {key: float(np.median(v)) for key, v in phases.items()}
        rows[label] = {"config": codec.get_config(), "phases_s": med,
                       "total_s": sum(med.values()),
                       "transformed": plan is not None}
    base = rows["fp8 b128"]["total_s"]
    for row in rows.values():
        row["vs_fp8"] = row["total_s"] / base
    return {"shape": list(BIG), "reps": args.reps, "threads": os.environ.get("OMP_NUM_THREADS"),
            "rows": rows}


# ---------------------------------------------------------------------------
# output


def write_outputs(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=1))
    if "variants" in result:
        path.with_suffix(".md").write_text(markdown(result))
        plot(result, path.with_suffix(".png"))


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def markdown(result: dict[str, Any]) -> str:
    model, train = result["model"], result["train"]
    lines = [
        "# GeoFP8 on real gradients",
        "",
        f"Command: `{result['command']}`",
        "",
        f"{model['name']} byte-level Llama ({model['params'] / 1e6:.2f}M parameters: "
        f"d_model {model['d_model']}, {model['n_layers']} layers, {model['n_heads']} heads, "
        f"ff {model['ff']}, seq {model['seq_len']}, batch {model['batch']} per rank), "
        f"{result['world']} ranks, {len(train['loss'])} AdamW steps on the exact average "
        f"(loss {train['loss'][0]:.3f} -> {np.mean(train['loss'][-10:]):.3f}, held-out "
        f"{train['heldout_loss']:.3f}). Metrics on {len(result['measured_steps'])} steps "
        f"({result['measured_steps'][0]}..{result['measured_steps'][-1]}), "
        f"{len(result['variants'][0]['per_tensor'])} weight matrices, through "
        "`geocomm.allreduce(g, codec, op=\"avg\", key=name)` (both quantizations).",
        "",
        "Ratios: per tensor and step against the base quantizer (E4M3 block 128, or "
        "NVFP4), median over steps, then over matrices; `p90 / max`: of the rel ratio over "
        "all (matrix, step) pairs. `out`: error outside the top-4 "
        "singular subspace of the exact average. `adam`: error of the AdamW-normalized "
        "gradient. Extra bytes: payload + side channel over the base payload, for the "
        "whole model, one 4096x4096 gradient, and the matrices of the `medium` and "
        "`7b` shapes (upper bound: every eligible matrix transformed). "
        "`bf16` rows: side channel rounded to bf16 (needs collective support).",
        "",
        "| variant | base | rel | rel ratio | p90 / max | out ratio | in ratio | adam ratio | "
        "cos | extra model | extra 4096² | extra medium | extra 7b | ranks agree |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v in result["variants"]:
        s = v["summary"]
        lines.append(
            f"| {v['label']} | {v['base_label']} | {s['rel']:.4f} | {s['rel_ratio']:.3f} | "
            f"{s['rel_ratio_p90']:.2f} / {s['rel_ratio_max']:.2f} | {s['out_ratio']:.3f} | "
            f"{s['in_ratio']:.3f} | {s['adam_ratio']:.3f} | "
            f"{s['cos']:.5f} | {_pct(s['extra_model'])} | {_pct(s['extra_4096'])} | "
            f"{_pct(s['extra_medium'])} | {_pct(s['extra_7b'])} | "
            f"{'yes' if v['consistent'] else 'NO'} |")
    lines += targets_lines(result)
    lines += ["", "Median top-k energy share of the exact average gradient (k = 4, 8, 16, 32):",
              "", "| tensor | k=4 | k=8 | k=16 | k=32 |", "| --- | --- | --- | --- | --- |"]
    for name, shares in result["spectra"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in shares) + " |")
    lines += notes_lines(result)
    if "overhead" in result:
        lines += overhead_lines(result["overhead"])
    return "\n".join(lines) + "\n"


#: the issue's targets for the defaults: (summary key, bound, what)
TARGETS = [("rel_ratio", 0.5, "relative error <= 0.5x the base quantizer's"),
           ("out_ratio", 0.6, "error outside the top-4 subspace <= 0.6x"),
           ("extra_4096", 0.05, "extra wire bytes on a 4096x4096 gradient <= 5%"),
           ("extra_model", 0.05, "extra wire bytes for the whole model <= 5%")]


def targets_lines(result: dict[str, Any]) -> list[str]:
    """The issue's targets checked for the default geofp8 and geonvfp4 rows."""
    rows = {v["label"]: v for v in result["variants"]}
    lines = ["", "## Targets for the defaults", "",
             "| codec | target | measured | met |", "| --- | --- | --- | --- |"]
    for label in ("geofp8 (default)", "geonvfp4 (default)"):
        if label not in rows:
            continue
        s = rows[label]["summary"]
        for key, bound, what in TARGETS:
            value = f"{s[key]:.3f}" if key.endswith("ratio") else _pct(s[key])
            lines.append(f"| {label} vs {rows[label]['base_label']} | {what} | {value} | "
                         f"{'yes' if s[key] <= bound else 'no'} |")
    config = rows.get("geofp8 (default)", {}).get("config")
    if config:
        lines += ["", f"Default geofp8 config: `{json.dumps(config, sort_keys=True)}`"]
    return lines


def notes_lines(result: dict[str, Any]) -> list[str]:
    """Findings of the full sweep, numbers read from its rows (none for other sweeps)."""
    rows = {v["label"]: v["summary"] for v in result["variants"]}

    def r(label: str, key: str = "rel_ratio") -> str:
        value = rows[label][key]
        return _pct(value) if key.startswith("extra") else f"{value:.3f}"

    try:
        return ["", "## Findings", "",
                "* The default (whiten both sides, basis and energies tracked from past "
                "reduced results by one power step in `end`, k = 64, alpha = 1/8) sends no "
                f"side channel: {r('geofp8 (default)')}x the E4M3 error (90th percentile "
                f"over matrices and steps {r('geofp8 (default)', 'rel_ratio_p90')}, worst "
                f"{r('geofp8 (default)', 'rel_ratio_max')}), {r('geonvfp4 (default)')}x "
                "NVFP4's. Its error inside the top-4 subspace grows a little (the inverse "
                "stretches it by 1/d), everything else shrinks.",
                "* Exponent: alpha = 1/16 gives "
                f"{r('whiten past k=64 a=0.0625 dmin=1/8')}x, 1/4 "
                f"{r('whiten past k=64 a=0.25 dmin=1/8')}x, 1/2 (full whitening) "
                f"{r('whiten past k=64 a=0.5 dmin=1/32')}x. Rank: k = 16, 32, 64, 128 give "
                f"{r('whiten past k=16')}, {r('whiten past k=32')}, {r('geofp8 (default)')}, "
                f"{r('whiten past k=128')}x (arithmetic grows with k; see the overhead).",
                "* Side channels are expensive on 256-wide matrices: a current refresh "
                "sends k (m + n) fp32 values, +40% of the payload at k = 16 (split current "
                f"k=16: {r('split current k=16')}x at {r('split current k=16', 'extra_model')})."
                " Within the issue's 5% the best side-channel variant is two-sided split with "
                "the past basis (k x k coefficients; "
                f"{r('split past k=64 side<=0.05')}x at "
                f"{r('split past k=64 side<=0.05', 'extra_model')}); the one-sided split "
                f"drops to k = 3 there ({r('split-R past k=32 side<=0.05')}x).",
                "* One-sided split on the input side with the past basis captures as much as "
                "a current two-sided refresh for less than half the bytes (split-R past "
                f"k=16: {r('split-R past k=16')}x at {r('split-R past k=16', 'extra_model')} "
                f"vs split current k=16: {r('split current k=16')}x at "
                f"{r('split current k=16', 'extra_model')}); the output side moves between "
                f"steps (split-L past k=8: {r('split-L past k=8')}x vs split-R past k=8: "
                f"{r('split-R past k=8')}x), which is also why two-sided split with a past "
                f"basis captures little (k=16: {r('split past k=16')}x).",
                "* bf16 side channel (simulated): split-R past k=16 "
                f"{r('split-R past k=16')}x (fp32) vs {r('split-R past k=16 bf16')}x (bf16), "
                f"split current k=16 {r('split current k=16')}x vs "
                f"{r('split current k=16 bf16')}x: the same error for half the side bytes. "
                "It needs the collectives to sum bf16 contributions (each rank decodes the "
                "same bytes, so results stay bitwise identical); today `allreduce_sum` "
                "moves fp32.",
                f"* Baselines: Hadamard rotation {r('hadamard')}x (a rotation keeps the norm, "
                "and E4M3's rounding error is relative to it), E4M3 with 1x32 blocks "
                f"{r('fp8 b32')}x for {r('fp8 b32', 'extra_model')} bytes.",
                "* Bytes at larger shapes are computed from each codec's layout (side "
                "channel at the rank the budget allows, every eligible matrix transformed): "
                "the default sends nothing extra at any size. A smaller check at larger "
                "width is in geo_real_gradients_medium.md (1024-wide matrices, 2 layers, 4 "
                "measured steps early in training)."]
    except KeyError:
        return []


def overhead_lines(oh: dict[str, Any]) -> list[str]:
    lines = ["", f"## Overhead on one {oh['shape'][0]}x{oh['shape'][1]} float32 gradient", "",
             f"One process, warm state, no communication, median of {oh['reps']} calls, "
             f"{oh['threads']} BLAS thread(s). Command: `{oh['command']}`. Whitening "
             "with the past basis does about 20 k m n flops per call (forward and inverse "
             "8 m n k each, the power step in `end` 4 m n k); the encode and decode are "
             "the quantizer's own.", "",
             "| codec | begin | forward | encode | decode | inverse | end | total | vs fp8 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, row in oh["rows"].items():
        ph = row["phases_s"]
        lines.append(f"| {label} | " + " | ".join(
            f"{1e3 * ph[k]:.1f} ms" for k in ("begin", "forward", "encode", "decode",
                                               "inverse", "end"))
            + f" | {1e3 * row['total_s']:.1f} ms | {row['vs_fp8']:.1f}x |")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, key, bx) = plt.subplots(1, 3, figsize=(20, 7.5),
                                      gridspec_kw={"width_ratios": [3, 1.4, 3]})
    entries = []
    for i, v in enumerate(result["variants"], 1):
        s = v["summary"]
        marker = {"fp8": "o", "nvfp4": "s"}[v["base"]]
        color = "tab:red" if "default" in v["label"] else (
            "tab:green" if v["side"] == "bf16" else "tab:blue")
        ax.scatter(100 * s["extra_model"], s["rel_ratio"], marker=marker, color=color)
        ax.annotate(str(i), (100 * s["extra_model"], s["rel_ratio"]), fontsize=7,
                    xytext=(3, 2), textcoords="offset points")
        entries.append(f"{i:2d} {v['label']}")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.axhline(0.5, color="gray", lw=0.5, ls="--")
    ax.axvline(5, color="gray", lw=0.5, ls="--")
    ax.set_xlabel("extra wire bytes over the base quantizer, whole model (%)")
    ax.set_ylabel("median relative error / base quantizer's")
    ax.set_title("error vs wire bytes (o: E4M3 b128 base, s: NVFP4 base;\n"
                 "red: defaults, green: bf16 side channel)")
    key.axis("off")
    key.text(0, 1, "\n".join(entries), va="top", family="monospace", fontsize=6.5,
             transform=key.transAxes)
    names = list(result["variants"][0]["per_tensor"])
    picks = [v for v in result["variants"] if v["label"] in
             ("geofp8 (default)", "geonvfp4 (default)", "hadamard", "split past k=64 side<=0.05",
              "split current k=16", "split-R past k=16")]
    for v in picks:
        bx.plot(range(len(names)), [v["per_tensor"][n]["rel_ratio"] for n in names],
                marker=".", label=v["label"])
    bx.set_xticks(range(len(names)))
    bx.set_xticklabels([n.replace(".weight", "").replace("blocks.", "") for n in names],
                       rotation=90, fontsize=6)
    bx.axhline(1, color="gray", lw=0.5)
    bx.set_ylabel("relative error / base quantizer's (median over steps)")
    bx.set_title("error ratio per weight matrix")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("train", "overhead", "report"), default="train",
                        help="train (under MPI), overhead (one process), report (re-render "
                             "the md and png from the JSON)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default="full")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--start", type=int, default=20, help="first measured step")
    parser.add_argument("--every", type=int, default=5, help="measure every this many steps")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank")
    parser.add_argument("--layers", type=int, default=None, help="override n_layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5, help="timed calls (overhead)")
    parser.add_argument("-J", "--json", default="perf/results/geo_real_gradients.json")
    args = parser.parse_args(argv)
    path = Path(args.json)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv)
    if args.part == "report":
        write_outputs(json.loads(path.read_text()), path)
        return 0
    if args.part == "overhead":
        result = json.loads(path.read_text()) if path.exists() else {}
        result["overhead"] = run_overhead(args) | {"command": command}
        write_outputs(result, path)
        print(json.dumps(result["overhead"]["rows"], indent=1))
        return 0
    result = run_training(args)
    if result:
        old = json.loads(path.read_text()) if path.exists() else {}
        if "overhead" in old:
            result["overhead"] = old["overhead"]
        result = {"command": "python -m geocomm.launch -n "
                  f"{result['world']} --timeout 3600 -- {command}", "args": vars(args), **result}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_outputs(result, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
