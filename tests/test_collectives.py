"""Compressed collectives on MPI: correctness at any rank count.

Expected values are written in terms of rank and size; every rank rebuilds
every other rank's input from a seed, so any ``-n`` works. Error bounds are
the per-element worst cases derived in ``geocomm.codecs.bounds``, never tuned
to a run.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest

import geocomm
from geocomm import CollectiveMismatchError, get_codec
from geocomm.codecs import bounds
from geocomm.engine.layout import shard_bounds

pytestmark = pytest.mark.mpi

CODECS = {
    "none": "none",
    "bf16": "bf16",
    "fp8": {"id": "fp8", "fmt": "e4m3", "block": 128},
    "fp8-e5m2": {"id": "fp8", "fmt": "e5m2", "block": 0},
    "nvfp4": "nvfp4",
}
COUNTS = [0, 1, 2, 97, 1000, 12_345, 300_007]


def inputs(count: int, size: int, tag: int, dtype=np.float32) -> list[np.ndarray]:
    """Every rank's input, rebuildable on any rank."""
    return [
        np.random.default_rng([r, count, tag]).standard_normal(count).astype(dtype)
        for r in range(size)
    ]


def single_bound(values: np.ndarray, name: str) -> np.ndarray:
    return bounds.single_bound(values, get_codec(CODECS[name]))


def two_stage_bound(xs: list[np.ndarray], name: str) -> np.ndarray:
    return bounds.allreduce_bound(xs, get_codec(CODECS[name]))


def same_on_all_ranks(comm, array: np.ndarray) -> bool:
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).digest()
    rows = comm.allgather_int64(np.frombuffer(digest[:8], np.int64))
    return bool((rows == rows[0]).all())


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce_error_bound_and_identical(comm, name, count, op):
    xs = inputs(count, comm.size, tag=1)
    y = geocomm.allreduce(xs[comm.rank].copy(), codec=CODECS[name], op=op, stage_size=4096)
    assert y.dtype == np.float32 and y.shape == (count,)
    assert same_on_all_ranks(comm, y)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    scale = comm.size if op == "avg" else 1
    err = np.abs(y.astype(np.float64) * scale - exact)
    # avg divides the fp32 result by N: one more rounding, relative 2^-24
    assert np.all(err <= two_stage_bound(xs, name) + 2.0**-23 * np.abs(exact))


def test_none_is_exact(comm):
    """Integers up to 2^24 add exactly in fp32: the plain path must be exact."""
    count = 1001
    x = (np.arange(count) + comm.rank + 1).astype(np.float32)
    y = geocomm.allreduce(x, codec=None)
    n = comm.size
    expected = n * np.arange(count) + n * (n + 1) // 2
    np.testing.assert_array_equal(y, expected.astype(np.float32))


@pytest.mark.parametrize("name", ["none", "fp8", "bf16", "nvfp4"])
@pytest.mark.parametrize("chunk", [None, 777])
def test_inplace_out(comm, name, chunk):
    """out=x and a separate out both receive the reduction directly; with many
    pipeline stages (chunk 777) in place stays exact because a stage only
    writes ranges the pipeline has already encoded."""
    xs = inputs(5000, comm.size, tag=2)
    x = xs[comm.rank].copy()
    expected = geocomm.allreduce(x.copy(), codec=CODECS[name], stage_size=chunk)
    out = np.full_like(x, np.nan)
    assert geocomm.allreduce(x, codec=CODECS[name], out=out, stage_size=chunk) is out
    np.testing.assert_array_equal(out, expected)
    result = geocomm.allreduce(x, codec=CODECS[name], out=x, stage_size=chunk)
    assert result is x
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("name", ["none", "fp8"])
def test_out_overlapping_x_at_an_offset(comm, name):
    """out sharing x's buffer one element further on is not reduced into
    directly (the pipeline would overwrite values it has not read yet)."""
    xs = inputs(3001, comm.size, tag=9)
    expected = geocomm.allreduce(xs[comm.rank].copy(), codec=CODECS[name], stage_size=500)
    buf = np.empty(3002, np.float32)
    buf[:3001] = xs[comm.rank]
    result = geocomm.allreduce(buf[:3001], codec=CODECS[name], out=buf[1:], stage_size=500)
    np.testing.assert_array_equal(result, expected)


def test_scratch_pool_reuses_and_isolates_threads():
    """Wire buffers come back from the per-thread pool at the right size, and a
    buffer held by one thread is never handed to another."""
    import threading

    from geocomm.engine.host import _ScratchPool

    pool = _ScratchPool()
    a = pool.take(np, 1000)
    assert a.size == 1000 and a.dtype == np.uint8
    pool.give_back([a])
    b = pool.take(np, 600)
    assert b.size == 600 and np.shares_memory(a, b)  # reused, trimmed view
    pool.give_back([b])
    seen = []
    worker = threading.Thread(target=lambda: seen.append(pool.take(np, 600)))
    worker.start()
    worker.join()
    assert not np.shares_memory(seen[0], b)  # the other thread's pool was empty
    big = [pool.take(np, pool.KEEP_BYTES // 2 + 1) for _ in range(3)]
    pool.give_back(big)
    assert len(pool._free()) <= 2  # the smaller buffer stays, big ones beyond the budget go


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", ["none", "fp8"])
def test_low_precision_dtypes_keep_dtype_and_shape(comm, dtype, name):
    xs = inputs(6 * 35, comm.size, tag=3, dtype=dtype)
    x = xs[comm.rank].reshape(6, 5, 7)
    y = geocomm.allreduce(x, codec=CODECS[name])
    assert y.dtype == np.dtype(dtype) and y.shape == (6, 5, 7)
    exact = np.sum([v.astype(np.float64) for v in xs], axis=0).reshape(6, 5, 7)
    # input-dtype rounding of the result: relative 2^-8 (bf16) or 2^-11 (fp16)
    out_u = 2.0**-8 if dtype == ml_dtypes.bfloat16 else 2.0**-11
    bound = two_stage_bound([v.astype(np.float32) for v in xs], name).reshape(6, 5, 7)
    assert np.all(
        np.abs(y.astype(np.float64) - exact) <= bound * (1 + out_u) + out_u * np.abs(exact) + 1e-6
    )


def test_float64_policy(comm):
    x = np.full(10, 0.1, np.float64) * (comm.rank + 1)
    y = geocomm.allreduce(x, codec="none")
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, 0.1 * comm.size * (comm.size + 1) / 2, rtol=1e-15)
    with pytest.raises(TypeError, match="float64"):
        geocomm.allreduce(x, codec="fp8")


@pytest.mark.parametrize("bad", [np.arange(4, dtype=np.int32), np.zeros(3, np.complex64)])
def test_non_float_rejected(comm, bad):
    with pytest.raises(TypeError, match="dtype"):
        geocomm.allreduce(bad, codec="fp8")


def test_noncontiguous_input(comm):
    xs = inputs(2 * 301, comm.size, tag=4)
    x = xs[comm.rank].reshape(301, 2)
    y = geocomm.allreduce(x.T, codec="fp8")  # a transposed, non-contiguous view
    expected = geocomm.allreduce(np.ascontiguousarray(x.T), codec="fp8")
    np.testing.assert_array_equal(y, expected)


def test_bad_out_and_op(comm):
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="op"):
        geocomm.allreduce(x, codec="fp8", op="max")
    with pytest.raises(ValueError, match="out"):
        geocomm.allreduce(x, codec="fp8", out=np.ones(9, np.float32))
    frozen = np.ones(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        geocomm.allreduce(x, codec="fp8", out=frozen)


def test_an_out_whose_elements_share_memory_is_refused(comm):
    """A broadcast view (stride 0) would keep only its last row of the result."""
    x = np.ones((4, 3), np.float32)
    shared = np.lib.stride_tricks.as_strided(np.zeros(3, np.float32), (4, 3), (0, 4))
    with pytest.raises(ValueError, match="share memory"):
        geocomm.allreduce(x, codec="none", out=shared)


@pytest.mark.parametrize("name", ["none", "fp8"])
def test_unaligned_arrays_reduce_like_aligned_ones(comm, name):
    """A float32 view at an odd byte offset is C-contiguous but unaligned: MPI cannot read
    it in place (it raised a KeyError from mpi4py), so it is copied, and an unaligned out
    is written through a copy; the result is the aligned input's."""
    xs = inputs(1000, comm.size, tag=11)
    raw = np.zeros(4 * 1000 + 1, np.uint8)
    x = np.frombuffer(raw.data, np.float32, count=1000, offset=1)
    x[...] = xs[comm.rank]
    assert not x.flags.aligned
    want = geocomm.allreduce(xs[comm.rank], codec=CODECS[name])
    np.testing.assert_array_equal(geocomm.allreduce(x, codec=CODECS[name]), want)
    out = np.frombuffer(np.zeros(4 * 1000 + 1, np.uint8).data, np.float32, 1000, 1)
    assert geocomm.allreduce(xs[comm.rank], codec=CODECS[name], out=out) is out
    np.testing.assert_array_equal(out, want)
    shard = geocomm.reduce_scatter(x, codec=CODECS[name])
    np.testing.assert_array_equal(shard, geocomm.reduce_scatter(xs[comm.rank], codec=CODECS[name]))


def test_parts_and_stage_size_are_checked(comm):
    """parts may be any iterable (a generator is read once); their dimensions and the
    stage size must be integers (2.5 was truncated to 2, "6" parsed, 4096.5 failed deep
    inside and True was taken for 1)."""
    x = np.ones(6, np.float32)
    parts = (p for p in [("a", (2, 3))])
    np.testing.assert_array_equal(geocomm.allreduce(x, codec="fp8", parts=parts), x * comm.size)
    for bad in ([("a", (2.5, 2)), ("b", (2,))], [("a", "6")]):
        with pytest.raises(TypeError, match="parts entries"):
            geocomm.allreduce(x, codec="fp8", parts=bad)
    for bad_size in (4096.5, True):
        with pytest.raises(TypeError, match="stage_size must be an integer"):
            geocomm.allreduce(x, codec="fp8", stage_size=bad_size)
    # a key names one tensor of a call: two would share one state (GeoFP8's basis
    # flipped between them from call to call); None keys stand for the shape
    for twice in ([("w", (3,)), ("w", (3,))], [(None, (3,)), (None, (3,))]):
        with pytest.raises(ValueError, match="twice"):
            geocomm.allreduce(x, codec="geofp8", parts=twice)
    np.testing.assert_array_equal(
        geocomm.allreduce(x, codec="fp8", parts=[(None, (2,)), (None, (4,))]), x * comm.size
    )


@pytest.mark.parametrize("name", ["fp8", "bf16"])
def test_chunking_does_not_change_bytes(comm, name):
    """Pieces start at multiples of 4096 within a shard, so 128-blocks never
    move with the chunk size: every chunk size gives the same bits."""
    xs = inputs(50_003, comm.size, tag=5)
    results = [
        geocomm.allreduce(xs[comm.rank], codec=CODECS[name], stage_size=chunk)
        for chunk in (256, 4096, 1 << 22)
    ]
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("count", [0, 1, 97, 12_345])
def test_reduce_scatter_shard(comm, name, count):
    xs = inputs(count, comm.size, tag=6)
    shard = geocomm.reduce_scatter(xs[comm.rank], codec=CODECS[name], op="sum", stage_size=2048)
    offsets = shard_bounds(count, comm.size)
    lo, hi = offsets[comm.rank], offsets[comm.rank + 1]
    assert shard.shape == (hi - lo,)
    assert shard.size == np.array_split(np.arange(count), comm.size)[comm.rank].size
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)[lo:hi]
    # one quantization per rank (block amax taken over the whole input: an
    # upper bound of every piece's), then the owner's fp32 sum
    bound = bounds.reduce_scatter_bound(xs, get_codec(CODECS[name]))[lo:hi]
    assert np.all(np.abs(shard - exact) <= bound)


@pytest.mark.parametrize("name", ["none", "fp8"])
def test_reduce_scatter_into_out(comm, name):
    """out= receives the shard: written directly when apart from x, through a scratch
    when it overlaps x (here x's own shard, in place as NCCL's reduce-scatter allows,
    which the pipeline would overwrite before it read it), in float16 by a cast; the
    same bits as the shard returned. An out of another shape or dtype is refused
    before anything moves."""
    count = 12_345
    x = inputs(count, comm.size, tag=10)[comm.rank]
    want = geocomm.reduce_scatter(x, codec=CODECS[name], stage_size=2048)
    out = np.full_like(want, np.nan)
    assert geocomm.reduce_scatter(x, codec=CODECS[name], out=out, stage_size=2048) is out
    np.testing.assert_array_equal(out, want)
    offsets = shard_bounds(count, comm.size)
    lo, hi = int(offsets[comm.rank]), int(offsets[comm.rank + 1])
    inplace = x.copy()
    codec = CODECS[name]
    result = geocomm.reduce_scatter(inplace, codec=codec, out=inplace[lo:hi], stage_size=2048)
    np.testing.assert_array_equal(result, want)
    half = np.empty(want.shape, np.float16)
    got = geocomm.reduce_scatter(x.astype(np.float16), codec=CODECS[name], out=half)
    assert got is half
    want_half = geocomm.reduce_scatter(x.astype(np.float16), codec=CODECS[name])
    np.testing.assert_array_equal(half, want_half)
    with pytest.raises(ValueError, match="out"):
        geocomm.reduce_scatter(x, codec="fp8", out=np.empty(want.size + 1, np.float32))
    with pytest.raises(ValueError, match="out"):
        geocomm.reduce_scatter(x, codec="fp8", out=np.empty(want.shape, np.float16))


@pytest.mark.parametrize("name", ["none", "fp8", "nvfp4"])
def test_allgather(comm, name):
    xs = inputs(3 * 11, comm.size, tag=7)
    stacked = geocomm.allgather(xs[comm.rank].reshape(3, 11), codec=CODECS[name])
    assert stacked.shape == (comm.size, 3, 11)
    assert same_on_all_ranks(comm, stacked)
    for r, x in enumerate(xs):
        assert np.all(np.abs(stacked[r].ravel() - x) <= single_bound(x, name))


@pytest.mark.mpi(min_size=2)
def test_mismatched_count_raises_everywhere(comm):
    x = np.ones(100 + (comm.rank == 1), np.float32)
    with pytest.raises(CollectiveMismatchError, match="count"):
        geocomm.allreduce(x, codec="fp8")
    # the communicator is still usable afterwards
    assert geocomm.allreduce(np.ones(4, np.float32), codec=None)[0] == comm.size


@pytest.mark.mpi(min_size=2)
def test_mismatched_codec_raises_everywhere(comm):
    codec = "fp8" if comm.rank == 0 else "nvfp4"
    with pytest.raises(CollectiveMismatchError, match="codec"):
        geocomm.allreduce(np.ones(64, np.float32), codec=codec)


@pytest.mark.mpi(min_size=2)
def test_mismatched_stage_sizes_raise_everywhere(comm):
    """Different stage sizes cut different pieces, so the ranks' transfers would not
    match in size (a hang, or bytes read as the wrong piece): the check compares them."""
    stage_size = 8192 if comm.rank == 0 else 32768
    with pytest.raises(CollectiveMismatchError, match="stage size"):
        geocomm.allreduce(np.ones(1 << 16, np.float32), codec="fp8", stage_size=stage_size)


def test_a_communicator_is_not_kept_alive_by_its_calls(comm):
    """The signatures of a communicator's calls, and their plans (which hold the
    communicator), live on the communicator: once the caller lets it go, it goes,
    with its buffers, however many compressed calls it made."""
    import gc
    import weakref

    from geocomm.comm.mpi import MPICommunicator

    own = MPICommunicator()
    for codec in ("fp8", "none", "nvfp4"):
        geocomm.allreduce(np.ones(1 << 14, np.float32), codec=codec, comm=own)
    gone = weakref.ref(own)
    del own
    gc.collect()
    assert gone() is None


def test_auto_switches_at_the_crossover(comm):
    """Below crossover_bytes the plain all-reduce runs (exact), above it fp8."""
    auto = {"id": "auto", "codec": "fp8", "crossover_bytes": 4 * 1000}
    small = np.random.default_rng([comm.rank, 98]).standard_normal(999).astype(np.float32)
    exact_small = geocomm.allreduce(small, codec="none")
    assert not np.array_equal(geocomm.allreduce(small, codec="fp8"), exact_small)
    np.testing.assert_array_equal(geocomm.allreduce(small, codec=auto), exact_small)
    large = np.random.default_rng([comm.rank, 99]).standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(
        geocomm.allreduce(large, codec=auto), geocomm.allreduce(large, codec="fp8")
    )
    assert geocomm.get_codec(geocomm.get_codec(auto).get_config()) == geocomm.get_codec(auto)
