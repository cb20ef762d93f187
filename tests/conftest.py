"""Shared test set-up.

Under MPI (``mpiexec -n N python -P -m mpi4py -m pytest --with-mpi``) a test
that fails on one rank would leave the other ranks waiting in their next
collective. So a failure on any rank prints its report at once and aborts the
whole job (MPI_Abort): the run fails fast and loudly instead of hanging.
pytest-timeout (pyproject: ``timeout``) bounds every test as well.
"""

from __future__ import annotations

import sys

import numpy as np
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
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n[rank {rank}] aborting the MPI job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def comm():
    """The geocomm communicator over MPI.COMM_WORLD."""
    import geocomm

    return geocomm.init()


@pytest.fixture
def rng_for():
    """rng_for(rank, tag): a generator every rank can rebuild for any rank."""

    def make(rank: int, tag: int = 0) -> np.random.Generator:
        return np.random.default_rng([rank, tag, 20261129])

    return make
