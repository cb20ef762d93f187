"""Which tensors GeoFP8 transforms, and at what rank: a pure function of shape and config.

Every rank must make the same choice without talking, so nothing here looks
at values or at the machine. The knobs (defaults in :data:`DEFAULTS`):

* ``budget``: multiply-adds per value and call the geometry may spend. A
  split map of rank k costs 3k per call (project and subtract on the way
  out, add back on the way in) plus 2k every ``refresh`` calls (the basis's
  power step on the call's own gradients: project on the old basis, then
  accumulate), so k = floor(budget / (3 + 2 / refresh)), capped by ``k``
  (inf: no cap but ``k``);
* ``max_side``: bytes of the exact side channel (the summed coefficients and
  the power steps' sums, bfloat16; a frame stores its coefficients and its
  fp32 basis) as a fraction of the quantized payload; k shrinks until it fits
  (inf: never);
* ``min_dim``, ``min_numel``: smaller matrices go plain (the fixed costs of
  a map outweigh what it saves);
* ``min_share``: a tensor whose measured top-k energy share beats a flat
  spectrum's k / min(m, n) by less than this goes plain;
* ``side_budget``: the model-wide cap on side bytes (the coefficients every
  call plus the power steps' sums, per call) as a fraction of the quantized
  payload of every mapped key. Within it, :func:`allocate` gives each key the
  rank k (0: plain) that buys the most error reduction per byte, from the
  spectra the keys' states track; the cap above is then the most a key may
  get. ``side_budget`` of inf gives every key its cap (k as above);
* ``transform``: the geometry. ``split`` sends the top k directions exactly
  and quantizes the rest; ``whiten`` does the same and also scales the next
  ``whiten`` input-side directions of the rest down before quantizing (up
  after), by (bulk / energy) ** ``alpha`` each, from a basis every rank
  measures from the last result (no bytes in an all-reduce); ``auto`` picks
  by ``device`` (:data:`DEVICE_GEOMETRY`);
* ``device``: ``cpu``, ``gpu`` or ``auto`` (the kind of the arrays planned:
  CuPy is a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Defaults, chosen on the tuning half of the gradient zoo (perf/studies/zoo.py;
#: perf/studies/geo_heldout.py, perf/results/geo_heldout.md, which also reports
#: the held-out half): the model-wide side budget of 5% of the payload spends
#: the bytes where the tracked spectra promise most; a basis that takes its
#: power step every call while the geometry turns follows the fast-turning
#: gradients (a fixed period of 4 calls errs more on most sources); the 40
#: multiply-add budget caps a key's split at rank 8; the whitening, where it
#: is asked for, scales 32 more directions by the fourth root of their energy
#: over the bulk's (the exponent that minimizes the error of an isotropic
#: quantizer, docs/design.md "Whitening").
DEFAULTS: dict[str, Any] = {
    "transform": "auto",
    "k": 32,
    "budget": 40.0,
    "refresh": 1,
    "refresh_max": 8,
    "max_side": 0.25,
    "min_dim": 64,
    "min_numel": 16384,
    "min_share": 0.2,
    "side_budget": 0.05,
    "whiten": 32,
    "alpha": 0.25,
    "device": "auto",
    "seed": 0,
}
TRANSFORMS = ("auto", "split", "whiten", "hadamard", "none")
DEVICES = ("auto", "cpu", "gpu")
#: The geometry ``transform="auto"`` applies on each kind of device. The whitening
#: wins at equal bytes on the held-out zoo (the error does not depend on the
#: device) but costs more than either kind's budget: on a host, measured, many
#: times FP8's pass; on a GPU, modelled, past 1.5x FP8's call, its Gram-Schmidt
#: ran on the host at every call (docs/design.md, "Choosing the defaults"). It now
#: runs on the device, but the whitening still picks its directions on the host at
#: every call and no GPU has timed it: both keep the split until one does;
#: ``transform="whiten"`` asks for the whitening anywhere.
DEVICE_GEOMETRY = {"cpu": "split", "gpu": "split"}
#: Whitening exponents: powers of one half, so a scale is a chain of square roots
#: (correctly rounded everywhere: every rank gets the same bits, whatever its libm).
ALPHAS = (0.5, 0.25, 0.125, 0.0625)
#: The smallest whitening scale: the inverse multiplies a direction's share of the
#: quantization error by at most 1 / WHITEN_FLOOR.
WHITEN_FLOOR = 1.0 / 64
#: A rank no cap reaches (``budget`` of inf): above any matrix's rank.
NO_CAP = 1 << 62
#: Bytes of one value on the side channel: coefficients, step and refresh sums travel
#: as bfloat16 (GeoCodec.side_format); a frame's stored basis is fp32 (4).
SIDE_BYTES = 2


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The (m, n) matrix view of ``shape`` ((shape[0], prod(rest))), None for 1-D and scalars."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class MapShape:
    """How one eligible tensor is mapped: its (m, n) view and the rank k of its
    basis (k rows of length n; 0 for the Hadamard rotation)."""

    m: int
    n: int
    k: int


def rank_for_budget(budget: float, refresh: int) -> int:
    """The largest split rank whose cost (3 + 2 / refresh) k fits in ``budget`` (inf: no
    cap, as large as any matrix's rank may be)."""
    if math.isinf(budget):
        return NO_CAP
    return int(budget // (3 + 2 / refresh))


def map_shape(
    shape: Sequence[int], config: dict[str, Any], payload_bytes: int, framed: bool = False
) -> MapShape | None:
    """The map of a tensor of ``shape`` under ``config``, or None (plain quantization).

    ``payload_bytes``: the quantized body of the whole tensor. ``framed``: a
    standalone frame also carries the basis (k (m + n) floats instead of k c).
    Hadamard maps have k = 0.
    """
    mn = matrix_shape(shape)
    if mn is None or config["transform"] == "none":
        return None
    m, n = mn
    if min(m, n) < config["min_dim"] or m * n < config["min_numel"]:
        return None
    if config["transform"] == "hadamard":
        return MapShape(m, n, 0)
    # side bytes per basis vector: in a frame its coefficients and the vector itself,
    # in a collective its coefficients and its power-step sums
    k = min(config["k"], min(m, n) // 2, rank_for_budget(config["budget"], config["refresh"]))
    per_vector: float = SIDE_BYTES * m + 4 * n
    if not framed:
        per_vector = direction_bytes(MapShape(m, n, k), config["refresh"])
    if not math.isinf(config["max_side"]):  # inf: no cap
        k = min(k, int(config["max_side"] * payload_bytes // per_vector))
    return MapShape(m, n, k) if k >= 1 else None


def anisotropic(share: float, dims: MapShape, min_share: float) -> bool:
    """Whether a top-k energy share beats a flat spectrum's k / min(m, n) by ``min_share``."""
    return share - dims.k / min(dims.m, dims.n) >= min_share


def geometry(transform: str, device: str) -> str:
    """The geometry a plan applies: ``transform``, with ``auto`` resolved for the
    kind of ``device`` (``cpu`` or ``gpu``) by :data:`DEVICE_GEOMETRY`."""
    return DEVICE_GEOMETRY[device] if transform == "auto" else transform


def whiten_rows(dims: MapShape, whiten: int) -> tuple[int, int]:
    """(directions whitened, rows of the measured basis they are chosen from) for a
    key of cap ``dims``: at most ``whiten`` and a quarter of the smaller side; the
    basis holds the key's k split rows more, so that r remain once the mapped
    ones are taken out."""
    r = min(whiten, min(dims.m, dims.n) // 4)
    if r < 1:
        return 0, 0
    return r, min(r + dims.k, min(dims.m, dims.n) // 2)


def whiten_scale(energy: float, bulk: float, alpha: float) -> float:
    """The factor a direction of ``energy`` is scaled by before quantizing:
    (bulk / energy) ** alpha, within [WHITEN_FLOOR, 1] (1: no more energy than the
    bulk's mean per direction). ``alpha`` is one of :data:`ALPHAS`: square roots
    only, so every rank computes the same bits."""
    if not (bulk > 0 and energy > bulk and math.isfinite(energy)):
        return 1.0
    scale = bulk / energy
    while alpha < 1.0:
        scale, alpha = math.sqrt(scale), 2 * alpha
    return max(scale, WHITEN_FLOOR)


def direction_bytes(dims: MapShape, period: int) -> float:
    """Side bytes per call of one basis direction of a mapped key: its m
    coefficients every call and its n-value power-step sum every ``period``
    calls (a mapped key's basis steps on the call's own gradients, summed
    over ranks, in an all-reduce as in a reduce-scatter)."""
    return SIDE_BYTES * (dims.m + dims.n / period)


#: A refresh whose new mapped directions keep at least this share of their
#: energy in the old basis's span found the geometry standing still: the
#: key's period doubles (up to ``refresh_max``); below it, the period drops
#: back to ``refresh`` (the gradient is turning).
STABLE_OVERLAP = 0.9


def next_period(period: int, overlap: float, shortest: int, longest: int) -> int:
    """The refresh period after a refresh whose bases overlapped by ``overlap``."""
    return min(2 * period, longest) if overlap >= STABLE_OVERLAP else shortest


@dataclass(frozen=True)
class Spectrum:
    """What a key's state promises: its cap, the energy its result had along each
    tracked direction (best first), the result's whole energy, its payload
    bytes, its refresh period and whether its basis updates sum over ranks."""

    dims: MapShape
    energies: tuple[float, ...]
    total: float
    payload: int
    period: int = 1
    summed: bool = True


def allocate(
    spectra: Mapping[Any, Spectrum], side_budget: float, min_share: float
) -> dict[Any, int]:
    """The rank of every key under one model-wide cap on side bytes.

    A direction j of a key promises the error energy it removes, relative to
    the key's (what the per-matrix error ratio feels) plus relative to the
    mean key's (what the whole model's error feels): e_j / E + e_j / mean(E).
    Directions go, best promise per side byte first, while the bytes (with
    the re-measures of the plain flat keys) stay within ``side_budget`` times
    the payload of all keys; a key's directions
    are taken in order (promises made non-increasing). Keys whose tracked
    share beats a flat spectrum by less than ``min_share`` stay plain. Pure
    Python on values every rank shares, in key order: every rank gets the same.
    """
    keys = sorted(spectra, key=repr)
    totals = [spectra[k].total for k in keys if spectra[k].total > 0]
    if not keys or not totals:
        return dict.fromkeys(keys, 0)
    mean = sum(totals) / len(totals)
    room = side_budget * sum(spectra[k].payload for k in keys)
    offers = []
    spent = 0.0
    for order, key in enumerate(keys):
        sp = spectra[key]
        if sp.total <= 0 or not anisotropic(sum(sp.energies) / sp.total, sp.dims, min_share):
            # plain, but re-measured every period calls: k (m + n) values if summed
            if sp.summed:
                spent += SIDE_BYTES * sp.dims.k * (sp.dims.m + sp.dims.n) / sp.period
            continue
        cost, best = direction_bytes(sp.dims, sp.period), math.inf
        for j, e in enumerate(sp.energies[: sp.dims.k]):
            best = min(best, e / sp.total + e / mean)
            offers.append((-best / cost, order, j, cost))
    offers.sort()
    ranks = dict.fromkeys(keys, 0)
    for _, order, j, cost in offers:
        key = keys[order]
        if ranks[key] == j and spent + cost <= room:
            ranks[key], spent = j + 1, spent + cost
    return ranks
