"""Shared test set-up.

Under MPI (``mpiexec -n N python -P -m mpi4py -m pytest --with-mpi``) a test
that fails on one rank would leave the other ranks waiting in their next
collective. So a failure on any rank prints its report at once and aborts the
whole job (MPI_Abort): the run fails fast and loudly instead of hanging.
pytest-timeout (pyproject: ``timeout``) bounds every test as well.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

try:
    from mpi4py import MPI
except ImportError:  # the codec tests run without MPI
    MPI = None


def world_size() -> int:
    return MPI.COMM_WORLD.Get_size() if MPI is not None else 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI is not None and world_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(
            f"\n[rank {rank}] FAILED {item.nodeid} ({report.when})\n"
            f"{report.longreprtext}\n[rank {rank}] aborting the MPI job\n"
        )
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(autouse=True)
def _torch_transfers_release_their_tensors(monkeypatch):
    """A transfer through torch.distributed waits, once complete, until gloo let go of
    its tensors (geocomm/comm/torchdist.py, ``TorchWork``); a path that keeps a
    reference to its work would wait out ``RELEASE_WAIT_S`` on every call. Here that
    wait is 2 s, not 0.1 (a loaded machine may hold gloo's thread back longer than
    0.1 s, which is not a kept reference), and one late release per test is let
    through."""
    module = sys.modules.get("geocomm.comm.torchdist")
    if module is not None:  # imported with the test modules that use it
        monkeypatch.setattr(module, "RELEASE_WAIT_S", 2.0)
    before = getattr(module, "late_releases", 0)
    yield
    after = getattr(sys.modules.get("geocomm.comm.torchdist"), "late_releases", 0)
    assert after - before <= 1, f"{after - before} transfers waited out RELEASE_WAIT_S"


@pytest.fixture
def comm():
    """The geocomm communicator over MPI.COMM_WORLD."""
    import geocomm

    return geocomm.init()


#: prepended to the scripts of :func:`without_native`: importing geocomm._native fails
BLOCK_NATIVE = """
import sys

class BlockNative:
    def find_spec(self, name, path=None, target=None):
        if name == "geocomm._native":
            raise ImportError("geocomm._native blocked by the test")
        return None

sys.meta_path.insert(0, BlockNative())
"""


@pytest.fixture
def without_native(tmp_path):
    """without_native(body): run the script ``body`` in a fresh interpreter in which
    the compiled core cannot be imported (a missing build); the CompletedProcess."""

    def run(body: str) -> subprocess.CompletedProcess:
        script = tmp_path / "without_native.py"
        script.write_text(BLOCK_NATIVE + textwrap.dedent(body))
        return subprocess.run(
            [sys.executable, "-P", str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )

    return run
