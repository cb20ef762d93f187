"""CPU-only checks of the GPU path: the CUDA kernels compile, and the CuPy/NCCL
modules degrade cleanly without CuPy.

``nvcc`` (no GPU needed) compiles the exact translation units that
geocomm.kernels.cuda, geocomm.engine.device and geocomm.codecs.geo.kernels hand to
NVRTC (the codec's kernels, the batched pipeline's, native/gc_pipeline.cu, and
GeoFP8's geometry, native/gc_geometry.cu), with warnings as errors,
so a CUDA compile error fails CI. A PTX scan then checks the flags that bit-exactness rests on: no
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
import geocomm.kernels.cuda as gcuda
from geocomm.codecs.geo import kernels as geo_kernels
from geocomm.engine import device as gpu_pipeline
from geocomm.kernels import cuda_build, native


def _nvcc() -> str | None:
    for candidate in (
        os.environ.get("NVCC"),
        shutil.which("nvcc"),
        "/usr/local/bin/nvcc",
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = _nvcc()
#: steps of the fp8 team kernels (native/gc_cuda.cu: GC_TEAM_MAX / (4 * 32))
GC_TEAM_STEPS = gcuda.TEAM_MAX // (4 * 32)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not found")

# The options of geocomm.kernels.cuda.NVRTC_OPTIONS, spelled for nvcc.
NVCC_FLAGS = [
    "-fmad=false",
    "-ftz=false",
    "-prec-div=true",
    "-prec-sqrt=true",
    "-Werror",
    "all-warnings",
    "-Xcompiler",
    "-Wall,-Wextra",
]


def _run_nvcc(args: list[str], cwd: Path) -> None:
    proc = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"nvcc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


#: The NVRTC units and the entry points each must hold: the codec's kernels
#: (geocomm.kernels.cuda) and the batched pipeline's (geocomm.engine.device, which
#: includes the codec's helpers).
UNITS = {
    "codec": (
        gcuda.kernel_source,
        {
            "gc_amax_tiles",
            "gc_fp8_encode_team",
            "gc_fp8_encode_team_wide",
            "gc_fp8_encode_tiles",
            "gc_fp8_decode_team",
            "gc_fp8_decode_tiles",
            "gc_nvfp4_encode",
            "gc_e2m1_decode",
            "gc_bf16_encode",
            "gc_bf16_decode",
            "gc_mxfp8_encode",
            "gc_mxfp8_decode",
            "gc_mxfp4_encode",
            "gc_divide_f32",
            "gc_divide_f64",
            "gc_add_f32",
            "gc_copy_f32",
            "gc_residual_f32",
        },
    ),
    "pipeline": (
        gpu_pipeline.kernel_source,
        {
            "gc_pipe_set_call",
            "gc_pipe_value_encode",
            "gc_pipe_fp8_encode_team",
            "gc_pipe_fp8_encode_team_wide",
            "gc_pipe_fp8_encode_team_split",
            "gc_pipe_fp8_encode_team_wide_split",
            "gc_pipe_amax_tiles",
            "gc_pipe_fp8_encode_tiles",
            "gc_pipe_nvfp4_encode",
            "gc_pipe_mxfp8_encode",
            "gc_pipe_mxfp4_encode",
            "gc_pipe_reduce",
            "gc_pipe_decode",
            "gc_pipe_e2m1_decode",
            "gc_pipe_fp8_decode_team",
            "gc_pipe_fp8_decode_team_split",
            "gc_pipe_fp8_decode_tiles",
        },
    ),
    "geometry": (
        geo_kernels._source,
        {
            "gc_geo_project",
            "gc_geo_expand",
            "gc_geo_accumulate",
            "gc_geo_round_bf16",
            "gc_geo_hash",
            "gc_geo_sumsq_squares",
            "gc_geo_sumsq_totals",
        },
    ),
}


@pytest.fixture(params=list(UNITS))
def unit(request, tmp_path: Path) -> tuple[Path, set[str]]:
    """A kernel unit exactly as NVRTC gets it (headers inlined), in a private folder,
    and the entry points it must define."""
    source, entries = UNITS[request.param]
    path = tmp_path / f"gc_{request.param}.cu"
    path.write_text(source())
    return path, entries


@pytest.fixture
def kernel_cu(tmp_path: Path) -> Path:
    """The codec's kernel source exactly as NVRTC gets it (header inlined)."""
    path = tmp_path / "gc_kernels.cu"
    path.write_text(gcuda.kernel_source())
    return path


@needs_nvcc
def test_kernel_ptx_is_ieee(unit, tmp_path: Path):
    """sm_80 PTX: every fp32 multiply/add is .rn (ptxas may not fuse it), no .ftz, no approx."""
    ptx_path = tmp_path / "gc_kernels.ptx"
    _run_nvcc(
        ["-ptx", "-arch=compute_80", *NVCC_FLAGS, str(unit[0]), "-o", str(ptx_path)], tmp_path
    )
    ptx = ptx_path.read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert unit[1] <= entries
    instructions = [
        line.split()[0]
        for line in ptx.splitlines()
        if line.strip() and not line.lstrip().startswith(("//", ".", "{", "}", "$"))
    ]
    assert not [i for i in instructions if i.startswith("fma")], "fused multiply-add in PTX"
    assert not [i for i in instructions if ".ftz" in i], "flush-to-zero in PTX"
    assert not [i for i in instructions if ".approx" in i or ".full" in i], "approximate math"
    loose = [i for i in instructions if re.match(r"(mul|add|sub|div)\.(f32|f64)$", i)]
    assert not loose, f"fp arithmetic without a rounding mode (ptxas may contract it): {loose}"


@needs_nvcc
@pytest.mark.parametrize("name", ["gc_cuda.cu", "gc_pipeline.cu"])
def test_kernel_file_compiles_with_include(tmp_path: Path, name: str):
    """The installed kernel files also compile as files that include their headers."""
    src = cuda_build.source_dir()
    _run_nvcc(
        [
            "-c",
            "-arch=sm_80",
            *NVCC_FLAGS,
            "-I",
            str(src),
            str(src / name),
            "-o",
            str(tmp_path / "kernels.o"),
        ],
        tmp_path,
    )


#: the codec's kernels that keep a lane's values in registers (besides every pipeline one)
REGISTER_KERNELS = {
    "gc_fp8_encode_team",
    "gc_fp8_encode_team_wide",
    "gc_fp8_decode_team",
    "gc_nvfp4_encode",
    "gc_e2m1_decode",
    "gc_bf16_encode",
    "gc_bf16_decode",
}


@needs_nvcc
@pytest.mark.parametrize("unit", list(UNITS))
def test_kernels_compile_for_sm90_in_registers_without_stack(tmp_path: Path, unit: str):
    """Each unit compiles for sm_90, where the NVFP4 encoders keep their 16 values and the
    fp8 team kernels their 32 in registers (no local memory), and no batched kernel
    spills: a spill would cost more memory traffic than the data."""
    path = tmp_path / f"gc_{unit}.cu"
    path.write_text(UNITS[unit][0]())
    proc = subprocess.run(
        [
            NVCC,
            "-c",
            "-arch=sm_90",
            *NVCC_FLAGS,
            "-Xptxas",
            "-v",
            str(path),
            "-o",
            str(tmp_path / "p.o"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "p.o").stat().st_size > 0
    report = re.split(r"Compiling entry function '(\w+)'", proc.stderr)
    stats = dict(zip(report[1::2], report[2::2], strict=True))
    checked = REGISTER_KERNELS if unit == "codec" else UNITS[unit][1]
    assert checked <= set(stats)
    for name in checked:
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in stats[name], name


#: per kernel: the 16-byte (values) and 4-byte (codes) vector accesses its aligned path
#: must compile to (PTX), and how many at least (fp8 teams: one per step; E2M1: two
#: loads of 4 codes and four stores of 4 values per chunk)
_LOAD_VALUES = r"ld\.global(\.nc|\.ca)?\.v4\.(f32|u32|b32)"
_STORE_CODES = r"st\.global\.v4\.(u8|b8)"
_LOAD_CODES = r"ld\.global(\.nc)?\.v4\.(u8|b8)"
_STORE_VALUES = r"st\.global(\.wb)?\.v4\.f32"
VECTOR_ACCESSES = {
    "gc_fp8_encode_team": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_fp8_encode_team_wide": {_LOAD_VALUES: GC_TEAM_STEPS, _STORE_CODES: GC_TEAM_STEPS},
    "gc_fp8_decode_team": {_LOAD_CODES: GC_TEAM_STEPS, _STORE_VALUES: GC_TEAM_STEPS},
    "gc_pipe_fp8_encode_team": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_pipe_fp8_encode_team_wide": {_LOAD_VALUES: GC_TEAM_STEPS, _STORE_CODES: GC_TEAM_STEPS},
    "gc_pipe_fp8_decode_team": {_LOAD_CODES: GC_TEAM_STEPS, _STORE_VALUES: GC_TEAM_STEPS},
    "gc_pipe_fp8_encode_team_split": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_pipe_fp8_encode_team_wide_split": {
        _LOAD_VALUES: GC_TEAM_STEPS,
        _STORE_CODES: GC_TEAM_STEPS,
    },
    "gc_pipe_fp8_decode_team_split": {_LOAD_CODES: GC_TEAM_STEPS, _STORE_VALUES: GC_TEAM_STEPS},
    "gc_e2m1_decode": {_LOAD_CODES: 2, _STORE_VALUES: 4},
    "gc_bf16_encode": {_LOAD_VALUES: 1, _STORE_CODES: 2},
    "gc_bf16_decode": {_LOAD_CODES: 2, _STORE_VALUES: 1},
    "gc_pipe_e2m1_decode": {_LOAD_CODES: 2, _STORE_VALUES: 4},
    "gc_mxfp8_encode": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_mxfp8_decode": {_LOAD_CODES: 1, _STORE_VALUES: 1},
    "gc_pipe_mxfp8_encode": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_pipe_value_encode": {_LOAD_VALUES: 1, _STORE_CODES: 2},
    "gc_pipe_reduce": {_LOAD_VALUES: 1, _STORE_VALUES: 1},
    "gc_pipe_decode": {_LOAD_CODES: 1, _STORE_VALUES: 1},
    "gc_amax_tiles": {_LOAD_VALUES: 1},
    "gc_fp8_encode_tiles": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_fp8_decode_tiles": {_LOAD_CODES: 1, _STORE_VALUES: 1},
    "gc_pipe_amax_tiles": {_LOAD_VALUES: 1},
    "gc_pipe_fp8_encode_tiles": {_LOAD_VALUES: 1, _STORE_CODES: 1},
    "gc_pipe_fp8_decode_tiles": {_LOAD_CODES: 1, _STORE_VALUES: 1},
    "gc_nvfp4_encode": {_LOAD_VALUES: 4},
    "gc_mxfp4_encode": {_LOAD_VALUES: 1},
    "gc_pipe_nvfp4_encode": {_LOAD_VALUES: 4},
    "gc_pipe_mxfp4_encode": {_LOAD_VALUES: 1},
    "gc_divide_f32": {_LOAD_VALUES: 1, _STORE_VALUES: 1},
    "gc_add_f32": {_LOAD_VALUES: 2, _STORE_VALUES: 1},
    "gc_copy_f32": {_LOAD_VALUES: 1, _STORE_VALUES: 1},
    "gc_residual_f32": {_LOAD_VALUES: 2, _STORE_VALUES: 1},
    "gc_geo_expand": {_LOAD_VALUES: 1, _STORE_VALUES: 1},
}


@needs_nvcc
def test_kernels_move_four_values_per_access(tmp_path: Path):
    """The fp8 team and tile kernels', MXFP8's, bf16's, the E2M1 encoders' and decoders'
    and the batched value kernels' aligned paths are one 16-byte access per four fp32
    values and one 4-byte access per four codes (PTX), not four each: without that, a
    kernel keeps too few bytes in flight to reach the memory's bandwidth."""
    ptx = ""
    for unit in ("codec", "pipeline", "geometry"):
        path = tmp_path / f"{unit}.cu"
        path.write_text(UNITS[unit][0]())
        out = tmp_path / f"{unit}.ptx"
        _run_nvcc(["-ptx", "-arch=sm_90", *NVCC_FLAGS, str(path), "-o", str(out)], tmp_path)
        ptx += out.read_text()
    bodies = dict(re.findall(r"\.visible \.entry (\w+)(.*?)(?=\.visible \.entry |\Z)", ptx, re.S))
    for name, wanted in VECTOR_ACCESSES.items():
        for pattern, least in wanted.items():
            found = len(re.findall(pattern, bodies[name]))
            assert found >= least, (name, pattern, found)


# ---------------------------------------------------------------------------
# without CuPy


@pytest.fixture
def no_cupy(monkeypatch):
    """Make ``import cupy`` fail (as on a CPU machine) and forget cached probes."""
    for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cupy", None)
    cuda_build.probe.cache_clear()
    nccl_mod._probe.cache_clear()
    yield
    cuda_build.probe.cache_clear()
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


@needs_nvcc
def test_divide_is_one_ieee_division(kernel_cu: Path, tmp_path: Path):
    """op="avg" on the GPU: the divide kernels divide with round-to-nearest (div.rn), never
    flushing subnormals (no .ftz anywhere, checked above) nor approximating."""
    ptx_path = tmp_path / "gc_kernels.ptx"
    _run_nvcc(
        ["-ptx", "-arch=compute_80", *NVCC_FLAGS, str(kernel_cu), "-o", str(ptx_path)], tmp_path
    )
    ptx = ptx_path.read_text()
    for name, op in (("gc_divide_f32", "div.rn.f32"), ("gc_divide_f64", "div.rn.f64")):
        body = ptx[ptx.index(f".entry {name}") :]
        body = body[: body.index("\n}\n")]
        divisions = re.findall(r"\bdiv\.[\w.]+", body)
        assert divisions and set(divisions) == {op}, (name, divisions)


def test_wire_size_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown format"):
        gcuda.wire_size(9, 10)
    with pytest.raises(ValueError, match="unknown format"):
        gcuda.wire_size("e3m4", 10)
    with pytest.raises(ValueError):
        gcuda.wire_size("e4m3", -1)
    with pytest.raises(ValueError):
        gcuda.wire_size("e4m3", 10, -16)


def test_divide_launch_geometry_and_arguments():
    """Four float32 values or one float64 value per thread, THREADS threads per thread
    block; the divisor is a positive integer."""
    assert [gcuda.divide_grid(n) for n in (1, 4 * gcuda.THREADS, 4 * gcuda.THREADS + 1)] == [
        (1,),
        (1,),
        (2,),
    ]
    assert [gcuda.divide_grid(n, np.float64) for n in (1, 256, 257, 10**6)] == [
        (1,),
        (1,),
        (2,),
        (3907,),
    ]
    most = (2**31 - 1) * gcuda.THREADS
    assert gcuda.divide_grid(4 * most) == gcuda.divide_grid(most, np.float64) == (2**31 - 1,)
    with pytest.raises(ValueError, match="grid"):
        gcuda.divide_grid(4 * most + 1)
    with pytest.raises(ValueError, match="grid"):
        gcuda.divide_grid(most + 1, np.float64)
    with pytest.raises(ValueError):
        gcuda.divide_grid(0)
    assert gcuda._divisor(np.int64(3)) == 3
    for bad in (0, -2, 1.0, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            gcuda._divisor(bad)


def test_divide_without_cupy(no_cupy):
    with pytest.raises(gcuda.CudaUnavailable, match="CuPy"):
        gcuda.divide(np.ones(3, np.float32), 2)


def test_team_and_tile_plans():
    """Launch geometry: a team's lanes take four values per step, so its width is the
    next power of two >= ceil(block / 4), up to a warp; tiles cover blocks."""
    blocks = (1, 4, 5, 16, 17, 32, 33, 128, 129, 1024)
    assert [gcuda.team_shift(b) for b in blocks] == [0, 0, 1, 2, 3, 3, 4, 5, 5, 5]
    assert [gcuda.team_kernel("gc_fp8_encode_team", b) for b in (1, 128, 129, 1024)] == [
        "gc_fp8_encode_team",
        "gc_fp8_encode_team",
        "gc_fp8_encode_team_wide",
        "gc_fp8_encode_team_wide",
    ]
    defines = _defines(cuda_build.source_dir() / "gc_cuda.cu")
    assert defines["GC_TEAM_MAX"] == gcuda.TEAM_MAX
    assert defines["GC_E2M1_CHUNK"] == gcuda.E2M1_CHUNK
    plan = gcuda.fp8_launch(10_000, 5000)
    assert plan.team_shift is None and plan.nblocks == 2
    assert plan.tiles_per_block == -(-5000 // gcuda.TILE) and plan.grid == 2 * plan.tiles_per_block
    assert gcuda.THREADS % 32 == 0


@pytest.mark.parametrize("n", [1, 31, 1000, 4097, 10**6 + 3, 2**31 + 5])
@pytest.mark.parametrize("block", [0, 1, 7, 128, 1024, 1025, 5000, 2**30, 2**48])
def test_fp8_launch_plan_caps_the_block_at_n(n, block):
    """Block 0 and every block >= n are one scale over n values (as gc_wire_size counts
    them), so the plan's grid depends on n, not on the block's nominal size: no thread
    block may be launched for values that do not exist (issue #14, item 4)."""
    plan = gcuda.fp8_launch(n, block)
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
        gcuda.fp8_launch(0, 128)
    with pytest.raises(ValueError):
        gcuda.fp8_launch(10, -1)
    with pytest.raises(ValueError, match="grid"):  # one lane per value, 2^40 values
        gcuda.fp8_launch(2**40, 1)


# ---------------------------------------------------------------------------
# constants: the compiled core's, never numbers written in Python (issue #15)


def _defines(path: Path) -> dict[str, int]:
    return {
        m[1]: int(m[2])
        for m in re.finditer(r"^#define (GC_\w+) (-?\d+)\s*$", path.read_text(), re.MULTILINE)
    }


@pytest.mark.skipif(not native.available, reason="native core not built")
def test_constants_come_from_the_compiled_core():
    from geocomm._native import lib

    for name in native.CDEF_NAMES:
        assert getattr(native, name) == getattr(lib, f"GC_{name}"), name
        assert getattr(gcuda, name) == getattr(lib, f"GC_{name}"), name
    assert native.FORMATS == {f: getattr(lib, f"GC_{f.upper()}") for f in native.FORMAT_NAMES}
    assert gcuda.FORMATS == native.FORMATS and gcuda.MX_FORMATS == native.MX_FORMATS
    from geocomm.codecs import reference as ref

    assert set(ref.FORMAT_NAMES) == set(native.FORMAT_NAMES)
    assert (ref.NVFP4_BLOCK, ref.NVFP4_SUPERBLOCK, ref.MX_BLOCK) == (
        native.NVFP4_BLOCK,
        native.NVFP4_SUPERBLOCK,
        native.MX_BLOCK,
    )
    # the layout constants the kernels and the C loops use (gc_scalar.h) are the API's
    native_dir = Path(__file__).resolve().parent.parent / "native"
    api = _defines(native_dir / "geocomm.h")
    for header in (native_dir / "gc_scalar.h", cuda_build.source_dir() / "gc_scalar.h"):
        scalar = _defines(header)
        for name in ("GC_NVFP4_BLOCK", "GC_NVFP4_SUPERBLOCK", "GC_MX_BLOCK"):
            assert scalar[name] == api[name] == getattr(lib, name), (header, name)


def test_format_names_and_ids():
    assert native.format_id("nvfp4") == native.NVFP4 == native.format_id(native.NVFP4)
    for bad in ("e3m4", 99, None, True):
        with pytest.raises(ValueError, match="unknown format"):
            native.format_id(bad)


WITHOUT_NATIVE = """
import numpy as np
import geocomm
import geocomm.kernels.cuda as gcuda
from geocomm.codecs.geo import kernels as geo_kernels
from geocomm.kernels import cuda_build, native

assert native.available is False
for read in (lambda: native.E4M3, lambda: native.FORMATS, lambda: native.STOCHASTIC,
             lambda: native.NVFP4_SUPERBLOCK, lambda: gcuda.NVFP4,
             lambda: gcuda.wire_size("e4m3", 4), lambda: native.format_id("bf16"),
             lambda: geocomm.get_codec("nvfp4", rounding="stochastic").wire_size(10)):
    try:
        read()
    except native.NativeBuildMissing as exc:
        assert "pip install" in str(exc)
    else:
        raise SystemExit("a constant of the C core was readable without it")
try:
    native.NOT_A_NAME
except AttributeError:
    pass
mx = geocomm.get_codec("mxfp4", rounding="stochastic")  # configuring needs no C core
assert mx.get_config()["scale_rule"] == "rceil"
print("OK")
"""


def test_constants_without_the_native_core(without_native):
    """Without the build, importing works and reading a constant of the core raises
    NativeBuildMissing (an ImportError saying how to build), never a made-up number."""
    proc = without_native(WITHOUT_NATIVE)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
