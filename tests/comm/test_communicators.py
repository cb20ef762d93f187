"""The collectives over communicators other than COMM_WORLD (mpi4py's matrix).

Every collective runs over ``MPI.COMM_SELF``, ``COMM_WORLD``, a ``Dup`` of
it and a ``Split`` into the even and the odd world ranks, ordered by
descending world rank inside each group (so group rank and world rank
differ). Which world ranks form this rank's group, and in what order, is
written in terms of rank and size (:func:`members`), not read back from MPI:
the test checks that MPI agrees. Inputs are rebuilt from world ranks, so
every rank knows its group's inputs; the expected result is what
:mod:`geocomm.testing` simulates for that group, bit for bit, and for the
exact codec the integer-valued sum itself. Results must be bitwise identical
within a group. Passes at any ``-n``; at 4 ranks the split makes two groups
of two.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest

import geocomm
from geocomm import get_codec
from geocomm.api import resolve_codec
from geocomm.comm.mpi import MPICommunicator
from geocomm.testing import roundtrip, simulate_allreduce, simulate_reduce_scatter

MPI = pytest.importorskip("mpi4py.MPI")

pytestmark = pytest.mark.mpi

GROUPS = ("self", "world", "dup", "split")
#: codec config and pipeline chunk. Small matrices are eligible for GeoFP8; NVFP4
#: scales per piece, so it keeps one pipeline stage to match the simulation.
CODECS = {
    "none": ("none", 1000),
    "fp8": ({"id": "fp8", "fmt": "e4m3", "block": 128}, 1000),
    "nvfp4": ("nvfp4", None),
    "geofp8": ({"id": "geofp8", "min_dim": 8, "min_numel": 0}, 1000),
}
SHAPE = (97, 83)  # 8051 values: shards of every size are ragged, blocks split
STEPS = 3  # GeoFP8 measures on the first call, maps from the second on


def members(kind: str, rank: int, size: int) -> list[int]:
    """World ranks of the group of world rank ``rank``, in group-rank order."""
    if kind == "self":
        return [rank]
    if kind in ("world", "dup"):
        return list(range(size))
    return sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)


def mpi_comm(kind: str, world: MPI.Comm) -> MPI.Comm:
    """The mpi4py communicator of ``kind``; Split's key -rank reverses the order."""
    if kind == "self":
        return MPI.COMM_SELF
    if kind == "world":
        return world
    if kind == "dup":
        return world.Dup()
    return world.Split(world.Get_rank() % 2, -world.Get_rank())


@pytest.fixture(params=GROUPS)
def group(request):
    """(geocomm communicator over the group, world ranks of its members in group order)."""
    world = MPI.COMM_WORLD
    raw = mpi_comm(request.param, world)
    world_ranks = members(request.param, world.Get_rank(), world.Get_size())
    try:
        comm = MPICommunicator(raw)
        assert comm.size == len(world_ranks)
        assert comm.rank == world_ranks.index(world.Get_rank())
        yield comm, world_ranks
    finally:
        if raw not in (MPI.COMM_SELF, world):
            raw.Free()


def inputs(world_ranks: list[int], step: int) -> list[np.ndarray]:
    """The members' gradients (group-rank order): a shared rank-4 signal plus each
    world rank's noise, in multiples of 1/64 below 2^5, so that fp32 sums of a
    few are exact."""
    shared = np.random.default_rng([step, 4])
    signal = shared.standard_normal((SHAPE[0], 4)) @ shared.standard_normal((4, SHAPE[1]))
    xs = []
    for r in world_ranks:
        noise = np.random.default_rng([r, step, 5]).standard_normal(SHAPE)
        xs.append((np.round((signal + 0.3 * noise) * 64) / 64).astype(np.float32))
    return xs


def identical_in_group(comm, array: np.ndarray) -> bool:
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).digest()
    rows = comm.allgather_int64(np.frombuffer(digest[:8], np.int64))
    return bool((rows == rows[0]).all())


@pytest.mark.parametrize("name", list(CODECS))
def test_allreduce(group, name):
    comm, world_ranks = group
    config, chunk = CODECS[name]
    mine = get_codec(config)
    simulated = [get_codec(config) for _ in world_ranks]  # one state per member
    for step in range(STEPS):
        xs = inputs(world_ranks, step)
        got = geocomm.allreduce(xs[comm.rank], codec=mine, key="w", comm=comm, stage_size=chunk)
        assert got.shape == SHAPE and got.dtype == np.float32
        assert np.array_equal(got, simulate_allreduce(simulated, xs, key="w"))
        if name == "none":
            assert np.array_equal(got, np.sum(xs, axis=0, dtype=np.float64))
        assert identical_in_group(comm, got)
    if name == "geofp8":
        assert mine.state_checksum() == simulated[0].state_checksum()
        assert mine.state_info("w")["vt"] is not None  # the map was in use


@pytest.mark.parametrize("name", list(CODECS))
def test_reduce_scatter(group, name):
    comm, world_ranks = group
    config, chunk = CODECS[name]
    mine = get_codec(config)
    simulated = [get_codec(config) for _ in world_ranks]
    mine_of_all = np.array_split(np.arange(SHAPE[0] * SHAPE[1]), comm.size)[comm.rank]
    for step in range(STEPS):
        xs = inputs(world_ranks, step)
        shard = geocomm.reduce_scatter(
            xs[comm.rank], codec=mine, key="w", comm=comm, stage_size=chunk
        )
        assert shard.shape == mine_of_all.shape
        assert np.array_equal(shard, simulate_reduce_scatter(simulated, xs, key="w")[comm.rank])
        if name == "none":
            total = np.sum(xs, axis=0, dtype=np.float64).reshape(-1)
            assert np.array_equal(shard, total[mine_of_all])


@pytest.mark.parametrize("name", list(CODECS))
def test_allgather(group, name):
    comm, world_ranks = group
    config, _ = CODECS[name]
    codec = get_codec(config)
    xs = inputs(world_ranks, step=0)
    rows = geocomm.allgather(xs[comm.rank], codec=codec, comm=comm)
    assert rows.shape == (len(world_ranks), *SHAPE)
    # every member's array through the wire format once (GeoFP8: its quantizer, no map)
    expected = np.stack([roundtrip(codec, x).reshape(SHAPE) for x in xs])
    assert np.array_equal(rows, expected)
    if name == "none":
        assert np.array_equal(rows, np.stack(xs))
    assert identical_in_group(comm, rows)


def test_a_codec_named_by_id_keeps_a_state_per_communicator():
    """GeoFP8's allocation of directions spans every key its codec instance holds, so
    one instance shared by the calls of two communicators gave the ranks of the
    second different allocations when only some of them had called on the first:
    side channels of other sizes (MPI_ERR_TRUNCATE, or a crash) at 3 ranks, a
    sub-communicator of ranks 0 and 1 first. A codec named by id or config is now
    one instance per communicator; the world's calls match the simulation."""
    world = MPI.COMM_WORLD
    config = {"id": "geofp8", "min_dim": 8, "min_numel": 0}
    raw = world.Split(int(world.Get_rank() < 2), world.Get_rank())
    try:
        sub = MPICommunicator(raw)
        world_comm = MPICommunicator(world)
        assert resolve_codec(config, sub) is not resolve_codec(config, world_comm)
        if world.Get_rank() < 2:
            for step in range(4):
                x = inputs(list(range(sub.size)), step)[sub.rank] * 8
                geocomm.allreduce(x.reshape(-1)[: 96 * 80].reshape(96, 80), codec=config,
                                  key="z", comm=sub)  # fmt: skip
        ranks = list(range(world.Get_size()))
        simulated = [get_codec(config) for _ in ranks]
        for step in range(STEPS + 1):
            xs = inputs(ranks, step)
            got = geocomm.allreduce(xs[world_comm.rank], codec=config, key="w", comm=world_comm)
            assert np.array_equal(got, simulate_allreduce(simulated, xs, key="w"))
    finally:
        raw.Free()


def test_world_ranks_name_the_group(group):
    """A communicator names its processes by their ranks in the world, in its own rank
    order (what tells a codec's group apart; Split's key -rank reverses the order)."""
    comm, world_ranks = group
    assert comm.world_ranks() == tuple(world_ranks)


def test_a_codec_object_serves_one_group_of_ranks():
    """A Codec object keeps one state wherever it is used: shared by the calls of the
    world and of a sub-communicator, GeoFP8's allocation then differed across the
    world's ranks (MPI_ERR_TRUNCATE at 3 ranks). Its state now serves the first group
    of ranks that calls with it: another group's call raises ValueError on each of its
    ranks before anything moves, and the world's calls go on as the simulation's. A
    communicator of the same ranks (a Dup) shares the state; reset_state() frees it."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("one rank makes one group of ranks")
    config = {"id": "geofp8", "min_dim": 8, "min_numel": 0}
    codec = get_codec(config)
    world_comm = MPICommunicator(world)
    ranks = list(range(size))
    simulated = [get_codec(config) for _ in ranks]
    raw_sub, raw_dup = world.Split(int(rank == 0), rank), world.Dup()
    try:
        sub, dup = MPICommunicator(raw_sub), MPICommunicator(raw_dup)
        for step in range(STEPS + 1):
            xs = inputs(ranks, step)
            on = world_comm if step % 2 == 0 else dup  # the same ranks: one state
            got = geocomm.allreduce(xs[rank], codec=codec, key="w", comm=on)
            assert np.array_equal(got, simulate_allreduce(simulated, xs, key="w"))
            mine = sorted(r for r in ranks if (r == 0) == (rank == 0))
            held = re.escape(f"of ranks {ranks}; a call of ranks {mine}")
            with pytest.raises(ValueError, match=held):
                geocomm.allreduce(xs[rank], codec=codec, key="z", comm=sub)
        codec.reset_state()  # now free for the sub-communicator's calls
        x = inputs(ranks, 0)[rank]
        assert geocomm.allreduce(x, codec=codec, key="z", comm=sub).shape == x.shape
        with pytest.raises(
            ValueError, match=re.escape(f"of ranks {mine}; a call of ranks {ranks}")
        ):
            geocomm.allreduce(x, codec=codec, key="w", comm=world_comm)  # a signature cached
    finally:
        raw_sub.Free()
        raw_dup.Free()


def test_node_keys_are_equal_on_one_host():
    """A node key is a hash of the host (this suite's ranks share one): the same on
    every rank, without a collective of its own."""
    comm = MPICommunicator(MPI.COMM_WORLD)
    key = comm.node_key()
    assert key >= 0
    assert (comm.allgather_int64(np.array([key], np.int64)) == key).all()


def test_first_calls_on_two_communicators_from_two_threads():
    """The first compressed call of a communicator learns its node layout. That split
    the communicator (``Split_type``, then a blocking all-reduce): first calls on two
    communicators made from two threads at once deadlocked Open MPI 5 within 30 rounds
    (the timeout could not fire). Now the layout takes one bounded all-gather."""
    import threading

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("MPI gave less than MPI_THREAD_MULTIPLE")
    x = np.ones(1 << 12, np.float32)
    for _ in range(30):
        a, b = (MPICommunicator(MPI.COMM_WORLD.Dup()) for _ in range(2))
        errors: list[Exception] = []

        def second(comm: MPICommunicator, errors: list[Exception]) -> None:
            try:
                geocomm.allreduce(x, codec="fp8", comm=comm)
            except Exception as exc:  # reported below, on this rank
                errors.append(exc)

        thread = threading.Thread(target=second, args=(b, errors))
        thread.start()
        geocomm.allreduce(x, codec="fp8", comm=a)
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
        a.comm.Free()
        b.comm.Free()


def test_init_sets_the_default_to_any_mpi4py_communicator():
    """geocomm.init(MPI.COMM_SELF): collectives without comm= stay on this rank."""
    previous = geocomm.get_comm()
    try:
        comm = geocomm.init(MPI.COMM_SELF)
        assert (comm.rank, comm.size) == (0, 1)
        x = inputs([MPI.COMM_WORLD.Get_rank()], step=0)[0]
        assert np.array_equal(geocomm.allreduce(x, codec="none"), x)
        assert np.array_equal(
            geocomm.allreduce(x, codec="fp8"), roundtrip(get_codec("fp8"), x).reshape(SHAPE)
        )
    finally:
        geocomm.init(previous)


def test_nccl_from_either_wheel_is_found(tmp_path):
    """nvidia-nccl-cu12 and nvidia-nccl-cu13 both put libnccl.so.2 at nvidia/nccl/lib of
    their site directory: the first such file on the path is the one loaded before
    CuPy's NCCL binding, and none is found where no wheel is installed."""
    from geocomm.comm.nccl import nccl_wheel_library

    empty, site = tmp_path / "empty", tmp_path / "site"
    library = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    empty.mkdir()
    assert nccl_wheel_library([str(empty)]) is None
    assert nccl_wheel_library([str(empty), str(site)]) == library
