"""The adapter's routes that a GPU would take, exercised on the CPU.

* bfloat16 <-> float32 bit conversion (written against the array API, so the
  same code runs on CuPy): exact widening; rounding identical to the C core's
  gc_bf16_code and to ml_dtypes on every class of input;
* the DLPack dispatch on ``__dlpack_device__``: CUDA to ``cupy.from_dlpack``
  (a fake cupy module records the call), host memory to NumPy, anything else
  a TypeError;
* the bfloat16 CUDA tensor route (``_torch_device``) run with NumPy standing
  in for CuPy on a CPU tensor: same DLPack calls, same conversions.
"""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest
import torch

from geocomm.api import arrays
from geocomm.kernels import native


def special_bits() -> np.ndarray:
    """float32 bit patterns around every rounding and range boundary of bfloat16."""
    rng = np.random.default_rng(7)
    hi = np.concatenate(
        [np.arange(0x0000, 0x0010), np.arange(0x7F70, 0x7F90), np.arange(0x3F70, 0x3F90)]
    ).astype(np.uint32)
    lo = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    grid = ((hi[:, None] << 16) | lo[None, :]).ravel()
    grid = np.concatenate([grid, grid | np.uint32(0x80000000)])
    random = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([grid, random])


def native_bf16(values: np.ndarray) -> np.ndarray:
    wire = np.empty(native.wire_size(native.BF16, values.size), np.uint8)
    native.encode(native.BF16, values, 0, wire)
    return wire.view("<u2")


def test_float32_to_bf16_matches_ml_dtypes_and_the_c_core_in_range():
    """A result narrows as ml_dtypes casts (the host route's narrowing), which is the
    C core's bf16 code except past bfloat16's largest value: the cast gives inf, the
    codec saturates what it sends."""
    values = special_bits().view(np.float32)
    got = arrays.float32_to_bf16_bits(values)
    assert got.dtype == np.uint16 and got.shape == values.shape
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(got, values.astype(ml_dtypes.bfloat16).view(np.uint16))
    past = np.isfinite(values) & ((got & 0x7FFF) == 0x7F80)
    assert past.any()  # the special values reach the case
    np.testing.assert_array_equal(got[~past], native_bf16(values)[~past])


def test_bf16_to_float32_is_exact_for_every_code():
    codes = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    for bits in (codes, codes.view(np.int16)):
        wide = arrays.bf16_bits_to_float32(bits)
        assert wide.dtype == np.float32
        np.testing.assert_array_equal(wide.view(np.uint32), codes.astype(np.uint32) << 16)
    # and narrowing what was widened gives every non-NaN code back unchanged
    wide = arrays.bf16_bits_to_float32(codes)
    back = arrays.float32_to_bf16_bits(wide)
    keep = ~np.isnan(wide)
    np.testing.assert_array_equal(back[keep], codes[keep])


def test_bf16_conversions_keep_shape_and_refuse_wrong_dtypes():
    bits = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)[:, ::2]  # non-contiguous
    wide = arrays.bf16_bits_to_float32(bits)
    assert wide.shape == bits.shape
    assert arrays.float32_to_bf16_bits(wide).shape == bits.shape
    with pytest.raises(TypeError, match="int16 or uint16"):
        arrays.bf16_bits_to_float32(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="float32"):
        arrays.float32_to_bf16_bits(np.zeros(3, np.float64))


# ---------------------------------------------------------------------------
# DLPack dispatch


class Producer:
    """A foreign array that only speaks DLPack and claims a device type."""

    def __init__(self, array: np.ndarray, device_type: int):
        self.array, self.device_type = array, device_type

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (self.device_type, 0)


@pytest.fixture
def fake_cupy(monkeypatch):
    """A module named cupy whose from_dlpack records what it was given."""
    seen = []
    module = types.ModuleType("cupy")

    def from_dlpack(x):
        seen.append(x)
        return "cupy array"

    module.from_dlpack = from_dlpack
    monkeypatch.setitem(sys.modules, "cupy", module)
    return seen


@pytest.mark.parametrize("device_type", sorted(arrays.DLPACK_CUDA))
def test_cuda_dlpack_producer_goes_to_cupy(fake_cupy, device_type):
    producer = Producer(np.ones(3, np.float32), device_type)
    array, restore = arrays.as_array(producer)
    assert array == "cupy array" and fake_cupy == [producer]
    assert restore(array) == "cupy array"  # a foreign producer's result stays a CuPy array


@pytest.mark.parametrize("device_type", [1])
def test_host_dlpack_producer_goes_to_numpy(fake_cupy, device_type):
    data = np.arange(4, dtype=np.float32)
    array, _ = arrays.as_array(Producer(data, device_type))
    assert isinstance(array, np.ndarray) and np.shares_memory(array, data)
    assert fake_cupy == []


def test_unknown_dlpack_device_is_refused():
    with pytest.raises(TypeError, match="device type 14"):  # kDLOneAPI
        arrays.as_array(Producer(np.ones(2, np.float32), 14))


def test_cuda_dlpack_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(ImportError, match=r"geocomm\[cuda12\]'.*'geocomm\[cuda13\]'"):
        arrays.as_array(Producer(np.ones(2, np.float32), 2))


def test_dlpack_device_type():
    assert arrays.dlpack_device_type(torch.ones(2)) == 1
    assert arrays.dlpack_device_type(np.ones(2)) == 1
    assert arrays.dlpack_device_type([1.0]) is None


# ---------------------------------------------------------------------------
# the bfloat16 CUDA route, with NumPy in CuPy's place


def test_bf16_device_route_converts_restores_and_commits():
    values = torch.tensor([[1.0, -2.5, 3.0e38], [1e-40, float("inf"), 0.1]]).to(torch.bfloat16)
    tensor = values.clone()
    operand = arrays._torch_device(tensor, np)
    # the collective sees exact float32 values of the bf16 tensor
    assert operand.array.dtype == np.float32 and operand.array.shape == (2, 3)
    np.testing.assert_array_equal(operand.array, values.float().numpy())
    # a float32 result comes back as a bf16 tensor cast like the host route's
    # (-3.4e38: past bfloat16's range, -inf)
    result = np.array([[1.00390625, 1.01171875, -3.4e38], [np.nan, -0.0, 2.0**-133]], np.float32)
    restored = operand.restore(result)
    assert restored.dtype == torch.bfloat16 and restored.shape == (2, 3)
    with np.errstate(over="ignore"):
        cast = result.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(restored.view(torch.int16).numpy().view(np.uint16), cast)
    # out=: what the collective wrote into operand.array lands in the tensor's memory
    operand.array[...] = result
    operand.commit()
    assert torch.equal(tensor.view(torch.int16), restored.view(torch.int16))


def test_float_device_route_shares_memory():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    operand = arrays._torch_device(tensor, np)
    assert operand.commit is None and np.shares_memory(operand.array, tensor.numpy())


def test_bf16_cpu_tensor_in_place_keeps_storage():
    """The CPU bfloat16 route still shares memory (no commit step needed)."""
    tensor = torch.ones(5, dtype=torch.bfloat16)
    array, _ = arrays.as_array(tensor)
    assert array.dtype == ml_dtypes.bfloat16
    array[0] = 3
    assert tensor[0].item() == 3
