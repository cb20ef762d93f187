"""Bad input at every public collective entry point: a documented result or a
clear exception, never garbage and never a hang (see tests/README.md)."""

from __future__ import annotations

import numpy as np
import pytest

import geocomm
from geocomm import get_codec
from geocomm.codecs import bounds

pytestmark = pytest.mark.mpi

ENTRY_POINTS = {
    "allreduce": lambda x, codec: geocomm.allreduce(x, codec=codec),
    "reduce_scatter": lambda x, codec: geocomm.reduce_scatter(x, codec=codec),
    "allgather": lambda x, codec: geocomm.allgather(x, codec=codec),
}
LOSSY = ["bf16", "fp8", "nvfp4", "geofp8"]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    "bad",
    [np.arange(6, dtype=np.int32), np.zeros(6, np.complex64), np.zeros(6, bool)],
    ids=["int32", "complex64", "bool"],
)
def test_non_float_dtypes_raise_type_error(comm, entry, bad):
    with pytest.raises(TypeError, match="dtype"):
        ENTRY_POINTS[entry](bad, "fp8")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_float64_lossy_raises_type_error(comm, entry):
    with pytest.raises(TypeError, match="float64"):
        ENTRY_POINTS[entry](np.zeros(6), "fp8")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("codec", ["none", *LOSSY])
def test_zero_size_gives_empty(comm, entry, codec):
    result = ENTRY_POINTS[entry](np.zeros((0, 4), np.float32), codec)
    assert result.size == 0


@pytest.mark.parametrize("codec", ["none", *LOSSY])
def test_read_only_and_strided_inputs_work(comm, codec):
    base = np.random.default_rng([comm.rank, 3]).standard_normal((128, 96)).astype(np.float32)
    frozen = base.copy()
    frozen.flags.writeable = False
    strided = np.asfortranarray(base)
    a = geocomm.allreduce(frozen, codec=codec, key="ro")
    b = geocomm.allreduce(strided, codec=codec, key="ro2")
    c = geocomm.allreduce(base.copy(), codec=codec, key="ro3")
    # stateful codecs evolve per key, so compare each against a fresh first call
    assert a.shape == b.shape == c.shape == base.shape
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(b, c)


@pytest.mark.parametrize("codec", ["none", *LOSSY])
def test_all_zero_stays_zero(comm, codec):
    y = geocomm.allreduce(np.zeros((64, 64), np.float32), codec=codec, key="zeros")
    assert np.all(y == 0)


@pytest.mark.parametrize("codec", ["bf16", "fp8", "nvfp4"])
def test_denormal_only_input(comm, codec):
    """fp32 subnormals only: the tiny-amax pre-scale path keeps the result
    within the derived bound (no NaN, no inf, no garbage)."""
    xs = [
        (np.random.default_rng([r, 5]).standard_normal(1000) * 1e-39).astype(np.float32)
        for r in range(comm.size)
    ]
    assert np.all(np.abs(xs[0]) < np.finfo(np.float32).tiny)
    y = geocomm.allreduce(xs[comm.rank], codec=codec)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    bound = bounds.allreduce_bound(xs, get_codec(codec))
    # the bound's absolute term covers subnormal scales (geocomm.codecs.bounds)
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y - exact) <= bound)


@pytest.mark.parametrize("codec", ["bf16", "fp8", "nvfp4"])
def test_values_beyond_fp8_range_on_one_rank(comm, codec):
    """1e30 on one rank: scales absorb any finite range; the others' values
    drown in that block's error but nothing overflows."""
    xs = [
        np.random.default_rng([r, 6]).standard_normal(4096).astype(np.float32)
        for r in range(comm.size)
    ]
    xs[-1][100] = 1e30
    y = geocomm.allreduce(xs[comm.rank], codec=codec)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y - exact) <= bounds.allreduce_bound(xs, get_codec(codec)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_shape_mismatch_across_ranks(comm, entry):
    x = np.ones(32 if comm.rank == 0 else 33, np.float32)
    with pytest.raises(geocomm.CollectiveMismatchError):
        ENTRY_POINTS[entry](x, "fp8")


@pytest.mark.mpi(min_size=2)
def test_dtype_and_op_mismatch_across_ranks(comm):
    x = np.ones(16, np.float32 if comm.rank == 0 else np.float16)
    with pytest.raises(geocomm.CollectiveMismatchError, match="dtype"):
        geocomm.allreduce(x, codec="fp8")
    with pytest.raises(geocomm.CollectiveMismatchError, match="op"):
        geocomm.allreduce(
            np.ones(16, np.float32), codec="fp8", op="sum" if comm.rank == 0 else "avg"
        )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    ("refused", "codec", "error"),
    [
        (lambda: np.zeros(16), "fp8", TypeError),  # float64 through a lossy codec
        (lambda: np.zeros(16, np.int32), "fp8", TypeError),
        (lambda: [1.0] * 16, "fp8", TypeError),  # not an array
        (lambda: np.ones(16, np.float32), "fp9", KeyError),  # no such codec
    ],
    ids=["float64", "int32", "list", "unknown-codec"],
)
def test_a_call_one_rank_refuses_raises_on_every_rank(comm, entry, refused, codec, error):
    """The last rank refuses the call before the ranks compare (its own error); it
    still takes part in the check, so the others raise CollectiveMismatchError
    naming it at once, where they used to wait for it until GEOCOMM_TIMEOUT (300 s;
    the suite runs under a far shorter limit). Nothing moved, so the next call of
    every rank pairs with the next call of the others."""
    last = comm.size - 1
    if comm.rank == last:
        with pytest.raises(error):
            ENTRY_POINTS[entry](refused(), codec)
    else:
        with pytest.raises(geocomm.CollectiveMismatchError, match=rf"ranks \[{last}\] refused"):
            ENTRY_POINTS[entry](np.ones(16, np.float32), "fp8")
    got = geocomm.allreduce(np.full(8, comm.rank + 1, np.float32), codec="bf16")
    assert np.array_equal(got, np.full(8, comm.size * (comm.size + 1) / 2, np.float32))


@pytest.mark.mpi(min_size=2)
def test_a_call_every_rank_refuses_raises_each_ranks_own_error(comm):
    """Every rank refuses: each raises its own error (all rows refused: no mismatch to
    report), and the ranks stay in step."""
    with pytest.raises(ValueError, match="op must be"):
        geocomm.allreduce(np.ones(8, np.float32), codec="fp8", op="max")
    with pytest.raises(TypeError, match="unexpected keyword"):
        geocomm.allreduce(np.ones(8, np.float32), codec="fp8", stream=0)
    got = geocomm.allreduce(np.ones(8, np.float32), codec="bf16")
    assert np.array_equal(got, np.full(8, comm.size, np.float32))
