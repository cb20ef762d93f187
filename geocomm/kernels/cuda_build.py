"""How geocomm's CUDA units are found, compiled and loaded (for :mod:`geocomm.kernels.cuda`,
the GeoFP8 kernels and the device pipeline).

``probe()`` says whether CuPy imports and sees a CUDA device (cached);
``require()`` returns cupy or raises :class:`CudaUnavailable` naming what is
missing. ``source_dir()`` finds the ``.cu`` files (installed beside the
package, or the source tree); ``kernel(cupy, name, source)`` compiles the
unit ``source()`` gives with NVRTC, directly, with ``NVRTC_OPTIONS``, once
per device, and returns its kernel ``name``. Not CuPy's ``RawModule``: it
appends ``-ftz=true``, which would flush the subnormal values and scales
the codec must keep. Importing this module never imports CuPy.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Bit-exactness needs IEEE fp32: no FMA contraction, no flush to zero, exact division.
NVRTC_OPTIONS = ("-std=c++17", "-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")

_SOURCES = ("gc_scalar.h", "gc_cuda.cu")
_INCLUDE_LINE = '#include "gc_scalar.h"'


class CudaUnavailable(ImportError):
    """CuPy, a CUDA device or NVRTC is missing."""


@functools.cache
def probe() -> tuple[Any, str]:
    """(cupy module, "") when usable, else (None, why not)."""
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return None, f"CuPy found no usable CUDA device ({exc})"
    if count < 1:
        return None, "CuPy found no CUDA device"
    return cupy, ""


def cuda_extra() -> str:
    """The install line of geocomm's GPU extra for this machine's CUDA: ``geocomm[cuda13]``
    (cupy-cuda13x, nvidia-nccl-cu13) or ``geocomm[cuda12]``, by the CUDA major version of
    an installed CuPy; both, when no CuPy says which."""
    try:
        import cupy

        major = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # no CuPy, or one that cannot load its CUDA runtime
        return "pip install 'geocomm[cuda12]' (CUDA 12) or 'geocomm[cuda13]' (CUDA 13)"
    return f"pip install 'geocomm[cuda{major}]'"


def require() -> Any:
    """The cupy module, or :class:`CudaUnavailable` naming what is missing."""
    cupy, why = probe()
    if cupy is None:
        raise CudaUnavailable(
            f"geocomm's GPU codec needs CuPy and a CUDA device: {cuda_extra()} on a machine "
            f"with an NVIDIA GPU. {why}."
        )
    return cupy


# ---------------------------------------------------------------------------
# kernel source and compilation


def source_dir() -> Path:
    """Where gc_scalar.h and gc_cuda.cu live: installed beside this module, or the source tree."""
    here = Path(__file__).resolve().parent
    tree = here.parent.parent / "native"
    for candidate in (here / "sources", tree):
        if all((candidate / name).is_file() for name in _SOURCES):
            return candidate
    raise FileNotFoundError(
        f"geocomm's CUDA kernel sources {_SOURCES} are neither installed in {here / 'sources'} "
        f"nor in a source tree at {tree}; reinstall geocomm"
    )


def kernel_source() -> str:
    """gc_cuda.cu with gc_scalar.h inlined: one translation unit for NVRTC (or nvcc)."""
    directory = source_dir()
    header = (directory / "gc_scalar.h").read_text()
    kernels = (directory / "gc_cuda.cu").read_text()
    if _INCLUDE_LINE not in kernels:
        raise RuntimeError(f"gc_cuda.cu does not contain the line {_INCLUDE_LINE!r}")
    return kernels.replace(_INCLUDE_LINE, header, 1)


def _nvrtc(cupy: Any) -> Any:
    try:
        return cupy.cuda.nvrtc
    except AttributeError:
        from cupy_backends.cuda.libs import nvrtc

        return nvrtc


def _compile(cupy: Any, source: str) -> bytes:
    """Cubin for the current device (PTX when NVRTC does not know its architecture)."""
    nvrtc = _nvrtc(cupy)
    cc = int(cupy.cuda.Device().compute_capability)
    archs = nvrtc.getSupportedArchs() if hasattr(nvrtc, "getSupportedArchs") else (cc,)
    cubin = cc in archs and hasattr(nvrtc, "getCUBIN")
    if cubin:
        arch = f"-arch=sm_{cc}"
    else:
        older = [a for a in archs if a <= cc]
        arch = f"-arch=compute_{max(older) if older else cc}"
    options = (*NVRTC_OPTIONS, arch)
    prog = nvrtc.createProgram(source, "gc_cuda.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(
                f"NVRTC failed to compile geocomm's CUDA kernels with {' '.join(options)}:\n"
                f"{nvrtc.getProgramLog(prog)}"
            ) from exc
        if cubin:
            return bytes(nvrtc.getCUBIN(prog))
        ptx = nvrtc.getPTX(prog)
        return (ptx.encode() if isinstance(ptx, str) else bytes(ptx)) + b"\0"
    finally:
        nvrtc.destroyProgram(prog)


#: per (device id, source function): (loaded module, its kernel functions by name)
_modules: dict[tuple[int, Callable[[], str]], tuple[Any, dict[str, Any]]] = {}
_lock = threading.Lock()


def kernel(cupy: Any, name: str, source: Callable[[], str] = kernel_source) -> Any:
    """Kernel ``name`` of the module that ``source()`` gives (default: the codec's
    kernels), compiled with NVRTC_OPTIONS and loaded on the current device on first use."""
    key = (cupy.cuda.Device().id, source)
    with _lock:
        entry = _modules.get(key)
        if entry is None:
            module = cupy.cuda.function.Module()
            module.load(_compile(cupy, source()))
            entry = _modules[key] = (module, {})
        module, functions = entry
        function = functions.get(name)
        if function is None:
            function = functions[name] = module.get_function(name)
    return function
