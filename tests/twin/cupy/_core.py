"""The twin's ``cupy.ndarray`` and array functions: CuPy's behaviour for what geocomm uses.

An array is a view (offset, shape, strides, dtype) of one device allocation
(:mod:`cupy._memory`). Metadata operations (slicing, ``reshape``, ``view``)
return views at once; everything that touches the data is queued on the
current stream (:mod:`cupy._device`) and runs later, in stream order, with
its reads and writes checked against the other streams. Host reads
(``get``, ``asnumpy``, ``float()``) queue the copy on the current stream and
synchronize it, as CuPy does; implicit conversion to NumPy raises as in CuPy,
and NumPy ufuncs and functions refuse twin arrays instead of silently
computing on the host. Float32 arithmetic flushes subnormal inputs and
results to (signed) zero, as CuPy's elementwise kernels (compiled with
``-ftz=true``) do on a GPU; copies keep bits. Advanced indexing and every
function the twin does not implement raise ``NotImplementedError``.
"""

from __future__ import annotations

import builtins
import math
import numbers
from typing import Any

import numpy as np

from cupy import _device, _memory

_TINY32 = np.float32(np.finfo(np.float32).tiny)


def _ftz(values: np.ndarray) -> np.ndarray:
    """float32 subnormals to signed zero (CUDA's -ftz=true); other dtypes unchanged."""
    if values.dtype == np.float32:
        sub = (np.abs(values) < _TINY32) & (values != 0)
        if sub.any():
            values = np.where(sub, np.copysign(np.float32(0), values), values)
    return values


class Device:
    """``cupy.cuda.Device``: the twin has GEOCOMM_TWIN_DEVICES devices (default 1)."""

    def __init__(self, device: int | None = None):
        self.id = _current_device() if device is None else int(device)
        if not 0 <= self.id < device_count():
            raise _device.CUDARuntimeError(
                f"cudaErrorInvalidDevice: device {self.id} (the twin has {device_count()})"
            )

    compute_capability = "90"

    def use(self) -> None:
        _dev_tls.current = self.id

    def __enter__(self) -> Device:
        self._previous = _current_device()
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _dev_tls.current = self._previous

    def synchronize(self) -> None:
        _device.synchronize_all()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("twin-device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


def device_count() -> int:
    import os

    return int(os.environ.get("GEOCOMM_TWIN_DEVICES", "1"))


class _DevTLS(__import__("threading").local):
    current = 0


_dev_tls = _DevTLS()


def _current_device() -> int:
    return _dev_tls.current


class MemoryPointer:
    """``ndarray.data`` and what an allocator returns: the address (``ptr``) of a byte
    ``offset`` bytes into an allocation (``mem``)."""

    def __init__(self, alloc: _memory.Allocation, offset: int):
        self.mem, self.ptr, self.device_id = alloc, alloc.ptr + offset, 0

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))


def _malloc(nbytes: int) -> MemoryPointer:
    """The twin's own allocator (CuPy's pool, see :mod:`cupy._memory`): a block of the
    current stream's, refused under capture (see :mod:`cupy._device`)."""
    stream = _device.current_stream()
    stream._not_capturing("an allocation")
    return MemoryPointer(_memory.Allocation(nbytes, stream.ptr), 0)


class _AllocatorTLS(__import__("threading").local):
    allocator: Any = None  # ``cupy.cuda.using_allocator``'s, for this thread


_allocator_tls = _AllocatorTLS()


def get_allocator() -> Any:
    """``cupy.cuda.get_allocator``: this thread's allocator (``using_allocator``'s), else
    the twin's own."""
    return _allocator_tls.allocator or _malloc


class using_allocator:
    """``cupy.cuda.using_allocator``: ``allocator(nbytes) -> MemoryPointer`` makes this
    thread's device arrays inside the block (an allocation inside an allocation)."""

    def __init__(self, allocator: Any):
        self.allocator = allocator

    def __enter__(self) -> None:
        self._previous = _allocator_tls.allocator
        _allocator_tls.allocator = self.allocator

    def __exit__(self, *exc: Any) -> None:
        _allocator_tls.allocator = self._previous


class _Flags:
    def __init__(self, view: np.ndarray):
        self.c_contiguous = bool(view.flags.c_contiguous)
        self.f_contiguous = bool(view.flags.f_contiguous)
        self.owndata = False

    def __getitem__(self, name: str) -> bool:
        return {
            "C_CONTIGUOUS": self.c_contiguous,
            "F_CONTIGUOUS": self.f_contiguous,
            "OWNDATA": self.owndata,
        }[name]


def _not_implemented(name: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"the CuPy twin does not implement cupy.{name}")

    call.__name__ = name
    return call


class ndarray:
    """A device array of the twin (see the module docstring)."""

    __array_ufunc__ = None  # NumPy ufuncs defer to (or refuse) twin arrays

    def __init__(
        self,
        shape: Any,
        dtype: Any = float,
        memptr: Any = None,
        strides: Any = None,
        order: str = "C",
        *,
        _alloc: Any = None,
        _offset: int = 0,
    ):
        dtype = np.dtype(dtype)
        shape = (
            (int(shape),) if isinstance(shape, numbers.Integral) else tuple(int(s) for s in shape)
        )
        if order != "C" or memptr is not None:
            raise NotImplementedError("the CuPy twin makes C-ordered arrays of their own memory")
        if _alloc is None:
            pointer = get_allocator()(math.prod(shape) * dtype.itemsize)
            _alloc, _offset = pointer.mem, pointer.ptr - pointer.mem.ptr
        if strides is None:
            strides = _c_strides(shape, dtype.itemsize)
        self._alloc, self._offset = _alloc, int(_offset)
        self.shape, self.dtype, self.strides = shape, dtype, tuple(strides)
        lo, hi = _extent(self._offset, shape, self.strides, dtype.itemsize)
        self._lo, self._hi = lo, hi

    # -- metadata --------------------------------------------------------------
    def _view(self) -> np.ndarray:
        """The host view of this array's bytes (for operations running on a stream)."""
        return np.ndarray(
            self.shape,
            self.dtype,
            buffer=self._alloc.payload,
            offset=self._offset,
            strides=self.strides,
        )

    @classmethod
    def _of_view(cls, alloc: _memory.Allocation, view: np.ndarray) -> ndarray:
        offset = view.__array_interface__["data"][0] - alloc.ptr if view.size else 0
        return cls(
            view.shape, view.dtype, strides=view.strides, _alloc=alloc, _offset=max(offset, 0)
        )

    size = property(lambda self: math.prod(self.shape))
    ndim = property(lambda self: len(self.shape))
    itemsize = property(lambda self: self.dtype.itemsize)
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    data = property(lambda self: MemoryPointer(self._alloc, self._offset))
    device = property(lambda self: Device(0))
    flags = property(lambda self: _Flags(self._view()))
    base = property(lambda self: None)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"<twin cupy.ndarray shape={self.shape} dtype={self.dtype}>"

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        try:
            view = self._view().reshape(shape, order=order)
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"twin: cannot reshape {self.shape} to {shape}: {exc}") from None
        if not np.shares_memory(view, self._view()) and view.size:
            raise NotImplementedError("twin: reshape that needs a copy")
        return ndarray._of_view(self._alloc, view)

    @property
    def T(self) -> ndarray:  # CuPy's transpose of a view
        return ndarray._of_view(self._alloc, self._view().T)

    def ravel(self) -> ndarray:
        return self.reshape(-1) if self.flags.c_contiguous else self.copy().reshape(-1)

    def view(self, dtype: Any) -> ndarray:
        return ndarray._of_view(self._alloc, self._view().view(np.dtype(dtype)))

    def __getitem__(self, key: Any) -> ndarray:
        return ndarray._of_view(self._alloc, self._view()[_basic_key(key)])

    # -- data ------------------------------------------------------------------
    def __setitem__(self, key: Any, value: Any) -> None:
        target = self[key]
        if isinstance(value, ndarray):
            _copy_into(target, value, "a setitem copy")
        elif isinstance(value, np.ndarray):
            _host_to_device(target, np.broadcast_to(value.astype(target.dtype), target.shape))
        else:
            scalar = np.asarray(value).astype(target.dtype)
            if scalar.ndim:
                _host_to_device(target, np.broadcast_to(scalar, target.shape))
            else:
                _run(lambda: target._view().__setitem__(..., scalar), "a fill", [], [target])

    def fill(self, value: Any) -> None:
        self[...] = value

    def copy(self, order: str = "C") -> ndarray:
        out = ndarray(self.shape, self.dtype)
        _copy_into(out, self, "a copy")
        return out

    def astype(
        self,
        dtype: Any,
        order: str = "C",
        casting: Any = None,
        subok: Any = None,
        copy: bool = True,
    ) -> ndarray:
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self.copy() if copy else self
        return _elementwise(lambda a: a.astype(dtype), [self], dtype, "astype")

    def get(
        self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True
    ) -> np.ndarray:
        """Copy to the host: queued on the current stream, which is then synchronized.
        ``blocking=False`` only queues the copy into ``out``, which must lie in pinned
        memory (``cupy.cuda.alloc_pinned_memory``: on a GPU a copy to pageable memory
        does not overlap the host); ``out`` reads as poison until the copy lands."""
        stream = stream or _device.current_stream()
        src = self
        if stream.capture is not None:  # CuPy's guard (MemoryPointer.copy_to_host_async)
            raise RuntimeError("the current stream is capturing, so D2H transfers are disallowed")
        if not blocking:
            if out is None or not _memory.is_pinned(out):
                raise ValueError("twin: an asynchronous copy to the host needs pinned memory")
            if out.shape != self.shape or out.dtype != self.dtype:
                want = f"{self.dtype} {self.shape}"
                raise ValueError(f"twin get: out is {out.dtype} {out.shape}, not {want}")
            out.view(np.uint8)[...] = _memory.POISON

            def land() -> None:
                out[...] = src._view()

            stream.enqueue(land, "a device-to-host copy", [_device.access(self)], [])
            return out
        result = np.empty(self.shape, self.dtype)

        def copy() -> None:
            result[...] = src._view()

        stream.enqueue(copy, "a device-to-host copy", [_device.access(self)], [])
        stream.synchronize()
        if out is not None:
            out[...] = result
            return out
        return result

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        arr = np.asarray(arr)
        if arr.shape != self.shape:
            raise ValueError(f"twin set: shape {arr.shape} != {self.shape}")
        _host_to_device(self, arr.astype(self.dtype), stream)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def _scalar(self) -> Any:
        if self.size != 1:
            raise TypeError(f"only size-1 arrays convert to Python scalars (size {self.size})")
        return self.get().reshape(()).item()

    __bool__ = lambda self: bool(self._scalar())  # noqa: E731
    __float__ = lambda self: float(self._scalar())  # noqa: E731
    __int__ = lambda self: int(self._scalar())  # noqa: E731
    __index__ = __int__

    def item(self) -> Any:
        return self._scalar()

    def tolist(self) -> Any:
        return self.get().tolist()

    # -- DLPack ------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        """kDLCPU: the twin's device memory is host memory, which a consumer (torch)
        then reads and writes directly; the host must have waited for it first."""
        return (1, 0)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        access = _device.access(self)
        _device.host_access(
            "a DLPack export (the consumer reads and writes it on the host)", [access], [access]
        )
        kwargs = {
            k: v
            for k, v in (("max_version", max_version), ("dl_device", dl_device), ("copy", copy))
            if v is not None
        }
        return self._view().__dlpack__(**kwargs)

    # -- arithmetic (flush-to-zero, like CuPy's kernels) -------------------------
    def _binary(self, other: Any, fn: Any, name: str, reflected: bool = False) -> Any:
        if isinstance(other, np.ndarray) and other.ndim:
            raise TypeError(f"Unsupported type {type(other)}: a NumPy array in twin {name}")
        if not isinstance(other, (ndarray, numbers.Number, np.generic)):
            return NotImplemented
        operands = [other, self] if reflected else [self, other]
        return _elementwise(fn, operands, None, name)

    def _inplace(self, other: Any, fn: Any, name: str) -> ndarray:
        if isinstance(other, np.ndarray) and other.ndim:
            raise TypeError(f"Unsupported type {type(other)}: a NumPy array in twin {name}")
        _elementwise(fn, [self, other], self.dtype, name, out=self)
        return self

    def __neg__(self) -> ndarray:
        return _elementwise(np.negative, [self], None, "negative")

    def __abs__(self) -> ndarray:
        return _elementwise(np.abs, [self], None, "absolute")

    def __invert__(self) -> ndarray:
        return _elementwise(np.invert, [self], None, "invert")


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _extent(offset: int, shape: tuple, strides: tuple, itemsize: int) -> tuple[int, int]:
    """[lo, hi) bytes of the allocation a view can touch."""
    if math.prod(shape) == 0:
        return offset, offset
    lo = hi = offset
    for dim, step in zip(shape, strides, strict=True):
        span = (dim - 1) * step
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return lo, hi + itemsize


def _basic_key(key: Any) -> Any:
    items = key if isinstance(key, tuple) else (key,)
    for item in items:
        if not (
            item is None or item is Ellipsis or isinstance(item, (slice, numbers.Integral))
        ) or isinstance(item, bool):
            raise NotImplementedError(f"the CuPy twin supports basic indexing only, got {item!r}")
    if Ellipsis not in items:
        items = (*items, Ellipsis)  # integer indexing then still gives a (0-d) view
    return items


_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
}
for _name, _fn in _BINARY.items():
    setattr(
        ndarray,
        f"__{_name}__",
        (lambda fn, name: lambda self, o: self._binary(o, fn, name))(_fn, _name),
    )
    setattr(
        ndarray,
        f"__r{_name}__",
        (lambda fn, name: lambda self, o: self._binary(o, fn, name, True))(_fn, _name),
    )
    setattr(
        ndarray,
        f"__i{_name}__",
        (lambda fn, name: lambda self, o: self._inplace(o, fn, name))(_fn, _name),
    )
for _name, _fn in {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}.items():
    setattr(
        ndarray,
        f"__{_name}__",
        (lambda fn, name: lambda self, o: self._binary(o, fn, name))(_fn, _name),
    )


# ---------------------------------------------------------------------------
# queued operations


def _run(fn: Any, what: str, reads: list, writes: list, stream: Any = None) -> None:
    """Queue ``fn`` on the current stream (or ``stream``); reads/writes are twin arrays."""
    stream = stream or _device.current_stream()
    allocs = {a._alloc for a in writes}

    def op() -> None:
        with _device.device_lock:
            fn()
        _memory.check_redzones(allocs, what)

    stream.enqueue(
        op, what, [_device.access(a) for a in reads], [_device.access(a) for a in writes]
    )


def _copy_into(target: ndarray, source: ndarray, what: str) -> None:
    np.broadcast_shapes(source.shape, target.shape)
    _run(
        lambda: np.copyto(target._view(), source._view(), casting="unsafe"),
        what,
        [source],
        [target],
    )


def _host_to_device(target: ndarray, values: np.ndarray, stream: Any = None) -> None:
    """A host-to-device copy: the host buffer is read now (pageable memory), the device
    bytes written in stream order. Refused under capture: a graph's copy would read
    the host buffer at every replay, and CuPy's staging copy of it is gone by then."""
    if (stream or _device.current_stream()).capture is not None:  # CuPy's guard, its words
        raise RuntimeError("the current stream is capturing, so H2D transfers are disallowed")
    snapshot = np.array(values, dtype=target.dtype, copy=True)
    _run(lambda: np.copyto(target._view(), snapshot), "a host-to-device copy", [], [target], stream)


def _operand_shape(x: Any) -> tuple:
    return x.shape if isinstance(x, ndarray) else ()


def _elementwise(
    fn: Any, operands: list, dtype: Any, what: str, out: ndarray | None = None
) -> ndarray:
    """Queue ``fn`` over the operands' host views (float32 flushed to zero in and out)."""
    for x in operands:
        if not isinstance(x, (ndarray, numbers.Number, np.generic)):
            raise TypeError(f"twin {what}: unsupported operand {type(x).__name__}")
    probe = [
        np.empty(_operand_shape(x), x.dtype) if isinstance(x, ndarray) else x for x in operands
    ]
    with np.errstate(all="ignore"):
        shaped = np.asarray(fn(*probe))
    result_dtype = np.dtype(dtype) if dtype is not None else shaped.dtype
    if out is None:
        out = ndarray(shaped.shape, result_dtype)
    elif np.broadcast_shapes(shaped.shape, out.shape) != out.shape:
        raise ValueError(f"twin {what}: result of shape {shaped.shape} does not fit {out.shape}")
    arrays = [x for x in operands if isinstance(x, ndarray)]

    def compute() -> None:
        values = [_ftz(x._view()) if isinstance(x, ndarray) else x for x in operands]
        with np.errstate(all="ignore"):
            result = _ftz(np.asarray(fn(*values)))
        np.copyto(out._view(), result, casting="unsafe")

    _run(compute, f"an elementwise {what}", arrays, [out])
    return out


# ---------------------------------------------------------------------------
# functions


def _shape(shape: Any) -> tuple:
    return (int(shape),) if isinstance(shape, numbers.Integral) else tuple(shape)


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(_shape(shape), dtype, order=order)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    out = empty(shape, dtype, order)
    out.fill(0)
    return out


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    out = empty(shape, dtype, order)
    out.fill(1)
    return out


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    out = empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype, order)
    out.fill(fill_value)
    return out


def empty_like(
    a: Any, dtype: Any = None, order: str = "C", subok: Any = None, shape: Any = None
) -> ndarray:
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(
    a: Any, dtype: Any = None, order: str = "C", subok: Any = None, shape: Any = None
) -> ndarray:
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__") or (
        hasattr(a, "__dlpack__") and not isinstance(a, np.ndarray)
    ):
        raise NotImplementedError(f"the CuPy twin takes no foreign device array ({type(a)})")
    host = np.asarray(a, dtype=dtype)
    out = empty(host.shape, host.dtype)
    _host_to_device(out, host)
    return out


def array(
    obj: Any,
    dtype: Any = None,
    copy: bool = True,
    order: str = "K",
    subok: bool = False,
    ndmin: int = 0,
    *,
    blocking: bool = False,
) -> ndarray:
    if isinstance(obj, ndarray):
        out = obj.astype(dtype or obj.dtype, copy=copy)
        return out
    return asarray(obj, dtype)


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a)
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    if a.flags.c_contiguous and dtype == a.dtype:
        return a
    if dtype == a.dtype:
        return a.copy()
    return a.astype(dtype)


def asnumpy(
    a: Any, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True
) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, out=out)
    return np.asarray(a, order=order)


def reshape(a: ndarray, newshape: Any, order: str = "C") -> ndarray:
    return a.reshape(newshape, order=order)


def ravel(a: ndarray) -> ndarray:
    return a.ravel()


def concatenate(arrays: Any, axis: int = 0, out: Any = None, dtype: Any = None) -> ndarray:
    arrays = list(arrays)
    if not arrays or not builtins.all(isinstance(a, ndarray) for a in arrays):
        raise TypeError("twin concatenate takes a non-empty sequence of twin arrays")
    probe = np.concatenate([np.empty(a.shape, a.dtype) for a in arrays], axis=axis)
    result = empty(probe.shape, dtype or probe.dtype) if out is None else out
    small = builtins.sum(a.nbytes for a in arrays) < (2 << 20) * len(arrays)
    if len(arrays) > 8 and small and len({a.dtype for a in arrays} | {result.dtype}) == 1:
        # CuPy joins more than 8 small arrays of one dtype in one kernel, which reads a
        # table of their addresses that the host uploads first
        asarray(np.array([a.data.ptr for a in arrays], np.int64))
    start = 0
    for a in arrays:
        width = a.shape[axis] if a.ndim else 1
        index = (slice(None),) * (axis % max(result.ndim, 1)) + (slice(start, start + width),)
        _copy_into(result[index], a, "a concatenate copy")
        start += width
    return result


def where(condition: ndarray, x: Any, y: Any) -> ndarray:
    return _elementwise(np.where, [condition, x, y], None, "where")


def isfinite(x: ndarray) -> ndarray:
    return _elementwise(np.isfinite, [x], np.bool_, "isfinite")


def isnan(x: ndarray) -> ndarray:
    return _elementwise(np.isnan, [x], np.bool_, "isnan")


def _reduction(
    fn: Any, name: str, x: ndarray, axis: Any = None, dtype: Any = None, keepdims: bool = False
) -> ndarray:
    probe = np.asarray(fn(np.zeros(x.shape, x.dtype), axis=axis, keepdims=keepdims))
    out = empty(probe.shape, dtype or probe.dtype)
    _run(
        lambda: np.copyto(
            out._view(), fn(_ftz(x._view()), axis=axis, keepdims=keepdims), casting="unsafe"
        ),
        f"a reduction {name}",
        [x],
        [out],
    )
    return out


def all(a: ndarray, axis: Any = None, out: Any = None, keepdims: bool = False) -> ndarray:
    return _reduction(np.all, "all", a, axis, np.bool_, keepdims)


def any(a: ndarray, axis: Any = None, out: Any = None, keepdims: bool = False) -> ndarray:
    return _reduction(np.any, "any", a, axis, np.bool_, keepdims)


def may_share_memory(a: Any, b: Any, max_work: Any = None) -> bool:
    if not (isinstance(a, ndarray) and isinstance(b, ndarray)):
        return False
    return a._alloc is b._alloc and a._lo < b._hi and b._lo < a._hi


shares_memory = may_share_memory


def from_dlpack(x: Any) -> ndarray:
    if isinstance(x, ndarray):
        return x
    raise NotImplementedError(
        f"the CuPy twin cannot import DLPack memory of {type(x).__name__} "
        "(torch CUDA tensors run on a real GPU only)"
    )


def get_array_module(*args: Any) -> Any:
    import cupy

    return cupy if builtins.any(isinstance(a, ndarray) for a in args) else np
