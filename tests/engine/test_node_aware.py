"""Node-aware collectives (docs/design.md, "Node-aware collectives").

Ranks are grouped into nodes by ``GEOCOMM_RANKS_PER_NODE``; the oracle is the
algorithm written out on simulated ranks: exact fp32 node sums in local rank
order, then :func:`geocomm.testing.simulate_allreduce` of each shard over the
nodes, with the shard keys of :func:`geocomm.engine.call.shard_parts`.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

import geocomm
from geocomm import CollectiveMismatchError, get_codec
from geocomm.comm.nodes import NodeLayout
from geocomm.engine import costs
from geocomm.engine.call import Part, shard_parts
from geocomm.engine.layout import shard_bounds
from geocomm.testing import simulate_allreduce, simulate_reduce_scatter

#: rows split evenly into 1, 2 and 3 shards, each at least GeoFP8's min_dim (64) rows:
#: a node-aware call maps each local index's shard, and fewer rows would go plain
SHAPE = (192, 1024)


def same_on_all_ranks(comm, array) -> bool:
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).digest()
    rows = comm.allgather_int64(np.frombuffer(digest[:8], np.int64))
    return bool((rows == rows[0]).all())


def gradients(size: int, call: int) -> list[np.ndarray]:
    """Gradient-like inputs: a shared rank-8 signal plus each rank's noise."""
    shared = np.random.default_rng([call, 99])
    signal = shared.standard_normal((SHAPE[0], 8)) @ shared.standard_normal((8, SHAPE[1]))
    return [
        (signal + 0.3 * np.random.default_rng([call, r]).standard_normal(SHAPE)).astype(np.float32)
        for r in range(size)
    ]


def node_sums(xs: list[np.ndarray], layout: NodeLayout) -> list[np.ndarray]:
    """Every node's exact sum: fp32, in local rank order."""
    sums = []
    for n in range(layout.nodes):
        members = layout.members(n)
        total = xs[members[0]].reshape(-1).copy()
        for r in members[1:]:
            total += xs[r].reshape(-1)
        sums.append(total)
    return sums


def oracle_allreduce(codecs: dict, xs: list[np.ndarray], layout: NodeLayout) -> np.ndarray:
    """What the node-aware all-reduce returns; ``codecs[(index, node)]`` keeps the state
    of the rank with local index ``index`` on node ``node`` across calls."""
    sums = node_sums(xs, layout)
    width = min(layout.sizes())
    bounds = shard_bounds(sums[0].size, width)
    result = np.empty(sums[0].size, np.float32)
    for i in range(width):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        (part,) = shard_parts([Part(0, SHAPE, ("shape", SHAPE))], [(lo, hi)])
        shard = [s[lo:hi].reshape(part.shape) for s in sums]
        ranks = [codecs[(i, n)] for n in range(layout.nodes)]
        result[lo:hi] = simulate_allreduce(ranks, shard, key=part.key).reshape(-1)
    return result.reshape(SHAPE)


def layout_of(size: int, per_node: int) -> NodeLayout:
    return NodeLayout(tuple(r // per_node for r in range(size)))


CODECS = {
    "fp8": lambda: get_codec("fp8"),
    "nvfp4": lambda: get_codec("nvfp4"),
    "geofp8": lambda: get_codec("geofp8", refresh=2),
}


def _nodes_for(size: int) -> list[int]:
    """GEOCOMM_RANKS_PER_NODE values that give a two-level layout on ``size`` ranks."""
    return [g for g in (2, 3) if 1 < g < size]


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("per_node", [2, 3])
def test_allreduce_matches_the_oracle(comm, monkeypatch, name, per_node):
    if per_node not in _nodes_for(comm.size):
        pytest.skip(f"{per_node} ranks per node on {comm.size} ranks is one node")
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", str(per_node))
    layout = layout_of(comm.size, per_node)
    codec = CODECS[name]()
    oracle = {(i, n): CODECS[name]() for i in range(per_node) for n in range(layout.nodes)}
    for call in range(4):  # geofp8: a cold call, refreshes, mapped calls
        xs = gradients(comm.size, call)
        y = geocomm.allreduce(xs[comm.rank], codec=codec, topology="node")
        assert same_on_all_ranks(comm, y)
        np.testing.assert_array_equal(y, oracle_allreduce(oracle, xs, layout))
    if name == "geofp8":  # every shard was mapped (the oracle's state is the codec's)
        states = [st for c in oracle.values() for _, st in c.state_dict()["keys"]]
        assert states and all(st["use"] > 0 for st in states), states


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(CODECS))
def test_one_rank_per_node_is_the_compressed_step_alone(comm, monkeypatch, name):
    """With one rank per node nothing is added or handed out inside a node: the
    node-aware all-reduce and reduce-scatter are the compressed step between nodes
    on the rank's own values (the oracle's), with no copies around it."""
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", "1")
    layout = layout_of(comm.size, 1)
    codec = CODECS[name]()
    oracle = {(0, n): CODECS[name]() for n in range(layout.nodes)}
    for call in range(4):
        xs = gradients(comm.size, call)
        y = geocomm.allreduce(xs[comm.rank], codec=codec, topology="node")
        assert same_on_all_ranks(comm, y)
        np.testing.assert_array_equal(y, oracle_allreduce(oracle, xs, layout))
    xs = gradients(comm.size, 5)
    shard = geocomm.reduce_scatter(xs[comm.rank], codec="fp8", topology="node")
    flat = geocomm.reduce_scatter(xs[comm.rank], codec="fp8", topology="flat")
    np.testing.assert_array_equal(shard, flat)


@pytest.mark.mpi(min_size=3)
def test_error_feedback_node_aware(comm, monkeypatch):
    """Ranks identical; the first call has no residual (it is the plain codec's), and
    the residuals make the running mean approach the exact mean."""
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", "2")
    codec = get_codec("fp8", error_feedback=True)
    xs = gradients(comm.size, 0)
    first = geocomm.allreduce(xs[comm.rank], codec=codec, topology="node")
    plain = geocomm.allreduce(xs[comm.rank], codec="fp8", topology="node")
    np.testing.assert_array_equal(first, plain)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    mean = first.astype(np.float64)
    for _ in range(1, 8):
        y = geocomm.allreduce(xs[comm.rank], codec=codec, topology="node")
        assert same_on_all_ranks(comm, y)
        mean += y
    err_one = np.linalg.norm(first - exact)
    assert np.linalg.norm(mean / 8 - exact) < 0.5 * err_one


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("codec_id", ["fp8", "geofp8"])
def test_error_feedback_goes_flat_after_node_aware_calls(comm, monkeypatch, codec_id):
    """One error-feedback codec through node-aware calls and then flat ones (as
    ``auto`` picks by size in a model of large and small buckets): the node-aware
    calls keep residuals per local index, which differ across ranks by design, and a
    flat call's check compares its own residual's count only. It compared them all,
    and every flat call after a node-aware one raised a false CollectiveMismatchError
    ("codec state") on every rank."""
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", "2")
    codec = get_codec(codec_id, error_feedback=True)
    xs = gradients(comm.size, 3)
    small = xs[comm.rank][:8].copy()
    for call in range(3):
        big = geocomm.allreduce(xs[comm.rank], codec=codec, key="big", topology="node")
        assert same_on_all_ranks(comm, big)
        for topology in ("flat", "auto"):  # auto: 32 KiB goes flat
            y = geocomm.allreduce(small, codec=codec, key="small", topology=topology)
            assert same_on_all_ranks(comm, y), (call, topology)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("per_node", [2, 3])
def test_reduce_scatter_keeps_the_flat_ownership(comm, monkeypatch, per_node):
    if per_node not in _nodes_for(comm.size):
        pytest.skip(f"{per_node} ranks per node on {comm.size} ranks is one node")
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", str(per_node))
    layout = layout_of(comm.size, per_node)
    xs = gradients(comm.size, 5)
    shard = geocomm.reduce_scatter(xs[comm.rank], codec="fp8", topology="node")
    flat = shard_bounds(xs[0].size, comm.size)
    lo, hi = int(flat[comm.rank]), int(flat[comm.rank + 1])
    assert shard.shape == (hi - lo,)
    sums = node_sums(xs, layout)
    if len(set(layout.sizes())) == 1:  # even nodes: a reduce-scatter across nodes
        g, me, nodes = per_node, layout.local_index(comm.rank), layout.nodes
        mine = [
            np.concatenate([s[flat[m * g + me] : flat[m * g + me + 1]] for m in range(nodes)])
            for s in sums
        ]
        codecs = [get_codec("fp8") for _ in range(layout.nodes)]
        expected = simulate_reduce_scatter(codecs, mine, key="any")[layout.node[comm.rank]]
    else:  # uneven nodes: the node-aware all-reduce's shard
        total = geocomm.allreduce(xs[comm.rank], codec="fp8", topology="node")
        expected = total.reshape(-1)[lo:hi]
    np.testing.assert_array_equal(shard, expected)


@pytest.mark.mpi(min_size=2)
def test_topology_is_in_the_fingerprint(comm):
    x = np.ones(1000, np.float32)
    topology = "flat" if comm.rank == 0 else "node"
    with pytest.raises(CollectiveMismatchError, match="topology"):
        geocomm.allreduce(x, codec="fp8", topology=topology)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("variable", "value"),
    [("GEOCOMM_RANKS_PER_NODE", "2"), ("GEOCOMM_INTER_GBPS", "1"), ("GEOCOMM_INTRA_GBPS", "9")],
)
def test_node_settings_set_on_one_rank_only_fail_on_every_rank(comm, monkeypatch, variable, value):
    """Rank 0 alone sets a variable that decides the node layout or ``auto``'s choice.
    The ranks would run other collectives: with GEOCOMM_RANKS_PER_NODE rank 0 skipped
    the node-key split the others blocked in, for good (no timeout bounds MPI's
    split). The fingerprint of a call that reads the settings holds them, so every
    rank raises at the check; calls that read none are not refused for them."""
    if comm.rank == 0:
        monkeypatch.setenv(variable, value)
    else:
        monkeypatch.delenv(variable, raising=False)
    x = gradients(comm.size, 9)[comm.rank]
    with pytest.raises(CollectiveMismatchError, match="node settings"):
        geocomm.allreduce(x, codec="fp8", topology="auto")
    # calls that never read it go on: flat, lossless, all-gathers, and "node" for the
    # link speeds (it reads the ranks per node only)
    calls = [
        lambda: geocomm.allreduce(x, codec="fp8", topology="flat"),
        lambda: geocomm.allreduce(x, codec="none", topology="auto"),
        lambda: geocomm.allgather(x[:4], codec="fp8"),
    ]
    if variable != "GEOCOMM_RANKS_PER_NODE":
        calls.append(lambda: geocomm.allreduce(x, codec="fp8", topology="node"))
    for call in calls:
        assert same_on_all_ranks(comm, call())


@pytest.mark.mpi(min_size=2)
def test_auto_is_flat_with_one_rank_per_node(comm, monkeypatch):
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", "1")
    xs = gradients(comm.size, 7)
    auto = geocomm.allreduce(xs[comm.rank], codec="fp8", topology="auto")
    node = geocomm.allreduce(xs[comm.rank], codec="fp8", topology="node")
    flat = geocomm.allreduce(xs[comm.rank], codec="fp8", topology="flat")
    np.testing.assert_array_equal(auto, flat)
    np.testing.assert_array_equal(node, flat)


def test_auto_never_goes_node_aware_on_trivial_layouts():
    for sizes in ([1, 1, 1, 1], [4], [1], [8], [1] * 64):
        for nbytes in (1 << 12, 1 << 26, 1 << 34):
            assert not costs.node_aware_pays("mpi", nbytes, sizes)
            assert not costs.node_aware_pays("nccl", nbytes, sizes)
    assert costs.node_aware_pays("mpi", 64 << 20, [2, 2])
    assert costs.node_aware_pays("nccl", 1 << 30, [8] * 16)


def test_the_node_model_charges_the_shard_owners_their_traffic():
    """Inside a node of G ranks the w shard owners (w: the smallest node's ranks) each
    receive and send (G - 1) B / w: a 3 + 1 layout moved 2 MiB each way through rank 0
    for 1 MiB (MeteredComm), where the model charged 2 (G - 1) / G B in all. Even
    layouts (w = G) are as before."""
    free = costs.Links(intra_Bps=1.0, inter_Bps=math.inf, latency_s=0.0, codec_Bps=math.inf)
    assert costs.node_seconds(free, 1.0, [3, 1], 0.25) == pytest.approx(2 * 2 / 1)
    assert costs.node_seconds(free, 1.0, [8, 2], 0.25) == pytest.approx(2 * 7 / 2)
    assert costs.node_seconds(free, 1.0, [4, 4], 0.25) == pytest.approx(2 * 3 / 4)


def test_link_overrides():
    model = costs.links("mpi", {"GEOCOMM_INTRA_GBPS": "2", "GEOCOMM_INTER_GBPS": "0.125"})
    assert model.intra_Bps == 2e9 and model.inter_Bps == 0.125e9
    assert costs.links("nccl", {}) == costs.DEVICE_LINKS["nccl"]


def test_layout_groups():
    layout = NodeLayout.from_keys([7, 7, 7, 3])
    assert layout.node == (0, 0, 0, 1) and layout.sizes() == [3, 1]
    assert layout.groups() == ([[0, 1, 2], [3]], [[0, 3], [1], [2]])
    assert not layout.trivial and NodeLayout((0, 1, 2)).trivial and NodeLayout((0, 0)).trivial


def test_shard_parts_cut_at_rows():
    parts = [Part(0, (4, 10), "w"), Part(40, (5,), "b")]
    cut = shard_parts(parts, [(15, 43)])
    assert [(p.offset, p.shape, p.key) for p in cut] == [
        (0, (5,), ("w", "node", 15)),
        (5, (2, 10), ("w", "node", 20)),
        (25, (3,), ("b", "node", 0)),
    ]
    two = shard_parts(parts, [(0, 10), (40, 45)])
    assert [(p.offset, p.shape) for p in two] == [(0, (1, 10)), (10, (5,))]
