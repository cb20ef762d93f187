"""The CuPy twin's "NVRTC" and kernel launcher: CUDA translation units built for the host.

:func:`compile_source` takes one CUDA translation unit (as geocomm.kernels.cuda builds
it, headers inlined) and NVRTC's options, and compiles it with g++ (C++) into
a shared library against ``tests/twin/cuda_twin.h``, which maps CUDA's device
built-ins to the host and holds the block scheduler (with ``cuda_twin_fp32.h``,
which makes the unit's ``float`` CUDA's fp32). It returns an opaque *image*
(bytes) that :func:`load` turns into an :class:`Image`;
``Image.function(name)`` gives a :class:`Kernel` whose :meth:`Kernel.launch`
runs the whole grid synchronously on the calling thread, with CUDA's thread,
barrier and warp-shuffle semantics (see cuda_twin.h for the execution model
and what it reports as errors).

Contract
--------
``compile_source(source, name, options) -> bytes``
    Options are NVRTC's: ``-std=c++NN``, ``-arch=sm_XX|compute_XX``,
    ``-fmad=true|false`` (false: ``-ffp-contract=off``; true, the default:
    ``-ffp-contract=fast``, plus ``-mfma`` where the host CPU has FMA so that
    contraction really fuses as on a GPU), ``-ftz=true|false`` (true sets
    MXCSR.FTZ|DAZ during launches; refused with CompileError on machines
    other than x86-64 and aarch64), ``-prec-div``, ``-prec-sqrt`` (accepted;
    division and sqrt are always IEEE), ``-use_fast_math`` (= ``-ftz=true
    -fmad=true``), ``-D``, ``-U``, ``-I``, ``-lineinfo``, ``-G``, ``-w`` (both
    spellings). Anything else raises :class:`CompileError`, as NVRTC does.
    The unit is always built with ``-O2 -fPIC -fno-fast-math``. Results are
    cached on disk (``$GEOCOMM_TWIN_CACHE`` or ``<tempdir>/geocomm-twin-<uid>``)
    under a hash of the source (as given and preprocessed, so headers found
    through ``-I`` count), the options, the g++ flags, the twin's headers, this
    file and the compiler's identity. Concurrent processes are safe: one compiles
    under a lock file while the others wait, and every library is written
    under a temporary name and ``os.replace``d into place.

``load(image) -> Image``; ``Image.function(name) -> Kernel``
    :class:`KernelNotFound` (a KeyError, so a LookupError) names a kernel the
    unit does not define as ``extern "C" __global__``.

``Kernel.launch(grid, block, args, shared_mem=0, *, order="descending")``
    ``grid``/``block``: an int or 1 to 3 positive ints (grid x < 2^31, y and z
    <= 65535; block x, y <= 1024, z <= 64, at most 1024 threads);
    ``shared_mem`` must be 0 (static ``__shared__`` only). Arguments are
    checked as strictly as the kernel's signature demands, which CuPy does
    not do: a pointer parameter takes a NumPy array or anything with
    ``.data.ptr`` and ``.dtype`` (the twin's device arrays) whose dtype is
    the pointee's (``void *`` and struct pointees take any), or
    ``np.uint64(0)``, NULL (CuPy packs it as eight zero bytes); a value
    parameter takes a NumPy scalar of exactly its type, and a Python int,
    float or bool only where CuPy's conversion (int64, float64, bool) is the
    parameter's type (``long long``, ``double``, ``bool``). Any mismatch, a
    wrong argument count, a bad grid, and every error the scheduler reports
    (barrier divergence, bad shuffles, deadlock) raise :class:`LaunchError`
    naming the kernel. :meth:`Kernel.check` runs the argument checks alone.
    ``order="ascending"`` runs each phase's threads in thread-id order instead
    of the default descending order (to show that a result depends on it).

Launches are serialized by a process-wide lock taken inside ``launch``
(``__shared__`` variables are statics, and the runtime state is per module);
callers need no lock of their own. Compilation needs g++ (``$GEOCOMM_TWIN_CXX``
overrides the compiler) and runs on Linux (fibers use mmap; the fast context
switch is x86-64, other machines use ucontext).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "CompileError",
    "Image",
    "Kernel",
    "KernelNotFound",
    "LaunchError",
    "Param",
    "cache_dir",
    "compile_source",
    "host_flags",
    "load",
]

#: cuda_twin.h lives in tests/twin, one level above this package
TWIN_DIR = Path(__file__).resolve().parents[1]
HEADER = TWIN_DIR / "cuda_twin.h"
#: the headers a unit is built against (all of them key the cache)
HEADERS = (HEADER, TWIN_DIR / "cuda_twin_fp32.h")
IMAGE_MAGIC = b"GEOCOMM-TWIN-IMAGE-1\n"

GRID_MAX = (2**31 - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
MAX_THREADS = 1024
_ORDERS = {"descending": 0, "ascending": 1}
_ERR_BYTES = 4096


class CompileError(RuntimeError):
    """The unit does not compile (the message holds the compiler's log) or an option is bad."""


class LaunchError(RuntimeError):
    """A launch was refused (grid, block, arguments) or failed (divergence, deadlock...)."""


class KernelNotFound(KeyError):
    """The module has no ``extern "C" __global__`` kernel of that name."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0]) if self.args else ""


class Param(NamedTuple):
    """One kernel parameter as the source spells it: ``const float *x`` is
    ``Param("x", "float", True, True)``; ``gc_u64 n`` is ``Param("n", "gc_u64", False,
    False)``. ``const`` is the pointee's constness for pointers."""

    name: str
    ctype: str
    pointer: bool
    const: bool


# ---------------------------------------------------------------------------
# options


@dataclass
class _Options:
    """NVRTC's options, understood."""

    std: str = "c++17"
    arch: int = 520
    fmad: bool = True
    ftz: bool = False
    defines: list[str] = field(default_factory=list)  # -D... / -U... for g++
    includes: list[str] = field(default_factory=list)  # absolute directories


_BOOL_OPTION = re.compile(r"--?(fmad|ftz|prec-div|prec-sqrt)=(.*)")
_STD_OPTION = re.compile(r"(?:--?std)=(.*)")
_ARCH_OPTION = re.compile(r"(?:-arch|--gpu-architecture)=(.*)")
_ARCH_VALUE = re.compile(r"(?:sm|compute)_(\d{2,3})[af]?")
_MACRO = re.compile(r"[A-Za-z_]\w*(=.*)?", re.DOTALL)
_STDS = ("c++03", "c++11", "c++14", "c++17", "c++20")
_IGNORED = (
    "-lineinfo",
    "--generate-line-info",
    "-G",
    "--device-debug",
    "-w",
    "--disable-warnings",
    "-default-device",
    "--device-as-default-execution-space",
)


def _bad_option(option: object, why: str = "") -> CompileError:
    return CompileError(
        f"twin NVRTC: invalid option {option!r}{': ' + why if why else ''} "
        "(NVRTC_ERROR_INVALID_OPTION)"
    )


def _prefixed(option: str, short: str, long: str) -> str | None:
    """The value of -Xvalue / --long=value, else None."""
    if option.startswith(long + "="):
        return option[len(long) + 1 :]
    if option.startswith(short) and len(option) > len(short):
        return option[len(short) :]
    return None


def _parse_options(options: Sequence[str]) -> _Options:
    if isinstance(options, (str, bytes)):
        raise CompileError(f"twin NVRTC: options must be a sequence of strings, got {options!r}")
    opts = _Options()
    for option in options:
        if not isinstance(option, str):
            raise _bad_option(option, "not a string")
        if m := _BOOL_OPTION.fullmatch(option):
            if m.group(2) not in ("true", "false"):
                raise _bad_option(option, "the value must be true or false")
            value = m.group(2) == "true"
            if m.group(1) == "fmad":
                opts.fmad = value
            elif m.group(1) == "ftz":
                opts.ftz = value
            # -prec-div / -prec-sqrt: the host's division and sqrt are always IEEE
        elif m := _STD_OPTION.fullmatch(option):
            if m.group(1) not in _STDS:
                raise _bad_option(option, f"the dialect must be one of {', '.join(_STDS)}")
            opts.std = m.group(1)
        elif m := _ARCH_OPTION.fullmatch(option):
            arch = _ARCH_VALUE.fullmatch(m.group(1))
            if not arch:
                raise _bad_option(option, "expected sm_XX or compute_XX")
            opts.arch = int(arch.group(1)) * 10
        elif option in ("-use_fast_math", "--use_fast_math"):
            opts.ftz = opts.fmad = True
        elif (macro := _prefixed(option, "-D", "--define-macro")) is not None:
            if not _MACRO.fullmatch(macro):
                raise _bad_option(option, "expected NAME or NAME=VALUE")
            opts.defines.append("-D" + macro)
        elif (macro := _prefixed(option, "-U", "--undefine-macro")) is not None:
            if not _MACRO.fullmatch(macro) or "=" in macro:
                raise _bad_option(option, "expected NAME")
            opts.defines.append("-U" + macro)
        elif (path := _prefixed(option, "-I", "--include-path")) is not None:
            opts.includes.append(os.path.abspath(path))
        elif option not in _IGNORED:
            raise _bad_option(option, "unknown to NVRTC")
    if opts.ftz and _machine() not in ("x86_64", "aarch64"):
        raise CompileError(
            f"twin NVRTC: -ftz=true cannot be emulated on {_machine()} "
            "(x86-64 MXCSR or aarch64 FPCR needed)"
        )
    return opts


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _cpu_has_fma() -> bool:
    """Whether contracted code may use FMA instructions on this host."""
    if _machine() == "aarch64":
        return True  # FMA is part of the base ISA; gcc contracts without extra flags
    if _machine() != "x86_64":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return "fma" in flags.split()


def _compiler() -> str:
    cxx = os.environ.get("GEOCOMM_TWIN_CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise CompileError(
            f"twin NVRTC: the host compiler {cxx!r} was not found (install g++ "
            "or set GEOCOMM_TWIN_CXX)"
        )
    return path


_identities: dict[str, str] = {}


def _compiler_identity(cxx: str) -> str:
    """The compiler's path, version and target: part of the cache key."""
    if cxx not in _identities:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
        target = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=False)
        _identities[cxx] = f"{cxx}\n{version.stdout}\n{target.stdout}"
    return _identities[cxx]


def _macro_flags(opts: _Options) -> list[str]:
    """What both the scan and the build define, and the include path."""
    flags = [
        "-D__CUDACC__",
        "-D__CUDACC_RTC__",
        f"-D__CUDA_ARCH__={opts.arch}",
        "-DGEOCOMM_CUDA_TWIN=1",
        *opts.defines,
    ]
    return flags + [f"-I{d}" for d in opts.includes]


def host_flags(options: Sequence[str]) -> list[str]:
    """The g++ flags that build a unit compiled with NVRTC ``options`` (after the
    compiler and before the file names); raises CompileError for a bad option."""
    opts = _parse_options(options)
    # -fno-weak: the __shared__ statics of inline functions would be COMDAT, and gcc
    # refuses to mix COMDAT and plain variables in the one "gctwin_shared" section
    # (harmless: a unit is one translation unit with hidden symbols)
    flags = [
        f"-std={opts.std}",
        "-O2",
        "-fPIC",
        "-shared",
        "-fno-fast-math",
        "-fvisibility=hidden",
        "-fno-weak",
        "-U_FORTIFY_SOURCE",
        "-Wno-unknown-pragmas",
        "-fstack-clash-protection",
    ]  # big frames probe each page: overflow hits the guard
    if _machine() == "x86_64":
        flags.append("-fcf-protection=none")  # the fibers' stack switch is not CET-aware
    if opts.fmad:
        flags.append("-ffp-contract=fast")
        if _machine() == "x86_64" and _cpu_has_fma():
            flags.append("-mfma")
    else:
        flags.append("-ffp-contract=off")
    # the unit's own macros go on the command line; __CUDACC__ and friends are
    # defined by cuda_twin.h after its system headers (libstdc++ tests __CUDACC__)
    flags += opts.defines + [f"-I{TWIN_DIR}"] + [f"-I{d}" for d in opts.includes]
    flags += ["-Wl,-z,defs"]
    return flags


# ---------------------------------------------------------------------------
# kernel signatures


_KERNEL = re.compile(
    r'extern\s+"C"\s+((?:[A-Za-z_]\w*\s*(?:\([^()]*\)\s*)?)*?)void\s+([A-Za-z_]\w*)\s*'
    r"\(([^()]*)\)\s*([{;])"
)
_TOKEN = re.compile(r"[A-Za-z_]\w*|::|[*&\[\]<>,]")
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}
_BUILTIN_WORDS = {
    "unsigned",
    "signed",
    "int",
    "long",
    "short",
    "char",
    "float",
    "double",
    "bool",
    "void",
}


def _split_params(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _parse_param(text: str, index: int) -> Param:
    tokens = _TOKEN.findall(text.split("=")[0])
    pointer = "*" in tokens or "[" in tokens
    if pointer:
        first = min(tokens.index(t) for t in ("*", "[") if t in tokens)
        last = max(i for i, t in enumerate(tokens) if t in ("*", "[", "]"))
        base, tail = tokens[:first], tokens[last + 1 :]
        if "[" in tokens:  # float x[]: the name precedes the bracket
            tail = [t for t in base[1:] if t not in _QUALIFIERS][-1:] + tail
            base = [t for t in base if t not in tail]
        names = [t for t in tail if t not in _QUALIFIERS and re.match(r"[A-Za-z_]", t)]
        name = names[-1] if names else ""
        const = "const" in base
    else:
        base = tokens
        words = [t for t in base if t not in _QUALIFIERS]
        name = words[-1] if len(words) >= 2 and words[-1] not in _BUILTIN_WORDS else ""
        if name:
            base = base[: len(base) - 1 - base[::-1].index(name)]
        const = "const" in tokens
    ctype = " ".join(t for t in base if t not in _QUALIFIERS and t != ",")
    return Param(name or f"arg{index}", ctype, pointer, const)


def _scan_kernels(preprocessed: str) -> dict[str, list[Param]]:
    """extern "C" __global__ kernels of a preprocessed unit and their parameters."""
    kernels: dict[str, list[Param]] = {}
    for m in _KERNEL.finditer(preprocessed):
        if "__global__" not in m.group(1).split():
            continue
        text = " ".join(m.group(3).split())
        params = (
            []
            if text in ("", "void")
            else [_parse_param(p, i) for i, p in enumerate(_split_params(text))]
        )
        name = m.group(2)
        if name in kernels and kernels[name] != params:
            raise CompileError(f"twin NVRTC: kernel {name} is declared with two signatures")
        kernels[name] = params
    return kernels


# ---------------------------------------------------------------------------
# compilation


def cache_dir() -> Path:
    """The directory of compiled units: $GEOCOMM_TWIN_CACHE, or a private per-user one."""
    env = os.environ.get("GEOCOMM_TWIN_CACHE")
    if env:
        path = Path(env)
        path.mkdir(parents=True, exist_ok=True)
        return path
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    path = Path(tempfile.gettempdir()) / f"geocomm-twin-{user}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if path.is_symlink() or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        raise CompileError(
            f"twin NVRTC: the cache directory {path} is not yours; set GEOCOMM_TWIN_CACHE"
        )
    return path


def _run(cmd: list[str], what: str, source: str | None = None) -> str:
    proc = subprocess.run(cmd, input=source, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise CompileError(
            f"twin NVRTC: {what} failed (g++ exit {proc.returncode})\n"
            f"command: {' '.join(cmd)}\n{proc.stderr}{proc.stdout}"
        )
    return proc.stdout


def _c_string(text: str) -> str:
    """text (ASCII) as a C string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("?", "\\?") + '"'


def _wrappers(kernels: dict[str, list[Param]], manifest: dict[str, Any], ftz: bool) -> str:
    """The code appended to a unit: per kernel a generic entry (args[i] points to
    argument i, as cuLaunchKernel's kernelParams) and its compiler-resolved
    signature; the module's -ftz flag; the manifest."""
    lines = [
        '#line 1 "<twin wrappers>"',
        f"namespace gctwin {{ extern const int module_ftz = {int(ftz)}; }}",
    ]
    for name in kernels:
        lines += [
            f"GCTWIN_EXPORT void gctwin_call_{name}(void **args) "
            f"{{ ::gctwin::invoke(&{name}, args); }}",
            f"GCTWIN_EXPORT const char *gctwin_sig_{name}(void) "
            f"{{ return ::gctwin::signature(&{name}); }}",
        ]
    text = json.dumps(manifest, sort_keys=True)
    lines.append(f"GCTWIN_EXPORT const char *gctwin_manifest(void) {{ return {_c_string(text)}; }}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` across processes (a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _image(path: Path, key: str) -> bytes:
    return IMAGE_MAGIC + json.dumps({"path": str(path), "key": key}).encode()


def compile_source(source: str, name: str, options: Sequence[str]) -> bytes:
    """Build CUDA unit ``source`` (file name ``name`` in messages) for the host with
    NVRTC ``options``; the image that :func:`load` loads (see the module docstring)."""
    if not isinstance(source, str):
        raise CompileError(f"twin NVRTC: the source must be a str, got {type(source).__name__}")
    opts = _parse_options(options)
    flags = host_flags(options)
    cxx = _compiler()
    # the scan: the unit preprocessed as CUDA sees it, without cuda_twin.h (whose
    # macros would hide __global__); its text also keys the cache, so headers
    # reached through -I count
    scan = [cxx, "-E", "-P", "-x", "c++", f"-std={opts.std}", *_macro_flags(opts), "-"]
    preprocessed = _run(scan, f"preprocessing {name}", source)
    headers = "".join(h.read_text() for h in HEADERS)
    digest = hashlib.sha256()
    for part in (
        Path(__file__).read_text(),
        headers,
        _compiler_identity(cxx),
        json.dumps([list(options), flags, name]),
        source,
        preprocessed,
    ):
        digest.update(f"{len(part)}\n".encode())
        digest.update(part.encode())
    key = digest.hexdigest()[:40]
    cache = cache_dir()
    target = cache / f"{key}.so"
    if target.exists():
        return _image(target, key)
    with _file_lock(cache / f"{key}.lock"):
        if target.exists():  # another process built it while we waited
            return _image(target, key)
        kernels = _scan_kernels(preprocessed)
        manifest = {
            "name": name,
            "options": list(options),
            "ftz": opts.ftz,
            "key": key,
            "kernels": {k: [list(p) for p in ps] for k, ps in kernels.items()},
        }
        unit = (
            f"#define GCTWIN_CUDA_ARCH {opts.arch}\n"
            '#include "cuda_twin.h"\n'
            f"#line 1 {_c_string(name)}\n"
            f"{source}{'' if source.endswith(chr(10)) else chr(10)}"
            f"{_wrappers(kernels, manifest, opts.ftz)}"
        )
        work = Path(tempfile.mkdtemp(prefix=f"{key[:12]}.", dir=cache))
        try:
            (work / "unit.cpp").write_text(unit)
            _run(
                [cxx, *flags, "-o", str(work / "unit.so"), str(work / "unit.cpp")],
                f"compiling {name} with {' '.join(options)}",
            )
            os.replace(work / "unit.so", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _image(target, key)


# ---------------------------------------------------------------------------
# loading and launching


#: the numpy dtype of each fundamental C type a parameter can resolve to
_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "char(signed)": np.dtype(np.int8),
    "char(unsigned)": np.dtype(np.uint8),
    "signed char": np.dtype(np.int8),
    "unsigned char": np.dtype(np.uint8),
    "short": np.dtype(np.int16),
    "unsigned short": np.dtype(np.uint16),
    "int": np.dtype(np.int32),
    "unsigned int": np.dtype(np.uint32),
    "long": np.dtype(f"i{ctypes.sizeof(ctypes.c_long)}"),
    "unsigned long": np.dtype(f"u{ctypes.sizeof(ctypes.c_long)}"),
    "long long": np.dtype(np.int64),
    "unsigned long long": np.dtype(np.uint64),
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
}

#: the resolved type a Python scalar passed by CuPy must meet (CuPy sends int as
#: int64, float as float64, bool as bool)
_PYTHON_SCALARS = ((bool, "bool"), (int, "long long"), (float, "double"))

_launch_lock = threading.Lock()
_load_lock = threading.Lock()
_images: dict[str, Image] = {}


class _Resolved(NamedTuple):
    """A parameter as the compiler resolved it (typedefs seen through)."""

    pointer: bool
    const: bool
    ctype: str  # a key of _DTYPES, or void / struct / enum / pointer


def _parse_signature(text: str) -> list[_Resolved]:
    out = []
    for entry in filter(None, text.split(";")):
        kind, const, ctype = entry.split("|")
        out.append(_Resolved(kind == "P", const == "c", ctype))
    return out


def _dims(value: Any, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not 1 <= len(value) <= 3:
        raise LaunchError(f"{what} must be an int or 1 to 3 ints, got {value!r}")
    dims = []
    for axis, d in zip("xyz", value, strict=False):
        if not isinstance(d, (int, np.integer)) or isinstance(d, (bool, np.bool_)):
            raise LaunchError(f"{what} must be an int or 1 to 3 ints, got {value!r}")
        if not 1 <= int(d) <= limits[len(dims)]:
            raise LaunchError(
                f"{what}.{axis} = {int(d)} is outside [1, {limits[len(dims)]}] "
                "(cudaErrorInvalidConfiguration)"
            )
        dims.append(int(d))
    return (*dims, 1, 1, 1)[:3]  # type: ignore[return-value]


class Kernel:
    """One ``extern "C" __global__`` kernel of a loaded :class:`Image`.

    ``name``; ``params``: the :class:`Param` list of its source signature;
    ``resolved``: per parameter the fundamental type the compiler resolved
    (``"unsigned long long"`` for ``gc_u64``), pointee types for pointers.
    """

    def __init__(self, image: Image, name: str, params: list[Param]):
        self.image = image
        self.name = name
        self.params = params
        lib = image._lib
        sig = getattr(lib, f"gctwin_sig_{name}")
        sig.restype = ctypes.c_char_p
        self._resolved = _parse_signature(sig().decode())
        if len(self._resolved) != len(params) or any(
            r.pointer != p.pointer for r, p in zip(self._resolved, params, strict=True)
        ):
            raise CompileError(
                f"twin: the signature of {name} read from the source "
                f"({params}) disagrees with the compiler's ({self._resolved})"
            )
        self.resolved = [r.ctype for r in self._resolved]
        self._entry = ctypes.cast(getattr(lib, f"gctwin_call_{name}"), ctypes.c_void_p)

    def __repr__(self) -> str:
        params = ", ".join(_spell(p) for p in self.params)
        return f"<twin kernel {self.name}({params})>"

    # -- checks

    def _fail(self, message: str) -> LaunchError:
        return LaunchError(f"kernel {self.name}: {message}")

    def _pointer(self, i: int, param: Param, resolved: _Resolved, arg: Any) -> int:
        if isinstance(arg, np.uint64) and arg == 0:
            return 0  # NULL: eight zero bytes, as CuPy packs a uint64 scalar
        if isinstance(arg, np.ndarray):
            ptr, dtype = arg.ctypes.data, arg.dtype
            if not param.const and not arg.flags.writeable:
                raise self._fail(
                    f"parameter {i} ({_spell(param)}) is written by the kernel, "
                    "but the array is read-only"
                )
        elif hasattr(arg, "dtype") and hasattr(getattr(arg, "data", None), "ptr"):
            ptr, dtype = int(arg.data.ptr), np.dtype(arg.dtype)
        else:
            raise self._fail(
                f"parameter {i} ({_spell(param)}) takes an array, got "
                f"{type(arg).__name__} {arg!r:.60}"
            )
        want = _DTYPES.get(resolved.ctype)
        if want is not None and dtype != want:
            raise self._fail(
                f"parameter {i} ({_spell(param)}) points to {resolved.ctype} "
                f"({want}), got an array of dtype {dtype}"
            )
        return int(ptr)

    def _value(self, i: int, param: Param, resolved: _Resolved, arg: Any) -> bytes:
        want = _DTYPES.get(resolved.ctype)
        if want is None:
            raise self._fail(
                f"parameter {i} ({_spell(param)}) has type {resolved.ctype}, "
                "which the twin cannot pass"
            )
        if isinstance(arg, np.generic):
            if arg.dtype != want:
                raise self._fail(
                    f"parameter {i} ({_spell(param)}) is {resolved.ctype} "
                    f"({want}), got a numpy.{arg.dtype} scalar"
                )
            return arg.tobytes()
        for kind, ctype in _PYTHON_SCALARS:
            if isinstance(arg, kind):
                if resolved.ctype != ctype:
                    raise self._fail(
                        f"parameter {i} ({_spell(param)}) is {resolved.ctype} ({want}), got a "
                        f"Python {kind.__name__}, which CuPy passes as {ctype}: pass "
                        f"numpy.{want.name}(...) instead"
                    )
                if kind is int and not -(2**63) <= arg < 2**63:
                    raise self._fail(
                        f"parameter {i} ({_spell(param)}): {arg} does not fit long long"
                    )
                return np.array(arg, want).tobytes()
        raise self._fail(
            f"parameter {i} ({_spell(param)}) takes a numpy.{want.name} scalar, "
            f"got {type(arg).__name__}"
        )

    def _prepare(
        self, grid: Any, block: Any, args: Sequence[Any], shared_mem: Any
    ) -> tuple[tuple[int, int, int], tuple[int, int, int], list[Any]]:
        try:
            grid3 = _dims(grid, "grid", GRID_MAX)
            block3 = _dims(block, "block", BLOCK_MAX)
        except LaunchError as exc:
            raise self._fail(str(exc)) from None
        threads = block3[0] * block3[1] * block3[2]
        if threads > MAX_THREADS:
            raise self._fail(
                f"block {block3} has {threads} threads, more than {MAX_THREADS} "
                "(cudaErrorInvalidConfiguration)"
            )
        if not isinstance(shared_mem, (int, np.integer)) or int(shared_mem) != 0:
            raise self._fail(
                f"shared_mem={shared_mem!r}: the twin supports static __shared__ "
                "memory only (dynamic shared memory must be 0)"
            )
        if not isinstance(args, (tuple, list)):
            raise self._fail(f"args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise self._fail(
                f"takes {len(self.params)} arguments ("
                f"{', '.join(_spell(p) for p in self.params)}), got {len(args)}"
            )
        storage: list[Any] = []
        for i, (param, resolved, arg) in enumerate(
            zip(self.params, self._resolved, args, strict=True)
        ):
            if resolved.pointer:
                storage.append(ctypes.c_void_p(self._pointer(i, param, resolved, arg)))
            else:
                raw = self._value(i, param, resolved, arg)
                storage.append(ctypes.create_string_buffer(raw, max(len(raw), 8)))
        return grid3, block3, storage

    def check(self, grid: Any, block: Any, args: Sequence[Any], shared_mem: Any = 0) -> None:
        """Raise :class:`LaunchError` if launch(grid, block, args, shared_mem) would be refused
        before running (configuration and arguments)."""
        self._prepare(grid, block, args, shared_mem)

    # -- launch

    def launch(
        self,
        grid: Any,
        block: Any,
        args: Sequence[Any],
        shared_mem: Any = 0,
        *,
        order: str = "descending",
    ) -> None:
        """Run the whole grid now, on this thread (see the module docstring)."""
        if order not in _ORDERS:
            raise ValueError(f"order must be one of {sorted(_ORDERS)}, got {order!r}")
        grid3, block3, storage = self._prepare(grid, block, args, shared_mem)
        argv = (ctypes.c_void_p * max(1, len(storage)))(*[ctypes.addressof(s) for s in storage])
        g = (ctypes.c_uint * 3)(*grid3)
        b = (ctypes.c_uint * 3)(*block3)
        err = ctypes.create_string_buffer(_ERR_BYTES)
        with _launch_lock:
            rc = self.image._launch(self._entry, argv, g, b, _ORDERS[order], err, _ERR_BYTES)
        if rc:
            raise self._fail(f"grid {grid3}, block {block3}: {err.value.decode(errors='replace')}")

    __call__ = launch


def _spell(param: Param) -> str:
    const = "const " if param.const else ""
    star = " *" if param.pointer else " "
    return f"{const}{param.ctype}{star}{param.name}".replace("* ", "*")


class Image:
    """A loaded unit: ``function(name)`` gives its kernels; ``kernels`` names them."""

    def __init__(self, path: str):
        self.path = path
        self._lib = ctypes.CDLL(path, mode=os.RTLD_NOW | getattr(os, "RTLD_LOCAL", 0))
        self._lib.gctwin_manifest.restype = ctypes.c_char_p
        self.manifest = json.loads(self._lib.gctwin_manifest().decode())
        self.ftz: bool = self.manifest["ftz"]
        self._params = {k: [Param(*p) for p in ps] for k, ps in self.manifest["kernels"].items()}
        self._launch = self._lib.gctwin_launch
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        self._kernels: dict[str, Kernel] = {}

    @property
    def kernels(self) -> list[str]:
        return list(self._params)

    def function(self, name: str) -> Kernel:
        kernel = self._kernels.get(name)
        if kernel is None:
            if name not in self._params:
                raise KernelNotFound(
                    f'twin: {self.manifest["name"]} has no extern "C" __global__ kernel '
                    f"{name!r} (it has: {', '.join(self._params) or 'none'})"
                )
            kernel = self._kernels[name] = Kernel(self, name, self._params[name])
        return kernel

    def __repr__(self) -> str:
        return f"<twin image {self.manifest['name']}: {len(self._params)} kernels>"


def load(image: bytes) -> Image:
    """The :class:`Image` of bytes from :func:`compile_source` (loaded once per process)."""
    if isinstance(image, (bytearray, memoryview)):
        image = bytes(image)
    if not isinstance(image, bytes) or not image.startswith(IMAGE_MAGIC):
        raise ValueError("not a twin image (compile_source returns them)")
    path = json.loads(image[len(IMAGE_MAGIC) :].decode())["path"]
    with _load_lock:
        loaded = _images.get(path)
        if loaded is None:
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"twin image {path} no longer exists (its cache was "
                    "cleared); compile the source again"
                )
            loaded = _images[path] = Image(path)
    return loaded
