"""The oracle: what geocomm's collectives return on N ranks, computed in one process.

:func:`simulate_allreduce` / :func:`simulate_reduce_scatter` run the
collectives' algorithm (both quantizations, the owner's own piece exact, the
transforming-codec protocol with its exact side sums and refresh rounds: a
reduce-scatter's summed over ranks, an all-reduce's on every rank alone) on
N simulated ranks, each with its own codec instance, for arrays of any
namespace that speaks the array API (NumPy, array-api-strict, CuPy). What
they return is what :func:`geocomm.allreduce` returns on N real ranks, bit
for bit (tests check that), for round-to-nearest codecs without error
feedback. :func:`roundtrip` is one codec's decode(encode(x)) through its wire
format; :func:`run_refresh_locally` a plan's refresh as one rank alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from geocomm.codecs import Codec, TransformingCodec
from geocomm.codecs.checks import host_array, roundtrip
from geocomm.engine.layout import shard_bounds

__all__ = ["roundtrip", "run_refresh_locally", "simulate_allreduce", "simulate_reduce_scatter"]


def run_refresh_locally(codec: TransformingCodec, plan: Any, values: Any, side_sum: Any) -> None:
    """A plan's refresh as one rank alone runs it: ``values`` is the whole result
    (the rank's shard is everything) and each partial sum is its own total."""
    rounds = codec.refresh(plan, values, 0, side_sum, alone=True)
    value = next(rounds, None)
    while value is not None:
        value = _send(rounds, value)
    codec.flush()


def _ordered_sum(values: Sequence[Any]) -> Any:
    """The collectives' exact sum (:func:`geocomm.engine.exact.exact_sum`): every rank's
    values added in rank order, whatever the route."""
    total = values[0]
    for other in values[1:]:
        total = total + other
    return total


def _plans(
    codecs: Sequence[Codec], xs: Sequence[Any], shape: tuple[int, ...], key: Any, bounds: Any
) -> tuple[list[Any], list[Any]]:
    """Every rank's plan and mapped flat values (its input when there is no plan),
    after the plans' basis steps (their rounds summed over the ranks in order)."""
    plans, flats, steppers = [], [], []
    for codec, x in zip(codecs, xs, strict=True):
        xp = array_namespace(x)
        flat = xp.reshape(xp.astype(x, xp.float32), (-1,))
        plan = (
            codec.plan(flat, shape, key, bounds) if isinstance(codec, TransformingCodec) else None
        )
        plans.append(plan)
        flats.append(flat)
        if plan is not None and plan.steps:
            assert isinstance(codec, TransformingCodec)  # only those plan
            steppers.append(codec.step(plan, flat))
    if steppers:
        _lockstep(steppers)
    mapped = []
    for plan, flat in zip(plans, flats, strict=True):
        out = flat
        if plan is not None:
            out = array_namespace(flat).empty_like(flat)
            plan.forward(flat, out)
        mapped.append(out)
    return plans, mapped


def _side_sum(plans: Sequence[Any]) -> Any:
    if plans[0] is None or plans[0].side is None:
        return None
    xp = array_namespace(plans[0].side)
    shape = plans[0].side.shape
    return xp.reshape(_ordered_sum([xp.reshape(p.side, (-1,)) for p in plans]), shape)


def _refresh(
    codecs: Sequence[Any],
    plans: Sequence[Any],
    shards: Sequence[Any],
    los: Sequence[int],
    side_sum: Any,
) -> None:
    """Drive every rank's refresh rounds in lockstep, summing their yields in order."""
    if plans[0] is None or not plans[0].refreshes:
        return
    _lockstep(
        [
            c.refresh(p, s, lo, side_sum)
            for c, p, s, lo in zip(codecs, plans, shards, los, strict=True)
        ]
    )
    for c in codecs:
        c.flush()


def _lockstep(rounds: Sequence[Any]) -> None:
    """Drive every rank's generator of rounds in lockstep, summing their yields in order."""
    yields = [next(r, None) for r in rounds]
    while yields[0] is not None:
        xp = array_namespace(yields[0])
        shape = yields[0].shape
        total = xp.reshape(_ordered_sum([xp.reshape(v, (-1,)) for v in yields]), shape)
        yields = [_send(r, total) for r in rounds]


def _send(rounds: Any, total: Any) -> Any:
    try:
        return rounds.send(total)
    except StopIteration:
        return None


def _reduce_shards(
    codecs: Sequence[Codec], mapped: Sequence[Any], bounds: np.ndarray, gather: bool
) -> list[np.ndarray]:
    """Per owner, its shard of the pipeline's sum: its own piece exact, the others
    quantized once, summed in rank order (and re-quantized when ``gather``)."""
    size = len(mapped)
    host = [np.ascontiguousarray(host_array(m), np.float32) for m in mapped]
    shards = []
    for owner, (lo, hi) in enumerate(itertools.pairwise(int(b) for b in bounds)):
        acc = host[owner][lo:hi].copy()
        for rank in range(size):
            if rank != owner:
                acc += roundtrip(codecs[rank], host[rank][lo:hi])
        shards.append(roundtrip(codecs[owner], acc) if gather else acc)
    return shards


def simulate_allreduce(codecs: Sequence[Codec], xs: Sequence[Any], key: Any = None) -> Any:
    """The sum that :func:`geocomm.allreduce` returns on ``len(xs)`` ranks.

    Rank i uses ``codecs[i]`` (its own state, as separate processes would)
    and input ``xs[i]``; shards follow np.array_split. ``key`` None stands for
    the shape, as in the collectives. Returns an array of xs[0]'s namespace and
    shape, identical on every simulated rank (the codecs' states advance).
    """
    size = len(xs)
    xp = array_namespace(*xs)
    shape = tuple(xs[0].shape)
    count = math.prod(shape)
    key = ("shape", shape) if key is None else key
    bounds = shard_bounds(count, size)
    plans, mapped = _plans(codecs, xs, shape, key, bounds)
    total = xp.asarray(np.concatenate(_reduce_shards(codecs, mapped, bounds, gather=True)))
    side_sum = _side_sum(plans)
    if plans[0] is not None:
        plans[0].inverse(total, 0, side_sum)  # identical on every rank: invert once
        if plans[0].refreshes:  # every rank refreshes from the whole result, alone
            for codec, plan in zip(codecs, plans, strict=True):
                assert isinstance(codec, TransformingCodec)  # only those plan
                run_refresh_locally(codec, plan, total, side_sum)
    return xp.reshape(total, shape)


def simulate_reduce_scatter(
    codecs: Sequence[Codec], xs: Sequence[Any], key: Any = None
) -> list[Any]:
    """Every rank's shard that :func:`geocomm.reduce_scatter` returns (flat, in rank order)."""
    size = len(xs)
    xp = array_namespace(*xs)
    shape = tuple(xs[0].shape)
    key = ("shape", shape) if key is None else key
    bounds = shard_bounds(math.prod(shape), size)
    plans, mapped = _plans(codecs, xs, shape, key, bounds)
    shards = [xp.asarray(s) for s in _reduce_shards(codecs, mapped, bounds, gather=False)]
    side_sum = _side_sum(plans)
    los = [int(bounds[r]) for r in range(size)]
    for plan, shard, lo in zip(plans, shards, los, strict=True):
        if plan is not None and shard.shape[0]:
            plan.inverse(shard, lo, side_sum)
    _refresh(codecs, plans, shards, los, side_sum)
    return shards
