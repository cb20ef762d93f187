"""A CPU twin of CuPy, for geocomm's tests and checks only.

Put ``tests/twin`` first on ``sys.path`` (``PYTHONPATH=tests/twin``) and
``import cupy`` gives this package: device arrays in host memory with CuPy's
behaviour for the part of its API geocomm uses (:mod:`cupy._core`), streams
and events that run queued work in order on worker threads and check that no
stream touches memory another wrote without an event wait
(:mod:`cupy._device`), red-zoned allocations that catch out-of-bounds
writes (:mod:`cupy._memory`), NVRTC and ``Module``/``RawModule`` that compile
the project's own ``.cu`` sources for the host (:mod:`cupy._kernels`), and
``cupy.cuda.nccl`` over MPI. Every name it does not implement raises
``NotImplementedError`` when called: the twin never falls back to NumPy in
silence. geocomm does not know it runs on a twin.
"""

from __future__ import annotations

from typing import Any

from numpy import (  # CuPy re-exports NumPy's scalar types and dtype
    bool_,
    complex64,
    complex128,
    dtype,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
)

from cupy import cuda, fft, linalg
from cupy._core import (
    _not_implemented,
    all,
    any,
    array,
    asarray,
    ascontiguousarray,
    asnumpy,
    concatenate,
    empty,
    empty_like,
    from_dlpack,
    full,
    get_array_module,
    isfinite,
    isnan,
    may_share_memory,
    ndarray,
    ones,
    ravel,
    reshape,
    shares_memory,
    where,
    zeros,
    zeros_like,
)
from cupy.cuda.function import RawKernel, RawModule

__version__ = "14.0.0+twin"
TWIN = True  # for the tests' own checks; geocomm never looks at it

__all__ = [
    "RawKernel",
    "RawModule",
    "all",
    "any",
    "array",
    "asarray",
    "ascontiguousarray",
    "asnumpy",
    "bool_",
    "complex64",
    "complex128",
    "concatenate",
    "cuda",
    "dtype",
    "empty",
    "empty_like",
    "fft",
    "float16",
    "float32",
    "float64",
    "from_dlpack",
    "full",
    "get_array_module",
    "int8",
    "int16",
    "int32",
    "int64",
    "isfinite",
    "isnan",
    "linalg",
    "may_share_memory",
    "ndarray",
    "ones",
    "ravel",
    "reshape",
    "shares_memory",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "where",
    "zeros",
    "zeros_like",
]


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module 'cupy' (twin) has no attribute {name!r}")
    return _not_implemented(name)
