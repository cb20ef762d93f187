"""``cupy.cuda.nvrtc`` of the twin: "compiles" CUDA C++ for the host (:mod:`cupy._kernels`).

The image a program yields (``getCUBIN``, ``getPTX``) is the twin's own; only
the twin's ``function.Module.load`` takes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cupy import _device

__all__ = [
    "NVRTCError",
    "compileProgram",
    "createProgram",
    "destroyProgram",
    "getCUBIN",
    "getPTX",
    "getProgramLog",
    "getSupportedArchs",
]


class NVRTCError(RuntimeError):
    """A compilation failed (the program's log says why)."""


class _Program:
    def __init__(self, source: str, name: str):
        self.source, self.name = source, name
        self.image: bytes | None = None
        self.log = ""


def createProgram(
    source: str, name: str, headers: Sequence[str] = (), include_names: Sequence[str] = ()
) -> _Program:
    if headers or include_names:
        raise NotImplementedError("the CuPy twin takes one translation unit, no header list")
    return _Program(source, name)


def compileProgram(prog: _Program, options: Sequence[str]) -> None:
    from cupy import _kernels

    _device.check_failure()
    try:
        prog.image = _kernels.compile_source(prog.source, prog.name, tuple(options))
    except _kernels.CompileError as exc:
        prog.log = str(exc)
        raise NVRTCError(f"NVRTC_ERROR_COMPILATION (twin): {prog.name}") from None


def getProgramLog(prog: _Program) -> str:
    return prog.log


def getCUBIN(prog: _Program) -> bytes:
    if prog.image is None:
        raise NVRTCError("NVRTC_ERROR_INVALID_PROGRAM: not compiled")
    return prog.image


def getPTX(prog: _Program) -> bytes:
    return getCUBIN(prog)


def getSupportedArchs() -> tuple[int, ...]:
    return (80, 90)


def destroyProgram(prog: _Program) -> None:
    prog.image = None
