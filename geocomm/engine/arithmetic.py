"""IEEE fp32 arithmetic with the same bits on every device
(docs/design.md, "The collective"): NumPy's on host arrays; the kernels of
:mod:`geocomm.kernels.cuda` on CuPy arrays, whose own elementwise kernels flush
subnormals to zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geocomm.engine.layout import array_module
from geocomm.kernels import native


def add_into(acc: Any, values: Any) -> None:
    """``acc += values`` in fp32, the same bits on every device: one IEEE addition per
    value, rounded to nearest, subnormals kept. NumPy arrays add in place with NumPy;
    CuPy arrays with :func:`geocomm.kernels.cuda.add` (CuPy's own ``+=`` is compiled with
    ``-ftz=true`` and flushes subnormals, so the GPU would disagree with the CPU).
    ``acc``, ``values``: C-contiguous float32 arrays of one size and kind; ``values``
    may be ``acc`` itself, else it must not overlap it. A NaN sum is written as a GPU's
    (:func:`geocomm.kernels.native.gpu_nans`)."""
    if array_module(acc) is np:
        np.add(acc, values, out=acc)
        native.gpu_nans(acc)
    else:
        from geocomm.kernels import cuda

        cuda.add(acc, values)


def residual_of(values: Any, decoded: Any) -> None:
    """``decoded = values - decoded`` in place (what a quantization lost), the same bits
    on every device: IEEE fp32, rounded to nearest, subnormals kept; 0 where that is
    not finite (a non-finite value was sent once, and a residual would send it again on
    every later call). NumPy computes ``-1 * decoded + values``; CuPy arrays go through
    :func:`geocomm.kernels.cuda.residual` (CuPy's own arithmetic flushes subnormals).
    C-contiguous float32 arrays of one size and kind, apart."""
    if array_module(decoded) is np:
        np.multiply(decoded, -1, out=decoded)
        np.add(decoded, values, out=decoded)
        decoded[~np.isfinite(decoded)] = 0
    else:
        from geocomm.kernels import cuda

        cuda.residual(decoded, values, decoded)


def copy_into(out: Any, values: Any) -> None:
    """``out[...] = values`` (C-contiguous float32 arrays of one size and kind, apart):
    NumPy's copy, or :func:`geocomm.kernels.cuda.copy` for CuPy arrays, which moves with
    a call's arrays inside its CUDA graph (CuPy's own copy would keep the addresses it
    was captured with)."""
    if array_module(out) is np:
        out[...] = values
    else:
        from geocomm.kernels import cuda

        cuda.copy(out, values)


def divide(values: Any, size: int) -> None:
    """values /= size in place, one IEEE division per value on every device (CuPy's
    own elementwise kernels flush subnormals to zero, so CuPy arrays get ours)."""
    if array_module(values) is np:
        values /= values.dtype.type(size)
    else:
        from geocomm.kernels import cuda

        cuda.divide(values, size)
