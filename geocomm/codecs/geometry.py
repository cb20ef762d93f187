"""Geometry-aware coordinates for gradient matrices: the GeoFP8 codecs.

A :class:`GeoCodec` wraps a quantizer (``FP8Codec`` or ``NVFP4Codec``) and,
for an eligible tensor, moves it into coordinates where it is closer to
isotropic before quantizing. A tensor of shape ``(m, *rest)`` is viewed as
the row-major matrix ``(m, n)``, ``n = prod(rest)``; 1-D tensors and scalars
always go plain.

Contract with the collective (DESIGN section 5)::

    plan = codec.begin(x, key, allreduce_sum)   # collective: same order on every rank
    y = plan.forward(x_flat)                    # quantized, summed over ranks, ...
    s = plan.inverse(sum_flat)                  # the sum in the original coordinates
    codec.end(key, plan, s)                     # state update; s identical on all ranks

Every rank applies the same linear map T, so ``sum_i T(G_i) = T(sum_i G_i)``.
Transforms (``transform=``), with orthonormal U (m x k), V (n x k):

* ``none``: no transform (the plain quantizer).
* ``hadamard``: randomized Walsh-Hadamard rotation of every row (the
  incoherence baseline). For n not a power of two, p = 2**floor(log2 n) and
  two rotations of size p act on columns [0, p) and then [n-p, n); the map is
  orthogonal and keeps the size. Signs come from ``seed``; no state.
* ``whiten``: ``T(X) = (I + U diag(d-1) U^T) X (I + V diag(d-1) V^T)`` with
  ``d_i = clip((bulk / lambda_i) ** alpha, d_min, 1)``, lambda_i the energy
  of direction i, bulk the mean energy of the other min(m, n) - k directions
  (floored at ``BULK_FLOOR`` times the mean energy per direction, so the
  empty directions of a rank-deficient gradient keep d = 1: shrinking them
  gains nothing and would amplify their quantization error in ``T^-1``).
  ``T^-1`` uses 1/d (exact because U and V are orthonormal).
* ``split``: the top-k coefficients ``C = U^T X V`` are summed exactly in
  fp32, the residual ``X - U C V^T`` is quantized and ``T^-1(Y) = Y + U (sum
  C) V^T``. With ``refresh="current"`` the summed C falls out of the power
  step at no extra cost; with ``"past"`` it is one k x k ``allreduce_sum``.

Sides (``sides=``): ``both`` as above; ``right`` maps X -> X (I + V diag(d-1)
V^T) (whiten), or quantizes X - X V V^T and sums the row coefficients X V
(m x k) exactly (split); ``left`` likewise with U^T X (k x n). One-sided
split keeps everything of X inside span(V), not just U^T X V, so with a
basis from past results (m x k values per rank) it captures as much as a
current two-sided refresh (k (m + n) values); the right side is the layer
input side, whose dominant directions move least between steps.

Basis refresh (``refresh=``): ``current`` runs one warm-started power step on
this step's gradient (``allreduce_sum`` of G_i V (m x k, plus one random
probe column that estimates the bulk energy) and then of G_i^T U (n x k);
orthonormalize with QR, then a Rayleigh-Ritz rotation so that U^T G V is
diagonal); ``past`` updates basis and energies in ``end`` from the reduced
result only (zero extra collectives; the key goes plain until it has a
basis). A current refresh with ``sides="right"`` runs the power step right
side first, so the summed X V comes out of it. A key's first refresh starts from a
fixed-seed random basis and runs ``COLD_ITERS`` power iterations. With
``key=None`` there is no state: every call refreshes from a cold start
(collectively when ``allreduce_sum`` is given, else on x alone). Without a
communicator (``allreduce_sum=None``) a key behaves as in a 1-rank world.

Selective application (per tensor; decided from shape, config and state only,
so identically on every rank): shape below ``min_dim``/``min_numel`` goes
plain; the rank is lowered from ``k`` until the side-channel bytes fit in
``max_side`` times the quantized payload (plain when no rank fits); once the
top-k energy share has been measured, a tensor whose share exceeds that of a
flat spectrum (k / min(m, n)) by less than ``min_share`` goes plain (its
state keeps being refreshed for free in ``end``, so it can come back); a
current refresh that measures such a share leaves this call untransformed
as well.

Guard rails: the first ``warmup`` calls of a key use no transform and only
refresh state. Non-finite entries are zeroed before the map and written back
at their positions after it (forward and inverse alike), so they stay
visible in the result; ``end`` skips the update when the result is not
finite. All-zero sums leave the state untouched.

Reduce-scatter (``begin_shards``): the owner of flat range [lo, hi) only sees
that range, so the map is right-sided and acts on the rows entirely inside
each shard of ``bounds`` (rows cut by a boundary stay untransformed):
``X_rows -> X_rows (I + V diag(d-1) V^T)`` (whiten), ``X_rows - X_rows V V^T``
with the summed row coefficients ``X V`` (m x k) kept exactly (split), the
row rotation (hadamard). With ``refresh="current"`` the power step runs
right side first, so those coefficients come out of it; the state is
committed in ``begin_shards`` (reduce-scatter has no common result for
``end``; a key skipped for low anisotropy refreshes every
``SHARD_REMEASURE`` calls instead). With ``"past"`` the basis comes from
earlier all-reduces of the same key; a key without one, or whose basis is
``SHARD_REMEASURE`` calls old (a key only ever reduce-scattered), runs the
collective right-first refresh first. Split sums X V in one
``allreduce_sum``. ``plan.inverse_range(values, lo, hi)`` inverts one shard.

Standalone frames: ``encode`` computes the basis from x itself (no state)
and the frame body is ``[u32 flag][side channel, fp32][quantized body]``; the
side channel is the bases of the mapped sides (U and/or V) followed by their d
vectors (whiten) or by C (split: k x k, m x k or k x n), so ``decode`` needs
no state. Flag 0 means no transform (side zero-filled).
Hadamard frames and tensors the rule leaves plain hold the quantized body
alone.

Numerics: every array on the wire path is float32; float64 only for k x k
work and QR. ``state_checksum()`` hashes all state so ranks can compare it.
"""

from __future__ import annotations

import itertools
import math
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from geocomm._layout import shard_bounds
from geocomm.codecs.base import AllreduceSum, Codec
from geocomm.codecs.formats import FP8Codec, NVFP4Codec

TRANSFORMS = ("none", "hadamard", "whiten", "split")
REFRESH = ("current", "past")
SIDES = ("both", "right", "left")
#: power iterations of a key's first refresh (from a fixed-seed random start)
COLD_ITERS = 2
#: random probe columns appended to a collective power step to estimate the bulk
#: energy; one suffices: the tail spreads over many directions and d depends on
#: bulk ** alpha only
PROBES = 1
#: a reduce-scatter key skipped for low anisotropy refreshes every this many calls
SHARD_REMEASURE = 16
#: whitening's bulk energy is at least this fraction of the mean energy per direction
BULK_FLOOR = 1e-4

_F32 = np.float32
_FLAG = struct.Struct("<I")

# The geometry knobs and their defaults (the quantizer's own knobs come first),
# chosen on real gradients: perf/geo_real_gradients.py, results and commands in
# perf/results/geo_real_gradients.md (3.3M-parameter byte-level Llama, 2 MPI
# ranks, both quantizations, medians over its 30 weight matrices and 20
# steps). Whitening both sides in the basis tracked from past reduced results
# sends no extra bytes and cuts the error to 0.36x of E4M3 block 128's at
# k = 64 (0.42x at k = 32, 0.34x at k = 128 for twice the arithmetic), the
# error outside the top-4 subspace likewise; geonvfp4 gets 0.37x of NVFP4's.
# alpha = 1/8 is the optimum (1/16: 0.49x, 1/4: 0.53x, 1/2: 3.4x, as full
# whitening blows up the error inside the top subspace); d_min is never
# reached. Split coefficients and current refreshes buy more (one-sided
# split, past basis, k = 32: 0.13x) only with side channels of 10-80% of the
# payload on 256-wide matrices, and their 5%-budget versions stay at
# 0.48-0.68x: real gradients' dominant subspace moves slowly, so a past basis
# loses little. max_side bounds the side channel of the transforms that have
# one at the 5% of the issue; k is capped at min(m, n) / 2.
GEOMETRY_DEFAULTS: dict[str, Any] = {
    "transform": "whiten",
    "k": 64,
    "alpha": 0.125,
    "d_min": 0.125,
    "refresh": "past",
    "sides": "both",
    "min_dim": 64,
    "min_numel": 16384,
    "max_side": 0.05,
    "min_share": 0.2,
    "warmup": 0,
    "seed": 0,
}


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The (m, n) matrix view of ``shape``, or None for 1-D tensors and scalars."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def _masked(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``fn(x)`` on x with non-finite entries zeroed, those entries written back after.

    ``fn`` must return a new array. Keeps a rank's inf/NaN visible in what it
    sends and in the result, instead of spreading along rows and columns.
    """
    bad = ~np.isfinite(x)
    if not bad.any():
        return fn(x)
    out = fn(np.where(bad, _F32(0), x))
    out[bad] = x[bad]
    return out


def _finite(x: np.ndarray) -> np.ndarray:
    """x with non-finite entries replaced by 0 (x itself when all finite)."""
    good = np.isfinite(x)
    return x if good.all() else np.where(good, x, _F32(0))


def _orth(a: np.ndarray) -> np.ndarray:
    """Orthonormal float32 basis of the column space of ``a`` (Householder QR in fp64).

    Q is orthonormal even when ``a`` is rank deficient or zero.
    """
    q, _ = np.linalg.qr(np.asarray(a, np.float64))
    return q.astype(_F32)


def _random_basis(rows: int, k: int, seed: int) -> np.ndarray:
    """Fixed-seed orthonormal (rows x k) start: identical on every rank."""
    rng = np.random.default_rng([seed, rows, k, 0x5354])
    return _orth(rng.standard_normal((rows, k)))


def _factors(sigma2: np.ndarray, bulk: float, alpha: float, d_min: float,
             directions: int) -> np.ndarray:
    """d_i = clip((bulk / lambda_i) ** alpha, d_min, 1); 1 for directions without energy.

    ``directions`` = min(m, n); bulk is floored at ``BULK_FLOOR`` times the mean
    energy per direction.
    """
    mean = (float(sigma2.sum()) + bulk * max(directions - sigma2.size, 0)) / directions
    bulk = max(bulk, BULK_FLOOR * mean)
    ratio = np.divide(bulk, sigma2, out=np.ones_like(sigma2), where=sigma2 > 0)
    return np.clip(ratio**alpha, d_min, 1.0).astype(_F32)


# ---------------------------------------------------------------------------
# the maps: apply(rows, r0, inverse) on a block of full rows starting at row r0


def _fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalized Sylvester Walsh-Hadamard transform of every row (length 2**j)."""
    r, p = x.shape
    y = x
    h = 1
    while h < p:
        y = y.reshape(r, p // (2 * h), 2, h)
        y = np.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), axis=2)
        h *= 2
    return y.reshape(r, p)


class _HadamardMap:
    """Randomized Hadamard rotation of each row of length n (orthogonal, size kept)."""

    def __init__(self, n: int, seed: int):
        self.n = n
        self.p = 1 << (n.bit_length() - 1)
        rng = np.random.default_rng([seed, n, 0x4841])
        count = 1 if self.p == n else 2
        self.signs = [rng.choice(np.array([-1, 1], _F32), self.p) for _ in range(count)]
        self.scale = _F32(1 / math.sqrt(self.p))

    def apply(self, x: np.ndarray, r0: int, inverse: bool) -> np.ndarray:
        y = np.array(x, _F32)
        parts = list(zip((0, self.n - self.p), self.signs, strict=False))
        for start, signs in reversed(parts) if inverse else parts:
            cols = slice(start, start + self.p)
            if inverse:
                y[:, cols] = _fwht(y[:, cols]) * self.scale * signs
            else:
                y[:, cols] = _fwht(y[:, cols] * signs) * self.scale
        return y


class _WhitenMap:
    """(I + U diag(dL-1) U^T) X (I + V diag(dR-1) V^T); a side whose basis is None is skipped."""

    def __init__(self, u: np.ndarray | None, d_left: np.ndarray | None,
                 v: np.ndarray | None, d_right: np.ndarray | None):
        self.u, self.d_left, self.v, self.d_right = u, d_left, v, d_right

    def apply(self, x: np.ndarray, r0: int, inverse: bool) -> np.ndarray:
        y = x
        if self.u is not None:
            f = (1 / self.d_left - 1) if inverse else (self.d_left - 1)
            y = y + self.u @ (f[:, None] * (self.u.T @ y))
        if self.v is not None:
            f = (1 / self.d_right - 1) if inverse else (self.d_right - 1)
            y = y + ((y @ self.v) * f) @ self.v.T
        return y

    def side_arrays(self) -> list[np.ndarray]:
        return [a for a in (self.u, self.v, self.d_left, self.d_right) if a is not None]


class _SplitMap:
    """Residual X - U U^T X V V^T; inverse adds U C V^T with the summed C (k x k).

    One-sided: with U None the residual is X - X V V^T and C holds the summed
    row coefficients X V (m x k), the inverse adds C[rows] V^T (row-local, so
    reduce-scatter shards use it); with V None the residual is X - U U^T X,
    C the summed U^T X (k x n) and the inverse adds U C (whole matrix only).
    """

    def __init__(self, u: np.ndarray | None, v: np.ndarray | None, coeffs: np.ndarray):
        self.u, self.v, self.coeffs = u, v, coeffs

    def apply(self, x: np.ndarray, r0: int, inverse: bool) -> np.ndarray:
        if self.u is None:
            if inverse:
                return x + self.coeffs[r0 : r0 + x.shape[0]] @ self.v.T
            return x - (x @ self.v) @ self.v.T
        if self.v is None:
            return x + self.u @ self.coeffs if inverse else x - self.u @ (self.u.T @ x)
        if inverse:
            return x + (self.u @ self.coeffs) @ self.v.T
        return x - (self.u @ ((self.u.T @ x) @ self.v)) @ self.v.T

    def side_arrays(self) -> list[np.ndarray]:
        return [a for a in (self.u, self.v, self.coeffs) if a is not None]


# ---------------------------------------------------------------------------
# plans


class GeoPlan:
    """A :class:`~geocomm.codecs.base.TransformPlan` over the whole (m, n) matrix.

    ``side_bytes``: bytes this rank sent through ``allreduce_sum`` for it.
    """

    def __init__(self, rowmap: Any, m: int, n: int, side_bytes: int = 0,
                 step: _Step | None = None):
        self.map, self.m, self.n, self.side_bytes = rowmap, m, n, side_bytes
        self.step = step  # a refresh to commit in end() once the result is known finite

    def _run(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        a = np.asarray(x, _F32).reshape(self.m, self.n)
        return _masked(lambda b: self.map.apply(b, 0, inverse), a).reshape(-1)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """T(x) of this rank's flat float32 values (a new array)."""
        return self._run(x, False)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """T^-1 of the flat sum over ranks (a new array)."""
        return self._run(y, True)


class GeoShardPlan:
    """Right-sided map on the full rows inside each shard [bounds[j], bounds[j+1]).

    ``forward`` transforms every shard region of the flat array;
    ``inverse_range(values, lo, hi)`` inverts one shard (lo, hi consecutive
    entries of ``bounds``); ``inverse`` inverts all of them.
    """

    def __init__(self, rowmap: Any, m: int, n: int, bounds: Sequence[int], side_bytes: int = 0):
        self.map, self.m, self.n, self.side_bytes = rowmap, m, n, side_bytes
        self.bounds = [int(b) for b in bounds]
        self._shards = set(itertools.pairwise(self.bounds))

    def _apply(self, buf: np.ndarray, lo: int, hi: int, base: int, inverse: bool) -> None:
        """Map the rows entirely inside [lo, hi) of ``buf`` (which starts at ``base``)."""
        r0, r1 = -(-lo // self.n), hi // self.n
        if r1 <= r0:
            return
        seg = buf[r0 * self.n - base : r1 * self.n - base].reshape(r1 - r0, self.n)
        seg[...] = _masked(lambda b: self.map.apply(b, r0, inverse), seg)

    def forward(self, x: np.ndarray) -> np.ndarray:
        out = np.array(x, _F32).reshape(-1)
        for lo, hi in sorted(self._shards):
            self._apply(out, lo, hi, 0, False)
        return out

    def inverse(self, y: np.ndarray) -> np.ndarray:
        out = np.array(y, _F32).reshape(-1)
        for lo, hi in sorted(self._shards):
            self._apply(out, lo, hi, 0, True)
        return out

    def inverse_range(self, values: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """T^-1 of the summed flat range [lo, hi), one shard of ``bounds``."""
        if (lo, hi) not in self._shards:
            raise ValueError(f"[{lo}, {hi}) is not a shard of bounds {self.bounds}")
        out = np.array(values, _F32).reshape(-1)
        if out.size != hi - lo:
            raise ValueError(f"values has {out.size} entries, the range holds {hi - lo}")
        self._apply(out, lo, hi, lo, True)
        return out


# ---------------------------------------------------------------------------
# the power step and the per-key state


@dataclass
class _Step:
    """Result of a power step on G = sum over ranks of the local g (m x n)."""

    u: np.ndarray  # (m, k) float32, orthonormal, ordered by energy
    v: np.ndarray  # (n, k) float32
    coeffs: np.ndarray  # (k, k) float64: U^T G V (diagonal up to rounding)
    second: np.ndarray  # (rows, k) float32: G^T U, or G V for a right-first step
    sigma2: np.ndarray  # (k,) float64 energies of the directions
    bulk: float  # mean energy of the other min(m, n) - k directions
    share: float  # top-k energy share sum(sigma2) / ||G||^2
    total: float  # ||G||^2 (estimated from probes in a collective step)
    sent: int  # bytes this rank passed to allreduce_sum

    def transposed(self) -> _Step:
        return _Step(self.v, self.u, self.coeffs.T, self.second, self.sigma2, self.bulk,
                     self.share, self.total, self.sent)


def _sum_squares(g: np.ndarray, slab_values: int = 1 << 18) -> float:
    """sum(g**2) accumulated in float64, a slab of rows at a time (no full copy)."""
    total, rows = 0.0, max(1, slab_values // max(g.shape[1], 1))
    for lo in range(0, g.shape[0], rows):
        slab = g[lo : lo + rows].astype(np.float64).ravel()
        total += float(slab @ slab)
    return total


def _power_step(g: np.ndarray, start: np.ndarray, reduce: AllreduceSum | None, iters: int,
                probe_seed: Sequence[int]) -> _Step | None:
    """Warm-started power iterations on G = sum over ranks of g, then Rayleigh-Ritz.

    ``start`` (n x k) is the shared warm start of the right basis. With
    ``reduce`` None, g is G itself and its energy is exact; otherwise every
    ``g @ .`` is summed with ``reduce`` and the bulk energy is estimated from
    ``PROBES`` random columns (E[Omega Omega^T] = I). Returns None (on every
    rank alike) when a summed projection is not finite.
    """
    m, n = g.shape
    k = start.shape[1]
    v, sent = start, 0
    for it in range(iters):
        right = v
        if reduce is not None and it == iters - 1:
            omega = np.random.default_rng(list(probe_seed)).standard_normal((n, PROBES))
            right = np.concatenate([v, omega.astype(_F32)], axis=1)
        p = g @ right
        if reduce is not None:
            p = reduce(p)
            sent += p.nbytes
        if not np.isfinite(p).all():
            return None
        u = _orth(p[:, :k])
        w = g.T @ u
        if reduce is not None:
            w = reduce(w)
            sent += w.nbytes
        if not np.isfinite(w).all():
            return None
        v = _orth(w)
    w64 = w.astype(np.float64)
    c = w64.T @ v  # U^T G V, since G^T U = W
    uc, s, vct = np.linalg.svd(c)
    u = (u.astype(np.float64) @ uc).astype(_F32)
    v = (v.astype(np.float64) @ vct.T).astype(_F32)
    second = (w64 @ uc).astype(_F32)
    coeffs = uc.T @ c @ vct.T
    energy_left = float(np.sum(w64 * w64))  # ||U^T G||^2
    if reduce is None:
        rest = _sum_squares(g) - energy_left
    else:
        probes = p[:, k:].astype(np.float64)
        q = probes - u.astype(np.float64) @ (u.astype(np.float64).T @ probes)
        rest = float(np.sum(q * q)) / PROBES
    rest = max(rest, 0.0)
    total = energy_left + rest
    sigma2 = s * s
    share = float(sigma2.sum() / total) if total > 0 else 0.0
    bulk = rest / max(min(m, n) - k, 1)
    return _Step(u, v, coeffs, second, sigma2, bulk, share, total, sent)


@dataclass
class _KeyState:
    m: int
    n: int
    k: int
    steps: int = 0
    u: np.ndarray | None = None
    v: np.ndarray | None = None
    sigma2: np.ndarray | None = None
    bulk: float = 0.0
    share: float | None = None  # None until measured
    pending: bool = False  # end() refreshes from the result
    refreshed: int = 0  # steps at the last committed refresh

    def commit(self, step: _Step) -> None:
        if step.total > 0:  # an all-zero sum says nothing about the geometry
            self.u, self.v, self.sigma2 = step.u, step.v, step.sigma2
            self.bulk, self.share = step.bulk, step.share
            self.refreshed = self.steps

    def arrays(self) -> list[np.ndarray]:
        head = np.array([self.m, self.n, self.k, self.steps, self.refreshed], np.int64)
        tail = np.array([self.bulk, -1.0 if self.share is None else self.share], np.float64)
        return [a for a in (head, self.u, self.v, self.sigma2, tail) if a is not None]


# ---------------------------------------------------------------------------
# codecs


class GeoCodec(Codec):
    """A quantizer preceded by a geometry transform (see the module docstring).

    Knobs: ``transform`` (none|hadamard|whiten|split), ``k`` (largest rank),
    ``alpha`` and ``d_min`` (whiten factors), ``refresh`` (current|past),
    ``min_dim``/``min_numel`` (smallest eligible matrix), ``max_side`` (side
    channel budget as a fraction of the quantized payload), ``min_share``
    (smallest top-k energy share beyond a flat spectrum's worth a transform),
    ``sides`` (both|right|left: the sides the map acts on), ``warmup`` (identity
    calls per key), ``seed`` (shared randomness). Per-key state lives in the
    codec; ``state_checksum()`` hashes it, ``reset_state()`` drops it.
    """

    codec_id: ClassVar[str] = "geo"
    #: knobs listed in get_config (subclasses may expose fewer)
    _fields: ClassVar[tuple[str, ...]] = tuple(GEOMETRY_DEFAULTS)

    def __init__(self, quantizer: Codec, *, transform: str = GEOMETRY_DEFAULTS["transform"],
                 k: int = GEOMETRY_DEFAULTS["k"], alpha: float = GEOMETRY_DEFAULTS["alpha"],
                 d_min: float = GEOMETRY_DEFAULTS["d_min"],
                 refresh: str = GEOMETRY_DEFAULTS["refresh"],
                 sides: str = GEOMETRY_DEFAULTS["sides"],
                 min_dim: int = GEOMETRY_DEFAULTS["min_dim"],
                 min_numel: int = GEOMETRY_DEFAULTS["min_numel"],
                 max_side: float = GEOMETRY_DEFAULTS["max_side"],
                 min_share: float = GEOMETRY_DEFAULTS["min_share"],
                 warmup: int = GEOMETRY_DEFAULTS["warmup"], seed: int = GEOMETRY_DEFAULTS["seed"]):
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
        if refresh not in REFRESH:
            raise ValueError(f"refresh must be one of {REFRESH}, got {refresh!r}")
        if sides not in SIDES:
            raise ValueError(f"sides must be one of {SIDES}, got {sides!r}")
        self.quantizer = quantizer
        self.transform, self.refresh, self.sides = transform, refresh, sides
        self.k = _check_int("k", k, 1)
        self.min_dim = _check_int("min_dim", min_dim, 1)
        self.min_numel = _check_int("min_numel", min_numel, 0)
        self.warmup = _check_int("warmup", warmup, 0)
        self.seed = _check_int("seed", seed, 0)
        self.alpha = _check_float("alpha", alpha, 0.0, 1.0)
        self.d_min = _check_float("d_min", d_min, 0.0, 1.0, low_open=True)
        self.max_side = _check_float("max_side", max_side, 0.0, math.inf)
        self.min_share = _check_float("min_share", min_share, 0.0, 1.0)
        self._state: dict[Any, _KeyState] = {}
        self._hadamards: dict[int, _HadamardMap] = {}

    # ---- configuration ---------------------------------------------------
    def _quantizer_config(self) -> dict[str, Any]:
        config = self.quantizer.get_config()
        config.pop("id")
        return config

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, **self._quantizer_config(),
                **{name: getattr(self, name) for name in self._fields}}

    # ---- wire API: the quantizer's -----------------------------------------
    def wire_size(self, n: int) -> int:
        return self.quantizer.wire_size(n)

    def encode_wire(self, x: np.ndarray, wire: np.ndarray) -> None:
        self.quantizer.encode_wire(x, wire)

    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        self.quantizer.decode_wire(wire, out, accumulate)

    # ---- selective application ------------------------------------------------
    def side_bytes(self, m: int, n: int, k: int, framed: bool = False) -> int:
        """Side-channel bytes per rank and call (or per frame) at rank k.

        current refresh: the two power-step sums (k (m + n) values plus the
        probe column); past: the exact split coefficients (k x k, or m x k
        and k x n for one side), nothing for whiten.
        """
        if framed:
            return 4 * sum(math.prod(s) for s in self._side_shapes(m, n, k))
        if self.refresh == "current":
            return 4 * (k * (m + n) + PROBES * (n if self.sides == "right" else m))
        if self.transform == "whiten":
            return 0
        return 4 * k * {"both": k, "right": m, "left": n}[self.sides]

    def layout(self, shape: Sequence[int], framed: bool = False) -> tuple[int, int, int] | None:
        """(m, n, k) when a tensor of ``shape`` gets a transform, else None.

        k is the largest rank <= ``self.k`` (and <= min(m, n) / 2) whose side
        channel fits in ``max_side`` times the quantized payload; 0 for hadamard.
        """
        mn = matrix_shape(shape)
        if mn is None or self.transform == "none":
            return None
        m, n = mn
        if min(m, n) < self.min_dim or m * n < self.min_numel:
            return None
        if self.transform == "hadamard":
            return m, n, 0
        budget = self.max_side * self.quantizer.wire_size(m * n)
        k = min(self.k, min(m, n) // 2)
        while k > 0 and self.side_bytes(m, n, k, framed) > budget:
            k -= 1
        return (m, n, k) if k > 0 else None

    def _anisotropic(self, share: float, lay: tuple[int, int, int]) -> bool:
        """Whether a top-k energy share beats a flat spectrum's k / min(m, n) by min_share."""
        m, n, k = lay
        return share - k / min(m, n) >= self.min_share

    def _hadamard(self, n: int) -> _HadamardMap:
        if n not in self._hadamards:
            self._hadamards[n] = _HadamardMap(n, self.seed)
        return self._hadamards[n]

    def _state_for(self, key: Any, m: int, n: int, k: int) -> _KeyState:
        st = self._state.get(key)
        if st is None or (st.m, st.n, st.k) != (m, n, k):
            st = self._state[key] = _KeyState(m, n, k)
        return st

    def _refresh(self, g: np.ndarray, st: _KeyState | None, k: int,
                 reduce: AllreduceSum | None, right_first: bool = False) -> _Step | None:
        """Power step on sum_i g_i warm-started from ``st`` (fixed-seed cold start if none)."""
        m, n = g.shape
        steps = st.steps if st is not None else 0
        if right_first:
            g = g.T
        warm = None if st is None else (st.u if right_first else st.v)
        start = _random_basis(g.shape[1], k, self.seed) if warm is None else warm
        iters = COLD_ITERS if warm is None else 1
        step = _power_step(g, start, reduce, iters, (self.seed, steps, m, n, int(right_first)))
        if step is not None and right_first:
            step = step.transposed()
        return step

    def _map(self, step_or_state: _Step | _KeyState, sides: str | None = None,
             coeffs: np.ndarray | None = None) -> _WhitenMap | _SplitMap:
        """The whiten or split map on ``sides`` (default ``self.sides``) from a
        refresh (its energies) or a state; ``coeffs``: the summed split coefficients."""
        s, sides = step_or_state, sides or self.sides
        u = None if sides == "right" else s.u
        v = None if sides == "left" else s.v
        if self.transform == "whiten":
            directions = min(s.u.shape[0], s.v.shape[0])
            d = _factors(s.sigma2, s.bulk, self.alpha, self.d_min, directions)
            return _WhitenMap(u, None if u is None else d, v, None if v is None else d)
        return _SplitMap(u, v, np.asarray(coeffs, _F32))

    def _coefficients(self, g: np.ndarray, st: _KeyState) -> np.ndarray:
        """This rank's split coefficients in the basis of ``st``: U^T g V, g V or U^T g."""
        if self.sides == "right":
            return g @ st.v
        if self.sides == "left":
            return st.u.T @ g
        return st.u.T @ g @ st.v

    def _step_coefficients(self, step: _Step) -> np.ndarray:
        """The summed split coefficients a power step yields for free.

        Two-sided: U^T G V; right: G V (``second`` of a right-first step);
        left: U^T G (``second`` of a left-first step is G^T U).
        """
        if self.sides == "right":
            return step.second
        if self.sides == "left":
            return step.second.T
        return step.coeffs

    # ---- geometry hooks ---------------------------------------------------------
    def begin(self, x: np.ndarray, key: Any, allreduce_sum: AllreduceSum | None) -> GeoPlan | None:
        """Plan for ``x`` (float32, caller's shape) or None (plain quantization).

        Collective: the calls of ``allreduce_sum`` depend only on shape, config
        and state, never on the values, so every rank makes the same ones.
        """
        lay = self.layout(np.shape(x))
        if lay is None:
            return None
        m, n, k = lay
        if self.transform == "hadamard":
            return GeoPlan(self._hadamard(n), m, n)
        g = _finite(np.asarray(x, _F32).reshape(m, n))
        right_first = self.sides == "right"
        if key is None:  # no state: this gradient alone, from a cold start
            step = self._refresh(g, None, k, allreduce_sum, right_first)
            return self._current_plan(step, m, n, commit=False)
        st = self._state_for(key, m, n, k)
        st.steps += 1
        active = st.steps > self.warmup and (st.share is None or self._anisotropic(st.share, lay))
        if self.refresh == "current":
            step = self._refresh(g, st, k, allreduce_sum, right_first) if active else None
            plan = self._current_plan(step, m, n)
            st.pending = step is None  # otherwise end() commits the plan's step
            return plan
        st.pending = True
        if not active or st.u is None:
            return None
        if self.transform == "whiten":
            return GeoPlan(self._map(st), m, n)
        coeffs = self._coefficients(g, st)
        side = 0
        if allreduce_sum is not None:
            coeffs = allreduce_sum(coeffs)
            side = coeffs.nbytes
        return GeoPlan(self._map(st, coeffs=coeffs), m, n, side)

    def _current_plan(self, step: _Step | None, m: int, n: int,
                      commit: bool = True) -> GeoPlan | None:
        """The plan of a fresh refresh; None when it failed or found no anisotropy.

        With ``commit`` a plan without a transform still carries the refresh
        for ``end`` to commit (an identity map).
        """
        if step is None:
            return None
        worth = step.total > 0 and self._anisotropic(step.share, (m, n, step.u.shape[1]))
        if not (worth or commit):
            return None
        rowmap = self._map(step, coeffs=self._step_coefficients(step)) if worth else _Identity()
        return GeoPlan(rowmap, m, n, step.sent, step if commit else None)

    def begin_shards(self, x: np.ndarray, key: Any, allreduce_sum: AllreduceSum | None,
                     bounds: Sequence[int]) -> GeoShardPlan | None:
        """Shard-local (right-sided) plan for reduce-scatter over ``bounds``.

        ``bounds``: the N+1 flat offsets of the shards (np.array_split). State
        is committed here, as reduce-scatter has no common result for ``end``.
        """
        lay = self.layout(np.shape(x))
        if lay is None:
            return None
        m, n, k = lay
        bounds = [int(b) for b in bounds]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != m * n or any(
                a > b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"bounds {bounds} do not split {m * n} values into shards")
        if self.transform == "hadamard":
            return GeoShardPlan(self._hadamard(n), m, n, bounds)
        g = _finite(np.asarray(x, _F32).reshape(m, n))
        st = None if key is None else self._state_for(key, m, n, k)
        if st is not None:
            st.steps += 1
            low = st.share is not None and not self._anisotropic(st.share, lay)
            # no end() re-measures a skipped tensor here: a refresh does, now and then
            if st.steps <= self.warmup or (low and st.steps % SHARD_REMEASURE):
                return None
        if key is None or self.refresh == "current":
            step = self._refresh(g, st, k, allreduce_sum, right_first=True)
            if step is None:
                return None
            if st is not None:
                st.commit(step)
            if step.total == 0 or not self._anisotropic(step.share, lay):
                return None
            rowmap = self._map(step, "right", coeffs=step.second)
            return GeoShardPlan(rowmap, m, n, bounds, step.sent)
        # past: the basis comes from all-reduce results; a key that only ever meets
        # reduce-scatter refreshes collectively at first and every SHARD_REMEASURE calls
        side = 0
        if st.v is None or st.steps - st.refreshed >= SHARD_REMEASURE:
            step = self._refresh(g, st, k, allreduce_sum, right_first=True)
            if step is None:
                return None
            st.commit(step)
            side = step.sent
            low = st.share is not None and not self._anisotropic(st.share, lay)
        if st.v is None or low:
            return None
        if self.transform == "whiten":
            return GeoShardPlan(self._map(st, "right"), m, n, bounds, side)
        coeffs = g @ st.v
        if allreduce_sum is not None:
            coeffs = allreduce_sum(coeffs)
            side += coeffs.nbytes
        return GeoShardPlan(self._map(st, "right", coeffs=coeffs), m, n, bounds, side)

    def end(self, key: Any, plan: Any, result: np.ndarray) -> None:
        """Refresh the state of ``key`` from the reduced ``result`` (flat, any rank alike).

        Skipped when ``result`` has a non-finite value. A plan from a current
        refresh commits its power step; otherwise (past refresh, warm-up,
        skipped tensors) one power step on ``result`` itself, no collective.
        """
        st = None if key is None else self._state.get(key)
        if st is None or isinstance(plan, GeoShardPlan):
            return
        step = plan.step if isinstance(plan, GeoPlan) else None
        if step is None and not st.pending:
            return
        st.pending = False
        result = np.asarray(result, _F32)
        if result.size != st.m * st.n:
            raise ValueError(f"result has {result.size} values, key {key!r} has {st.m * st.n}")
        if not np.isfinite(result).all():
            return
        if step is None:
            step = self._refresh(result.reshape(st.m, st.n), st, st.k, None)
        if step is not None:
            st.commit(step)

    # ---- state ------------------------------------------------------------------
    def state_checksum(self, key: Any = None) -> int:
        """CRC32 of one key's state, or (key None) of every key's in key order;
        equal on ranks that agree. The collectives' metadata check compares it
        across ranks before every call with a key."""
        crc = 0
        keys = sorted(self._state, key=str) if key is None else [key] * (key in self._state)
        for key in keys:
            crc = zlib.crc32(str(key).encode(), crc)
            for a in self._state[key].arrays():
                crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
        return crc

    def reset_state(self) -> None:
        """Forget every key's geometry."""
        self._state.clear()

    def state_info(self, key: Any) -> dict[str, Any] | None:
        """A copy of the state of ``key`` (None if it has none).

        ``shape`` (m, n), ``k``, ``steps`` (calls so far), ``u``/``v`` (None
        before the first refresh), ``energies`` (sigma_i^2), ``bulk`` and
        ``share`` (top-k energy share; None until measured).
        """
        st = self._state.get(key)
        if st is None:
            return None
        def copy(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a.copy()

        return {"shape": (st.m, st.n), "k": st.k, "steps": st.steps, "u": copy(st.u),
                "v": copy(st.v), "energies": copy(st.sigma2), "bulk": st.bulk,
                "share": st.share}

    # ---- frames -------------------------------------------------------------------
    def _side_shapes(self, m: int, n: int, k: int) -> list[tuple[int, ...]]:
        """Shapes of the frame side channel, in ``side_arrays`` order."""
        bases = {"both": [(m, k), (n, k)], "right": [(n, k)], "left": [(m, k)]}[self.sides]
        if self.transform == "whiten":
            return [*bases, *[(k,)] * len(bases)]
        return [*bases, {"both": (k, k), "right": (m, k), "left": (k, n)}[self.sides]]

    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        body = self.quantizer.wire_size(math.prod(shape))
        lay = self.layout(shape, framed=True)
        if lay is None or self.transform == "hadamard":
            return body
        return _FLAG.size + self.side_bytes(*lay, framed=True) + body

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        lay = self.layout(x.shape, framed=True)
        flat = x.reshape(-1)
        if lay is None or self.transform == "hadamard":
            plan = None if lay is None else GeoPlan(self._hadamard(lay[1]), lay[0], lay[1])
            self.quantizer.encode_wire(flat if plan is None else plan.forward(flat), body)
            return
        m, n, k = lay
        side = _FLAG.size + self.side_bytes(m, n, k, framed=True)
        step = self._refresh(_finite(x.reshape(m, n)), None, k, None, self.sides == "right")
        plan = self._current_plan(step, m, n, commit=False)
        if plan is None:
            body[:side] = 0
            self.quantizer.encode_wire(flat, body[side:])
            return
        body[: _FLAG.size] = np.frombuffer(_FLAG.pack(1), np.uint8)
        pos = _FLAG.size
        for a in plan.map.side_arrays():
            raw = np.ascontiguousarray(a, "<f4").reshape(-1).view(np.uint8)
            body[pos : pos + raw.size] = raw
            pos += raw.size
        self.quantizer.encode_wire(np.ascontiguousarray(plan.forward(flat)), body[side:])

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        lay = self.layout(out.shape, framed=True)
        flat = out.reshape(-1)
        if lay is None or self.transform == "hadamard":
            self.quantizer.decode_wire(body, flat)
            if lay is not None:
                flat[...] = GeoPlan(self._hadamard(lay[1]), lay[0], lay[1]).inverse(flat)
            return
        m, n, k = lay
        side = _FLAG.size + self.side_bytes(m, n, k, framed=True)
        (flag,) = _FLAG.unpack(bytes(body[: _FLAG.size]))
        if flag not in (0, 1):
            raise ValueError(f"GeoFP8 frame flag is {flag}, expected 0 or 1")
        self.quantizer.decode_wire(body[side:], flat)
        if flag == 0:
            return
        arrays, pos = [], _FLAG.size
        for shape in self._side_shapes(m, n, k):
            size = 4 * math.prod(shape)
            arrays.append(body[pos : pos + size].copy().view("<f4").astype(_F32).reshape(shape))
            pos += size
        if not all(np.isfinite(a).all() for a in arrays):
            raise ValueError("GeoFP8 frame side channel holds non-finite values")
        left = None if self.sides == "right" else arrays.pop(0)
        right = None if self.sides == "left" else arrays.pop(0)
        if self.transform == "whiten":
            if any((d <= 0).any() for d in arrays):
                raise ValueError("GeoFP8 frame holds non-positive whitening factors")
            d_left = None if left is None else arrays.pop(0)
            d_right = None if right is None else arrays.pop(0)
            rowmap: Any = _WhitenMap(left, d_left, right, d_right)
        else:
            rowmap = _SplitMap(left, right, arrays[0])
        flat[...] = GeoPlan(rowmap, m, n).inverse(flat)


class _Identity:
    """The identity row map (a plan that only carries a refresh to commit)."""

    def apply(self, x: np.ndarray, r0: int, inverse: bool) -> np.ndarray:
        return np.array(x, _F32)


def _check_int(name: str, value: Any, low: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (low < value if low_open else low <= value) or not value <= high:
        raise ValueError(f"{name} must lie in {'(' if low_open else '['}{low}, {high}], "
                         f"got {value!r}")
    return value


class GeoFP8Codec(GeoCodec):
    """GeoFP8: geometry transform + ``FP8Codec(fmt, block)``."""

    codec_id: ClassVar[str] = "geofp8"

    def __init__(self, fmt: str = "e4m3", block: int = 128, **geometry: Any):
        super().__init__(FP8Codec(fmt, block), **geometry)


class GeoNVFP4Codec(GeoCodec):
    """Geometry transform + NVFP4."""

    codec_id: ClassVar[str] = "geonvfp4"

    def __init__(self, **geometry: Any):
        super().__init__(NVFP4Codec(), **geometry)


class HadamardCodec(GeoCodec):
    """The random-rotation baseline: randomized Hadamard rows + ``FP8Codec(fmt, block)``."""

    codec_id: ClassVar[str] = "hadamard"
    _fields: ClassVar[tuple[str, ...]] = ("seed", "min_dim", "min_numel")

    def __init__(self, fmt: str = "e4m3", block: int = 128, seed: int = 0,
                 min_dim: int = GEOMETRY_DEFAULTS["min_dim"],
                 min_numel: int = GEOMETRY_DEFAULTS["min_numel"]):
        super().__init__(FP8Codec(fmt, block), transform="hadamard", seed=seed,
                         min_dim=min_dim, min_numel=min_numel)


# ---------------------------------------------------------------------------
# single-process reference of the compressed all-reduce (studies and tests)


class ThreadWorld:
    """``size`` simulated ranks in one process: threads meeting in ``allreduce_sum``.

    ``allreduce_sum(rank)`` returns that rank's ordered fp32 sum function.
    """

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[np.ndarray | None] = [None] * size

    def allreduce_sum(self, rank: int) -> AllreduceSum:
        def reduce(values: np.ndarray) -> np.ndarray:
            self._slots[rank] = np.array(values, _F32)
            self._barrier.wait()
            total = self._slots[0].copy()
            for other in self._slots[1:]:
                total += other
            self._barrier.wait()
            return total

        return reduce

    def run(self, fn: Callable[[int, AllreduceSum], Any]) -> list[Any]:
        """fn(rank, allreduce_sum) on every rank at once; the results in rank order."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.allreduce_sum(rank))
            except BaseException as exc:
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _roundtrip(codec: Codec, values: np.ndarray) -> np.ndarray:
    wire = np.empty(codec.wire_size(values.size), np.uint8)
    codec.encode_wire(np.ascontiguousarray(values, _F32), wire)
    out = np.empty(values.size, _F32)
    codec.decode_wire(wire, out)
    return out


def simulate_allreduce(codecs: Sequence[Codec], xs: Sequence[np.ndarray],
                       key: Any = None) -> tuple[np.ndarray, int]:
    """The two-quantization all-reduce of geocomm.collectives, ranks simulated in one process.

    Rank i uses ``codecs[i]`` (its own state, as separate processes would) and
    input ``xs[i]``; shards follow np.array_split. Returns the summed result
    (caller's shape, identical on every simulated rank) and the side-channel
    bytes rank 0 sent. One rank runs without a communicator
    (``allreduce_sum=None``).
    """
    size = len(xs)
    shape = np.shape(xs[0])

    def prepare(rank: int, reduce: AllreduceSum | None) -> tuple[Any, np.ndarray]:
        x = np.asarray(xs[rank], _F32)
        plan = codecs[rank].begin(x, key, reduce)
        flat = x.reshape(-1)
        return plan, (flat if plan is None else plan.forward(flat))

    if size == 1:
        prepared = [prepare(0, None)]
    else:
        prepared = ThreadWorld(size).run(prepare)
    count = math.prod(shape)
    offsets = [int(o) for o in shard_bounds(count, size)]
    total = np.empty(count, _F32)
    for owner, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        acc = np.array(prepared[owner][1][lo:hi], _F32)  # the owner's piece, unquantized
        for rank in range(size):
            if rank != owner:
                acc += _roundtrip(codecs[rank], prepared[rank][1][lo:hi])
        total[lo:hi] = _roundtrip(codecs[owner], acc)
    result = None
    for rank, (plan, _) in enumerate(prepared):
        s = total if plan is None else plan.inverse(total)
        codecs[rank].end(key, plan, s)
        result = s if result is None else result
    side = 0 if prepared[0][0] is None else prepared[0][0].side_bytes
    return result.reshape(shape), side
