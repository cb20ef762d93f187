"""GPU tests: on a real GPU where CuPy sees one, else on the CPU twin (tests/twin).

The twin must be in place before anything imports ``cupy`` (geocomm probes it
once per process), so this directory runs in pytest sessions of its own:
``tests/run.sh`` passes ``--ignore=tests/gpu`` to the other runs and runs
``pytest tests/gpu`` separately, single-process and under MPI at 1-4 ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TWIN = Path(__file__).resolve().parents[1] / "twin"


def _real_gpu() -> bool:
    if os.environ.get("GEOCOMM_TWIN") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


if not _real_gpu():
    for name in [m for m in sys.modules if m == "cupy" or m.startswith(("cupy.", "cupy_"))]:
        del sys.modules[name]
    sys.path.insert(0, str(TWIN))
    os.environ["GEOCOMM_TWIN"] = "1"  # subprocesses of the tests take the twin too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TWIN), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def cp():
    """The cupy module (twin or real); the device is synchronized after the test."""
    import cupy

    yield cupy
    cupy.cuda.Device().synchronize()


@pytest.fixture(autouse=True)
def _fresh_twin_device():
    """On the twin, a failed test's sticky device error does not fail the next tests
    (each test is its own program; on a GPU it would take a new process)."""
    yield
    device = sys.modules.get("cupy._device")
    if device is not None and getattr(device, "_failure", None):
        device._failure.clear()
