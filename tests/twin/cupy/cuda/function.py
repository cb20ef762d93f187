"""``cupy.cuda.function`` (``Module``, ``Function``) and ``cupy.RawModule`` of the twin.

A launch is queued on its stream like any CuPy work. Its checked accesses
are the arrays passed for pointer parameters: read for ``const T *``, read
and written for ``T *`` (the whole view each array spans). After it runs,
the red zones of every allocation it was given are checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cupy import _core, _device, _memory

__all__ = ["Function", "Module", "RawKernel", "RawModule"]


def _dims(dims: Any, what: str) -> tuple[int, int, int]:
    dims = (dims,) if isinstance(dims, int) else tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"twin: {what} must have 1 to 3 dimensions, got {dims}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


class Function:
    """One kernel of a loaded module: ``f(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def __call__(
        self, grid: Any, block: Any, args: Sequence[Any], shared_mem: int = 0, stream: Any = None
    ) -> None:
        kernel = self.kernel
        for name, dims in (("grid", grid), ("block", block)):
            if not isinstance(dims, tuple):  # CuPy's __call__(self, tuple grid, tuple block, ...)
                raise TypeError(
                    f"Argument '{name}' has incorrect type (expected tuple, got "
                    f"{type(dims).__name__})"
                )
        grid, block, args = _dims(grid, "grid"), _dims(block, "block"), tuple(args)
        kernel.check(grid, block, args, shared_mem)  # argument errors at call time, as CuPy's
        reads, writes = [], []
        for param, arg in zip(kernel.params, args, strict=True):
            if isinstance(arg, _core.ndarray):
                (reads if param.const else writes).append(arg)
        allocs = {a._alloc for a in reads + writes}
        what = f"kernel {kernel.name}"

        def launch() -> None:
            with _device.device_lock:
                kernel.launch(grid, block, args, shared_mem)
            _memory.check_redzones(allocs, what)

        stream = stream if stream is not None else _device.current_stream()
        stream.enqueue(
            launch, what, [_device.access(a) for a in reads], [_device.access(a) for a in writes]
        )


class Module:
    """``cupy.cuda.function.Module``: ``load`` a twin image, ``get_function`` by name."""

    def __init__(self) -> None:
        self._image: Any = None

    def load(self, image: bytes) -> None:
        from cupy import _kernels

        self._image = _kernels.load(bytes(image))

    def get_function(self, name: str) -> Function:
        if self._image is None:
            raise _device.CUDARuntimeError("CUDA_ERROR_INVALID_HANDLE: no module loaded")
        try:
            return Function(self._image.function(name))
        except LookupError:
            raise _device.CUDARuntimeError(
                f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name}"
            ) from None


class RawModule:
    """``cupy.RawModule(code=..., options=...)``: compiled on first use, with CuPy's
    ``-ftz=true`` appended (CuPy adds it to every runtime compilation)."""

    def __init__(
        self,
        *,
        code: str,
        options: Sequence[str] = (),
        backend: str = "nvrtc",
        name_expressions: Any = None,
        **unused: Any,
    ):
        if backend != "nvrtc" or name_expressions:
            raise NotImplementedError(
                "the CuPy twin's RawModule compiles with nvrtc, no name expressions"
            )
        self.code, self.options = code, (*tuple(options), "-ftz=true")
        self._module: Module | None = None

    def get_function(self, name: str) -> Function:
        if self._module is None:
            from cupy import _kernels

            module = Module()
            module.load(_kernels.compile_source(self.code, "raw_module.cu", self.options))
            self._module = module
        return self._module.get_function(name)


class RawKernel:
    """``cupy.RawKernel(code, name, options)``: one kernel of a RawModule."""

    def __init__(self, code: str, name: str, options: Sequence[str] = (), **kwargs: Any):
        self._function = RawModule(code=code, options=options, **kwargs).get_function(name)

    def __call__(self, grid: Any, block: Any, args: Sequence[Any], **kwargs: Any) -> None:
        self._function(grid, block, args, **kwargs)
