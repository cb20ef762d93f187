"""The adapters' worker thread (geocomm/adapters/torch/worker.py) at interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import torch

from geocomm.adapters.torch.worker import Worker

# A job inside torch's C++ with the GIL released (torch.mm) while the main thread
# exits: without the exit handler, CPython ends the worker with pthread_exit when it
# takes the GIL back during finalization, and the unwinding through torch's noexcept
# GIL guard aborts the process (SIGABRT, "terminate called without an active exception").
_EXIT_WHILE_A_JOB_RUNS = textwrap.dedent(
    """
    import torch
    from geocomm.adapters.torch.worker import Worker

    a = torch.randn(1000, 1000)
    worker, future = Worker("exit-test"), torch.futures.Future()

    def job():
        for _ in range(20):
            torch.mm(a, a)
        print("job done", flush=True)
        future.set_result(None)

    worker.submit(job, future)
    print("main exits", flush=True)
    """
)


def test_exit_waits_for_a_running_job_instead_of_aborting():
    done = subprocess.run(
        [sys.executable, "-P", "-c", _EXIT_WHILE_A_JOB_RUNS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["main", "exits", "job", "done"]


def test_close_reports_a_job_that_outlives_its_timeout():
    release = threading.Event()
    worker, future = Worker("close-test"), torch.futures.Future()
    worker.submit(lambda: (release.wait(60), future.set_result(None)), future)
    assert not worker.close(timeout=0.2)  # the job waits for `release`
    release.set()
    future.wait()
    assert worker.close()  # nothing left to stop
