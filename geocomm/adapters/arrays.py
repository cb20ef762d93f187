"""Any array in, the same kind of array out.

``geocomm.allreduce(x)`` accepts NumPy arrays, torch tensors (CPU; CUDA
through CuPy), CuPy arrays, JAX arrays and any other object that speaks
DLPack, and returns the result as the caller's type on the caller's device.
Conversions are zero-copy where the producer allows it (NumPy, torch CPU,
CuPy, DLPack on CPU); JAX arrays are immutable, so their result is a new JAX
array and ``out=`` cannot be a JAX array.

This module converts; :mod:`geocomm.collectives` computes on NumPy (or CuPy)
arrays and knows nothing of frameworks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from geocomm import collectives

Restore = Callable[[Any], Any]


def _module_of(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


def _torch_to_array(t: Any) -> tuple[Any, Restore]:
    import torch

    if t.requires_grad:
        t = t.detach()
    if t.device.type == "cuda":
        import cupy

        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 CUDA tensors have no CuPy dtype; cast to float32 first")
        return cupy.from_dlpack(t), lambda r: torch.from_dlpack(r)
    if t.device.type != "cpu":
        raise TypeError(f"torch tensors on {t.device.type} are not supported (cpu or cuda)")
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: share the memory through an int16 view
        array = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return array, lambda r: torch.from_numpy(
            np.ascontiguousarray(r).view(np.int16)).view(torch.bfloat16)
    if not t.dtype.is_floating_point:
        raise TypeError(f"torch tensor of dtype {t.dtype} is not a float tensor")
    return t.numpy(), torch.from_numpy


def _jax_to_array(x: Any) -> tuple[Any, Restore]:
    import jax.numpy as jnp

    device = next(iter(x.devices())) if hasattr(x, "devices") else None
    if device is not None and device.platform != "cpu":
        raise TypeError(f"JAX arrays on {device.platform} are not supported yet (cpu only)")
    array = np.asarray(x)  # zero-copy view of a CPU JAX buffer
    return array, lambda r: jnp.asarray(r)


def as_array(x: Any, name: str = "x") -> tuple[Any, Restore]:
    """(NumPy or CuPy array sharing x's memory where possible, function that
    turns a result array back into x's kind)."""
    if isinstance(x, np.ndarray):
        return x, lambda r: r
    module = _module_of(x)
    if module == "torch":
        return _torch_to_array(x)
    if module == "cupy":
        return x, lambda r: r
    if module in ("jax", "jaxlib"):
        return _jax_to_array(x)
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x), lambda r: r
        except (BufferError, TypeError, RuntimeError) as exc:
            raise TypeError(f"{name} of type {type(x).__name__} cannot be read through "
                            f"DLPack on the CPU: {exc}") from None
    raise TypeError(f"{name} of type {type(x).__module__}.{type(x).__name__} is not an "
                    "array geocomm understands (numpy, torch, cupy, jax or any DLPack array)")


def as_out(out: Any, name: str = "out") -> Any:
    """The array view through which ``out`` is written in place."""
    if _module_of(out) in ("jax", "jaxlib"):
        raise TypeError("JAX arrays are immutable and cannot be an out= target")
    array, _ = as_array(out, name)
    return array


def _is_cupy(array: Any) -> bool:
    return _module_of(array) == "cupy"


def _run(fn: Callable, x: Any, out: Any, **kwargs: Any) -> Any:
    array, restore = as_array(x)
    out_array = as_out(out) if out is not None else None
    if _is_cupy(array):
        return _run_cupy(fn, array, restore, out, out_array, **kwargs)
    if out_array is not None:
        fn(array, out=out_array, **kwargs)
        return out
    return restore(fn(array, **kwargs))


def _run_cupy(fn, array, restore, out, out_array, **kwargs):
    """CuPy arrays: the NCCL backend works on the device; the MPI backend
    stages through host memory (MPI is not assumed CUDA-aware)."""
    import cupy

    comm = collectives.get_comm(kwargs.pop("comm", None))
    if comm.backend == "nccl":
        if out_array is not None:
            fn(array, out=out_array, comm=comm, **kwargs)
            return out
        return restore(fn(array, comm=comm, **kwargs))
    result = fn(cupy.asnumpy(array), comm=comm, **kwargs)
    if out_array is not None:
        out_array[...] = cupy.asarray(result)
        return out
    return restore(cupy.asarray(result))


def allreduce(x: Any, codec: Any = None, op: str = "sum", out: Any = None, **kwargs: Any) -> Any:
    """:func:`geocomm.collectives.allreduce` for any array kind (see module docstring)."""
    return _run(collectives.allreduce, x, out, codec=codec, op=op, **kwargs)


def reduce_scatter(x: Any, codec: Any = None, op: str = "sum", **kwargs: Any) -> Any:
    """:func:`geocomm.collectives.reduce_scatter` for any array kind."""
    return _run(collectives.reduce_scatter, x, None, codec=codec, op=op, **kwargs)


def allgather(x: Any, codec: Any = None, **kwargs: Any) -> Any:
    """:func:`geocomm.collectives.allgather` for any array kind."""
    return _run(collectives.allgather, x, None, codec=codec, **kwargs)


__all__ = ["allgather", "allreduce", "as_array", "reduce_scatter"]
