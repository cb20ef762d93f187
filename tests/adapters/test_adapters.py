"""Framework adapters: type, dtype, shape and device round-trip; in-place out=."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import geocomm

pytestmark = pytest.mark.mpi

TORCH_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _expected_sum(comm, shape, dtype) -> np.ndarray:
    """Sum of (rank + 1) * base over ranks: exact in every dtype for small ints."""
    base = (np.arange(np.prod(shape)) % 7).reshape(shape)
    return base * comm.size * (comm.size + 1) / 2


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_torch_roundtrip(comm, dtype, codec):
    shape = (5, 3, 4)
    base = torch.from_numpy((np.arange(60) % 7).reshape(shape).astype(np.float32))
    x = (base * (comm.rank + 1)).to(dtype)
    y = geocomm.allreduce(x, codec=codec)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    expected = _expected_sum(comm, shape, dtype)
    # small integers times (rank + 1) are exact in E4M3 only up to 16; allow the
    # derived two-quantization bound (2^-4 relative per stage) for fp8
    tol = 0 if codec == "none" else 2 * 2.0**-4 * (1 + 2.0**-4) + 2.0**-7
    np.testing.assert_allclose(y.float().numpy(), expected, rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_out_in_place(comm, dtype):
    x = torch.full((64,), float(comm.rank + 1), dtype=dtype)
    data_ptr = x.data_ptr()
    result = geocomm.allreduce(x, codec="fp8", op="avg", out=x)
    assert result is x and x.data_ptr() == data_ptr
    expected = (comm.size + 1) / 2
    # a constant block encodes its amax exactly (code 448 * scale), so the only
    # error is the fp32 -> dtype cast of the average
    np.testing.assert_allclose(x.float().numpy(), expected, rtol=2.0**-7)


def test_torch_unsupported_dtype(comm):
    with pytest.raises(TypeError, match="int32"):
        geocomm.allreduce(torch.ones(4, dtype=torch.int32), codec="fp8")


def test_torch_requires_grad_tensor(comm):
    w = torch.ones(8, requires_grad=True)
    y = geocomm.allreduce(w, codec="none")
    assert not y.requires_grad
    assert torch.equal(y, torch.full((8,), float(comm.size)))


def test_numpy_bfloat16_and_reduce_scatter(comm):
    x = np.full(10, comm.rank + 1, ml_dtypes.bfloat16)
    y = geocomm.allreduce(x, codec="bf16")
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.astype(np.float32), comm.size * (comm.size + 1) / 2)
    shard = geocomm.reduce_scatter(torch.ones(10), codec="none")
    assert isinstance(shard, torch.Tensor)
    assert shard.numel() == np.array_split(np.arange(10), comm.size)[comm.rank].size


def test_dlpack_producer(comm):
    class Producer:
        """A minimal foreign array that only speaks DLPack."""

        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    y = geocomm.allreduce(Producer(np.ones(6, np.float32)), codec="none")
    np.testing.assert_array_equal(y, np.full(6, comm.size, np.float32))


def test_an_array_api_producer_comes_back_as_its_own_kind(comm):
    """A DLPack producer that names its array API namespace gets its result back
    through that namespace's from_dlpack (it once came back as NumPy); out= of that
    kind is written in place."""
    import array_api_strict as xp

    x = xp.asarray(np.arange(6, dtype=np.float32) + comm.rank)
    y = geocomm.allreduce(x, codec="bf16")
    assert type(y) is type(x) and y.dtype == xp.float32 and y.shape == (6,)
    want = comm.size * np.arange(6) + comm.size * (comm.size - 1) / 2
    np.testing.assert_array_equal(np.asarray(y), want)
    shard = geocomm.reduce_scatter(x, codec="bf16")
    assert type(shard) is type(x)
    out = xp.zeros(6, dtype=xp.float32)
    assert geocomm.allreduce(x, codec="bf16", out=out) is out
    np.testing.assert_array_equal(np.asarray(out), want)


def test_unknown_type(comm):
    with pytest.raises(TypeError, match="not an array"):
        geocomm.allreduce([1.0, 2.0], codec="fp8")


def test_jax_roundtrip(comm):
    import jax.numpy as jnp  # in the test extras: a missing jax fails, it does not skip

    x = jnp.ones((3, 4), dtype=jnp.float32) * (comm.rank + 1)
    y = geocomm.allreduce(x, codec="fp8")
    assert type(y).__module__.startswith("jax")
    assert y.shape == (3, 4) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), comm.size * (comm.size + 1) / 2, rtol=2.0**-3)
    with pytest.raises(TypeError, match="immutable"):
        geocomm.allreduce(x, codec="fp8", out=x)


def test_torch_out_is_checked_and_versioned_as_torch_does(comm):
    """A torch out is what torch would accept as one: x's dtype, not recorded by
    autograd; its write bumps its version counter, so autograd refuses to use values
    it saved before the write (it used the overwritten ones, without a word)."""
    x = torch.full((3,), 5.0)
    with pytest.raises(ValueError, match=r"out is torch\.float64"):
        geocomm.allreduce(x, codec="none", out=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="array like x"):
        geocomm.allreduce(x, codec="none", out=np.zeros(3, np.float32))
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="requires grad"):
        geocomm.allreduce(x, codec="none", out=w)
    saved = torch.ones(3, requires_grad=True)
    buffer = torch.ones(3)
    y = (saved * buffer).sum()  # autograd saves buffer for the gradient of saved
    geocomm.allreduce(x, codec="none", out=buffer)
    assert buffer._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_0d_tensor_keeps_its_shape(comm, dtype):
    got = geocomm.allreduce(torch.tensor(1.5, dtype=dtype), codec="none")
    assert got.shape == () and got.dtype == dtype and float(got) == 1.5 * comm.size
