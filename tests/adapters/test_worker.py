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


def test_a_close_that_timed_out_still_keeps_the_jobs_in_order():
    """close() reports a job that outlives its timeout; a job submitted then waits until
    the closing thread ran out its queue, so jobs never run concurrently or out of
    order (every rank must run its collectives in submission order)."""
    release, order = threading.Event(), []
    worker = Worker("close-test")
    first, second = torch.futures.Future(), torch.futures.Future()
    worker.submit(lambda: (release.wait(60), order.append("first"), first.set_result(None)), first)
    assert not worker.close(timeout=0.2)  # the first job waits for `release`
    threading.Timer(0.3, release.set).start()
    worker.submit(lambda: (order.append("second"), second.set_result(None)), second)
    second.wait()
    assert order == ["first", "second"]
    assert worker.close(timeout=10)
