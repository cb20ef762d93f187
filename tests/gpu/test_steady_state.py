"""What a steady-state device call costs the host, counted on the twin (docs/design.md,
"The collective"): no allocation, no host synchronization, and one graph launch (or,
where no graph can be kept, exactly the launches its plan names), at any rank count.

A call's signature is planned at its first call (tables, buffers: the allocations);
its second call is captured into a CUDA graph; every later call replays it, on the
arrays it names (one more one-thread launch where they lie elsewhere than the
capture's), alike on every rank (the twin's NCCL checks it). The twin counts what
reaches the device (``cupy._memory.counters``) and checks the stream order of the
graph's replay like any eager work, and these tests compare each call's result with
NumPy over MPI, bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import time

import numpy as np
import pytest
from gpu_helpers import ON_TWIN, inputs

import geocomm
from geocomm.comm.mpi import MPICommunicator
from geocomm.engine.layout import shard_bounds

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not ON_TWIN, reason="the twin counts what a call costs the host"),
]

#: stage sizes that give 1, 8 and 64 pipeline stages for COUNT values on one rank
COUNT = 64 * 4096


@pytest.fixture(scope="module")
def comms():
    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator()
    yield comm, MPICommunicator()
    comm.close()


@contextlib.contextmanager
def counted():
    """The twin's counters over the body: {kind: count} of what changed."""
    from cupy import _memory

    before = dict(_memory.counters)
    got: dict[str, int] = {}
    yield got
    for kind, value in _memory.counters.items():
        if value != before.get(kind, 0):
            got[kind] = value - before.get(kind, 0)


def reference(comms, x, codec, **options):
    return geocomm.allreduce(x, codec=codec, comm=comms[1], **options)


def device_call(cp, comms, d, out, codec, **options):
    return geocomm.allreduce(d, codec=codec, comm=comms[0], out=out, **options)


@pytest.mark.parametrize(
    ("codec", "stages"),
    [
        ("fp8", 1),
        ("fp8", 8),
        ("fp8", 64),
        ("nvfp4", 8),
        ({"id": "fp8", "block": 0}, 8),
        ("mxfp8", 8),
    ],
)
def test_a_steady_call_is_one_graph_launch(cp, comms, codec, stages):
    """From the third call with the same arrays on, a call launches one graph and queues
    nothing else, allocates nothing and never waits for the device: everything it needs
    was made at its first call and captured at its second. Steady calls go on while the
    device has run none of them (the twin holds it: a host synchronization raises), as
    a training step's buckets do on a GPU busy with the backward pass."""
    from cupy import _device

    comm = comms[0]
    x = inputs(comm.rank, COUNT)
    stage_size = COUNT // stages
    want = reference(comms, x, codec, stage_size=stage_size)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        d, out = cp.asarray(x), cp.empty(COUNT, cp.float32)
        costs = []
        for _ in range(4):
            with counted() as cost:
                device_call(cp, comms, d, out, codec, stage_size=stage_size)
            costs.append(cost)
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))
        with counted() as held, _device.hold():
            for _ in range(3):
                device_call(cp, comms, d, out, codec, stage_size=stage_size)
        assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))
    assert held == {"graph_launches": 3, "events": 3}, held
    first, captured, *steady = costs
    assert first.get("allocations", 0) > 0, "the first call plans the signature"
    assert captured.get("captured", 0) > 0 and captured.get("graph_launches") == 1
    for cost in steady:
        # one graph launch, and the event that watches it for timeouts
        assert cost == {"graph_launches": 1, "events": 1}, cost


def geo_gradients(rank: int, call: int, shapes: list[tuple[int, int]]) -> np.ndarray:
    """One rank's buffer of rank-4-plus-noise matrices whose row space turns at call 6
    (the power steps then find new bases), and a bias vector that goes plain."""
    tensors = []
    for i, (m, n) in enumerate(shapes):
        rows = np.random.default_rng([i, call // 6]).standard_normal((4, n))
        own = np.random.default_rng([rank, call, i])
        noise = 0.01 * own.standard_normal((m, n))
        tensors.append(10 * own.standard_normal((m, 4)) @ rows + noise)
    tensors.append(np.random.default_rng([rank, call, 9]).standard_normal(512))
    return np.concatenate([t.reshape(-1) for t in tensors]).astype(np.float32)


@pytest.mark.parametrize(
    ("kind", "stages", "op", "rounding"),
    [
        ("allreduce", 1, "sum", "nearest"),
        ("allreduce", 8, "avg", "nearest"),
        ("allreduce", 8, "sum", "stochastic"),
        ("reduce_scatter", 8, "avg", "nearest"),
    ],
)
def test_geofp8_calls_replay_one_graph_with_and_between_power_steps(
    cp, comms, kind, stages, op, rounding
):
    """GeoFP8 takes a power step every ``refresh`` to ``refresh_max`` calls; between
    steps a call maps with its bases as they are, and depends on device memory only:
    its arrays, the signature's buffers (side channel, exact sum, read scratch) and the
    keys' bases, which a step's commit overwrites in place. From its second such call
    on it is one graph launch (the average inside), allocating nothing. A call with
    power steps depends on the same memory, and on which keys step at which ranks: when
    that comes again, it is captured too, its step's temporaries in the graph's arena,
    and replays as one graph launch, allocating nothing; what each key's state takes
    from its step then comes behind the graph (three copies per key into one block of
    pinned memory, behind one event). No call ever waits for the device. Every call
    gives NumPy's bits over MPI and both codecs keep equal state, across the row
    space's turn at call 6.
    Stochastic rounding's keys are written before the graph, as for unmapped calls: a
    steady call is then that one-thread kernel and the graph. A reduce-scatter into the
    same ``out`` replays alike (its power steps sum each rank's part)."""
    from geocomm.engine import call as calls

    # w2's rows span three chunks of a dot product: its projections sum the chunks
    # in the side channel's scratch, which a replay must find where it was captured
    shapes = [(256, 512), (64, 1100)]
    parts = [("w1", shapes[0]), ("w2", shapes[1]), ("b", (512,))]
    count = sum(m * n for m, n in shapes) + 512
    # k = 4, the matrices' rank: the steps' bases settle
    config = {"id": "geofp8", "k": 4, "rounding": rounding}
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    options = {"parts": parts, "op": op, "stage_size": -(-count // stages)}
    collective = getattr(geocomm, kind)
    bounds = shard_bounds(count, comms[0].size)
    length = count if kind == "allreduce" else int(np.diff(bounds)[comms[0].rank])
    stream = cp.cuda.Stream(non_blocking=True)
    kinds, costs = [], []
    with stream:
        d, out = cp.empty(count, cp.float32), cp.empty(length, cp.float32)
        for call in range(20):
            x = geo_gradients(comms[0].rank, call, shapes)
            with calls.saved_call_counts():  # the device call rounds as the reference did
                want = collective(x, codec=host, comm=comms[1], **options)
            d.set(x)
            before = [dev.state_info(key) for key in ("w1", "w2")]
            with counted() as cost:
                collective(d, codec=dev, comm=comms[0], out=out, **options)
            after = [dev.state_info(key) for key in ("w1", "w2")]
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), call
            if any(b is None for b in before):
                kinds.append("first")  # the cold start measures the bases from the result
            else:
                pairs = zip(after, before, strict=True)
                stepped = sum(a["refreshed"] != b["refreshed"] for a, b in pairs)
                kinds.append(f"{stepped} steps" if stepped else "steady")
            costs.append(cost)
    assert dev.state_checksum() == host.state_checksum()
    steady = [c for k, c in zip(kinds, costs, strict=True) if k == "steady"]
    assert len(steady) >= 8, kinds  # the periods grow to refresh_max = 8 between turns
    assert sum(k.endswith("steps") for k in kinds) >= 4, kinds
    assert "2 steps" in kinds, kinds  # both matrices step in one call
    # no call waits for the device, the cold start's COLD_ITERS subspace iterations and
    # the power steps included: the bases are orthonormalized on the device, and what
    # the state takes (the step's verdict, the summed energies, the new basis's hash)
    # comes to the host behind the call, read at the state's next read
    assert kinds[0] == "first", kinds
    for k, cost in zip(kinds, costs, strict=True):
        assert "syncs" not in cost, (k, cost)
    # the first steady call runs eagerly and the second is captured; every later one
    # replays: one graph launch and the event that watches it for timeouts
    keys = 1 if rounding == "stochastic" else 0
    for cost in steady[2:]:
        assert cost == {**({"launches": keys} if keys else {}), "graph_launches": 1, "events": 1}
    # a call with steps replays once its keys' steps and ranks come the third time
    replays = [
        (int(k.split()[0]), c)
        for k, c in zip(kinds, costs, strict=True)
        if k.endswith("steps") and "graph_launches" in c and "captured" not in c
    ]
    assert len(replays) >= 3, (kinds, costs)
    for steps, cost in replays:
        want = {"launches": keys + 3 * steps, "graph_launches": 1, "events": 2}
        assert cost == want, (cost, kinds)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("kind", "op"), [("allreduce", "avg"), ("reduce_scatter", "sum")])
def test_geofp8_arrays_may_move_on_some_ranks_only(cp, comms, kind, op):
    """GeoFP8's calls are captured and replayed by what they map (the keys' bases, the
    side channel, which plans step), never by where the caller's arrays lie: rank 0
    passes the same arrays every call, the others one of three pairs in turn (an
    in-place call among them), and every rank captures and replays the same calls,
    with and between power steps (the twin's NCCL checks that every transfer is
    captured alike), every kernel of the map, the step, the side and the pipeline
    reading and writing this call's arrays: NumPy's bits at every call, equal state."""
    from mpi4py import MPI

    from geocomm.engine import call as calls

    shapes = [(256, 512), (64, 1100)]
    parts = [("w1", shapes[0]), ("w2", shapes[1]), ("b", (512,))]
    count = sum(m * n for m, n in shapes) + 512
    config = {"id": "geofp8", "k": 4}
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    options = {"parts": parts, "op": op, "stage_size": -(-count // 4)}
    collective = getattr(geocomm, kind)
    rank = comms[0].rank
    bounds = shard_bounds(count, comms[0].size)
    length = count if kind == "allreduce" else int(np.diff(bounds)[rank])
    stream = cp.cuda.Stream(non_blocking=True)
    replayed = []
    with stream:
        sources = [cp.empty(count, cp.float32) for _ in range(3)]
        outs = [cp.empty(length, cp.float32) for _ in range(3)]
        for call in range(20):
            at = 0 if rank == 0 else call % 3
            in_place = kind == "allreduce" and at == 2
            d, out = sources[at], sources[at] if in_place else outs[at]
            x = geo_gradients(rank, call, shapes)
            with calls.saved_call_counts():
                want = collective(x, codec=host, comm=comms[1], **options)
            d.set(x)
            with counted() as cost:
                collective(d, codec=dev, comm=comms[0], out=out, **options)
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), call
            replayed.append("graph_launches" in cost and "captured" not in cost)
    assert dev.state_checksum() == host.state_checksum()
    every = MPI.COMM_WORLD.allgather(replayed)
    assert all(r == replayed for r in every), every
    assert sum(replayed) >= 8, replayed


def test_geofp8_replays_a_bucket_of_many_keys_stepping_at_once(cp, comms):
    """A bucket of ten weight gradients, the same every call: their bases settle alike,
    so all ten take their power steps in the same calls, at the same ranks, and such a
    call replays one graph from its third time on, allocating nothing (the steps' sums
    of all ten travel in one buffer, written slice by slice: CuPy joins more than 8
    arrays with a kernel that reads a table of their addresses uploaded from the host,
    which a graph cannot replay). What the ten states take from their steps follows
    the graph in 30 copies behind one event. Every call gives NumPy's bits over MPI and
    both codecs keep equal state."""
    from geocomm.engine import call as calls

    shapes = [(32, 64 + 8 * i) for i in range(10)]
    parts = [(f"w{i}", shape) for i, shape in enumerate(shapes)]
    x = np.concatenate(
        [geo_gradients(comms[0].rank, 0, [shape])[:-512] for shape in shapes]
    ).astype(np.float32)
    # small matrices map too, every one within the side budget, and each steps every call
    config = {"id": "geofp8", "k": 2, "min_dim": 16, "min_numel": 0, "side_budget": 1.0}
    config["refresh_max"] = 1
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    stream = cp.cuda.Stream(non_blocking=True)
    replays = 0
    with stream:
        d, out = cp.asarray(x), cp.empty(x.size, cp.float32)
        for call in range(16):
            with calls.saved_call_counts():
                want = geocomm.allreduce(x, codec=host, comm=comms[1], parts=parts)
            before = [dev.state_info(key) for key, _ in parts]
            with counted() as cost:
                geocomm.allreduce(d, codec=dev, comm=comms[0], out=out, parts=parts)
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), call
            after = [dev.state_info(key) for key, _ in parts]
            steps = sum(
                b is not None and a["refreshed"] != b["refreshed"]
                for a, b in zip(after, before, strict=True)
            )
            assert "syncs" not in cost, cost
            if steps == len(parts) and "captured" not in cost and "graph_launches" in cost:
                replays += 1
                assert cost == {"launches": 30, "graph_launches": 1, "events": 2}, cost
    assert replays >= 1, replays
    assert dev.state_checksum() == host.state_checksum()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("graphs", "kind", "op", "place"),
    [
        ("1", "allreduce", "sum", "out"),
        ("1", "allreduce", "avg", "in place"),
        ("1", "allreduce", "sum", "mixed"),
        ("1", "reduce_scatter", "avg", "out"),
        ("1", "allreduce", "sum", "stochastic"),
        ("0", "allreduce", "sum", "out"),
    ],
)
def test_arrays_may_move_on_some_ranks_only(cp, monkeypatch, graphs, kind, op, place):
    """NCCL lets a transfer be captured into a CUDA graph only on every rank alike (the
    twin's NCCL checks it). Whether a call is captured or replayed depends on its
    signature's calls alone, never on where its arrays lie, a rank-local fact: here
    rank 0 passes the same arrays every call and the others one of six in turn (fresh
    buffers from a pool that serves some ranks otherwise), and every rank runs its
    first call eagerly, captures the second and replays the rest, with the kernels
    reading and writing each call's arrays ("mixed": a graph captured in place, out=
    the source, replays calls that are not, and the other way round).
    ``GEOCOMM_GRAPHS=0`` on every rank captures nothing: each call runs eagerly, with
    the same bits."""
    from geocomm.comm.nccl import NCCLCommunicator

    monkeypatch.setenv("GEOCOMM_GRAPHS", graphs)
    comm = NCCLCommunicator()
    codec = {"id": "fp8", "rounding": "stochastic", "seed": 3} if place == "stochastic" else "fp8"
    x = np.full(COUNT, comm.rank + 1, np.float32)
    want = (comm.size + 1) / 2 if op == "avg" else comm.size * (comm.size + 1) / 2
    lo, hi = shard_bounds(COUNT, comm.size)[comm.rank : comm.rank + 2]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        sources = [cp.asarray(x) for _ in range(6)]
        size = COUNT if kind == "allreduce" else int(hi - lo)
        outs = [cp.empty(size, cp.float32) for _ in range(6)]
        costs = []
        for call in range(10):
            at = 0 if comm.rank == 0 else call % 6
            if place == "mixed":  # ranks > 0 capture in place (at 2) at their second call
                at = 0 if comm.rank == 0 else (call + 1) % 3
            source = sources[at]
            source.set(x)  # an in-place call overwrote it
            in_place = place == "in place" or (place == "mixed" and at == 2)
            out = source if in_place else outs[at]
            with counted() as cost:
                getattr(geocomm, kind)(source, codec=codec, comm=comm, op=op, out=out)
            costs.append(cost)
            assert np.all(out.get() == want), call  # small integers: exact in fp8
    comm.close()
    if graphs == "0":
        assert not any("graph_launches" in c or "captured" in c for c in costs), costs
        return
    assert "graph_launches" not in costs[0] and costs[1].get("captured", 0) > 0, costs[:2]
    assert all(c.get("graph_launches") == 1 and "captured" not in c for c in costs[2:]), costs


def test_a_call_the_callers_capture_records_leaves_its_slots_to_be_written_again(cp, comms):
    """A call made while the caller captures the current stream runs into the caller's
    graph, which writes the plan's slots (zero shifts: that call's arrays) whenever it
    runs, so geocomm no longer knows what they hold: here they held the shifts of a
    replay on other arrays, and the next call on the capture's arrays writes them
    again instead of trusting them. Every call, and the caller's graph, gives NumPy's
    bits. One rank: over NCCL with transfers a caller cannot capture a whole call (its
    transfers' timeouts query events), only geocomm's own graphs nest calls."""
    comm = comms[0]
    if comm.size > 1:
        pytest.skip("a caller's capture of a whole call is a one-rank scenario")
    count = COUNT - 8192  # a signature of its own
    x = inputs(comm.rank, count)
    want = reference(comms, x, "fp8").view(np.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a, b = cp.asarray(x), cp.asarray(x)
        out_a, out_b = cp.empty(count, cp.float32), cp.empty(count, cp.float32)
        for _ in range(2):  # eager, then captured on a and out_a
            device_call(cp, comms, a, out_a, "fp8", check=False)
        device_call(cp, comms, b, out_b, "fp8", check=False)  # a replay that moves
        stream.begin_capture()
        device_call(cp, comms, a, out_a, "fp8", check=False)  # the caller's graph
        graph = stream.end_capture()
        out_a.fill(0)
        with counted() as cost:
            device_call(cp, comms, a, out_a, "fp8", check=False)
        assert np.array_equal(out_a.get().view(np.uint32), want)
        out_b.fill(0)
        device_call(cp, comms, b, out_b, "fp8", check=False)
        out_a.fill(0)
        graph.launch(stream)
        assert np.array_equal(out_a.get().view(np.uint32), want)
        assert np.array_equal(out_b.get().view(np.uint32), want)
        out_b.fill(0)
        device_call(cp, comms, b, out_b, "fp8", check=False)
        assert np.array_equal(out_b.get().view(np.uint32), want)
    assert cost == {"launches": 1, "graph_launches": 1, "events": 1}, cost


@pytest.mark.mpi(min_size=2)
def test_a_capture_that_fails_on_one_rank_is_given_up_on_every_rank(cp, comms, monkeypatch):
    """NCCL requires a transfer to be captured on every rank or on none. Here only rank
    1's capture of the signature's second call fails (as an operation CUDA refuses
    under capture makes it fail), while the other ranks' succeed: every rank then runs
    that call and the later ones eagerly, giving NumPy's bits. Without the ranks'
    exchange the others would replay their graph's transfers against rank 1's eager
    ones, which the twin's NCCL refuses as NCCL forbids it."""
    from mpi4py import MPI

    from geocomm.engine import graphs

    def refused(self):
        raise graphs.ArenaExhausted("refused under capture, on this rank only")
        yield

    if MPI.COMM_WORLD.rank == 1:
        monkeypatch.setattr(graphs.Arena, "serving", contextlib.contextmanager(refused))
    comm, codec = comms[0], {"id": "fp8", "block": 64}  # a signature no other test makes
    x = inputs(comm.rank, COUNT)
    want = reference(comms, x, codec, stage_size=COUNT // 8)
    stream = cp.cuda.Stream(non_blocking=True)
    costs = []
    with stream:
        d, out = cp.asarray(x), cp.empty(COUNT, cp.float32)
        for _ in range(5):
            with counted() as cost:
                device_call(cp, comms, d, out, codec, stage_size=COUNT // 8)
            costs.append(cost)
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))
    assert all("graph_launches" not in cost for cost in costs), costs
    # the other ranks did capture the second call, and dropped the graph
    assert ("captured" in costs[1]) == (MPI.COMM_WORLD.rank != 1), costs[1]
    assert all(cost.get("launches", 0) > 0 for cost in costs[2:]), costs  # eager


def test_a_closed_communicator_replays_no_graph(cp):
    """A call whose graph is kept refuses a communicator that was closed (or aborted
    after a timeout or a mismatch) as an eager call does, instead of launching the
    graph's transfers on it."""
    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x, out = cp.ones(COUNT, cp.float32), cp.empty(COUNT, cp.float32)
        for _ in range(3):  # eager, captured, replayed
            with counted() as cost:
                geocomm.allreduce(x, codec="fp8", comm=comm, out=out)
        assert cost.get("graph_launches") == 1, cost
        comm.close()
        with counted() as cost, pytest.raises(RuntimeError, match="closed"):
            geocomm.allreduce(x, codec="fp8", comm=comm, out=out)
    assert "graph_launches" not in cost, cost


def test_a_geofp8_call_whose_capture_fails_after_its_step_steps_again_alike(cp, comms, monkeypatch):
    """A call with a power step whose capture fails after the step's rounds ran (here
    the arena comes one block short, as when a body allocates more under capture than
    eagerly) runs again eagerly, its step included. That step must start from the key's
    basis, not from the one the failed capture's step left in the plan, whose memory
    the device never wrote: every call gives NumPy's bits and both codecs keep equal
    state, call after call."""
    from geocomm.engine import call as calls
    from geocomm.engine import graphs

    capture = graphs.Graphs._capture

    def short(self, comm, body, nbytes, keep, here):
        return capture(self, comm, body, max(nbytes - graphs.ALIGN, 0), keep, here)

    monkeypatch.setattr(graphs.Graphs, "_capture", short)
    shapes = [(256, 512)]
    parts = [("w", shapes[0])]
    config = {"id": "geofp8", "k": 4, "refresh_max": 1}  # a step every call
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    stream = cp.cuda.Stream(non_blocking=True)
    kinds = []
    with stream:
        d, out = cp.empty(256 * 512, cp.float32), cp.empty(256 * 512, cp.float32)
        for call in range(6):
            x = geo_gradients(comms[0].rank, call, shapes)[:-512]
            with calls.saved_call_counts():
                want = geocomm.allreduce(x, codec=host, comm=comms[1], parts=parts)
            d.set(x)
            with counted() as cost:
                geocomm.allreduce(d, codec=dev, comm=comms[0], out=out, parts=parts)
            kinds.append("failed capture" if "captured" in cost else "eager")
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), call
            assert dev.state_checksum() == host.state_checksum(), (call, kinds)
        assert dev.state_info("w")["refreshed"] >= 4, kinds  # the state took the steps
    assert "failed capture" in kinds, kinds


def test_a_side_channel_whose_scratch_grew_never_replays_a_graph_of_the_old_one(
    cp, comms, monkeypatch
):
    """Two tensors of the same side layout (m rows, rank k) but of different row
    lengths need scratch of different sizes for their projections' chunk sums. When
    the side budget maps one, then the other, the channel's scratch grows
    (``SideChannel.reserve``) and the old one goes back to CuPy's pool: a graph
    captured with it must not replay when the first tensor is mapped alone again (it
    would write into memory the pool may have handed on). The graph keeps the scratch it
    was captured with and names it in its key, so that call is planned anew. Every call
    gives NumPy's bits."""
    from geocomm.codecs.geo import codec as geo
    from geocomm.engine import call as calls

    shapes = [(64, 1100), (64, 2100)]
    parts = [("a", shapes[0]), ("c", shapes[1])]
    count = sum(m * n for m, n in shapes)
    rank_of, mapped = geo.GeoCodec._rank_of, {"key": None}

    def only(self, key):  # the budget's choice, forced: one key mapped at rank 4
        return rank_of(self, key) if mapped["key"] is None else 4 * (key == mapped["key"])

    monkeypatch.setattr(geo.GeoCodec, "_rank_of", only)
    config = {"id": "geofp8", "k": 4, "refresh": 1000, "refresh_max": 1000}  # no steps
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    stream = cp.cuda.Stream(non_blocking=True)
    costs = []
    with stream:
        rng = np.random.default_rng(0)
        x = np.concatenate(
            [(rng.standard_normal((m, 4)) @ rng.standard_normal((4, n))).ravel() for m, n in shapes]
        ).astype(np.float32)
        d, out = cp.asarray(x), cp.empty(count, cp.float32)
        for key in [None, "a", "a", "a", "c", "c", "a"]:
            mapped["key"] = key
            with calls.saved_call_counts():
                want = geocomm.allreduce(x, codec=host, comm=comms[1], parts=parts)
            with counted() as cost:
                geocomm.allreduce(d, codec=dev, comm=comms[0], out=out, parts=parts)
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), key
            costs.append(cost)
    assert costs[3].get("graph_launches") == 1, costs  # "a" runs as its graph ...
    assert "graph_launches" not in costs[6], costs  # ... until the scratch grew for "c"


def test_geofp8_buckets_of_a_round_never_wait_for_a_lagging_device(cp, comms):
    """DDP hands the collective one bucket after another while the device still runs the
    earlier ones. GeoFP8's state takes a power step's outcome on the host (its verdict,
    energies and basis hash come behind the call): a key's own at the key's next call, and
    every key's when the round of calls starts again (a key comes back), where the
    allocation is made again and every rank must decide from the same state. So no call
    of a round reads what another call of that round found, and none waits for the
    device even when it has run none of the round's work yet (the twin holds it: a
    host synchronization raises). Each round starts with the device idle, as a training
    step's first bucket finds the last step's buckets done. Three buckets of one key
    each, with the default check on (it compares every key's state across ranks); every
    call gives NumPy's bits over MPI, with power steps, and both codecs keep equal
    state."""
    from cupy import _device

    from geocomm.engine import call as calls

    shapes = [(256, 512), (64, 1100), (128, 256)]
    buckets = [[(f"w{i}", shape)] for i, shape in enumerate(shapes)]
    config = {"id": "geofp8", "k": 4}
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    stream = cp.cuda.Stream(non_blocking=True)
    steps = 0
    with stream:
        arrays = [cp.empty(m * n, cp.float32) for m, n in shapes]
        for call in range(14):
            xs = [geo_gradients(comms[0].rank, call, [shape])[:-512] for shape in shapes]
            wants = []
            for x, parts in zip(xs, buckets, strict=True):
                with calls.saved_call_counts():  # the device calls round as the reference did
                    wants.append(geocomm.allreduce(x, codec=host, comm=comms[1], parts=parts))
            for d, x in zip(arrays, xs, strict=True):
                d.set(x)
            before = [dev.state_info(p[0][0]) for p in buckets]
            stream.synchronize()  # the last round's work is done
            with counted() as cost, _device.hold():
                for d, parts in zip(arrays, buckets, strict=True):
                    geocomm.allreduce(d, codec=dev, comm=comms[0], out=d, parts=parts)
            assert "syncs" not in cost, cost
            for d, want in zip(arrays, wants, strict=True):
                assert np.array_equal(d.get().view(np.uint32), want.view(np.uint32)), call
            after = [dev.state_info(p[0][0]) for p in buckets]
            steps += sum(
                b is not None and a["refreshed"] != b["refreshed"]
                for a, b in zip(after, before, strict=True)
            )
    assert steps >= 6, steps  # power steps were taken (and read) under the hold
    assert dev.state_checksum() == host.state_checksum()


def test_replays_leave_only_unfinished_transfers_watched(cp, comms):
    """Each replay hands its graph's work to the communicator's timeout watch; the watch
    lets go of what finished, so a training loop of replays (which starts no transfer of
    its own and may never synchronize the communicator) does not pile up events."""
    comm = comms[0]
    x = inputs(comm.rank, COUNT)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        d, out = cp.asarray(x), cp.empty(COUNT, cp.float32)
        for _ in range(12):
            device_call(cp, comms, d, out, "fp8", stage_size=COUNT // 8)
            stream.synchronize()  # this call's transfers are done
    # at most the last replay's event is left: every earlier one had finished when the
    # next replay was watched
    assert len(comm.queued) <= 1, len(comm.queued)


@pytest.mark.parametrize(
    ("codec", "stages"),
    [
        ({"id": "fp8", "rounding": "stochastic", "seed": 3}, 1),
        ({"id": "fp8", "rounding": "stochastic", "seed": 3}, 8),
        ({"id": "nvfp4", "rounding": "stochastic", "seed": 5}, 8),
    ],
)
def test_a_stochastic_call_replays_with_its_own_key(cp, comms, codec, stages):
    """Stochastic rounding draws a new key every call. The kernels read it from the
    plan's device memory, which each call writes first, so a steady call is that
    one-thread kernel and one graph launch, and every replay rounds with its own call's
    key: the same bits as the host path's call of the same number, which differ from
    call to call."""
    comm = comms[0]
    x = inputs(comm.rank, COUNT)
    stage_size = COUNT // stages
    from geocomm.engine import call as calls

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        d, out = cp.asarray(x), cp.empty(COUNT, cp.float32)
        costs, results = [], []
        for i in range(5):
            with calls.saved_call_counts():
                want = reference(comms, x, codec, stage_size=stage_size)
            with counted() as cost:
                device_call(cp, comms, d, out, codec, stage_size=stage_size)
            costs.append(cost)
            results.append(out.get())
            assert np.array_equal(results[-1].view(np.uint32), want.view(np.uint32)), i
    first, captured, *steady = costs
    assert first.get("allocations", 0) > 0, "the first call plans the signature"
    assert captured.get("captured", 0) > 0 and captured.get("graph_launches") == 1
    for cost in steady:
        # the keys' kernel, one graph launch and the event that watches it for timeouts
        assert cost == {"launches": 1, "graph_launches": 1, "events": 1}, cost
    # the keys do change: replays do not repeat the captured call's rounding
    assert not np.array_equal(results[2], results[3])


def test_a_changed_signature_is_planned_again_and_new_arrays_replay_its_graph(cp, comms):
    """A new count is a new signature (planned: it allocates). New arrays of a known
    signature replay its graph after one launch of one thread that tells the kernels
    where this call's arrays lie (gc_pipe_set_call); so does the call that goes back to
    the arrays it was captured with, and from then on a call on them is one graph
    launch again."""
    comm = comms[0]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a, out_a = cp.asarray(inputs(comm.rank, COUNT)), cp.empty(COUNT, cp.float32)
        for _ in range(3):
            device_call(cp, comms, a, out_a, "fp8")
        b, out_b = cp.asarray(inputs(comm.rank, COUNT, tag=1)), cp.empty(COUNT, cp.float32)
        with counted() as new_arrays:
            device_call(cp, comms, b, out_b, "fp8")
        got_b = out_b.get()
        costs = []
        for _ in range(2):
            with counted() as back:
                device_call(cp, comms, a, out_a, "fp8")
            costs.append(back)
        got_a = out_a.get()
        small, out_small = cp.asarray(inputs(comm.rank, 5000)), cp.empty(5000, cp.float32)
        with counted() as new_count:
            device_call(cp, comms, small, out_small, "fp8")
    assert new_arrays == {"launches": 1, "graph_launches": 1, "events": 1}, new_arrays
    assert costs == [new_arrays, {"graph_launches": 1, "events": 1}], costs
    assert new_count.get("allocations", 0) > 0, "a new signature makes its plan"
    want_b = reference(comms, inputs(comm.rank, COUNT, tag=1), "fp8")
    assert np.array_equal(got_b.view(np.uint32), want_b.view(np.uint32))
    want_a = reference(comms, inputs(comm.rank, COUNT), "fp8")
    assert np.array_equal(got_a.view(np.uint32), want_a.view(np.uint32))


def test_buffers_used_in_turn_replay_one_graph(cp, comms):
    """A caller that alternates between output buffers (double buffering, or more
    buffers than a plan keeps graphs) runs the first call eagerly, captures the second
    and replays that graph from then on, into whichever buffer a call names. (A count
    of its own: a new signature.)"""
    comm = comms[0]
    count = COUNT - 4096
    x = inputs(comm.rank, count)
    want = reference(comms, x, "fp8")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        d = cp.asarray(x)
        outs = [cp.empty(count, cp.float32) for _ in range(6)]
        costs = []
        for i in range(14):
            out = outs[i % 2] if i < 8 else outs[i % 6]
            out.fill(0)
            with counted() as cost:
                device_call(cp, comms, d, out, "fp8")
            costs.append(cost)
            assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), i
    assert "graph_launches" not in costs[0] and costs[1].get("captured", 0) > 0, costs[:2]
    for cost in costs[2:]:
        assert cost == {"launches": 1, "graph_launches": 1, "events": 1}, costs


@pytest.mark.parametrize("same_out", [False, True])
def test_a_call_on_another_stream_waits_for_the_plans_last_one(cp, comms, same_out):
    """The plan's buffers are reused by every call of its signature: a call on another
    stream must not touch them before the last call's work on its stream is done. Calls
    alternate between two streams with no host wait in between; the twin's
    stream-order checker raises if one call's kernels or transfers touch the buffers
    unordered with the other's; every result stays exact. With one ``out`` for every
    call, the calls replay one graph on both streams."""
    comm = comms[0]
    x = inputs(comm.rank, COUNT)
    want = reference(comms, x, "nvfp4")
    d = cp.asarray(x)
    outs = (
        [cp.empty(COUNT, cp.float32)] * 6
        if same_out
        else [cp.empty(COUNT, cp.float32) for _ in range(6)]
    )
    cp.cuda.Device().synchronize()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    for i, out in enumerate(outs):
        with streams[i % 2]:
            device_call(cp, comms, d, out, "nvfp4")
    cp.cuda.Device().synchronize()
    for i, out in enumerate(outs):
        assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32)), i


def test_a_dropped_signatures_buffers_come_back_after_its_last_calls_work(cp, monkeypatch):
    """A signature's buffers come from CuPy's pool on the stream of its first call; its
    later calls may run on another. When the signature is dropped (evicted from its
    communicator's cache here, which keeps one), the pool hands its blocks out again on
    the first stream at once: a new signature's plan there takes them back while the
    other stream's last call may still use them, unless the first stream waited for that
    call. The twin pools as CuPy does and reports the race; the blocks must come back
    (the assertion on their addresses), so the test has teeth."""
    from cupy import _device

    from geocomm.api import calls
    from geocomm.comm.nccl import NCCLCommunicator

    monkeypatch.setattr(calls, "SIGNATURES_KEPT", 1)
    comm = NCCLCommunicator(MPICommunicator().comm.Dup())  # a cache of its own
    first, other = (cp.cuda.Stream(non_blocking=True) for _ in range(2))
    with first:
        d, out = cp.asarray(inputs(comm.rank, COUNT)), cp.empty(COUNT, cp.float32)
        geocomm.allreduce(d, codec="fp8", comm=comm, out=out)
        (signature,) = getattr(comm, calls._SIGNATURES).values()
        (plan,) = signature[0].plans["flat"].device_plans.values()
        blocks = {a.data.ptr for a in (*plan.a2a_send, *plan.a2a_recv, *plan.ag_buf)}
        del signature, plan
    other.wait_event(first.record())
    with other:
        for _ in range(3):  # eager, captured, replayed: the buffers' last users
            geocomm.allreduce(d, codec="fp8", comm=comm, out=out)
    deadline = time.monotonic() + 60  # the twin ran other's work; the host never waited
    while other._queue and time.monotonic() < deadline:
        time.sleep(0.001)
    with first:
        geocomm.allreduce(d[:-1], codec="fp8", comm=comm, out=out[:-1])  # evicts the first
        gc.collect()
        geocomm.allreduce(d, codec="fp8", comm=comm, out=out)  # a plan made on first again
        (signature,) = getattr(comm, calls._SIGNATURES).values()
        (plan,) = signature[0].plans["flat"].device_plans.values()
        again = {a.data.ptr for a in (*plan.a2a_send, *plan.a2a_recv, *plan.ag_buf)}
        assert blocks & again, "the pool handed the dropped plan's blocks back"
    first.synchronize()
    assert not _device._failure
    comm.close()


def drain_aborted(comm) -> None:
    """Once ``comm`` is aborted, wait (at most 60 s) until its stuck transfers failed and
    every stream drained, so that nothing of this test outlives it."""
    if not comm.aborted:
        return
    from cupy import _device

    deadline = time.monotonic() + 60  # (an aborted transfer fails, then leaves)
    while time.monotonic() < deadline and any(
        s._queue for s in list(_device._streams_by_ptr.values())
    ):
        time.sleep(0.01)


@pytest.mark.mpi(min_size=2)
def test_a_call_that_differs_at_a_capture_fails_at_once_on_every_rank():
    """The call that captures a signature's graph exchanges with the other ranks whether
    their captures succeeded, so it settles the cross-rank checks still open first: a
    call that differs across ranks then raises CollectiveMismatchError at once, where the
    exchange would have waited out GEOCOMM_TIMEOUT and blamed a lost peer (or paired
    with the peer's next check). Here every rank calls A, B, B; then rank 0 calls A
    again (its capture of A) where the others call B (a replay). (No ``cp`` fixture: its
    device synchronization would raise what the aborted transfers left, a sticky error
    on the twin.)"""
    import cupy as cp
    from mpi4py import MPI

    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator(MPI.COMM_WORLD.Dup())  # its open checks meet no other test's
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a, b = cp.ones(4096, cp.float32), cp.ones(8192, cp.float32)
        a_out, b_out = cp.empty_like(a), cp.empty_like(b)
        for x, out in ((a, a_out), (b, b_out), (b, b_out)):
            geocomm.allreduce(x, codec="fp8", comm=comm, out=out)
        stream.synchronize()
        x, out = (a, a_out) if comm.rank == 0 else (b, b_out)
        if comm.rank:  # rank 0 captures before the others' rows are there to check
            time.sleep(0.5)
        began = time.monotonic()
        with pytest.raises(geocomm.CollectiveMismatchError):
            geocomm.allreduce(x, codec="fp8", comm=comm, out=out)
            comm.synchronize()  # the ranks that replayed find it when they settle
        assert time.monotonic() - began < 30, "found from the rows, not after a timeout"
    drain_aborted(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differs", ["op", "refused"])
def test_a_steady_call_that_differs_across_ranks_fails_on_every_rank(differs):
    """Later calls of a known signature compare their fingerprint without waiting for the
    other ranks. Rank 1's call differs where the others repeat their sum: ``op``, it
    asks for an average, and fails at once, since its signature is new and checked
    before it moves; ``refused``, it passes a float64 array through fp8 and refuses
    the call on its own (TypeError), its part of the check marked refused. The others
    find the mismatch once rank 1's row has arrived, at the latest when more than
    IN_FLIGHT checks are open; a call found to differ after it moved aborts the
    communicator (its transfers cannot complete), and so does one found before it
    moved, on rank 1 too: the others' transfers of that call are queued, and would
    pair with the next call's. (The communicator runs over a duplicate of MPI's world:
    the checks left open on it never meet another test's collectives.)"""
    import cupy as cp
    from mpi4py import MPI

    from geocomm.comm.nccl import NCCLCommunicator
    from geocomm.engine.checks import IN_FLIGHT

    comm = NCCLCommunicator(MPI.COMM_WORLD.Dup())
    stream = cp.cuda.Stream(non_blocking=True)
    found = "op" if differs == "op" else "ranks [1] refused"
    with stream:
        d, out = cp.asarray(inputs(comm.rank, COUNT)), cp.empty(COUNT, cp.float32)
        for _ in range(2):
            geocomm.allreduce(d, codec="fp8", comm=comm, out=out)
        # the matching calls finish first: an abort drops what its rank has queued, and
        # a peer's transfers of a call the aborting rank dropped would wait for good
        stream.synchronize()
        if comm.rank == 1:
            if differs == "op":
                with pytest.raises(geocomm.CollectiveMismatchError, match="op"):
                    geocomm.allreduce(d, codec="fp8", op="avg", comm=comm, out=out)
            else:
                with pytest.raises(TypeError, match="float64"):
                    geocomm.allreduce(d.astype(cp.float64), codec="fp8", comm=comm)
            assert comm.aborted
            return
        raised_at = None
        for call in range(IN_FLIGHT + 2):
            try:
                geocomm.allreduce(d, codec="fp8", comm=comm, out=out)
            except geocomm.CollectiveMismatchError as exc:
                assert found in str(exc)
                raised_at = call
                break
    assert raised_at is not None, "a mismatch is found within IN_FLIGHT + 1 calls"
    assert comm.aborted
    drain_aborted(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("finish", ["synchronize", "barrier", "close"])
def test_a_last_call_that_differs_across_ranks_fails_where_the_job_finishes(finish):
    """The last calls' checks are still in flight when no call follows; the NCCL
    communicator's synchronize(), barrier() and close() finish them before they wait for
    the transfers. Here the ranks' last calls differ (rank 1 averages where the others
    sum), known signatures both, so their checks are deferred. Rank 1 calls only once
    every other rank's call returned (an MPI barrier of the world), so their checks
    cannot have finished in the call: ``finish`` raises the mismatch on them, and aborts
    (their call moved), where it used to time out or, had rank 1's transfers come, end
    the job with rank 1's result a sum over N and nothing said. Rank 1 raises at its
    call or at ``finish``; every rank's communicator is aborted."""
    import cupy as cp
    from mpi4py import MPI

    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator(MPI.COMM_WORLD.Dup())
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        d, out = cp.asarray(inputs(comm.rank, COUNT)), cp.empty(COUNT, cp.float32)
        for op in ("sum", "avg", "sum", "avg"):  # both signatures known and checked
            geocomm.allreduce(d, codec="fp8", op=op, comm=comm, out=out)
        stream.synchronize()
        if comm.rank != 1:
            geocomm.allreduce(d, codec="fp8", comm=comm, out=out)
        MPI.COMM_WORLD.barrier()
        with pytest.raises(geocomm.CollectiveMismatchError, match="op"):
            if comm.rank == 1:
                geocomm.allreduce(d, codec="fp8", op="avg", comm=comm, out=out)
            getattr(comm, finish)()
    assert comm.aborted
    comm.close()  # nothing left to do once aborted
    drain_aborted(comm)


def test_the_ddp_hooks_calls_replay_over_nccl_bootstrapped_by_torch(cp):
    """What the DDP hook runs for a CUDA bucket (dedicated_comm's communicator: geocomm's
    NCCL over a gloo group of torch.distributed, metered; one compressed all-reduce of
    the bucket with a key per parameter, averaged in place): from the third step on a
    bucket replays one graph and allocates nothing, the meter still counts every
    step's bytes, and the result is NumPy's over MPI, bit for bit."""
    import torch.distributed as dist

    from geocomm.adapters.torch import init_distributed_from_mpi
    from geocomm.comm.nccl import NCCLCommunicator
    from geocomm.comm.torchdist import TorchDistCommunicator
    from geocomm.testing import MeteredComm

    init_distributed_from_mpi("gloo")
    host = TorchDistCommunicator(dist.new_group(backend="gloo"))
    comm = MeteredComm(NCCLCommunicator(host))
    parts = [("w1", (256, 64)), ("b1", (256,)), ("w2", (3, 256))]
    count = sum(int(np.prod(s)) for _, s in parts)
    x = inputs(comm.rank, count, tag=5)
    want = geocomm.allreduce(x, codec="fp8", op="avg", parts=parts, comm=MPICommunicator())
    stream = cp.cuda.Stream(non_blocking=True)
    sent, costs = [], []
    with stream:
        bucket = cp.empty(count, cp.float32)
        for _ in range(4):
            bucket.set(x)
            before = comm.sent
            with counted() as cost:
                geocomm.allreduce(
                    bucket, codec="fp8", op="avg", out=bucket, parts=parts, comm=comm, check=False
                )
            costs.append(cost)
            sent.append(comm.sent - before)
            assert np.array_equal(bucket.get().view(np.uint32), want.view(np.uint32))
    # every step sends the same bytes, whether eager, captured or replayed
    assert len(set(sent)) == 1 and (sent[0] > 0) == (comm.size > 1), sent
    # the steady step: the graph and the average's one kernel... all inside the graph
    assert costs[-1] == {"graph_launches": 1, "events": 1}, costs[-1]


def test_the_ddp_hooks_geofp8_buckets_replay_between_power_steps(cp):
    """The DDP hook's call for a CUDA bucket (as above: NCCL bootstrapped by a gloo group
    of torch.distributed, metered, averaged in place) with GeoFP8 and a low-rank weight
    gradient, the same every step: its steps between power steps replay one graph from
    their second on (those with a step, from their third: the test above), with the
    side channel's all-gather inside,
    which the meter counts at every replay as at an eager call; the result is NumPy's
    over MPI, bit for bit, every step. Counted once the key's refresh period reached
    refresh_max (8): the side budget charges a power step's sums over the period, so
    the weight's rank, and with it the side channel's layout, grows until then."""
    import torch.distributed as dist

    from geocomm.adapters.torch import init_distributed_from_mpi
    from geocomm.comm.nccl import NCCLCommunicator
    from geocomm.comm.torchdist import TorchDistCommunicator
    from geocomm.engine import call as calls
    from geocomm.testing import MeteredComm

    init_distributed_from_mpi("gloo")
    host = TorchDistCommunicator(dist.new_group(backend="gloo"))
    comm = MeteredComm(NCCLCommunicator(host))
    parts = [("w1", (256, 128)), ("b1", (256,)), ("w2", (8, 256))]
    count = sum(int(np.prod(s)) for _, s in parts)
    rows = np.random.default_rng(4).standard_normal((4, 128))
    own = np.random.default_rng([comm.rank, 4])
    w1 = 10 * own.standard_normal((256, 4)) @ rows + 0.01 * own.standard_normal((256, 128))
    rest = own.standard_normal(count - w1.size)
    x = np.concatenate([w1.reshape(-1), rest]).astype(np.float32)
    config = {"id": "geofp8", "k": 4}
    dev, ref = geocomm.get_codec(config), geocomm.get_codec(config)
    options = {"op": "avg", "parts": parts}
    stream = cp.cuda.Stream(non_blocking=True)
    steady_sent, steady_costs = [], []
    with stream:
        bucket = cp.empty(count, cp.float32)
        for _ in range(24):
            with calls.saved_call_counts():
                want = geocomm.allreduce(x, codec=ref, comm=MPICommunicator(), **options)
            bucket.set(x)
            refreshed = dev.state_info("w1") and dev.state_info("w1")["refreshed"]
            before = comm.sent
            with counted() as cost:
                geocomm.allreduce(bucket, codec=dev, out=bucket, comm=comm, check=False, **options)
            assert np.array_equal(bucket.get().view(np.uint32), want.view(np.uint32))
            state = dev.state_info("w1")
            if refreshed and state["refreshed"] == refreshed and state["period"] == 8:
                steady_sent.append(comm.sent - before)
                steady_costs.append(cost)
    assert dev.state_info("w1")["use"] > 0, "the weight's gradient was mapped"
    assert len(steady_costs) >= 8, steady_costs
    assert len(set(steady_sent)) == 1 and (steady_sent[0] > 0) == (comm.size > 1), steady_sent
    for cost in steady_costs[2:]:
        assert cost == {"graph_launches": 1, "events": 1}, steady_costs
