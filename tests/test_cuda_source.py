"""CPU-only checks of the GPU path: the CUDA kernels compile, and the CuPy/NCCL
modules degrade cleanly without CuPy.

``nvcc`` (no GPU needed) compiles the exact translation unit that
geocomm.cuda hands to NVRTC, with warnings as errors, so a CUDA compile error
fails CI. A PTX scan then checks the flags that bit-exactness rests on: no
fused multiply-add, no flush-to-zero, no approximate division. Whether the
kernels give the C core's bytes is checked on a GPU by perf/gpu_check.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import geocomm.comm.nccl as nccl_mod
import geocomm.cuda as gcuda
from geocomm import _nativecodec as native


def _nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/bin/nvcc",
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not found")

# The options of geocomm.cuda.NVRTC_OPTIONS, spelled for nvcc.
NVCC_FLAGS = ["-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
              "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra"]


def _run_nvcc(args: list[str], cwd: Path) -> None:
    proc = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"nvcc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture
def kernel_cu(tmp_path: Path) -> Path:
    """The kernel source exactly as NVRTC gets it (header inlined), in a private folder."""
    path = tmp_path / "gc_kernels.cu"
    path.write_text(gcuda.kernel_source())
    return path


@needs_nvcc
def test_kernels_compile_for_sm90(kernel_cu: Path, tmp_path: Path):
    obj = tmp_path / "gc_kernels.o"
    _run_nvcc(["-c", "-arch=sm_90", *NVCC_FLAGS, str(kernel_cu), "-o", str(obj)], tmp_path)
    assert obj.stat().st_size > 0


@needs_nvcc
def test_kernel_ptx_is_ieee(kernel_cu: Path, tmp_path: Path):
    """sm_80 PTX: every fp32 multiply/add is .rn (ptxas may not fuse it), no .ftz, no approx."""
    ptx_path = tmp_path / "gc_kernels.ptx"
    _run_nvcc(["-ptx", "-arch=compute_80", *NVCC_FLAGS, str(kernel_cu), "-o", str(ptx_path)],
              tmp_path)
    ptx = ptx_path.read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert {"gc_amax_tiles", "gc_fp8_encode_team", "gc_fp8_encode_tiles", "gc_fp8_decode_team",
            "gc_fp8_decode_tiles", "gc_nvfp4_encode", "gc_nvfp4_decode", "gc_bf16_encode",
            "gc_bf16_decode", "gc_mxfp8_encode", "gc_mxfp8_decode", "gc_mxfp4_encode",
            "gc_mxfp4_decode"} <= entries
    instructions = [line.split()[0] for line in ptx.splitlines()
                    if line.strip() and not line.lstrip().startswith(("//", ".", "{", "}", "$"))]
    assert not [i for i in instructions if i.startswith("fma")], "fused multiply-add in PTX"
    assert not [i for i in instructions if ".ftz" in i], "flush-to-zero in PTX"
    assert not [i for i in instructions if ".approx" in i or ".full" in i], "approximate math"
    loose = [i for i in instructions
             if re.match(r"(mul|add|sub|div)\.(f32|f64)$", i)]
    assert not loose, f"fp arithmetic without a rounding mode (ptxas may contract it): {loose}"


@needs_nvcc
def test_kernel_file_compiles_with_include(tmp_path: Path):
    """The installed gc_cuda.cu also compiles as a file that includes gc_scalar.h."""
    src = gcuda._source_dir()
    _run_nvcc(["-c", "-arch=sm_80", *NVCC_FLAGS, "-I", str(src), str(src / "gc_cuda.cu"),
               "-o", str(tmp_path / "gc_cuda.o")], tmp_path)


# ---------------------------------------------------------------------------
# without CuPy


@pytest.fixture
def no_cupy(monkeypatch):
    """Make ``import cupy`` fail (as on a CPU machine) and forget cached probes."""
    for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cupy", None)
    gcuda._probe.cache_clear()
    nccl_mod._probe.cache_clear()
    yield
    gcuda._probe.cache_clear()
    nccl_mod._probe.cache_clear()


def test_modules_do_not_import_cupy_eagerly():
    assert "cupy" not in vars(gcuda) and "cupy" not in vars(nccl_mod)


def test_cuda_unavailable_without_cupy(no_cupy):
    assert gcuda.available is False
    with pytest.raises(ImportError, match="CuPy"):
        gcuda.require()
    x = np.zeros(4, np.float32)
    wire = np.zeros(gcuda.wire_size("e4m3", 4), np.uint8)
    with pytest.raises(gcuda.CudaUnavailable, match="pip install"):
        gcuda.encode("e4m3", x, 0, wire)
    with pytest.raises(ImportError, match="CuPy"):
        gcuda.decode(gcuda.E4M3, wire, 0, x)


def test_nccl_unavailable_without_cupy(no_cupy):
    assert nccl_mod.available is False
    with pytest.raises(ImportError, match="CuPy"):
        nccl_mod.NCCLCommunicator()


def test_unknown_module_attribute():
    with pytest.raises(AttributeError):
        _ = gcuda.not_a_name
    with pytest.raises(AttributeError):
        _ = nccl_mod.not_a_name


@pytest.mark.skipif(not native.available, reason="native core not built")
def test_wire_size_matches_native():
    """geocomm.cuda computes the C gc_wire_size in Python (no CuPy needed)."""
    for name, fmt in native.FORMATS.items():
        for n in (0, 1, 2, 15, 16, 17, 31, 127, 128, 129, 1000, 4097, 10**6 + 3):
            for block in (0, 1, 3, 16, 128, 1000, 5000):
                expect = native.wire_size(fmt, n, block)
                assert gcuda.wire_size(fmt, n, block) == expect, (name, n, block)
                assert gcuda.wire_size(name, n, block) == expect, (name, n, block)


def test_wire_size_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown format"):
        gcuda.wire_size(9, 10)
    with pytest.raises(ValueError, match="unknown format"):
        gcuda.wire_size("e3m4", 10)
    with pytest.raises(ValueError):
        gcuda.wire_size("e4m3", -1)
    with pytest.raises(ValueError):
        gcuda.wire_size("e4m3", 10, -16)


def test_team_and_tile_plans():
    """Launch geometry: team width is the next power of two up to a warp; tiles cover blocks."""
    assert [gcuda._team_shift(b) for b in (1, 2, 3, 16, 17, 32, 33, 1024)] == [0, 1, 2, 4, 5, 5,
                                                                               5, 5]
    plan = gcuda.fp8_plan(10_000, 5000)
    assert plan.team_shift is None and plan.nblocks == 2
    assert plan.tiles_per_block == -(-5000 // gcuda.TILE) and plan.grid == 2 * plan.tiles_per_block
    assert gcuda.THREADS % 32 == 0


@pytest.mark.parametrize("n", [1, 31, 1000, 4097, 10**6 + 3, 2**31 + 5])
@pytest.mark.parametrize("block", [0, 1, 7, 128, 1024, 1025, 5000, 2**30, 2**48])
def test_fp8_launch_plan_caps_the_block_at_n(n, block):
    """Block 0 and every block >= n are one scale over n values (as gc_wire_size counts
    them), so the plan's grid depends on n, not on the block's nominal size: no thread
    block may be launched for values that do not exist (issue #14, item 4)."""
    plan = gcuda.fp8_plan(n, block)
    one_scale = block == 0 or block >= n
    assert plan.block == (n if one_scale else block)
    assert plan.nblocks == -(-n // plan.block)
    assert gcuda.wire_size("e4m3", n, block) == 4 * plan.nblocks + n  # the layout agrees
    if plan.team_shift is not None:  # team kernels: 2^shift lanes per scaling block
        assert plan.block <= gcuda.TEAM_MAX and plan.tiles_per_block == 0
        assert plan.grid == -(-(plan.nblocks << plan.team_shift) // gcuda.THREADS)
    else:  # tile kernels: every tile holds at least one value of its block
        assert plan.block > gcuda.TEAM_MAX
        assert plan.tiles_per_block == -(-plan.block // gcuda.TILE)
        assert plan.grid == plan.nblocks * plan.tiles_per_block
        assert (plan.tiles_per_block - 1) * gcuda.TILE < plan.block
    if one_scale:  # the grid is what n values need, however large the nominal block
        need = -(-n // gcuda.TILE) if plan.team_shift is None else 1
        assert plan.grid == need
    assert plan.grid <= 2**31 - 1


def test_fp8_launch_plan_rejects_bad_arguments():
    with pytest.raises(ValueError):
        gcuda.fp8_plan(0, 128)
    with pytest.raises(ValueError):
        gcuda.fp8_plan(10, -1)
    with pytest.raises(ValueError, match="grid"):  # one lane per value, 2^40 values
        gcuda.fp8_plan(2**40, 1)
