"""CuPy face of the codec: the CUDA kernels of ``native/gc_cuda.cu``.

Mirrors :mod:`geocomm.kernels.native` for CuPy arrays: ``wire_size``,
``encode(fmt, x, block, wire, stream=None, *, flags=0, seed=0,
rounding_stream=0, offset=0)`` and ``decode(fmt, wire, block, out, accumulate=False,
stream=None)`` write the same wire bodies (``native/geocomm.h``) as the C
core, byte for byte, because both run the arithmetic of
``native/gc_scalar.h``. ``stream`` is the CUDA stream; the stochastic
rounding stream is ``rounding_stream``. Decoded values are bitwise equal too,
except the payloads of decoded NaNs (GPU arithmetic returns the canonical NaN,
where x86 keeps the code's sign); accumulated sums write that canonical NaN
on both. Format ids, flags and layout
constants are the C core's (``geocomm.kernels.native``, from the compiled
cdef); this module forwards them (``geocomm.kernels.cuda.E4M3`` ...). ``divide`` is
the IEEE division of op="avg", ``add`` the fp32 sums of the collectives and
``residual`` error feedback's differences (CuPy's own arithmetic flushes subnormals),
``copy`` a copy of fp32 values.

Kernels that run inside a call's CUDA graph on the caller's arrays read and write
them at their arguments' addresses plus a shift in device memory (``gc_moved``
in ``native/gc_scalar.h``): :func:`moving` names the arrays of the call under way
and their shifts' slots, and :func:`moved` gives a launch the slot of the array it
passes (:class:`Moves`).

Importing this module never imports CuPy. ``available`` (computed on first
access) says whether CuPy imports and sees a CUDA device; every function that
needs CuPy raises :class:`CudaUnavailable` (an ImportError) saying what is
missing. :mod:`geocomm.kernels.cuda_build` finds, compiles (NVRTC) and loads the
kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from geocomm.kernels import native
from geocomm.kernels.cuda_build import (
    NVRTC_OPTIONS,
    CudaUnavailable,
    kernel,
    kernel_source,
    probe,
    require,
)

__all__ = [
    "NVRTC_OPTIONS",
    "UNMOVED",
    "CudaUnavailable",
    "Fp8Launch",
    "Moves",
    "add",
    "copy",
    "decode",
    "divide",
    "divide_grid",
    "encode",
    "fp8_launch",
    "kernel_source",
    "moved",
    "moving",
    "require",
    "residual",
    "wire_size",
]

#: Threads per thread block of every launch (a multiple of the warp size).
THREADS = 256
#: Values per thread block in the tile kernels (fp8 blocks > TEAM_MAX, block 0).
TILE = 4096
#: Threads per NVFP4 superblock of the encoders (GC_NVFP4_THREADS of native/gc_cuda.cu).
NVFP4_THREADS = 256
#: Values per thread of the E2M1 (NVFP4, MXFP4) decoders (GC_E2M1_CHUNK).
E2M1_CHUNK = 16
#: Lanes per 32-value block of the MXFP8 encoders, four values each (GC_MX_LANES).
MX_LANES = 8
#: Largest fp8 block handled by one team (<= one warp) of lanes in a single pass
#: (GC_TEAM_MAX of native/gc_cuda.cu).
TEAM_MAX = 1024
#: Values a team of 32 lanes takes per step (four per lane): the largest block of the
#: one-step team encoders (:func:`team_kernel`).
TEAM_STEP = 4 * 32
_GRID_MAX = 2**31 - 1


def __getattr__(name: str) -> Any:
    if name == "available":
        return probe()[0] is not None
    if name in (*native.CDEF_NAMES, "FORMATS", "MX_FORMATS"):  # the C core's constants
        return getattr(native, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# argument checks (as in geocomm.kernels.native)


def wire_size(fmt: int | str, n: int, block: int = 0) -> int:
    """Bytes of the headerless wire body of ``n`` values: the layout the kernels
    write (native/geocomm.h), with the compiled core's constants; needs no CuPy."""
    fmt = native.format_id(fmt)
    n, block = native.check_count(n), native.check_block(block)
    if n == 0:
        return 0
    if fmt in (native.E4M3, native.E5M2):
        return 4 * -(-n // (block or n)) + n
    if fmt == native.NVFP4:
        return 4 * -(-n // native.NVFP4_SUPERBLOCK) + -(-n // native.NVFP4_BLOCK) + -(-n // 2)
    if fmt in native.MX_FORMATS:
        return -(-n // native.MX_BLOCK) + (-(-n // 2) if fmt == native.MXFP4 else n)
    return 2 * n


def _check_f32(cupy: Any, x: Any, name: str) -> None:
    if not isinstance(x, cupy.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        got = f"{type(x).__name__} of dtype {getattr(x, 'dtype', None)}"
        raise TypeError(f"{name} must be a C-contiguous float32 cupy array, got {got}")


def _check_wire(cupy: Any, wire: Any, need: int, device: Any) -> None:
    if not isinstance(wire, cupy.ndarray) or wire.dtype != np.uint8 or not wire.flags.c_contiguous:
        got = f"{type(wire).__name__} of dtype {getattr(wire, 'dtype', None)}"
        raise TypeError(f"wire must be a C-contiguous uint8 cupy array, got {got}")
    if wire.size < need:
        raise ValueError(f"wire holds {wire.size} bytes, the body needs {need}")
    if wire.device != device:
        raise ValueError(f"wire is on {wire.device}, the values on {device}")


def _grid(threads: int) -> tuple[int]:
    blocks = -(-threads // THREADS)
    if blocks > _GRID_MAX:
        raise ValueError(f"{threads} threads exceed one CUDA grid")
    return (blocks,)


def team_kernel(name: str, block: int) -> str:
    """The fp8 team encoder ``name`` (``gc_fp8_encode_team``, ``gc_pipe_fp8_encode_team``)
    for scaling blocks of ``block`` values: the kernel itself covers blocks up to
    TEAM_STEP values in one step, in few registers (so many warps fit on an SM); its
    ``_wide`` twin holds TEAM_MAX / TEAM_STEP steps of values in registers."""
    return name if block <= TEAM_STEP else name + "_wide"


def team_shift(block: int) -> int:
    """log2 of the team width of the fp8 team kernels, whose lanes take four consecutive
    values per step: the next power of two >= ceil(block / 4), at most a warp (32)."""
    return min(5, (-(-block // 4) - 1).bit_length())


@dataclass(frozen=True)
class Fp8Launch:
    """How the fp8 kernels cover n values (see :func:`fp8_launch`).

    ``block`` is the effective scaling block (<= n), ``nblocks`` the number
    of scales. Team kernels (``team_shift`` is not None) run 2^team_shift
    lanes per scaling block; tile kernels run ``tiles_per_block`` thread
    blocks of TILE values per scaling block. ``grid`` is the thread blocks of
    one launch.
    """

    block: int
    nblocks: int
    team_shift: int | None
    tiles_per_block: int
    grid: int


def fp8_launch(n: int, block: int) -> Fp8Launch:
    """The launch plan of the fp8 kernels for n >= 1 values and scaling ``block``.

    Block 0 and any block >= n mean one scale for all n values, so the plan
    caps the block at n: a huge block must not launch tiles for values that
    do not exist (block 2^30 used to start 262,144 thread blocks for one
    scale, and 2^48 overflowed the grid). Raises ValueError past one grid.
    """
    if n < 1 or block < 0:
        raise ValueError(f"fp8_launch needs n >= 1 and block >= 0, got n={n}, block={block}")
    block = n if block == 0 or block > n else block
    nblocks = -(-n // block)
    if block <= TEAM_MAX:
        shift = team_shift(block)
        return Fp8Launch(block, nblocks, shift, 0, _grid(nblocks << shift)[0])
    per_block, total = _tiles(n, block)
    return Fp8Launch(block, nblocks, None, per_block, total)


def _tiles(n: int, block: int) -> tuple[int, int]:
    """(tiles per scaling block, total tiles) for the tile kernels; block <= n."""
    per_block = -(-block // TILE)
    total = -(-n // block) * per_block
    if total > _GRID_MAX:
        raise ValueError(f"{total} tiles exceed one CUDA grid")
    return per_block, total


def _launch_context(device: Any, stream: Any) -> contextlib.ExitStack:
    """Make ``device`` (and ``stream``, if given) current for the launches inside."""
    stack = contextlib.ExitStack()
    stack.enter_context(device)
    if stream is not None:
        stack.enter_context(stream)
    return stack


def _u64(v: int) -> np.uint64:
    return np.uint64(v)


# ---------------------------------------------------------------------------
# encode / decode


def _amax_tiles(cupy: Any, x: Any, n: int, block: int) -> Any:
    """Per-scaling-block amax bits (uint32 device array) by the tile kernel; 1 <= block <= n."""
    per_block, total = _tiles(n, block)
    amax = cupy.zeros(-(-n // block), dtype=cupy.uint32)
    kernel(cupy, "gc_amax_tiles")(
        (total,), (THREADS,), (x, _u64(n), _u64(block), _u64(per_block), _u64(TILE), amax)
    )
    return amax


def encode(
    fmt: int | str,
    x: Any,
    block: int,
    wire: Any,
    stream: Any = None,
    *,
    flags: int = 0,
    seed: int = 0,
    rounding_stream: int = 0,
    offset: int = 0,
) -> None:
    """Encode the float32 values of cupy array ``x`` into the first bytes of ``wire``.

    ``flags`` (STOCHASTIC, RCEIL), ``seed``, ``rounding_stream`` and ``offset`` as
    in the C gc_encode_ex. Runs on CUDA ``stream`` (default: the current
    stream) of x's device; returns without synchronizing.
    """
    cupy = require()
    fmt, block = native.format_id(fmt), native.check_block(block)
    flags = native.check_flags(fmt, flags)
    seed = native.check_u64(seed, "seed")
    rounding_stream = native.check_u64(rounding_stream, "rounding_stream")
    offset = native.check_u64(offset, "offset")
    _check_f32(cupy, x, "x")
    n = x.size
    _check_wire(cupy, wire, wire_size(fmt, n, block), x.device)
    if n == 0:
        return
    sr = np.int32(bool(flags & native.STOCHASTIC))
    if sr:
        key = native.sr_key(seed, rounding_stream)
    else:
        key = 0
    rounding = (sr, _u64(key), _u64(offset))
    rceil = np.int32(bool(flags & native.RCEIL))
    with _launch_context(x.device, stream):
        if fmt == native.BF16:
            kernel(cupy, "gc_bf16_encode")(
                _grid(-(-n // 4)), (THREADS,), (x, _u64(n), *rounding, wire)
            )
        elif fmt == native.NVFP4:  # one thread block per superblock, one pass
            supers = -(-n // native.NVFP4_SUPERBLOCK)
            if supers > _GRID_MAX:
                raise ValueError(f"{supers} NVFP4 superblocks exceed one CUDA grid")
            kernel(cupy, "gc_nvfp4_encode")(
                (supers,), (NVFP4_THREADS,), (x, _u64(n), *rounding, wire)
            )
        elif fmt == native.MXFP4:
            kernel(cupy, "gc_mxfp4_encode")(
                _grid(-(-n // 4)), (THREADS,), (x, _u64(n), rceil, *rounding, wire)
            )
        elif fmt in native.MX_FORMATS:  # 8 lanes of four values per 32-value block
            kernel(cupy, "gc_mxfp8_encode")(
                _grid(MX_LANES * -(-n // native.MX_BLOCK)),
                (THREADS,),
                (x, _u64(n), np.int32(fmt == native.MXFP8_E5M2), rceil, *rounding, wire),
            )
        else:
            _encode_fp8(cupy, fmt, x, n, fp8_launch(n, block), rounding, wire)


def _encode_fp8(
    cupy: Any, fmt: int, x: Any, n: int, plan: Fp8Launch, rounding: tuple, wire: Any
) -> None:
    e5m2 = np.int32(fmt == native.E5M2)
    head = (x, _u64(n), _u64(plan.block), _u64(plan.nblocks))
    if plan.team_shift is not None:
        kernel(cupy, team_kernel("gc_fp8_encode_team", plan.block))(
            (plan.grid,), (THREADS,), (*head, np.uint32(plan.team_shift), e5m2, *rounding, wire)
        )
        return
    amax = _amax_tiles(cupy, x, n, plan.block)
    kernel(cupy, "gc_fp8_encode_tiles")(
        (plan.grid,),
        (THREADS,),
        (*head, _u64(plan.tiles_per_block), _u64(TILE), amax, e5m2, *rounding, wire),
    )


def decode(
    fmt: int | str, wire: Any, block: int, out: Any, accumulate: bool = False, stream: Any = None
) -> None:
    """Decode ``out.size`` values from ``wire`` into (or, accumulating, onto) cupy array ``out``.

    Accumulation is one fp32 add per value, as in the C core. Runs on
    ``stream`` (default: the current stream) of out's device.
    """
    cupy = require()
    fmt, block = native.format_id(fmt), native.check_block(block)
    _check_f32(cupy, out, "out")
    n = out.size
    _check_wire(cupy, wire, wire_size(fmt, n, block), out.device)
    if n == 0:
        return
    acc = np.int32(bool(accumulate))
    with _launch_context(out.device, stream):
        if fmt == native.BF16:
            kernel(cupy, "gc_bf16_decode")(_grid(-(-n // 4)), (THREADS,), (wire, _u64(n), acc, out))
        elif fmt in (native.NVFP4, native.MXFP4):
            kernel(cupy, "gc_e2m1_decode")(
                _grid(-(-n // E2M1_CHUNK)),
                (THREADS,),
                (wire, _u64(n), np.int32(fmt == native.MXFP4), acc, out),
            )
        elif fmt in native.MX_FORMATS:
            kernel(cupy, "gc_mxfp8_decode")(
                _grid(-(-n // 4)),
                (THREADS,),
                (wire, _u64(n), np.int32(fmt == native.MXFP8_E5M2), acc, out),
            )
        else:
            _decode_fp8(cupy, fmt, wire, n, fp8_launch(n, block), acc, out)


def _decode_fp8(
    cupy: Any, fmt: int, wire: Any, n: int, plan: Fp8Launch, acc: np.int32, out: Any
) -> None:
    e5m2 = np.int32(fmt == native.E5M2)
    head = (wire, _u64(n), _u64(plan.block), _u64(plan.nblocks))
    if plan.team_shift is not None:
        kernel(cupy, "gc_fp8_decode_team")(
            (plan.grid,), (THREADS,), (*head, np.uint32(plan.team_shift), e5m2, acc, out)
        )
        return
    kernel(cupy, "gc_fp8_decode_tiles")(
        (plan.grid,), (THREADS,), (*head, _u64(plan.tiles_per_block), _u64(TILE), e5m2, acc, out)
    )


# ---------------------------------------------------------------------------
# op="avg": division by the rank count


#: the kernel of each dtype :func:`divide` takes, and how many values each thread divides
_DIVIDE_KERNELS = {
    np.dtype(np.float32): ("gc_divide_f32", 4),
    np.dtype(np.float64): ("gc_divide_f64", 1),
}


def divide_grid(n: int, dtype: Any = np.float32) -> tuple[int]:
    """Thread blocks of THREADS threads for :func:`divide` of n >= 1 values of ``dtype``
    (float32: four values per thread, float64: one)."""
    if n < 1:
        raise ValueError(f"divide_grid needs n >= 1, got {n}")
    per_thread = _DIVIDE_KERNELS[np.dtype(dtype)][1]
    return _grid(-(-n // per_thread))


def _divisor(size: int) -> int:
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    return int(size)


# ---------------------------------------------------------------------------
# where a call's arrays lie


#: the slot of an array that does not move: NULL (``gc_moved`` adds nothing)
UNMOVED = np.uint64(0)


class Moves:
    """The shifts a call's kernels add to the addresses of its source and result
    (``gc_moved``): ``source`` and ``result`` are (first byte, end, slot), the slot a
    device array of one uint64 that the call writes before its kernels run
    (:meth:`geocomm.engine.device.DevicePlan.bind`); every other array takes
    :data:`UNMOVED`. A result is apart from its source or the same memory (an
    in-place call), and a graph captured in place must serve calls that are not, and
    the other way round: there an array is the result where the launch writes its
    memory, else the source. That holds because a call reads its source only in
    launches that write none of it (the pipeline writes a range only once it has
    read it), and reads its result back only in launches that write it too (a
    map's inverse, the average)."""

    __slots__ = ("in_place", "result", "source")

    def __init__(self, source: tuple[int, int, Any], result: tuple[int, int, Any]):
        self.source, self.result = source, result
        self.in_place = source[:2] == result[:2]
        if not self.in_place and source[0] < result[1] and result[0] < source[1]:
            raise ValueError("a call's result overlaps its source without being the same memory")

    def slot(self, a: Any, writes: bool = False) -> Any:
        """The slot of the array whose memory holds ``a`` (a view of it, or itself),
        whose memory the launch writes (``writes``) or only reads."""
        at = int(a.data.ptr)
        if self.in_place:
            lo, hi, _ = self.source
            if not lo <= at < hi:
                return UNMOVED
            return self.result[2] if writes else self.source[2]
        for lo, hi, slot in (self.source, self.result):
            if lo <= at < hi:
                return slot
        return UNMOVED


_moves: contextvars.ContextVar[Moves | None] = contextvars.ContextVar("moves", default=None)


@contextlib.contextmanager
def moving(moves: Moves) -> Iterator[None]:
    """Launches inside (this thread's) take their slots from ``moves``."""
    token = _moves.set(moves)
    try:
        yield
    finally:
        _moves.reset(token)


def moved(a: Any, writes: bool = False) -> Any:
    """The slot of the shift a kernel adds to ``a``'s address, whose memory the launch
    writes (``writes``) or only reads: the :func:`moving` call's (:meth:`Moves.slot`),
    else :data:`UNMOVED`."""
    moves = _moves.get()
    return UNMOVED if moves is None else moves.slot(a, writes)


def divide(values: Any, size: int, stream: Any = None) -> None:
    """``values /= size`` in place on the GPU, as NumPy does it on the CPU.

    ``values``: a C-contiguous float32 (or float64) cupy array; ``size``: a
    positive integer (the rank count of op="avg"). Every value becomes the
    IEEE quotient ``values[i] / dtype(size)``, rounded to nearest, subnormal
    results kept: CuPy's own elementwise kernels are compiled with
    ``-ftz=true`` and flush results below 2^-126 (x 1.2e-38) to zero, so the
    GPU would disagree with the CPU there. Runs on ``stream`` (default: the
    current stream) of values' device; returns without synchronizing.
    """
    cupy = require()
    size = _divisor(size)
    dtype = getattr(values, "dtype", None)
    if (
        not isinstance(values, cupy.ndarray)
        or dtype not in _DIVIDE_KERNELS
        or not values.flags.c_contiguous
    ):
        raise TypeError(
            "values must be a C-contiguous float32 or float64 cupy array, got "
            f"{type(values).__name__} of dtype {dtype}"
        )
    n = values.size
    if n == 0:
        return
    args: tuple[Any, ...] = (values, _u64(n), values.dtype.type(size))
    if dtype == np.float32:  # a call's result, inside its graph: it moves
        args = (values, moved(values, writes=True), *args[1:])
    with _launch_context(values.device, stream):
        kernel(cupy, _DIVIDE_KERNELS[dtype][0])(divide_grid(n, dtype), (THREADS,), args)


def copy(out: Any, values: Any, stream: Any = None) -> None:
    """``out[...] = values`` (C-contiguous float32 cupy arrays of one size on one
    device, apart), both moving (:func:`moved`): a call's graph copies a caller's
    values with it. Runs on ``stream`` (default: the current stream); returns without
    synchronizing."""
    cupy = require()
    _check_f32(cupy, out, "out")
    _check_operand(cupy, values, "values", out)
    n = out.size
    if n == 0:
        return
    args = (out, moved(out, writes=True), values, moved(values), _u64(n))
    with _launch_context(out.device, stream):
        kernel(cupy, "gc_copy_f32")(_grid(-(-n // 4)), (THREADS,), args)


# ---------------------------------------------------------------------------
# fp32 sums and differences (exact sums, error-feedback residuals)


def _check_operand(cupy: Any, a: Any, name: str, like: Any) -> None:
    """``a`` is a C-contiguous float32 cupy array of ``like``'s size on its device."""
    _check_f32(cupy, a, name)
    if a.size != like.size:
        raise ValueError(f"{name} holds {a.size} values, expected {like.size}")
    if a.device != like.device:
        raise ValueError(f"{name} is on {a.device}, expected {like.device}")


def add(acc: Any, values: Any, stream: Any = None) -> None:
    """``acc += values`` in place on the GPU, as NumPy does it on the CPU.

    ``acc`` and ``values``: C-contiguous float32 cupy arrays of one size on one
    device; ``values`` may be ``acc`` itself, else it must not overlap it. Every
    value becomes the IEEE sum ``acc[i] + values[i]``, rounded to nearest, with
    subnormal operands and results kept (CuPy's ``+=`` is compiled with
    ``-ftz=true`` and flushes them). Runs on ``stream`` (default: the current
    stream) of acc's device; returns without synchronizing.
    """
    cupy = require()
    _check_f32(cupy, acc, "acc")
    _check_operand(cupy, values, "values", acc)
    n = acc.size
    if n == 0:
        return
    with _launch_context(acc.device, stream):
        kernel(cupy, "gc_add_f32")(_grid(-(-n // 4)), (THREADS,), (acc, values, _u64(n)))


def residual(out: Any, a: Any, b: Any, stream: Any = None) -> None:
    """``out = a - b`` on the GPU, as NumPy's ``np.subtract(a, b, out=out)`` does it,
    and 0 where that is not finite (error feedback's residual).

    C-contiguous float32 cupy arrays of one size on one device; ``out`` may be
    ``a`` or ``b`` itself, else it must not overlap them. Every value becomes
    ``a[i] + (-b[i])``, which is the IEEE difference, rounded to nearest, with
    subnormals kept (CuPy's own ``-`` flushes them). Runs on ``stream``
    (default: the current stream) of out's device; returns without
    synchronizing.
    """
    cupy = require()
    _check_f32(cupy, out, "out")
    _check_operand(cupy, a, "a", out)
    _check_operand(cupy, b, "b", out)
    n = out.size
    if n == 0:
        return
    with _launch_context(out.device, stream):
        kernel(cupy, "gc_residual_f32")(_grid(-(-n // 4)), (THREADS,), (out, a, b, _u64(n)))
