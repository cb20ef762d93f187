"""The CuPy twin's kernel runtime (tests/twin/cupy/_kernels.py, tests/twin/cuda_twin.h)
on NumPy buffers, without the twin's ndarray or streams.

Hand-written kernels pin down the CUDA semantics the runtime promises (indices,
block and phase order, __shared__ through __syncthreads, shuffles against a
model written from the CUDA documentation, atomics, votes), the errors it
reports (barrier divergence, bad shuffle masks, deadlock, argument and
configuration checks), the floating-point options (-ftz, -fmad) and the
compile cache. The project's own units are then built exactly as geocomm
builds them (``kernel_source()`` with ``NVRTC_OPTIONS``) and launched with the
arguments geocomm.kernels.cuda passes: their bytes must equal the NumPy reference
(geocomm.codecs.reference) and, where the compiled core is importable (the
installed package, ``python -P``), the C core.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

TWIN = Path(__file__).resolve().parents[1] / "twin"
if str(TWIN) not in sys.path:  # conftest.py puts it first unless a real GPU is present
    sys.path.insert(0, str(TWIN))
try:
    from cupy import _kernels
except ImportError:  # a real CuPy was imported: load the twin's runtime by its path
    _spec = importlib.util.spec_from_file_location(
        "geocomm_twin_kernels", TWIN / "cupy" / "_kernels.py"
    )
    _kernels = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_kernels)

from geocomm.codecs import reference  # noqa: E402
from geocomm.codecs.geo import kernels as geo  # noqa: E402
from geocomm.engine import device as gpu_pipeline  # noqa: E402
from geocomm.kernels import cuda, native  # noqa: E402

LaunchError, CompileError = _kernels.LaunchError, _kernels.CompileError
u64, u32, i32 = np.uint64, np.uint32, np.int32
needs_core = pytest.mark.skipif(
    not native.available, reason="native core not built (run with python -P)"
)
FULL = 0xFFFFFFFF


def build(source: str, *options: str, name: str = "test.cu") -> _kernels.Image:
    return _kernels.load(_kernels.compile_source(source, name, ("-std=c++17", *options)))


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


# ---------------------------------------------------------------------------
# hand-written kernels

KERNELS = r"""
typedef unsigned long long gc_u64;
typedef unsigned int gc_u32;

__device__ __forceinline__ unsigned int linear_thread(void)
{
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ unsigned int linear_block(void)
{
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

/* 12 words per thread: threadIdx, blockIdx, blockDim, gridDim */
extern "C" __global__ void indices(unsigned int *out)
{
    unsigned int per = blockDim.x * blockDim.y * blockDim.z;
    unsigned int *r = out + 12 * (linear_block() * per + linear_thread());
    r[0] = threadIdx.x; r[1] = threadIdx.y; r[2] = threadIdx.z;
    r[3] = blockIdx.x; r[4] = blockIdx.y; r[5] = blockIdx.z;
    r[6] = blockDim.x; r[7] = blockDim.y; r[8] = blockDim.z;
    r[9] = gridDim.x; r[10] = gridDim.y; r[11] = gridDim.z;
}

/* the order in which threads run: seq[thread] = how many ran before it */
extern "C" __global__ void sequence(unsigned int *counter, unsigned int *seq)
{
    unsigned int per = blockDim.x * blockDim.y * blockDim.z;
    seq[linear_block() * per + linear_thread()] = atomicAdd(counter, 1u);
}

/* out[t] = x[t + 1] of the block, through shared memory */
extern "C" __global__ void rotate(const float *x, float *out, int sync)
{
    __shared__ float s[1024];
    unsigned int t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
    s[t] = x[base + t];
    if (sync)
        __syncthreads();
    out[base + t] = s[(t + 1) % n];
}

/* tree sum of each block: log2(blockDim.x) barrier phases */
extern "C" __global__ void block_sum(const int *x, int *out)
{
    __shared__ int s[1024];
    unsigned int t = threadIdx.x;
    s[t] = x[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (t < h)
            s[t] += s[t + h];
        __syncthreads();
    }
    if (t == 0)
        out[blockIdx.x] = s[0];
}

extern "C" __global__ void block_votes(const int *pred, int *out)
{
    int p = pred[threadIdx.x];
    int c = __syncthreads_count(p);
    int a = __syncthreads_and(p);
    int o = __syncthreads_or(p);
    out[3 * threadIdx.x] = c;
    out[3 * threadIdx.x + 1] = a;
    out[3 * threadIdx.x + 2] = o;
}

/* op 0: __shfl_sync, 1: up, 2: down, 3: xor, with a per-lane lane/delta/mask */
extern "C" __global__ void shuffle(const unsigned int *x, const int *arg, int op, int width,
                                   unsigned int *out)
{
    unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int v = x[t], r;
    if (op == 0)
        r = __shfl_sync(0xffffffffu, v, arg[t], width);
    else if (op == 1)
        r = __shfl_up_sync(0xffffffffu, v, (unsigned int)arg[t], width);
    else if (op == 2)
        r = __shfl_down_sync(0xffffffffu, v, (unsigned int)arg[t], width);
    else
        r = __shfl_xor_sync(0xffffffffu, v, arg[t], width);
    out[t] = r;
}

/* the same exchange for float and double values (bit patterns kept) */
extern "C" __global__ void shuffle_wide(const float *f, const double *d, int lane_mask,
                                        float *fo, double *dout)
{
    unsigned int t = threadIdx.x;
    fo[t] = __shfl_xor_sync(0xffffffffu, f[t], lane_mask);
    dout[t] = __shfl_down_sync(0xffffffffu, d[t], (unsigned int)lane_mask, 16);
}

extern "C" __global__ void warp_votes(const int *pred, unsigned int *out)
{
    unsigned int t = threadIdx.x;
    int p = pred[t];
    out[3 * t] = __ballot_sync(0xffffffffu, p);
    out[3 * t + 1] = __any_sync(0xffffffffu, p);
    out[3 * t + 2] = __all_sync(0xffffffffu, p);
}

/* two half-warp groups with their own masks; xor lane_mask inside them */
extern "C" __global__ void half_masks(int lane_mask, unsigned int *out)
{
    unsigned int lane = threadIdx.x & 31u;
    unsigned int mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    out[threadIdx.x] = __shfl_xor_sync(mask, threadIdx.x, lane_mask);
}

extern "C" __global__ void amax(const gc_u32 *x, gc_u64 n, gc_u32 *m, gc_u32 *old)
{
    gc_u64 i = (gc_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        old[i] = atomicMax(m + i % 3, x[i]);
}

/* ---- kernels that must fail ---- */

extern "C" __global__ void exit_before_sync(int *out)
{
    if (threadIdx.x == 5)
        return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void two_syncs(int *out)
{
    if (threadIdx.x < 16) {
        out[threadIdx.x] = 1;
        __syncthreads();
    } else {
        out[threadIdx.x] = 2;
        __syncthreads();
    }
}

extern "C" __global__ void exit_before_shuffle(unsigned int *out)
{
    unsigned int v = threadIdx.x;
    if (threadIdx.x == 3)
        return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 1);
}

extern "C" __global__ void mask_without_caller(unsigned int *out)
{
    out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, threadIdx.x, 1);
}

extern "C" __global__ void full_mask(unsigned int *out)
{
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, threadIdx.x, 1);
}

extern "C" __global__ void shuffle_then_sync(unsigned int *out)
{
    unsigned int v = threadIdx.x;
    if (threadIdx.x < 16)
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

extern "C" __global__ void trap(int *out)
{
    if (threadIdx.x == 7)
        __trap();
    out[threadIdx.x] = 1;
}

/* every parameter kind, for the argument checks */
extern "C" __global__ void params(const float *x, gc_u64 n, int k, unsigned int u, float f,
                                  double d, long long ll, bool b, unsigned char *w,
                                  const void *any)
{
    if (threadIdx.x == 0 && blockIdx.x == 0)
        w[0] = (unsigned char)(n + (gc_u64)k + u + (unsigned int)f + (unsigned int)d
                               + (unsigned long long)ll + b + (x != 0) + (any != 0));
}

/* a deep call frame: 32 KiB of locals per thread fit in the fiber stacks */
extern "C" __global__ void big_frame(unsigned int *out)
{
    volatile unsigned int local[8192];
    for (unsigned int i = 0; i < 8192; ++i)
        local[i] = i ^ threadIdx.x;
    __syncthreads();
    unsigned int s = 0;
    for (unsigned int i = 0; i < 8192; ++i)
        s += local[i];
    out[threadIdx.x] = s;
}
"""


@pytest.fixture(scope="module")
def kernels() -> _kernels.Image:
    return build(KERNELS, "-fmad=false", "-ftz=false")


def test_indices_over_3d_grids(kernels):
    grid, block = (3, 2, 2), (4, 3, 2)
    per, blocks = 24, 12
    out = np.zeros((blocks * per, 12), np.uint32)
    kernels.function("indices").launch(grid, block, (out,))
    bz, by, bx, tz, ty, tx = np.meshgrid(*(np.arange(d) for d in (2, 2, 3, 2, 3, 4)), indexing="ij")
    want = np.stack([tx, ty, tz, bx, by, bz], axis=-1).reshape(-1, 6)
    assert np.array_equal(out[:, :6], want)
    assert (out[:, 6:9] == block).all() and (out[:, 9:] == grid).all()


def test_blocks_in_grid_order_threads_in_descending_order(kernels):
    """Blocks run one at a time, x fastest; inside a block the threads of a phase run
    in descending id order (ascending on request)."""
    grid, block = (2, 3, 1), (8, 2, 2)
    counter = np.zeros(1, np.uint32)
    seq = np.zeros(6 * 32, np.uint32)
    kernels.function("sequence").launch(grid, block, (counter, seq))
    per_block = seq.reshape(6, 32)
    assert np.array_equal(per_block.min(axis=1), np.arange(6) * 32)
    assert np.array_equal(
        per_block - per_block.min(axis=1, keepdims=True), np.tile(np.arange(31, -1, -1), (6, 1))
    )
    counter[:] = 0
    kernels.function("sequence").launch(grid, block, (counter, seq), order="ascending")
    assert np.array_equal(seq, np.arange(6 * 32))


def test_syncthreads_orders_shared_memory(kernels):
    n, blocks = 256, 3
    x = np.arange(n * blocks, dtype=np.float32)
    out = np.zeros_like(x)
    kernels.function("rotate").launch((blocks,), (n,), (x, out, i32(1)))
    assert np.array_equal(out, np.roll(x.reshape(blocks, n), -1, axis=1).ravel())


def test_missing_syncthreads_is_exposed(kernels):
    """Without the barrier the consumers run before thread 0 wrote s[0]: they read the
    0xff poison that fills shared memory at every block's start (not the last block's)."""
    n, blocks = 64, 2
    x = np.arange(n * blocks, dtype=np.float32)
    out = np.zeros_like(x)
    rotate = kernels.function("rotate")
    rotate.launch((blocks,), (n,), (x, out, i32(0)))
    got = bits(out).reshape(blocks, n)
    assert (got[:, -1] == 0xFFFFFFFF).all()  # thread n-1 read s[0] before thread 0 wrote it
    assert np.array_equal(out.reshape(blocks, n)[:, :-1], x.reshape(blocks, n)[:, 1:])
    rotate.launch((blocks,), (n,), (x, out, i32(0)), order="ascending")
    got = bits(out).reshape(blocks, n)
    assert (got[:, :-1] == 0xFFFFFFFF).all()  # in id order every other consumer is early


def test_barrier_phases_in_a_loop(kernels):
    rng = np.random.default_rng(1)
    for threads in (32, 256, 1024):
        x = rng.integers(-1000, 1000, 3 * threads).astype(np.int32)
        out = np.zeros(3, np.int32)
        kernels.function("block_sum").launch(3, threads, (x, out))
        assert np.array_equal(out, x.reshape(3, threads).sum(axis=1))


def test_syncthreads_count_and_or(kernels):
    for pred in (np.arange(64) % 3 == 0, np.ones(64, bool), np.zeros(64, bool)):
        out = np.zeros((64, 3), np.int32)
        kernels.function("block_votes").launch(1, 64, (pred.astype(np.int32), out))
        assert (out == [pred.sum(), pred.all(), pred.any()]).all()


def shuffle_model(op: str, x: np.ndarray, arg: np.ndarray, width: int) -> np.ndarray:
    """The CUDA programming guide's definition of the shuffles, lane by lane."""
    out = np.empty_like(x)
    for t in range(x.size):
        warp, lane = t - t % 32, t % 32
        seg = lane - lane % width  # first lane of the caller's segment
        if op == "idx":
            src = seg + arg[t] % width
        elif op == "up":  # below the segment: the caller's own value
            src = lane - arg[t] if lane - arg[t] >= seg else lane
        elif op == "down":  # past the segment: own value
            src = lane + arg[t] if lane + arg[t] < seg + width else lane
        else:  # xor: earlier segments may be read, later ones give the own value
            src = lane ^ arg[t] if (lane ^ arg[t]) < seg + width else lane
        out[t] = x[warp + src]
    return out


@pytest.mark.parametrize("width", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("op", ["idx", "up", "down", "xor"])
def test_shuffles_match_the_cuda_definition(kernels, op, width):
    rng = np.random.default_rng([width, len(op)])
    n = 4 * 64
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    for arg in (rng.integers(0, 32, n), np.full(n, 1), np.full(n, width // 2), np.full(n, 0)):
        arg = arg.astype(np.int32)
        out = np.zeros(n, np.uint32)
        code = ["idx", "up", "down", "xor"].index(op)
        kernels.function("shuffle").launch(4, 64, (x, arg, i32(code), i32(width), out))
        assert np.array_equal(out, shuffle_model(op, x, arg, width)), (op, width, arg[:8])


def test_shuffles_move_float_and_double_bits(kernels):
    rng = np.random.default_rng(3)
    f = rng.standard_normal(64).astype(np.float32)
    f[5] = np.float32(1e-40)  # subnormal: copied, never flushed
    d = rng.standard_normal(64)
    fo, do = np.zeros_like(f), np.zeros_like(d)
    kernels.function("shuffle_wide").launch(1, 64, (f, d, i32(3), fo, do))
    assert np.array_equal(bits(fo), bits(shuffle_model("xor", f, np.full(64, 3), 32)))
    assert np.array_equal(bits(do), bits(shuffle_model("down", d, np.full(64, 3), 16)))


def test_warp_votes(kernels):
    pred = (np.arange(64) % 5 == 0).astype(np.int32)
    pred[32:] = 1
    out = np.zeros((64, 3), np.uint32)
    kernels.function("warp_votes").launch(1, 64, (pred, out))
    ballot0 = sum(1 << i for i in range(32) if pred[i])
    assert (out[:32] == [ballot0, 1, 0]).all()
    assert (out[32:] == [FULL, 1, 1]).all()


def test_disjoint_masks_in_one_warp(kernels):
    out = np.zeros(64, np.uint32)
    kernels.function("half_masks").launch(1, 64, (i32(1), out))
    assert np.array_equal(out, np.arange(64) ^ 1)


def test_atomic_max(kernels):
    rng = np.random.default_rng(4)
    n = 1000
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    m, old = np.zeros(3, np.uint32), np.zeros(n, np.uint32)
    kernels.function("amax").launch(cuda._grid(n), (256,), (x, u64(n), m, old))
    assert np.array_equal(m, [x[r::3].max() for r in range(3)])
    for r in range(3):  # each call returned the running max of the calls before it
        assert (old[r::3] <= m[r]).all() and (old[r::3] == 0).sum() == 1
        assert set(old[r::3].tolist()) - {0} <= set(x[r::3].tolist())


def test_big_frames_fit_the_fiber_stacks(kernels):
    out = np.zeros(128, np.uint32)
    kernels.function("big_frame").launch(1, 128, (out,))
    want = [sum(i ^ t for i in range(8192)) & 0xFFFFFFFF for t in (0, 1, 127)]
    assert list(out[[0, 1, 127]]) == want


# ---------------------------------------------------------------------------
# errors the scheduler reports


def test_divergence_exit_before_syncthreads(kernels):
    with pytest.raises(
        LaunchError,
        match=r"exit_before_sync.*barrier divergence.*exited.*"
        r"thread \(5,0,0\)",
    ):
        kernels.function("exit_before_sync").launch(1, 64, (np.zeros(64, np.int32),))


def test_divergence_two_syncthreads_sites(kernels):
    with pytest.raises(LaunchError, match=r"two_syncs.*barrier divergence.*line \d+.*line \d+"):
        kernels.function("two_syncs").launch(1, 32, (np.zeros(32, np.int32),))


@pytest.mark.parametrize("order", ["descending", "ascending"])
def test_shuffle_after_early_return_of_a_masked_lane(kernels, order):
    with pytest.raises(LaunchError, match=r"exit_before_shuffle.*names lane 3.*exited"):
        kernels.function("exit_before_shuffle").launch(
            1, 32, (np.zeros(32, np.uint32),), order=order
        )


def test_bad_shuffle_masks(kernels):
    out = np.zeros(64, np.uint32)
    with pytest.raises(LaunchError, match="does not name the calling lane"):
        kernels.function("mask_without_caller").launch(1, 32, (out,))
    with pytest.raises(LaunchError, match="not in the block"):  # 48 threads: warp 1 has 16
        kernels.function("full_mask").launch(1, 48, (out,))
    with pytest.raises(
        LaunchError, match=r"reads lane (0|16), which its mask 0x(ffff0000|0000ffff) does "
    ):
        kernels.function("half_masks").launch(1, 32, (i32(16), out))
    with pytest.raises(LaunchError, match="width 3"):
        kernels.function("shuffle").launch(
            1, 32, (out, np.zeros(32, np.int32), i32(3), i32(3), out)
        )


def test_deadlock_shuffle_against_syncthreads(kernels):
    with pytest.raises(LaunchError, match=r"deadlock.*__shfl_xor_sync.*waits at __syncthreads"):
        kernels.function("shuffle_then_sync").launch(1, 32, (np.zeros(32, np.uint32),))


def test_trap_and_recovery(kernels):
    with pytest.raises(LaunchError, match=r"thread \(7,0,0\) called __trap"):
        kernels.function("trap").launch(1, 32, (np.zeros(32, np.int32),))
    out = np.zeros(64, np.uint32)  # the module is usable after a failed launch
    kernels.function("full_mask").launch(1, 64, (out,))
    assert np.array_equal(out, np.arange(64) ^ 1)


# ---------------------------------------------------------------------------
# arguments and configuration


class DeviceArray:
    """What the twin's ndarray offers the runtime: .data.ptr and .dtype."""

    def __init__(self, host: np.ndarray):
        self.host, self.dtype = host, host.dtype
        self.data = type("Memory", (), {"ptr": host.ctypes.data})()


def good_args(w: np.ndarray) -> list:
    return [
        np.zeros(4, np.float32),
        u64(1),
        i32(2),
        u32(3),
        np.float32(4.0),
        5.0,
        6,
        True,
        w,
        np.zeros(1, np.int16),
    ]


def test_params_are_parsed_from_the_source(kernels):
    k = kernels.function("params")
    P = _kernels.Param
    assert k.params == [
        P("x", "float", True, True),
        P("n", "gc_u64", False, False),
        P("k", "int", False, False),
        P("u", "unsigned int", False, False),
        P("f", "float", False, False),
        P("d", "double", False, False),
        P("ll", "long long", False, False),
        P("b", "bool", False, False),
        P("w", "unsigned char", True, False),
        P("any", "void", True, True),
    ]
    assert k.resolved[1] == "unsigned long long" and k.name == "params"
    assert kernels.function("amax").params[2] == P("m", "gc_u32", True, False)


def test_good_arguments(kernels):
    w = np.zeros(1, np.uint8)
    kernels.function("params").launch(1, 32, good_args(w))
    assert w[0] == 1 + 2 + 3 + 4 + 5 + 6 + 1 + 1 + 1
    w[0] = 0
    args = good_args(w)
    args[0], args[8] = DeviceArray(args[0]), DeviceArray(w)
    args[5], args[6], args[7] = np.float64(5), np.int64(6), np.bool_(True)
    kernels.function("params").launch((1, 1), (32, 1, 1), tuple(args))
    assert w[0] == 24


@pytest.mark.parametrize(
    "index,value,match",
    [
        (0, np.zeros(4, np.float64), r"parameter 0 \(const float \*x\).*float32.*float64"),
        (1, 1, r"parameter 1 \(gc_u64 n\).*uint64.*Python int"),
        (1, np.int64(1), r"gc_u64 n.*got a numpy.int64 scalar"),
        (2, 2, r"int k.*Python int"),
        (2, np.int64(2), r"int k.*int64"),
        (3, np.int32(3), r"unsigned int u.*int32"),
        (4, 4.0, r"float f.*Python float"),
        (4, np.float64(4.0), r"float f.*float64"),
        (5, np.float32(5.0), r"double d.*float32"),
        (6, 2**63, r"does not fit"),
        (7, 1, r"bool b.*Python int"),
        (8, np.zeros(1, np.int8), r"unsigned char \*w.*uint8.*int8"),
        (8, 0, r"takes an array"),
        (8, np.frombuffer(b"\0", np.uint8), "read-only"),
    ],
)
def test_bad_arguments(kernels, index, value, match):
    args = good_args(np.zeros(1, np.uint8))
    args[index] = value
    k = kernels.function("params")
    with pytest.raises(LaunchError, match=match):
        k.check(1, 32, args)
    with pytest.raises(LaunchError, match=r"kernel params: .*" + match):
        k.launch(1, 32, args)


@pytest.mark.parametrize(
    "grid,block,shared,match",
    [
        (1, 1025, 0, "outside"),
        (1, (32, 32, 2), 0, "2048 threads"),
        (1, (1, 1, 65), 0, "block.z = 65"),
        (0, 32, 0, "grid.x = 0"),
        ((1, 65536), 32, 0, "grid.y = 65536"),
        (2**31, 32, 0, "grid.x"),
        ((1, 1, 1, 1), 32, 0, "1 to 3"),
        (1.0, 32, 0, "1 to 3"),
        (1, 32, 16, "shared_mem=16"),
    ],
)
def test_bad_configuration(kernels, grid, block, shared, match):
    with pytest.raises(LaunchError, match=match):
        kernels.function("params").launch(grid, block, good_args(np.zeros(1, np.uint8)), shared)


def test_wrong_argument_count_and_missing_kernel(kernels):
    with pytest.raises(LaunchError, match=r"takes 10 arguments.*got 9"):
        kernels.function("params").launch(1, 32, good_args(np.zeros(1, np.uint8))[:9])
    with pytest.raises(LookupError, match="no extern \"C\" __global__ kernel 'nope'"):
        kernels.function("nope")
    with pytest.raises(KeyError):
        kernels.function("linear_thread")  # a __device__ function is not a kernel


# ---------------------------------------------------------------------------
# compilation: options, errors, cache

FP_KERNELS = r"""
extern "C" __global__ void mul(const float *a, const float *b, float *out)
{
    out[threadIdx.x] = a[threadIdx.x] * b[threadIdx.x];
}
extern "C" __global__ void ddiv(const double *a, double b, double *out)
{
    out[threadIdx.x] = __ddiv_rn(a[threadIdx.x], b);
}
extern "C" __global__ void mad(const float *a, const float *b, const float *c, float *out)
{
    unsigned int i = threadIdx.x;
    out[3 * i] = a[i] * b[i] + c[i];                          /* contracted under -fmad=true */
    out[3 * i + 1] = __fadd_rn(__fmul_rn(a[i], b[i]), c[i]);  /* never */
    out[3 * i + 2] = __fadd_rn(a[i] * b[i], c[i]);            /* never: __fadd_rn is not merged */
}
"""


@pytest.mark.parametrize("ftz", [False, True])
def test_ftz_flushes_subnormals_only_when_asked(ftz):
    image = build(FP_KERNELS, f"-ftz={'true' if ftz else 'false'}", "-fmad=false")
    tiny = np.float32(2.0**-70)
    a = np.array([tiny, np.float32(2.0**-140), 3.0], np.float32)  # product, input subnormal
    b = np.array([tiny, 1.0, 2.0], np.float32)
    out = np.zeros(3, np.float32)
    image.function("mul").launch(1, 3, (a, b, out))
    want = [0.0, 0.0, 6.0] if ftz else [2.0**-140, 2.0**-140, 6.0]
    assert out.tolist() == want and image.ftz is ftz
    d = np.array([1e-300], np.float64)
    dout = np.zeros(1, np.float64)
    image.function("ddiv").launch(1, 1, (d, 1e10, dout))  # CUDA's -ftz is fp32 only
    assert dout[0] == np.float64(1e-300) / np.float64(1e10) and dout[0] != 0
    # the caller's floating-point state is back: NumPy still makes subnormals
    assert np.float32(2.0**-70) * np.float32(2.0**-70) > 0


def test_fmad_maps_to_contraction():
    assert "-ffp-contract=off" in _kernels.host_flags(["-fmad=false"])
    assert "-ffp-contract=fast" in _kernels.host_flags(["-fmad=true"])
    assert "-ffp-contract=fast" in _kernels.host_flags([])  # NVRTC's default
    assert "-ffp-contract=fast" in _kernels.host_flags(["-use_fast_math"])
    flags = _kernels.host_flags(["-std=c++14", "-DX=1", "-UY", "-Iinc", "-arch=sm_90"])
    assert {
        "-std=c++14",
        "-DX=1",
        "-UY",
        f"-I{os.path.abspath('inc')}",
        "-O2",
        "-fPIC",
        "-fno-fast-math",
    } <= set(flags)


@pytest.mark.parametrize("fmad", [False, True])
def test_fmad_false_never_fuses(fmad):
    image = build(FP_KERNELS, f"-fmad={'true' if fmad else 'false'}", "-ftz=false")
    e = np.float32(1 + 2.0**-12)
    a, b, c = np.array([e], np.float32), np.array([e], np.float32), np.array([-1], np.float32)
    out = np.zeros(3, np.float32)
    image.function("mad").launch(1, 1, (a, b, c, out))
    unfused, fused = 2.0**-11, 2.0**-11 + 2.0**-24  # a*b = 1 + 2^-11 + 2^-24 exactly
    assert out[1] == unfused and out[2] == unfused
    flags = _kernels.host_flags([f"-fmad={'true' if fmad else 'false'}"])
    can_fuse = "-mfma" in flags or _kernels._machine() == "aarch64"
    assert out[0] == (fused if fmad and can_fuse else unfused)


def test_arch_and_macros_reach_the_source():
    src = r"""
    extern "C" __global__ void info(int *out)
    {
        out[0] = __CUDA_ARCH__;
        out[1] = VALUE;
    #ifdef __CUDACC__
        out[2] = 1;
    #endif
    #ifdef GONE
        out[3] = 1;
    #endif
    }
    """
    out = np.zeros(4, np.int32)
    build(src, "-arch=sm_90", "--define-macro=VALUE=7", "-DGONE", "-UGONE").function("info").launch(
        1, 1, (out,)
    )
    assert out.tolist() == [900, 7, 1, 0]


def test_compile_errors():
    with pytest.raises(CompileError, match=r"broken\.cu:3.*error"):
        build(
            'extern "C" __global__ void k(int *p)\n{\n    p[0] = undefined_name;\n}\n',
            name="broken.cu",
        )
    for bad in ("-funroll-loops", "-ftz=yes", "-std=c++99", "-arch=ampere", "-DX Y", "-I"):
        with pytest.raises(CompileError, match="invalid option"):
            _kernels.compile_source("", "x.cu", [bad])
    with pytest.raises(CompileError, match="sequence of strings"):
        _kernels.compile_source("", "x.cu", "-ftz=true")


def test_cache_reuse(tmp_path, monkeypatch):
    """A unit built once comes from the cache: building it again only preprocesses it
    (the preprocessed text keys the cache) and compiles nothing."""
    monkeypatch.setenv("GEOCOMM_TWIN_CACHE", str(tmp_path))
    src = KERNELS + "\n// cache test\n"
    ran, run = [], _kernels._run

    def logged(cmd: list[str], what: str, source: str | None = None) -> str:
        ran.append(what.split()[0])
        return run(cmd, what, source)

    monkeypatch.setattr(_kernels, "_run", logged)
    first = _kernels.compile_source(src, "k.cu", ["-fmad=false"])
    assert ran == ["preprocessing", "compiling"]
    ran.clear()
    second = _kernels.compile_source(src, "k.cu", ["-fmad=false"])
    assert first == second and ran == ["preprocessing"]
    assert _kernels.load(first) is _kernels.load(second)
    assert _kernels.compile_source(src, "k.cu", ["-fmad=true"]) != first
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".lock", ".so", ".so"]


CONCURRENT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("k", {path!r})
k = sys.modules["k"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(k)
image = k.compile_source({source!r}, "c.cu", ["-fmad=false"])
out = __import__("numpy").zeros(32, "uint32")
k.load(image).function("full_mask").launch(1, 32, (out,))
assert (out == __import__("numpy").arange(32) ^ 1).all()
sys.stdout.buffer.write(image)
"""


def test_concurrent_compiles_are_safe(tmp_path):
    """4 processes (ranks) compiling one unit into an empty cache: one library, all load it."""
    script = tmp_path / "compile.py"
    script.write_text(
        CONCURRENT.format(
            path=str(TWIN / "cupy" / "_kernels.py"), source=KERNELS + "\n// concurrent\n"
        )
    )
    env = {**os.environ, "GEOCOMM_TWIN_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [r[1].decode()[-2000:] for r in results]
    assert len({r[0] for r in results}) == 1
    assert [p.suffix for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock"] == [".so"]


def test_ucontext_fallback():
    """The portable context switch (used off x86-64) gives the same results and errors."""
    image = build(KERNELS, "-fmad=false", "-DGCTWIN_USE_UCONTEXT")
    x = np.arange(128, dtype=np.int32)
    out = np.zeros(2, np.int32)
    image.function("block_sum").launch(2, 64, (x, out))
    assert out.tolist() == [x[:64].sum(), x[64:].sum()]
    n = 64
    xs = np.arange(n, dtype=np.uint32)
    arg = np.full(n, 5, np.int32)
    shuffled = np.zeros(n, np.uint32)
    image.function("shuffle").launch(1, n, (xs, arg, i32(3), i32(8), shuffled))
    assert np.array_equal(shuffled, shuffle_model("xor", xs, arg, 8))
    with pytest.raises(LaunchError, match="barrier divergence"):
        image.function("exit_before_sync").launch(1, 64, (np.zeros(64, np.int32),))


def test_stack_overflow_faults_instead_of_corrupting(tmp_path):
    script = tmp_path / "overflow.py"
    script.write_text(
        textwrap.dedent(f"""
        import importlib.util, sys, numpy as np
        spec = importlib.util.spec_from_file_location("k", {str(TWIN / "cupy" / "_kernels.py")!r})
        k = sys.modules["k"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(k)
        src = '''extern "C" __global__ void deep(unsigned int *out)
        {{
            volatile unsigned int big[64 * 1024];
            big[threadIdx.x] = threadIdx.x;
            out[threadIdx.x] = big[threadIdx.x];
        }}'''
        out = np.zeros(32, np.uint32)
        k.load(k.compile_source(src, "deep.cu", [])).function("deep").launch(1, 32, (out,))
        print("no fault")
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)


# ---------------------------------------------------------------------------
# the project's kernels, built and launched as geocomm builds and launches them

THREADS = cuda.THREADS


@pytest.fixture(scope="module")
def codec() -> _kernels.Image:
    return _kernels.load(
        _kernels.compile_source(cuda.kernel_source(), "gc_cuda.cu", cuda.NVRTC_OPTIONS)
    )


def values(n: int, tag: int = 0) -> np.ndarray:
    """Gradient-like float32 values with subnormals, zeros, signed zeros, inf and NaN."""
    rng = np.random.default_rng([n, tag, 20261201])
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 10, n))).astype(np.float32)
    if n > 16:
        x[rng.integers(0, n, 3)] = np.float32(3e-39)
        x[rng.integers(0, n, 2)] = -0.0
        x[rng.integers(0, n, 1)] = np.inf
        x[rng.integers(0, n, 1)] = np.nan
    return x


def amax_tiles(codec, x: np.ndarray, n: int, block: int) -> np.ndarray:
    per_block, total = cuda._tiles(n, block)
    amax = np.zeros(-(-n // block), np.uint32)
    codec.function("gc_amax_tiles").launch(
        (total,), (THREADS,), (x, u64(n), u64(block), u64(per_block), u64(cuda.TILE), amax)
    )
    return amax


def twin_encode(
    codec,
    fmt: str,
    x: np.ndarray,
    block: int,
    *,
    seed: int | None = None,
    rounding_stream: int = 0,
    offset: int = 0,
    rceil: bool = False,
) -> np.ndarray:
    """geocomm.kernels.cuda.encode's launches, on NumPy buffers (seed: stochastic rounding)."""
    n = x.size
    wire = np.full(reference.wire_size(fmt, n, block), 0xA5, np.uint8)  # unwritten shows
    sr = i32(seed is not None)
    key = reference.sr_key(seed, rounding_stream) if seed is not None else 0
    rounding = (sr, u64(key), u64(offset))
    if fmt == "bf16":
        codec.function("gc_bf16_encode").launch(
            cuda._grid(-(-n // 4)), (THREADS,), (x, u64(n), *rounding, wire)
        )
    elif fmt == "nvfp4":
        supers = -(-n // reference.NVFP4_SUPERBLOCK)
        codec.function("gc_nvfp4_encode").launch(
            (supers,), (cuda.NVFP4_THREADS,), (x, u64(n), *rounding, wire)
        )
    elif fmt == "mxfp4":
        codec.function("gc_mxfp4_encode").launch(
            cuda._grid(-(-n // 4)), (THREADS,), (x, u64(n), i32(rceil), *rounding, wire)
        )
    elif fmt.startswith("mxfp8"):
        codec.function("gc_mxfp8_encode").launch(
            cuda._grid(cuda.MX_LANES * -(-n // reference.MX_BLOCK)),
            (THREADS,),
            (x, u64(n), i32(fmt == "mxfp8_e5m2"), i32(rceil), *rounding, wire),
        )
    else:
        plan = cuda.fp8_launch(n, block)
        head = (x, u64(n), u64(plan.block), u64(plan.nblocks))
        e5m2 = i32(fmt == "e5m2")
        if plan.team_shift is not None:
            codec.function(cuda.team_kernel("gc_fp8_encode_team", plan.block)).launch(
                (plan.grid,), (THREADS,), (*head, u32(plan.team_shift), e5m2, *rounding, wire)
            )
        else:
            amax = amax_tiles(codec, x, n, plan.block)
            codec.function("gc_fp8_encode_tiles").launch(
                (plan.grid,),
                (THREADS,),
                (*head, u64(plan.tiles_per_block), u64(cuda.TILE), amax, e5m2, *rounding, wire),
            )
    return wire


def twin_decode(
    codec, fmt: str, wire: np.ndarray, n: int, block: int, out: np.ndarray | None = None
) -> np.ndarray:
    """geocomm.kernels.cuda.decode's launches (accumulating onto ``out`` when given)."""
    acc = i32(out is not None)
    out = np.full(n, np.nan, np.float32) if out is None else out
    if fmt == "bf16":
        codec.function("gc_bf16_decode").launch(
            cuda._grid(-(-n // 4)), (THREADS,), (wire, u64(n), acc, out)
        )
    elif fmt in ("nvfp4", "mxfp4"):
        codec.function("gc_e2m1_decode").launch(
            cuda._grid(-(-n // cuda.E2M1_CHUNK)),
            (THREADS,),
            (wire, u64(n), i32(fmt == "mxfp4"), acc, out),
        )
    elif fmt.startswith("mxfp8"):
        codec.function("gc_mxfp8_decode").launch(
            cuda._grid(-(-n // 4)), (THREADS,), (wire, u64(n), i32(fmt == "mxfp8_e5m2"), acc, out)
        )
    else:
        plan = cuda.fp8_launch(n, block)
        head = (wire, u64(n), u64(plan.block), u64(plan.nblocks))
        e5m2 = i32(fmt == "e5m2")
        if plan.team_shift is not None:
            codec.function("gc_fp8_decode_team").launch(
                (plan.grid,), (THREADS,), (*head, u32(plan.team_shift), e5m2, acc, out)
            )
        else:
            codec.function("gc_fp8_decode_tiles").launch(
                (plan.grid,),
                (THREADS,),
                (*head, u64(plan.tiles_per_block), u64(cuda.TILE), e5m2, acc, out),
            )
    return out


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(bits(a[~nan]), bits(b[~nan])))


#: ragged sizes: n = 1, n < a block, not multiples of 32, 256 or 4096
COUNTS = (1, 2, 17, 255, 257, 1000, 4097, 9001)
FORMATS = [("e4m3", b) for b in (0, 1, 7, 32, 100, 1024, 1025, 5000)] + [
    ("e5m2", 0),
    ("e5m2", 128),
    ("bf16", 0),
    ("nvfp4", 0),
    ("mxfp8_e4m3", 0),
    ("mxfp8_e5m2", 0),
    ("mxfp4", 0),
]


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_codec_kernels_match_the_reference(codec, fmt, block):
    for n in COUNTS:
        x = values(n)
        wire = twin_encode(codec, fmt, x, block)
        assert np.array_equal(wire, reference.encode(fmt, x, block)), (fmt, block, n)
        out = twin_decode(codec, fmt, wire, n, block)
        assert same_values(out, reference.decode(fmt, wire, n, block)), (fmt, block, n)


@needs_core
@pytest.mark.parametrize("fmt,block", FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_codec_kernels_match_the_c_core(codec, fmt, block, stochastic):
    flags = native.STOCHASTIC if stochastic else 0
    for n in COUNTS:
        x = values(n, tag=1)
        want = np.zeros(native.wire_size(fmt, n, block), np.uint8)
        native.encode(fmt, x, block, want, flags=flags, seed=9, rounding_stream=4, offset=1000)
        wire = twin_encode(
            codec, fmt, x, block, seed=9 if stochastic else None, rounding_stream=4, offset=1000
        )
        assert np.array_equal(wire, want), (fmt, block, n)
        base = values(n, tag=2)
        want_sum = base.copy()
        native.decode(fmt, wire, block, want_sum, accumulate=True)
        assert same_values(twin_decode(codec, fmt, wire, n, block, out=base.copy()), want_sum)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4"])
def test_mx_rceil_and_stochastic_match_the_reference(codec, fmt):
    for n in (1, 33, 1000):
        x = values(n, tag=3)
        wire = twin_encode(codec, fmt, x, 0, seed=5, rounding_stream=2, offset=7, rceil=True)
        want = reference.encode(
            fmt, x, rounding="stochastic", seed=5, rounding_stream=2, offset=7, scale_rule="rceil"
        )
        assert np.array_equal(wire, want), n


@pytest.mark.parametrize("n", [1, 255, 257, 10_000])
def test_divide_keeps_subnormal_quotients(codec, n):
    x = values(n, tag=4)
    x[: min(n, 4)] = np.float32(3e-38)  # / 3: subnormal results
    for size in (1, 3, 4):
        got = x.copy()
        codec.function("gc_divide_f32").launch(
            cuda.divide_grid(n), (THREADS,), (got, np.zeros(1, np.uint64), u64(n), np.float32(size))
        )
        assert same_values(got, x / np.float32(size))
        assert got[0] != 0
        doubles = x.astype(np.float64) * 1e-290  # subnormal fp64 quotients too
        want = doubles / np.float64(size)
        codec.function("gc_divide_f64").launch(
            cuda.divide_grid(n, np.float64), (THREADS,), (doubles, u64(n), np.float64(size))
        )
        assert same_values(doubles, want)


def test_divide_flushes_when_built_like_rawmodule():
    """The same source built with CuPy RawModule's appended -ftz=true flushes what
    geocomm's -ftz=false build keeps: why geocomm compiles with NVRTC itself."""
    image = _kernels.load(
        _kernels.compile_source(
            cuda.kernel_source(), "gc_cuda.cu", (*cuda.NVRTC_OPTIONS, "-ftz=true")
        )
    )
    x = np.full(300, 3e-38, np.float32)
    image.function("gc_divide_f32").launch(
        cuda.divide_grid(300), (THREADS,), (x, np.zeros(1, np.uint64), u64(300), np.float32(3))
    )
    assert (x == 0).all()


def test_fp8_team_encode_over_many_blocks(codec):
    """One launch over 100K values (391 blocks of 256 fibers, 5 shuffle rounds each)."""
    x = values(100_000, tag=5)
    assert np.array_equal(twin_encode(codec, "e4m3", x, 32), reference.encode("e4m3", x, 32))


def test_pipeline_and_geometry_units_build():
    """Every kernel of the pipeline and geometry units resolves its signature."""
    for source, name in (
        (gpu_pipeline.kernel_source(), "gc_pipeline.cu"),
        (geo._source(), "gc_geometry.cu"),
    ):
        image = _kernels.load(_kernels.compile_source(source, name, cuda.NVRTC_OPTIONS))
        assert image.kernels
        for kernel in image.kernels:
            k = image.function(kernel)
            assert len(k.resolved) == len(k.params)


def moved_to(target: np.ndarray, given: np.ndarray) -> np.ndarray:
    """The slot that moves a kernel from ``given`` to ``target`` (gc_moved): their
    addresses' difference modulo 2^64."""
    return np.array([(target.ctypes.data - given.ctypes.data) % 2**64], np.uint64)


@needs_core
@pytest.mark.parametrize(
    "lo,length,n,k",
    [
        (0, 1, 1, 1),
        (5, 1000, 37, 3),
        (100, 64, 64, 8),
        (7, 12_345, 300, 4),
        (3, 4000, 90, 11),  # a projection's group takes 8 coefficients: 8, then 3
        (0, 2048, 64, 16),
        (9, 3000, 10, 5),  # 301 rows: three tiles of accumulation, partial rows at both ends
        (700, 5000, 1100, 9),  # dot products of three chunks, partial rows at both ends
    ],
)
def test_geometry_kernels_match_the_c_core(lo, length, n, k):
    """Each kernel gives the C core's bits, reading its values where its shift slot
    moves it (a decoy argument and the shift to the values, as a CUDA graph's replay
    on other arrays; 0 for the rest)."""
    image = _kernels.load(
        _kernels.compile_source(geo._source(), "gc_geometry.cu", cuda.NVRTC_OPTIONS)
    )
    rng = np.random.default_rng([lo, length, n, k])
    x = values(length, tag=6)
    vt = rng.standard_normal((k, n)).astype(np.float32)
    want, _ = native.geo_project(x, lo, n, vt)
    touched = geo.rows(lo, length, n)
    coef = np.zeros(want.shape, np.float32)
    chunks = -(-n // geo._DOT_CHUNK)
    partial = coef if chunks == 1 else np.full(touched * chunks * k, np.nan, np.float32)
    sizes = (u64(k), u64(touched), u64(chunks))
    decoy, unmoved = np.full_like(x, np.nan), np.uint64(0)  # NULL: no shift
    image.function("gc_geo_project").launch(
        geo._grid(touched * chunks * -(-k // geo._PROJECT_COEFS) * geo._LANES),
        (geo._THREADS,),
        (decoy, moved_to(x, decoy), u64(lo), u64(length), u64(n), vt, *sizes, partial),
    )
    if chunks > 1:
        image.function("gc_geo_project_chunks").launch(
            geo._grid(touched * k),
            (geo._THREADS,),
            (partial, u64(lo), u64(length), u64(n), *sizes, coef),
        )
    assert np.array_equal(bits(coef), bits(want))
    out, want_out = np.zeros_like(x), np.zeros_like(x)
    native.geo_expand(x, lo, n, want, vt, -1.0, want_out)
    out_decoy = np.zeros_like(x)
    image.function("gc_geo_expand").launch(
        geo._expand_grid(length),
        (geo._THREADS,),
        (decoy, moved_to(x, decoy), u64(lo), u64(length), u64(n), coef, vt, u64(k),
         np.float32(-1.0), out_decoy, moved_to(out, out_decoy)),
    )  # fmt: skip
    assert same_values(out, want_out) and not out_decoy.any()
    # off the 16-byte boundary (values one float into their allocation), and in place
    shifted = np.zeros(length + 1, np.float32)[1:]
    shifted[...] = x
    image.function("gc_geo_expand").launch(
        geo._expand_grid(length),
        (geo._THREADS,),
        (shifted, unmoved, u64(lo), u64(length), u64(n), coef, vt, u64(k), np.float32(-1.0),
         shifted, unmoved),
    )  # fmt: skip
    assert same_values(shifted, want_out)
    acc, want_acc = np.ones((k, n), np.float32), np.ones((k, n), np.float32)
    native.geo_accumulate(x, lo, n, want, want_acc)
    tiles = -(-touched // geo._ACC_ROWS)
    partial = np.full(tiles * k * n, np.nan, np.float32)
    image.function("gc_geo_accumulate").launch(
        geo._grid(n * tiles * -(-k // geo._PROJECT_COEFS)),
        (geo._THREADS,),
        (decoy, moved_to(x, decoy), u64(lo), u64(length), u64(n), coef, u64(k), u64(touched),
         partial),
    )  # fmt: skip
    image.function("gc_geo_accumulate_tiles").launch(
        geo._grid(k * n), (geo._THREADS,), (partial, u64(tiles), u64(k * n), acc)
    )
    assert same_values(acc, want_acc)


@needs_core
@pytest.mark.parametrize(
    "k,n,fill",
    [
        (1, 1, "normal"),
        (3, 5, "normal"),  # fewer columns than lanes: most lanes sum nothing
        (6, 50, "deficient"),  # a repeated row, a zero row, a NaN: random fills
        (12, 300, "normal"),  # more than GC_ORTHO_BATCH dot products in a pass
        (4, 513, "zeros"),  # a cold start's random rows; columns past two lane rounds
        (9, 9, "normal"),  # square: the last row is the one direction left
    ],
)
def test_orthonormalize_kernel_matches_the_c_core(k, n, fill):
    """gc_geo_orthonormalize's one block gives the C core's bits, random fills of lost
    rows included: both follow gc_linalg.h's "ortho" order step by step."""
    image = _kernels.load(
        _kernels.compile_source(geo._source(), "gc_geometry.cu", cuda.NVRTC_OPTIONS)
    )
    rng = np.random.default_rng([k, n])
    rows = rng.standard_normal((k, n)).astype(np.float32)
    if fill == "zeros":
        rows[...] = 0.0
    elif fill == "deficient":
        rows[2], rows[4], rows[5, 7] = rows[0], 0.0, np.nan
    want = rows.copy()
    native.geo_orthonormalize(want, 7)
    got = rows.copy()
    scratch = np.zeros(k * n + k + 1, np.float64)
    image.function("gc_geo_orthonormalize").launch(
        (1,), (geo._ORTHO_LANES,), (got, u64(k), u64(n), u64(7), scratch, scratch[k * n :])
    )
    assert np.array_equal(bits(got), bits(want))
    # orthonormal to fp32's rounding: |Q Q^T - I| <= a few n * 2^-24
    gram = want.astype(np.float64) @ want.astype(np.float64).T
    assert np.abs(gram - np.eye(k)).max() < 1e-5
