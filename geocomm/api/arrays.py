"""Any array in, the same kind of array out.

``geocomm.allreduce(x)`` accepts NumPy arrays, torch tensors (CPU; CUDA
through CuPy), CuPy arrays, JAX arrays and any other object that speaks
DLPack, and returns the result as the caller's type on the caller's device.
Conversions are zero-copy where the producer allows it (NumPy, torch CPU,
CuPy, DLPack on CPU); JAX arrays are immutable, so their result is a new JAX
array and ``out=`` cannot be a JAX array.

Details that are easy to get wrong:

* bfloat16 CUDA tensors: CuPy 13 has no bfloat16 dtype, so the tensor's bits
  are read as int16 through DLPack and widened to float32 on the device
  (exact); the result is rounded back to bfloat16 with round-to-nearest-even
  (:func:`float32_to_bf16_bits`, ml_dtypes' cast, as the host route), and ``out=``
  is written through the same int16 view. The collective sees float32, so
  its metadata check compares float32 on such ranks.
* torch CUDA tensors: geocomm's CuPy work (conversions, codec kernels, NCCL's
  start event, result copies) runs on torch's current stream of the tensor's
  device (:func:`cupy_stream`), so results and ``out=`` writes are
  ordered before anything the caller queues on that stream afterwards. A
  consumer on another torch stream must wait for the current stream, as for
  any torch operation.
* other DLPack producers are dispatched on ``__dlpack_device__()``: CUDA
  memory (device type 2, managed 13) goes to ``cupy.from_dlpack``, host memory
  (1, pinned 3 and 11) to ``numpy.from_dlpack``; anything else is a TypeError.

This module converts; :mod:`geocomm.api.collectives` builds the call and the
engine computes on NumPy (or CuPy) arrays, knowing nothing of frameworks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from geocomm.engine.layout import array_module
from geocomm.kernels import cuda_build

Restore = Callable[[Any], Any]

#: DLPack device types (``DLDeviceType``) read with CuPy and with NumPy
DLPACK_CUDA = {2: "CUDA", 13: "CUDA managed"}
DLPACK_HOST = {1: "CPU", 3: "CUDA pinned host", 11: "ROCm pinned host"}


class _Operand(NamedTuple):
    """A caller's array as the collectives see it.

    ``array``: NumPy or CuPy array; ``restore``: turns a result array into the
    caller's kind; ``commit``: None when ``array`` shares the caller's memory,
    else a function that writes ``array``'s values back into it (``out=``).
    """

    array: Any
    restore: Restore
    commit: Callable[[], None] | None = None


def _identity(r: Any) -> Any:
    return r


def _module_of(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


# ---------------------------------------------------------------------------
# bfloat16 bits <-> float32, on NumPy or CuPy (no bfloat16 dtype needed)


def _xp(array: Any) -> Any:
    return array_module(array)


def bf16_bits_to_float32(bits: Any) -> Any:
    """float32 values of bfloat16 bit patterns (int16/uint16 array, NumPy or
    CuPy): the bits become the upper half of the float32. Exact; same shape."""
    xp = _xp(bits)
    if bits.dtype not in (np.int16, np.uint16):
        raise TypeError(f"bfloat16 bits must be an int16 or uint16 array, got {bits.dtype}")
    wide = bits.view(np.uint16).astype(np.uint32) << xp.uint32(16)
    return wide.view(np.float32)


def _contiguous(a: Any) -> Any:
    """``a`` C-contiguous, of its shape (``ascontiguousarray`` makes 0-d arrays 1-d)."""
    return _xp(a).ascontiguousarray(a).reshape(a.shape)


def float32_to_bf16_bits(values: Any) -> Any:
    """uint16 bfloat16 bit patterns of float32 ``values`` (NumPy or CuPy), rounded
    to nearest even, NaN -> sign | 0x7fc0: ml_dtypes' cast, bit for bit, as a host
    route narrows a bfloat16 caller's result (a result past bfloat16's range is
    inf, where the bf16 codec's ``gc_bf16_code`` saturates what it sends). Same
    shape, C-contiguous."""
    xp = _xp(values)
    if values.dtype != np.float32:
        raise TypeError(f"values must be float32, got {values.dtype}")
    u32 = xp.uint32
    bits = _contiguous(values).view(np.uint32)
    # uint32 wrap-around only happens for NaN patterns, which are replaced below
    rounded = (bits + u32(0x7FFF) + ((bits >> u32(16)) & u32(1))) >> u32(16)
    nan = ((bits >> u32(16)) & u32(0x8000)) | u32(0x7FC0)
    is_nan = (bits & u32(0x7FFFFFFF)) > u32(0x7F800000)
    return xp.where(is_nan, nan, rounded).astype(np.uint16)


# ---------------------------------------------------------------------------
# torch


def _torch_cpu(t: Any) -> _Operand:
    import torch

    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: share the memory through an int16 view
        array = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return _Operand(
            array,
            lambda r: torch.from_numpy(_contiguous(r).view(np.int16)).view(torch.bfloat16),
        )
    return _Operand(t.numpy(), torch.from_numpy)


def _torch_device(t: Any, xp: Any) -> _Operand:
    """A torch tensor as an ``xp`` array through DLPack (``xp``: cupy for CUDA
    tensors; numpy works the same on CPU tensors, which is how it is tested).

    Float dtypes share the memory. bfloat16 becomes a float32 copy, since the
    array library may have no bfloat16; ``restore`` and ``commit`` round back.
    """
    import torch

    if t.dtype != torch.bfloat16:
        return _Operand(xp.from_dlpack(t), torch.from_dlpack)
    bits = xp.from_dlpack(t.view(torch.int16))

    def restore(r: Any) -> Any:
        return torch.from_dlpack(float32_to_bf16_bits(r).view(np.int16)).view(torch.bfloat16)

    array = bf16_bits_to_float32(bits)

    def commit() -> None:
        bits[...] = float32_to_bf16_bits(array).view(np.int16)

    return _Operand(array, restore, commit)


def _torch(t: Any) -> _Operand:
    if t.requires_grad:
        t = t.detach()
    if not t.dtype.is_floating_point:
        raise TypeError(f"torch tensor of dtype {t.dtype} is not a float tensor")
    if t.device.type == "cuda":
        return _torch_device(t, _cupy())
    if t.device.type != "cpu":
        raise TypeError(f"torch tensors on {t.device.type} are not supported (cpu or cuda)")
    return _torch_cpu(t)


def _torch_stream(*tensors: Any) -> contextlib.AbstractContextManager:
    """Make torch's current stream of the first CUDA tensor's device CuPy's
    current stream (and that device current), so geocomm's device work is
    ordered with the caller's torch work; a null context otherwise."""
    for t in tensors:
        if _module_of(t) == "torch" and t.device.type == "cuda":
            import torch

            cupy = _cupy()
            index = t.device.index if t.device.index is not None else torch.cuda.current_device()
            stack = contextlib.ExitStack()
            stack.enter_context(cupy.cuda.Device(index))  # current before the stream is wrapped
            stack.enter_context(
                cupy_stream(cupy, torch.cuda.current_stream(index).cuda_stream, index)
            )
            return stack
    return contextlib.nullcontext()


class _StreamHandle:
    """A CUDA stream pointer as the CUDA stream protocol presents it (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(cupy: Any, ptr: int, device_id: int) -> Any:
    """A CuPy stream object for the CUDA stream ``ptr`` of device ``device_id``, which
    must be CuPy's current device: ``cupy.cuda.Stream.from_external`` where CuPy has it
    (CuPy 14: it takes an object of the CUDA stream protocol and the current device),
    else ``cupy.cuda.ExternalStream(ptr, device_id)`` (CuPy 13; deprecated in 14,
    where it warns on every call). The stream stays the caller's to keep alive."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)


# ---------------------------------------------------------------------------
# other kinds


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            f"CUDA arrays need CuPy: {cuda_build.cuda_extra()}. Import error: {exc}"
        ) from None
    return cupy


def _jax(x: Any) -> _Operand:
    import jax.numpy as jnp

    device = next(iter(x.devices())) if hasattr(x, "devices") else None
    if device is not None and device.platform != "cpu":
        raise TypeError(f"JAX arrays on {device.platform} are not supported yet (cpu only)")
    array = np.asarray(x)  # zero-copy view of a CPU JAX buffer
    return _Operand(array, lambda r: jnp.asarray(r))


def dlpack_device_type(x: Any) -> int | None:
    """The DLPack device type of ``x`` (``__dlpack_device__()[0]``), None if it has none."""
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return None
    return int(device()[0])


def _dlpack(x: Any, name: str) -> _Operand:
    """Any other DLPack producer: CuPy for CUDA memory, NumPy for host memory. The
    result comes back through the producer's array API namespace (its ``from_dlpack``)
    where it has one, else as the CuPy or NumPy array."""
    kind = dlpack_device_type(x)
    restore = _namespace_restore(x)
    if kind in DLPACK_CUDA:
        return _Operand(_cupy().from_dlpack(x), restore)
    if kind is not None and kind not in DLPACK_HOST:
        raise TypeError(
            f"{name} of type {type(x).__name__} lives on DLPack device type {kind}; "
            f"geocomm reads {sorted(DLPACK_HOST.values())} memory with NumPy and "
            f"{sorted(DLPACK_CUDA.values())} memory with CuPy"
        )
    try:
        return _Operand(np.from_dlpack(x), restore)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise TypeError(
            f"{name} of type {type(x).__name__} cannot be read through DLPack on the CPU: {exc}"
        ) from None


def _namespace_restore(x: Any) -> Restore:
    """The caller's kind for a result of the DLPack producer ``x``: its array API
    namespace's ``from_dlpack`` (sharing the result's memory) where ``x`` names one."""
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        return _identity
    return namespace().from_dlpack


def _operand(x: Any, name: str) -> _Operand:
    if isinstance(x, np.ndarray):
        return _Operand(x, _identity)
    module = _module_of(x)
    if module == "torch":
        return _torch(x)
    if module == "cupy":
        return _Operand(x, _identity)
    if module in ("jax", "jaxlib"):
        return _jax(x)
    if hasattr(x, "__dlpack__"):
        return _dlpack(x, name)
    raise TypeError(
        f"{name} of type {type(x).__module__}.{type(x).__name__} is not an "
        "array geocomm understands (numpy, torch, cupy, jax or any DLPack array)"
    )


def as_array(x: Any, name: str = "x") -> tuple[Any, Restore]:
    """(NumPy or CuPy array sharing x's memory where possible, function that
    turns a result array back into x's kind). bfloat16 CUDA tensors give a
    float32 CuPy copy (see the module docstring)."""
    operand = _operand(x, name)
    return operand.array, operand.restore


def _out_operand(out: Any, x: Any, x_operand: _Operand, name: str = "out") -> _Operand:
    """The array through which ``out`` is written (plus its commit step). A torch
    ``out`` is checked as torch checks one: the same dtype as x, and none that autograd
    records (``requires_grad`` in grad mode)."""
    module = _module_of(out)
    if module in ("jax", "jaxlib"):
        raise TypeError("JAX arrays are immutable and cannot be an out= target")
    if module != _module_of(x):
        raise TypeError(
            f"out must be an array like x ({type(x).__name__}), got {type(out).__name__}"
        )
    if module == "torch":
        import torch

        if out.dtype != x.dtype:
            raise ValueError(f"out is {out.dtype}, expected {x.dtype}")
        if out.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "out= requires grad: geocomm's collectives are not differentiable (write "
                "into it under torch.no_grad())"
            )
    if out is x:
        return x_operand  # in place: one conversion serves both
    return _operand(out, name)


def _plain(array: Any) -> bool:
    """Whether ``array`` is a NumPy or CuPy ndarray (nothing to convert, nothing to restore)."""
    kind = type(array)
    return kind is np.ndarray or (kind.__name__ == "ndarray" and _module_of(array) == "cupy")


class Operands:
    """A call's array arguments as the engine sees them, for the duration of a ``with``
    block: ``x`` (NumPy or CuPy, sharing the caller's memory where it can) and
    ``out`` (the array ``out=`` is written through, or None). Inside the block,
    geocomm's device work runs on torch's current stream when the caller passed torch
    CUDA tensors (:func:`_torch_stream`). :meth:`finish` hands a result back as the
    caller's kind. NumPy and CuPy arrays pass through untouched."""

    __slots__ = ("_operand", "_out_in", "_stack", "_target", "_x_in", "out", "x")

    def __init__(self, x: Any, out: Any = None):
        self._x_in, self._out_in = x, out
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Operands:
        x, out = self._x_in, self._out_in
        if _plain(x) and (out is None or _plain(out)):
            self.x, self.out = x, out
            self._operand = self._target = None
            return self
        with contextlib.ExitStack() as stack:  # closed unless every conversion succeeds
            stack.enter_context(_torch_stream(x, out))
            operand = self._operand = _operand(x, "x")
            target = self._target = _out_operand(out, x, operand) if out is not None else None
            self.x, self.out = operand.array, None if target is None else target.array
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()

    def finish(self, result: Any) -> Any:
        """The caller's result: ``out`` (its values written through, for ``out=``) or
        ``result`` (a NumPy or CuPy array) as the caller's kind."""
        if self._out_in is not None:
            if self._target is not None and self._target.commit is not None:
                self._target.commit()
            if self._target is not None and _module_of(self._out_in) == "torch":
                # written behind torch's back: counted as an in-place write
                import torch

                torch.autograd.graph.increment_version(self._out_in)
            return self._out_in
        return result if self._operand is None else self._operand.restore(result)


__all__ = [
    "Operands",
    "as_array",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
]
