"""The exact, node-local steps of the node-aware collectives (docs/design.md,
"Node-aware collectives").

Inside a node every rank owns some ranges of the flat buffer (``ranges[j]``: the
``(lo, hi)`` ranges local rank ``j`` owns, possibly none). :func:`node_reduce`
sums every rank's values of the ranges it owns, in fp32, in local rank order
(rank 0's values, plus rank 1's, ...: the same bits on every device and whatever
the arrival order); :func:`node_allgather` sends every owner's values back to
every rank of the node. Both move fp32 bytes only: nothing inside a node is
quantized. The compressed step between nodes is the collectives' own pipeline, which
:func:`node_allreduce` and :func:`node_reduce_scatter` get as ``across``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from geocomm.comm.base import Communicator, wait, wait_ordered
from geocomm.comm.nodes import NodeComms
from geocomm.engine.arithmetic import add_into
from geocomm.engine.layout import array_module, segments, shard_bounds

Ranges = list[list[tuple[int, int]]]
#: ``across(kind, values, ranges, result, offset)``: the compressed collective
#: ("allreduce" or "reduce_scatter") between nodes of ``values``, the node's sums of
#: ``ranges`` of the buffer end to end, into ``result`` (from index ``offset`` on)
Across = Callable[[str, Any, list[tuple[int, int]], Any, int], None]


def owned(ranges: Ranges, rank: int) -> int:
    """Values local rank ``rank`` owns."""
    return sum(hi - lo for lo, hi in ranges[rank])


def _packed(values: Any, ranges: Ranges) -> tuple[Any, list[int]]:
    """(values laid out owner by owner, each owner's ranges in order; bytes per owner).
    A view of ``values`` when the ranges already tile it in owner order."""
    flat = [r for owner in ranges for r in owner]
    sizes = [4 * owned(ranges, j) for j in range(len(ranges))]
    contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(flat))
    if not flat or (contiguous and flat[0][0] == 0 and flat[-1][1] == values.size):
        return values, sizes
    xp = array_module(values)
    return xp.concatenate([values[lo:hi] for lo, hi in flat]), sizes


def node_reduce(local: Communicator, values: Any, ranges: Ranges) -> Any:
    """This rank's owned ranges (concatenated in order) of the sum over ``local``'s
    ranks of ``values`` (flat float32, one size on every rank), added in fp32 in
    local rank order; an empty array on a rank that owns nothing. One all-to-all,
    in which a rank sends nothing to itself: its own values are added from where
    they lie."""
    xp = array_module(values)
    me, size = local.rank, local.size
    mine = owned(ranges, me)
    send, send_sizes = _packed(values, ranges)
    if size == 1:
        return send[:mine].copy() if mine else xp.empty(0, np.float32)
    send_counts, send_displs = segments(send_sizes)
    own = send[send_displs[me] // 4 :][:mine]
    send_counts[me] = 0  # the own range stays where it is
    rows = xp.empty((size - 1, mine), np.float32)  # the peers' values, in rank order
    recv_sizes = [4 * mine] * size
    recv_sizes[me] = 0
    recv_counts, recv_displs = segments(recv_sizes)
    wait(
        local.alltoallv(
            send.view(np.uint8),
            send_counts,
            send_displs,
            rows.reshape(-1).view(np.uint8),
            recv_counts,
            recv_displs,
        ),
        "the node-local reduce-scatter",
        me,
    )
    # rank 0's values + rank 1's + ...: rank order, whoever this rank is. The sum
    # starts in the lowest peer's row (rank 0's, or rank 1's on rank 0): fp32
    # addition commutes, so r1 + r0 has the bits of r0 + r1
    total = rows[0]
    if me < 2:
        add_into(total, own)
    for j in range(2 if me < 2 else 1, size):
        add_into(total, own if j == me else rows[j - 1 if j > me else j])
    return total


def node_allgather(local: Communicator, mine: Any, result: Any, ranges: Ranges) -> None:
    """Every owner's values (``mine``, its ranges concatenated, as :func:`node_reduce`
    returns them) into their ranges of ``result`` (flat, on every rank of ``local``).
    One all-gather; ``mine`` must not share memory with ``result``."""
    sizes = [4 * owned(ranges, j) for j in range(len(ranges))]
    flat = [r for owner in ranges for r in owner]
    contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(flat))
    direct = contiguous and (not flat or (flat[0][0] == 0 and flat[-1][1] == result.size))
    xp = array_module(result)
    target = result if direct else xp.empty(sum(sizes) // 4, np.float32)
    counts, displs = segments(sizes)
    send = mine.reshape(-1).view(np.uint8)
    wait_ordered(
        local.allgatherv(send, target.reshape(-1).view(np.uint8), counts, displs),
        "the node-local all-gather",
        local.rank,
    )
    if not direct:
        at = 0
        for lo, hi in flat:
            result[lo:hi] = target[at : at + hi - lo]
            at += hi - lo


def node_allreduce(nodes: NodeComms, values: Any, total: Any, across: Across) -> None:
    """``total`` = the all-reduce of ``values`` (flat float32) in two levels: an exact
    reduce-scatter inside the node (local index i < w owns shard i of the
    ``np.array_split`` of the buffer into w, the smallest node's rank count), the
    compressed all-reduce of each shard across nodes (``across``), the node-local
    all-gather. Ranks of index >= w (larger nodes) only add and receive."""
    bounds = shard_bounds(values.size, nodes.width)
    ranges: Ranges = [
        [(int(bounds[j]), int(bounds[j + 1]))] if j < nodes.width else []
        for j in range(nodes.local.size)
    ]
    if nodes.local.size == 1:  # alone in its node: nothing to add or hand out inside it
        across("allreduce", values, ranges[0], total, 0)
        return
    mine = node_reduce(nodes.local, values, ranges)
    if nodes.index < nodes.width:
        across("allreduce", mine, ranges[nodes.index], mine, 0)
    node_allgather(nodes.local, mine, total, ranges)


def node_reduce_scatter(nodes: NodeComms, values: Any, across: Across) -> Any:
    """This rank's flat shard (``np.array_split`` into N, the flat collective's) of
    the sum of ``values``. On nodes of G ranks each, node n holding ranks nG ..
    nG + G - 1, local index i owns the flat shards of the ranks with index i on every
    node: it sums them exactly inside the node and a compressed reduce-scatter over
    the nodes (``across``) hands each its own. Other layouts (uneven nodes) run
    :func:`node_allreduce` and keep the shard."""
    layout, count = nodes.layout, values.size
    n, g = len(layout.node), nodes.width
    flat = shard_bounds(count, n)
    lo, hi = int(flat[nodes.rank]), int(flat[nodes.rank + 1])
    xp = array_module(values)
    if layout.node != tuple(r // g for r in range(n)) or max(layout.sizes()) != g:
        total = xp.empty_like(values)
        node_allreduce(nodes, values, total, across)
        return total[lo:hi].copy()
    ranges: Ranges = [
        [(int(flat[m * g + j]), int(flat[m * g + j + 1])) for m in range(layout.nodes)]
        for j in range(g)
    ]
    # alone in its node, a rank's own values are the node's sums (in owner order)
    mine = values if g == 1 else node_reduce(nodes.local, values, ranges)
    cross = shard_bounds(mine.size, layout.nodes)
    sizes = [b - a for a, b in ranges[nodes.index]]
    # flat shards shrink by at most one value from rank to rank: cut alike
    assert np.array_equal(np.diff(cross), sizes), "the cross shards are the flat shards"
    shard = xp.empty(hi - lo, np.float32)
    across("reduce_scatter", mine, ranges[nodes.index], shard, int(cross[nodes.cross.rank]))
    return shard
