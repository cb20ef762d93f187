"""Which ranks share a node, and communicators inside and between nodes
(docs/design.md, "Node-aware collectives").

The node layout of a communicator comes from, in this order:

1. ``GEOCOMM_RANKS_PER_NODE=G`` (emulation, unusual launchers): rank ``r`` of the
   communicator is on node ``r // G`` (so ``N`` ranks make nodes of ``G`` and a
   last node of ``N mod G``);
2. the communicator's own ``node_key()`` (MPI: a hash of the host's processor
   name and boot id; torch.distributed: the launcher's
   ``GROUP_RANK``, else ``RANK - LOCAL_RANK``), gathered from every rank;
3. nothing: the layout is unknown and the collectives stay flat.

Nodes are numbered by their first rank; a rank's local index is its position
among its node's ranks in rank order. :func:`node_comms` builds, once per
communicator and layout, the communicator of this rank's node and the one of
the ranks with its local index on every node (``subgroups``: MPI ``Split``,
torch ``new_group``). Everything that reaches every rank is decided from
gathered values only, so every rank takes the same decisions.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

ENV_RANKS_PER_NODE = "GEOCOMM_RANKS_PER_NODE"


@dataclass(frozen=True)
class NodeLayout:
    """``node[r]``: the node (0, 1, ...) of rank ``r``, nodes numbered by first rank."""

    node: tuple[int, ...]

    @classmethod
    def from_keys(cls, keys: Any) -> NodeLayout:
        """The layout of ranks whose node keys are ``keys`` (equal key: same node)."""
        order: dict[int, int] = {}
        return cls(tuple(order.setdefault(int(k), len(order)) for k in keys))

    @property
    def nodes(self) -> int:
        return max(self.node) + 1 if self.node else 0

    def members(self, n: int) -> list[int]:
        """The ranks of node ``n`` in rank order."""
        return [r for r, m in enumerate(self.node) if m == n]

    def sizes(self) -> list[int]:
        """Ranks per node, node by node."""
        return [len(self.members(n)) for n in range(self.nodes)]

    def local_index(self, rank: int) -> int:
        return self.members(self.node[rank]).index(rank)

    @property
    def trivial(self) -> bool:
        """One node, or one rank per node: nothing to gain from two levels."""
        return self.nodes <= 1 or max(self.sizes()) <= 1

    def groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(the ranks of every node, the ranks of every local index across nodes)."""
        nodes = [self.members(n) for n in range(self.nodes)]
        width = max((len(m) for m in nodes), default=0)
        cross = [[m[i] for m in nodes if i < len(m)] for i in range(width)]
        return nodes, cross


def ranks_per_node() -> int | None:
    """``GEOCOMM_RANKS_PER_NODE`` as a positive int, None when unset."""
    text = os.environ.get(ENV_RANKS_PER_NODE, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{ENV_RANKS_PER_NODE} must be a positive integer, got {text!r}")
    return value


_layouts: weakref.WeakKeyDictionary[Any, tuple[Any, NodeLayout | None]] = (
    weakref.WeakKeyDictionary()
)
_comms: weakref.WeakKeyDictionary[Any, dict[Any, NodeComms]] = weakref.WeakKeyDictionary()


def node_layout(comm: Any) -> NodeLayout | None:
    """The node layout of ``comm`` (None: unknown). Collective on the first call for a
    communicator (one tiny all-gather), cached afterwards; every rank must call it
    at the same point."""
    env = ranks_per_node()
    cached = _layouts.get(comm)
    if cached is not None and cached[0] == env:
        return cached[1]
    layout: NodeLayout | None
    if comm.size == 1:
        layout = NodeLayout((0,))
    elif env is not None:
        layout = NodeLayout(tuple(r // env for r in range(comm.size)))
    else:
        key = getattr(comm, "node_key", None)
        mine = int(key()) if key is not None else -1
        keys = (
            comm.allgather_int64(np.array([mine], np.int64))[:, 0]
            if key is not None
            else np.array([-1])
        )
        layout = None if (keys < 0).any() else NodeLayout.from_keys(keys)
    _layouts[comm] = (env, layout)
    return layout


@dataclass(frozen=True)
class NodeComms:
    """The two levels of a communicator for this rank: ``local``, its node's ranks;
    ``cross``, the ranks with its local index on every node; ``index``, its local
    index; ``width``, the smallest node's rank count (the local indices below it
    exist on every node and each owns one shard of a node's sum); ``rank``, its rank
    in the whole communicator."""

    layout: NodeLayout
    rank: int
    local: Any
    cross: Any
    index: int
    width: int


def node_comms(comm: Any, layout: NodeLayout) -> NodeComms | None:
    """The :class:`NodeComms` of ``comm`` for ``layout``; None when ``comm`` cannot
    make sub-communicators (no ``subgroups``). Collective on the first call (every
    rank, the same point), cached afterwards."""
    cache = _comms.setdefault(comm, {})
    if layout in cache:
        return cache[layout]
    subgroups = getattr(comm, "subgroups", None)
    if subgroups is None:
        return None
    nodes, cross = layout.groups()
    local = subgroups(nodes)
    across = subgroups(cross)
    result = NodeComms(
        layout, comm.rank, local, across, layout.local_index(comm.rank), min(layout.sizes())
    )
    cache[layout] = result
    return result
