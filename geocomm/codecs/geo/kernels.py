"""The geometry kernels for arrays of any namespace: the C core on the host, CUDA on CuPy.

Each function takes arrays of one namespace (NumPy, CuPy, array-api-strict,
...) and returns arrays of that namespace. Host arrays go through the C
kernels of ``native/geometry.c`` (zero-copy through DLPack), CuPy arrays
through ``native/gc_geometry.cu``; both follow the order of
``native/gc_linalg.h``, so the bits never depend on the device, the CPU or a
BLAS. CuPy arrays stay on the device except where a function returns host
values (:func:`sumsq`, :func:`column_sumsq`, :func:`host_copy`,
:class:`LaterCopy`).

A "range" is ``values``, the flat elements [lo, lo + values.size) of a
row-major matrix with ``n`` columns; coefficient matrices hold one row per
matrix row the range touches (:func:`rows`), the first being row lo // n.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
from array_api_compat import array_namespace, is_cupy_array

from geocomm.codecs.formats import BF16Codec, round_trip
from geocomm.kernels import cuda, native

__all__ = [
    "LaterCopy",
    "accumulate",
    "basis_hash",
    "column_sumsq",
    "expand",
    "host_copy",
    "orthonormalize",
    "pack",
    "project",
    "project_scratch_size",
    "residual",
    "round_bf16",
    "row_sumsq",
    "row_sumsq_f32",
    "rows",
    "sumsq",
]

_THREADS = 256
_BF16 = BF16Codec()  # the side channel's format (GeoCodec.side_format)
_LANES = 8  # GC_LANES of native/gc_linalg.h: the lanes of a dot product
_PROJECT_COEFS = 8  # GC_GEO_COEFS of native/gc_geometry.cu: coefficients per group
_SUMSQ_CHUNK = 2048  # GC_SUMSQ_CHUNK of native/gc_linalg.h
_DOT_CHUNK = 512  # GC_DOT_CHUNK of native/gc_linalg.h: columns per chunk of a dot product
_ACC_ROWS = 128  # GC_ACC_ROWS of native/gc_linalg.h: rows per tile of an accumulation
_ORTHO_LANES = 256  # GC_ORTHO_LANES of native/gc_linalg.h: one block's threads
_U64 = 2**64 - 1
_HASH_THREADS = 256  # GC_HASH_THREADS of native/gc_geometry.cu
_HASH_STEP = 0x9E3779B97F4A7C15  # GC_HASH_STEP of native/gc_geometry.cu


def rows(lo: int, length: int, n: int) -> int:
    """Rows of an n-column matrix that the flat range [lo, lo + length) touches."""
    if length <= 0:
        return 0
    return (lo + length - 1) // n - lo // n + 1


def _host(a: Any) -> np.ndarray:
    """A NumPy view of a host array (zero-copy through DLPack)."""
    return a if isinstance(a, np.ndarray) else np.from_dlpack(a)


def host_copy(a: Any) -> np.ndarray:
    """A NumPy copy of an array of any namespace (CuPy copies from the device)."""
    if is_cupy_array(a):
        return np.array(a.get())
    return np.array(_host(a), copy=True)


#: The device copies queued and not yet seen landed. Each keeps its block of pinned
#: memory until its event has passed, whoever dropped it (a state reset or load drops
#: the codec's pending ones): CuPy's pool hands a freed block out again at once, and
#: the copy would land in its next owner's bytes.
_landing: list[LaterCopy] = []
_landing_lock = threading.Lock()  # a DDP hook's worker makes them too


class LaterCopy:
    """Host copies of small arrays, read when needed: CuPy arrays' are queued on the
    current stream into one block of pinned memory behind one event, so the host
    goes on at once and :meth:`result` waits for the device only if the copies have
    not landed by then (the stream went on, in order, since). Other arrays are
    copied at once. The pinned block lives until the copies landed (:data:`_landing`)."""

    #: bytes between the starts of two arrays in the pinned block (any dtype's alignment)
    ALIGN = 64

    def __init__(self, *arrays: Any):
        self._event: Any = None
        self._host: list[np.ndarray] = []
        # each CuPy array's bytes in the pinned block (0: a host array, copied at once)
        spans = [
            -(-max(a.nbytes, 1) // self.ALIGN) * self.ALIGN if is_cupy_array(a) else 0
            for a in arrays
        ]
        if not any(spans):
            self._host = [host_copy(a) for a in arrays]
            return
        import cupy

        memory, at = cupy.cuda.alloc_pinned_memory(sum(spans)), 0
        for a, span in zip(arrays, spans, strict=True):
            if not span:
                self._host.append(host_copy(a))
                continue
            a = cupy.ascontiguousarray(a)
            host = np.frombuffer(memory, a.dtype, a.size, at).reshape(a.shape)
            a.get(out=host, blocking=False)
            self._host.append(host)
            at += span
        self._event = cupy.cuda.Event(disable_timing=True)
        self._event.record()
        with _landing_lock:
            _landing[:] = [c for c in _landing if not c._event.done]
            _landing.append(self)

    def result(self) -> list[np.ndarray]:
        """The copies, in the order given (NumPy; do not write to them)."""
        if self._event is not None and not self._event.done:
            self._event.synchronize()
        return self._host


def project_scratch_size(rows_: int, n: int, k: int) -> int:
    """Float32 values of scratch :func:`project` needs on a GPU for ``rows_`` rows of an
    n-column matrix and k coefficients: the chunk sums of rows longer than one chunk
    (``native/gc_linalg.h``, "dot"), 0 for shorter ones."""
    chunks = -(-n // _DOT_CHUNK)
    return rows_ * chunks * k if chunks > 1 else 0


def project(values: Any, lo: int, n: int, vt: Any, out: Any = None, scratch: Any = None) -> Any:
    """coef (rows, k): dot products of each touched row's part with the k rows of vt;
    written into ``out`` (C-contiguous float32 of that shape) when given. ``scratch``:
    a flat float32 array of at least :func:`project_scratch_size` values for a GPU's
    chunk sums (None: allocated; the host needs none).

    Non-finite values read as 0, so a rank's inf/NaN stays where it is
    instead of spreading into every coefficient of its row.
    """
    if out is not None:
        k = vt.shape[0]
        shape = (rows(lo, values.shape[0], n) if k else 0, k)
        if tuple(out.shape) != shape or out.dtype != np.float32:
            raise ValueError(f"project writes float32 {shape}, got {out.dtype} {tuple(out.shape)}")
    if is_cupy_array(values):
        return _cuda_project(values, lo, n, vt, out, scratch)
    xp = array_namespace(values, vt)
    coef, _ = native.geo_project(_host(values), lo, n, _host(vt))
    if out is None:
        return xp.asarray(coef)
    _host(out)[...] = coef
    return out


def pack(vt: Any) -> Any:
    """vt in the layout the host expansion reads fastest (None for CuPy: unused there)."""
    return None if is_cupy_array(vt) else native.geo_pack(_host(vt))


def expand(
    values: Any, lo: int, n: int, coef: Any, vt: Any, sign: float, out: Any, packed: Any = None
) -> None:
    """out = values + sign * coef vt over the range; ``out`` may be ``values``;
    ``packed``: :func:`pack` of vt, when the caller expands with it many times."""
    if is_cupy_array(values):
        _cuda_expand(values, lo, n, coef, vt, sign, out)
        return
    native.geo_expand(_host(values), lo, n, _host(coef), _host(vt), float(sign), _host(out), packed)


def round_bf16(values: Any) -> Any:
    """Round float32 ``values`` to bfloat16 in place (nearest even, the bf16
    codec's bits: ``native/gc_scalar.h``'s gc_bf16_code) and return them.

    GeoFP8's side channel carries bfloat16: its coefficients, step and refresh sums
    are rounded here before they are used or sent, so the wire holds them
    exactly.
    """
    if values.size == 0:
        return values
    if not (values if is_cupy_array(values) else _host(values)).flags.c_contiguous:
        raise ValueError("round_bf16 rounds C-contiguous arrays in place")
    if is_cupy_array(values):
        import cupy

        flat = values.reshape(-1)
        _kernel(cupy, "gc_geo_round_bf16")(
            _grid(flat.size), (_THREADS,), (flat, np.uint64(flat.size))
        )
        return values
    flat = _host(values).reshape(-1)
    round_trip(_BF16, flat, flat)
    return values


def residual(values: Any, n: int, vt: Any, out: Any) -> Any:
    """The split residual of a whole matrix: returns coef = project(values) rounded to
    bfloat16 (:func:`round_bf16`), writes out = values - coef vt (same bits as the
    three steps; one pass on the host)."""
    if is_cupy_array(values):
        coef = round_bf16(_cuda_project(values, 0, n, vt, None, None))
        _cuda_expand(values, 0, n, coef, vt, -1.0, out)
        return coef
    xp = array_namespace(values, vt)
    return xp.asarray(native.geo_residual(_host(values), n, _host(vt), _host(out)))


def accumulate(values: Any, lo: int, n: int, coef: Any, acc: Any) -> None:
    """acc (k, n) += coef^T values over the range's rows, in tiles of rows
    (``native/gc_linalg.h``, "accumulate")."""
    if is_cupy_array(values):
        _cuda_accumulate(values, lo, n, coef, acc)
        return
    native.geo_accumulate(_host(values), lo, n, _host(coef), _host(acc))


def sumsq(values: Any) -> float:
    """Sum of squares in fp64, in gc_linalg.h's "sumsq" order (CuPy sums on the device
    and copies the total)."""
    if is_cupy_array(values):
        return float(row_sumsq(values.reshape(1, -1))[0].get())
    return native.geo_sumsq(np.ascontiguousarray(_host(values), np.float32).reshape(-1))


def row_sumsq(a: Any) -> Any:
    """The :func:`sumsq` of every row of a 2-D float32 array, as a float64 array of its
    namespace (CuPy: computed on the device, nothing copied to the host)."""
    if is_cupy_array(a):
        return _cuda_row_sumsq(a)
    xp = array_namespace(a)
    host = _host(a)
    return xp.asarray(
        np.array([native.geo_sumsq(np.ascontiguousarray(r, np.float32)) for r in host], np.float64)
    )


def row_sumsq_f32(a: Any) -> Any:
    """:func:`row_sumsq` rounded to float32 (nearest even, subnormals kept; on CuPy by a
    kernel of its own: CuPy's casts flush subnormals to zero, the host's do not)."""
    if not is_cupy_array(a):
        xp = array_namespace(a)
        return xp.astype(row_sumsq(a), xp.float32)
    import cupy

    sums = _cuda_row_sumsq(a)
    out = cupy.empty(sums.shape, cupy.float32)
    if sums.size:
        _kernel(cupy, "gc_geo_to_f32")(
            _grid(sums.size), (_THREADS,), (sums, np.uint64(sums.size), out)
        )
    return out


def column_sumsq(coef: Any) -> list[float]:
    """:func:`sumsq` of every column of an (m, k) coefficient matrix (one copy to the host)."""
    return [float(e) for e in host_copy(row_sumsq(coef.T))]


def basis_hash(a: Any) -> Any:
    """A 64-bit hash of a float32 array's bits, as a (1,) uint64 array of its namespace
    (CuPy: computed on the device, nothing copied): the sum over its C-order elements
    of bits(a[i]) * ((i + 1) * GC_HASH_STEP | 1) mod 2^64. Integer sums mod 2^64 do
    not depend on their order, so every device gives the same bits; each weight is
    odd, so a change of any one element always changes the hash. What a key's state
    checksum holds of its basis (KeyState), so a power step need not copy its basis
    to the host."""
    if is_cupy_array(a):
        import cupy

        words = cupy.ascontiguousarray(a, cupy.float32).reshape(-1).view(cupy.uint32)
        out = cupy.empty(1, cupy.uint64)
        _kernel(cupy, "gc_geo_hash")((1,), (_HASH_THREADS,), (words, np.uint64(words.size), out))
        return out
    xp = array_namespace(a)
    words = np.ascontiguousarray(_host(a), np.float32).reshape(-1).view(np.uint32)
    terms = words.astype(np.uint64)
    np.multiply(terms, _hash_weights(words.size), out=terms)  # integer products wrap
    return xp.asarray(np.array([terms.sum(dtype=np.uint64)], np.uint64))


_HASH_WEIGHTS = np.zeros(0, np.uint64)


def _hash_weights(n: int) -> np.ndarray:
    """The first n weights of :func:`basis_hash`, (i + 1) * GC_HASH_STEP | 1, computed
    once for the largest n asked so far (they are most of a host hash's work).
    Thread-safe: a thread reads the global once, so another's smaller table never
    replaces the one it returns."""
    global _HASH_WEIGHTS
    weights = _HASH_WEIGHTS
    if weights.size < n:
        index = np.arange(1, n + 1, dtype=np.uint64)
        weights = _HASH_WEIGHTS = (index * np.uint64(_HASH_STEP)) | np.uint64(1)
    return weights[:n]


def orthonormalize(rows_: Any, seed: int) -> Any:
    """A new (k, d) float32 array of ``rows_``'s namespace whose rows are an
    orthonormal basis of the rows' span (k <= d).

    Rows lost to the ones before them (or zero, or non-finite) are replaced by
    fixed pseudo-random directions drawn from ``seed``; the work is fp64 in a
    fixed order (``native/gc_linalg.h``, "ortho"), in C on the host and in one
    thread block on a GPU, with the same bits. The rows are always finite.
    """
    if is_cupy_array(rows_):
        return _cuda_orthonormalize(rows_, seed)
    xp = array_namespace(rows_)
    host = np.array(_host(rows_), np.float32, copy=True, order="C")
    native.geo_orthonormalize(host, seed)
    return xp.asarray(host)


# ---------------------------------------------------------------------------
# CUDA (CuPy arrays)


@functools.cache
def _source() -> str:
    """gc_geometry.cu with gc_linalg.h and gc_scalar.h inlined (one NVRTC unit)."""
    from geocomm.kernels import cuda_build

    directory = cuda_build.source_dir()
    text = (directory / "gc_geometry.cu").read_text()
    for header in ("gc_linalg.h", "gc_scalar.h"):
        body = (directory / header).read_text()
        text = text.replace(f'#include "{header}"', body, 1)
    return text


def _kernel(cupy: Any, name: str) -> Any:
    from geocomm.kernels import cuda_build

    return cuda_build.kernel(cupy, name, _source)


def _grid(threads: int) -> tuple[int]:
    return (max(1, -(-threads // _THREADS)),)


def _expand_grid(length: int) -> tuple[int]:
    """Thread blocks for gc_geo_expand over a range of ``length`` values (four per thread)."""
    return _grid(-(-length // 4))


def _range_args(values: Any, lo: int, n: int, writes: bool = False) -> tuple[Any, ...]:
    """The arguments every geometry kernel that reads a range starts with: the range's
    values and the slot of their shift (:func:`geocomm.kernels.cuda.moved`; ``writes``:
    the launch writes their memory too), where the range starts in the matrix, its
    length and the row length."""
    moved = cuda.moved(values, writes=writes)
    return (values, moved, np.uint64(lo), np.uint64(values.size), np.uint64(n))


def _cuda_project(values: Any, lo: int, n: int, vt: Any, out: Any, scratch: Any) -> Any:
    import cupy

    k = vt.shape[0]
    touched = rows(lo, values.size, n) if k else 0
    if out is not None and not out.flags.c_contiguous:
        raise ValueError("project writes C-contiguous coefficients")
    coef = cupy.empty((touched, k), cupy.float32) if out is None else out
    if not touched:
        return coef
    chunks = -(-n // _DOT_CHUNK)  # a row's chunks of columns, summed at once
    partial = coef
    if chunks > 1:
        size = project_scratch_size(touched, n, k)
        partial = cupy.empty(size, cupy.float32) if scratch is None else scratch[:size]
    range_args = _range_args(values, lo, n)
    sizes = (np.uint64(k), np.uint64(touched), np.uint64(chunks))
    groups = touched * chunks * -(-k // _PROJECT_COEFS)
    _kernel(cupy, "gc_geo_project")(
        _grid(groups * _LANES), (_THREADS,), (*range_args, vt, *sizes, partial)
    )
    if chunks > 1:
        _kernel(cupy, "gc_geo_project_chunks")(
            _grid(touched * k), (_THREADS,), (partial, *range_args[2:], *sizes, coef)
        )
    return coef


def _cuda_expand(values: Any, lo: int, n: int, coef: Any, vt: Any, sign: float, out: Any) -> None:
    import cupy

    if values.size:
        in_place = int(values.data.ptr) == int(out.data.ptr)  # a map's inverse
        range_args = _range_args(values, lo, n, writes=in_place)
        _kernel(cupy, "gc_geo_expand")(
            _expand_grid(values.size),
            (_THREADS,),
            (
                *range_args,
                *(coef, vt, np.uint64(vt.shape[0]), np.float32(sign)),
                *(out, cuda.moved(out, writes=True)),
            ),
        )


def _cuda_accumulate(values: Any, lo: int, n: int, coef: Any, acc: Any) -> None:
    import cupy

    k = acc.shape[0]
    if not values.size or not k:
        return
    touched = rows(lo, values.size, n)
    tiles = -(-touched // _ACC_ROWS)
    partial = cupy.empty(tiles * k * n, cupy.float32)
    _kernel(cupy, "gc_geo_accumulate")(
        _grid(n * tiles * -(-k // _PROJECT_COEFS)),
        (_THREADS,),
        (*_range_args(values, lo, n), coef, np.uint64(k), np.uint64(touched), partial),
    )
    _kernel(cupy, "gc_geo_accumulate_tiles")(
        _grid(k * n), (_THREADS,), (partial, np.uint64(tiles), np.uint64(k * n), acc)
    )


def _cuda_orthonormalize(rows_: Any, seed: int) -> Any:
    import cupy

    k, n = rows_.shape
    if k == 0 or n < k:
        raise ValueError(f"orthonormalize takes k <= n rows, got a {k} x {n} matrix")
    out = cupy.array(rows_, cupy.float32, order="C")
    scratch = cupy.empty(k * n + k + 1, cupy.float64)
    _kernel(cupy, "gc_geo_orthonormalize")(
        (1,),
        (_ORTHO_LANES,),
        (out, np.uint64(k), np.uint64(n), np.uint64(seed & _U64), scratch, scratch[k * n :]),
    )
    return out


def _cuda_row_sumsq(a: Any) -> Any:
    """The levels of the "sumsq" order on the device: level 0 squares, each level above
    sums GC_SUMSQ_CHUNK totals, until one total per row is left."""
    import cupy

    level = cupy.ascontiguousarray(a, cupy.float32)
    rows, length = level.shape
    if length == 0:
        return cupy.zeros(rows, cupy.float64)
    name = "gc_geo_sumsq_squares"
    while True:
        chunks = -(-length // _SUMSQ_CHUNK)
        out = cupy.empty((rows, chunks), cupy.float64)
        first = (level, cuda.moved(level)) if name == "gc_geo_sumsq_squares" else (level,)
        _kernel(cupy, name)(
            _grid(rows * chunks * _LANES),
            (_THREADS,),
            (*first, np.uint64(rows), np.uint64(length), out),
        )
        if chunks == 1:
            return out.reshape(rows)
        level, length, name = out, chunks, "gc_geo_sumsq_totals"
