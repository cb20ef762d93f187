"""Faults under mpirun: a rank that raises, exits, never arrives or disagrees.

Each scenario runs a real 2-rank job (tests/fault_job.py) and checks that the
job ends on its own, quickly, with a message that names the problem, and
leaves no process behind. Single-process tests: they launch their own mpirun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("fault_job.py")


def run_job(scenario: str, timeout_s: float = 2.0) -> tuple[int, str, float]:
    env = dict(os.environ, GEOCOMM_TIMEOUT=str(timeout_s), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "geocomm.launch", "-n", "2", "--timeout", "120", "--",
         sys.executable, "-m", "mpi4py", str(JOB), scenario],
        capture_output=True, text=True, env=env, timeout=180)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def no_survivors(scenario: str) -> bool:
    found = subprocess.run(["pgrep", "-f", f"fault_job.py {scenario}"], capture_output=True)
    return found.returncode != 0


@pytest.mark.parametrize("scenario", ["raise", "exit"])
def test_failing_rank_ends_the_job(scenario):
    rc, out, elapsed = run_job(scenario)
    assert rc != 0
    assert "first all-reduce done" in out
    assert "second all-reduce done" not in out
    # mpirun tears the job down as soon as one rank dies: far below the
    # 120 s launcher limit (start-up itself takes a few seconds)
    assert elapsed < 60
    if scenario == "raise":
        assert "injected failure on rank 1" in out
    assert no_survivors(scenario)


def test_absent_rank_times_out_with_a_named_collective():
    rc, out, elapsed = run_job("absent", timeout_s=2.0)
    assert rc != 0
    # rank 0 gives up after GEOCOMM_TIMEOUT (2 s) in the metadata check of the
    # second all-reduce and names itself; python -m mpi4py then aborts the job
    assert "rank 0 waited" in out and "metadata all-gather" in out
    assert "CollectiveTimeout" in out
    assert elapsed < 60
    assert no_survivors("absent")


def test_mismatched_counts_fail_on_every_rank():
    rc, out, elapsed = run_job("mismatch")
    assert rc != 0
    assert "CollectiveMismatchError" in out and "count" in out
    assert elapsed < 60
    assert no_survivors("mismatch")
