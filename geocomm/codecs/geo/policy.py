"""Which tensors GeoFP8 transforms, and at what rank: a pure function of shape and config.

Every rank must make the same choice without talking, so nothing here looks
at values or at the machine. The knobs (defaults in :data:`DEFAULTS`):

* ``budget``: multiply-adds per value and call the geometry may spend. A
  split map of rank k costs 3k per call (project and subtract on the way
  out, add back on the way in) plus k every ``refresh`` calls (the basis
  update), so k = floor(budget / (3 + 1 / refresh)), capped by ``k``;
* ``max_side``: bytes of the exact side channel (the summed coefficients,
  fp32) as a fraction of the quantized payload; k shrinks until it fits;
* ``min_dim``, ``min_numel``: smaller matrices go plain (the fixed costs of
  a map outweigh what it saves);
* ``min_share``: a tensor whose measured top-k energy share beats a flat
  spectrum's k / min(m, n) by less than this goes plain (it is re-measured
  every ``refresh`` calls, so it can come back).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Defaults, chosen on real gradients (perf/studies/geo_real_gradients.py; see
#: docs/design.md, "Choosing the defaults"): a right-sided split of rank 12 at
#: a 40 multiply-add budget cuts the error of E4M3 block 128 to about 0.37x on
#: the gradients of the small Llama, and the basis refreshed every 4 calls
#: loses almost nothing against every call (rank 8: 0.490 vs 0.485).
DEFAULTS: dict[str, Any] = {
    "transform": "split",
    "k": 32,
    "budget": 40.0,
    "refresh": 4,
    "max_side": 0.25,
    "min_dim": 64,
    "min_numel": 16384,
    "min_share": 0.2,
    "seed": 0,
}
TRANSFORMS = ("split", "hadamard", "none")


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
    """The largest split rank whose cost (3 + 1 / refresh) k fits in ``budget``."""
    return int(budget // (3 + 1 / refresh))


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
    per_rank = (m + n) if framed else m  # floats per basis vector on the side channel
    k = min(config["k"], min(m, n) // 2, rank_for_budget(config["budget"], config["refresh"]))
    k = min(k, int(config["max_side"] * payload_bytes // (4 * per_rank)))
    return MapShape(m, n, k) if k >= 1 else None


def anisotropic(share: float, dims: MapShape, min_share: float) -> bool:
    """Whether a top-k energy share beats a flat spectrum's k / min(m, n) by ``min_share``."""
    return share - dims.k / min(dims.m, dims.n) >= min_share
