"""The twin's NCCL: real transfers over MPI on the streams, and clear errors, never hangs.

Each scenario is a real 2-rank job (geocomm.launch) driving ``cupy.cuda.nccl``
directly: matching calls move the bytes in stream order; a size mismatch fails
at once; a peer that never calls fails after GEOCOMM_TWIN_NCCL_TIMEOUT; a call captured
into a CUDA graph on one rank only fails (NCCL's rule).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from gpu_helpers import ON_TWIN, on_ranks

pytestmark = pytest.mark.skipif(not ON_TWIN, reason="the twin's NCCL itself")

#: two ranks of the raw twin NCCL, 100 bytes to send to each other and room for theirs
SETUP = textwrap.dedent("""
    import sys, numpy as np, cupy
    from cupy.cuda import nccl
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, scenario = world.Get_rank(), sys.argv[1]
    uid = world.bcast(nccl.get_unique_id() if rank == 0 else None)
    comm = nccl.NcclCommunicator(2, uid, rank)
    stream = cupy.cuda.Stream(non_blocking=True)
    send = cupy.asarray(np.full(100, rank + 1, np.uint8))
    recv = cupy.zeros(100, cupy.uint8)
    stream.wait_event(cupy.cuda.get_current_stream().record())
""")
JOB = SETUP + textwrap.dedent("""
    peer = 1 - rank
    count = 50 if scenario == "mismatch" and rank == 1 else 100
    captured = scenario == "graph on both" or (scenario == "graph on one" and rank == 0)
    if captured:
        stream.begin_capture()
    if not (scenario == "absent" and rank == 1):
        nccl.groupStart()
        comm.send(send.data.ptr, 100, nccl.NCCL_UINT8, peer, stream.ptr)
        comm.recv(recv.data.ptr, count, nccl.NCCL_UINT8, peer, stream.ptr)
        nccl.groupEnd()
    try:  # a device error surfaces at whichever call comes next: the launch or the sync
        if captured:
            stream.end_capture().launch(stream)
        stream.synchronize()
        print(f"rank {rank} got", int(recv.get()[0]), flush=True)
    except Exception as exc:
        print(f"rank {rank} ERROR {exc}", flush=True)
    if scenario == "absent":  # rank 1 stays until rank 0 gave up on it
        world.send(None, dest=1, tag=99) if rank == 0 else world.recv(source=0, tag=99)
""")


#: what Open MPI's launcher prints when it could not start a job at all, before any
#: rank ran (a race of the PMIx listeners of launches made at once on one machine,
#: seen once in some thirty CI runs): such a job is started once more
NOT_STARTED = "The PMIx server's listener thread failed to start"


def run_job(tmp_path, scenario: str, job: str = JOB, **env: str) -> tuple[str, float]:
    """Run ``job`` on 2 ranks with ``scenario`` and the environment's ``env`` (default:
    the twin's NCCL waits 60 s for a peer, so that only a test that means a peer to be
    absent sees one time out on a loaded machine); (its output, seconds)."""
    script = tmp_path / "nccl_job.py"
    script.write_text(job)
    env = {**os.environ, "GEOCOMM_TWIN_NCCL_TIMEOUT": "60", **env}
    command = on_ranks([sys.executable, str(script), scenario], 2, timeout_s=120)
    for _ in range(2):
        start = time.monotonic()
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
        out = run.stdout + run.stderr
        if NOT_STARTED not in out:
            break
    return out, time.monotonic() - start


@pytest.mark.parametrize("scenario", ["ok", "graph on both"])
def test_matching_calls_move_the_bytes(tmp_path, scenario):
    """Eagerly, or captured on every rank alike and replayed."""
    out, _ = run_job(tmp_path, scenario)
    assert "rank 0 got 2" in out and "rank 1 got 1" in out, out


def test_size_mismatch_is_an_error(tmp_path):
    out, _ = run_job(tmp_path, "mismatch")
    assert "rank 1 ERROR" in out and "does not match its peer" in out, out


def test_a_call_captured_on_one_rank_only_is_an_error(tmp_path):
    """NCCL's rule: whether a call is captured is a property every rank shares."""
    out, _ = run_job(tmp_path, "graph on one")
    assert "rank 0 ERROR" in out and "rank 1 ERROR" in out, out
    assert "captured in capture 1 met rank 1's eager transfer" in out, out
    assert "queued eagerly met rank 0's transfer of capture 1" in out, out


def test_absent_peer_is_an_error_after_the_timeout(tmp_path):
    out, seconds = run_job(tmp_path, "absent", GEOCOMM_TWIN_NCCL_TIMEOUT="2")
    assert "rank 0 ERROR" in out and "within 2 s" in out, out
    assert seconds < 60


# captures of the raw twin NCCL: two graphs launched in turn, or one dropped unlaunched
ORDER_JOB = SETUP + textwrap.dedent("""

    def captured():
        stream.begin_capture()
        nccl.groupStart()
        comm.send(send.data.ptr, 100, nccl.NCCL_UINT8, 1 - rank, stream.ptr)
        comm.recv(recv.data.ptr, 100, nccl.NCCL_UINT8, 1 - rank, stream.ptr)
        nccl.groupEnd()
        return stream.end_capture()

    try:
        if scenario == "in turn":  # both capture A then B; rank 1 launches B first
            graphs = [captured(), captured()]
            for graph in graphs if rank == 0 else graphs[::-1]:
                graph.launch(stream)
        if scenario == "dropped":  # rank 0's first capture is dropped unlaunched
            if rank == 0:
                captured()
            captured().launch(stream)
        stream.synchronize()
        print(f"rank {rank} got", int(recv.get()[0]), flush=True)
    except Exception as exc:
        print(f"rank {rank} ERROR {exc}", flush=True)
    world.Barrier()
""")


def test_graphs_of_a_capture_dropped_unlaunched_take_no_number(tmp_path):
    """A capture whose graph is never launched (geocomm's, given up because another rank's
    capture failed) does not count: the ranks' next captures still match."""
    out, _ = run_job(tmp_path, "dropped", ORDER_JOB)
    assert "rank 0 got 2" in out and "rank 1 got 1" in out, out


def test_graphs_launched_out_of_capture_order_are_refused(tmp_path):
    """Captures are told apart across ranks by the order of their first launches, so a
    graph launched while an earlier capture's graph lives unlaunched is refused: here
    rank 1 would replay B against rank 0's A."""
    out, _ = run_job(tmp_path, "in turn", ORDER_JOB, GEOCOMM_TWIN_NCCL_TIMEOUT="5")
    assert "rank 1 ERROR twin: the graph of capture 2" in out, out
    assert "before the graph of capture 1" in out, out


# geocomm's NCCLCommunicator over the twin's NCCL, a peer absent or late
COMMUNICATOR_JOB = textwrap.dedent("""
    import os, sys, numpy as np, cupy
    from mpi4py import MPI
    import geocomm
    from geocomm.comm.mpi import MPICommunicator
    from geocomm.comm.nccl import NCCLCommunicator
    from geocomm.engine.call import FIELDS
    world = MPI.COMM_WORLD
    rank, scenario = world.Get_rank(), sys.argv[1]
    if rank == 1:  # only rank 0 gives up; rank 1's waits are not the test's
        os.environ["GEOCOMM_TIMEOUT"] = "60"
    if scenario == "deferred":  # a second call that runs eagerly, not captured
        os.environ["GEOCOMM_GRAPHS"] = "0"
    comm = NCCLCommunicator(MPICommunicator(world))
    world.Barrier()  # both start the timed calls together
    where = "the call"
    try:
        if scenario == "allreduce" and rank == 0:
            x = cupy.ones(64, cupy.float32)
            comm.allreduce(x, cupy.empty_like(x), "sum")  # rank 1 never calls it
            comm.synchronize()
        if scenario == "metadata" and rank == 0:
            comm.allgather_int64(np.arange(3))  # rank 1 comes late
        if scenario in ("deferred", "capture"):
            x = cupy.ones(4096, cupy.float32)
            out = cupy.empty_like(x)
            for _ in range(1 if rank else 2):  # rank 0's second call: a deferred check
                geocomm.allreduce(x, codec="fp8", comm=comm, out=out)  # capture: settles it
            if rank == 0:
                where = "synchronize"
                comm.synchronize()  # finishes the check: rank 1 never sends its row
        print(f"rank {rank} done", flush=True)
    except geocomm.CollectiveTimeout as exc:  # what a user catches
        print(f"rank {rank} timed out in {where}: {exc} (aborted: {comm.aborted})", flush=True)
    if rank == 0:
        world.send(None, dest=1, tag=99)  # gave up: rank 1 may come now
    else:
        world.recv(source=0, tag=99)
    if scenario == "metadata" and rank == 1:
        comm.host.allgather_int64(np.arange(3))  # completes rank 0's on MPI
    if scenario in ("deferred", "capture") and rank == 1:
        comm.host.allgather_int64(np.zeros(len(FIELDS), np.int64))  # the row rank 0 waited for
""")


@pytest.mark.parametrize("scenario", ["allreduce", "metadata", "deferred", "capture"])
def test_the_communicator_bounds_what_the_host_waits_for(tmp_path, scenario):
    """geocomm's NCCL communicator: a plain (exact) all-reduce is watched like the grouped
    transfers, so synchronize() gives up after GEOCOMM_TIMEOUT (it returned at once,
    and a device synchronization behind it waits for good on a real GPU); a metadata
    all-gather that times out, at once, deferred (finished by synchronize()) or at a
    capture (the ranks' exchange of whether theirs succeeded), aborts the
    communicator, whose peer is gone (its later calls each waited out the timeout
    again)."""
    # geocomm gives up on rank 1 after 1 s; the twin's NCCL, as run_job sets it, only
    # after 60 s (a GPU's never does)
    out, _ = run_job(tmp_path, scenario, COMMUNICATOR_JOB, GEOCOMM_TIMEOUT="1")
    assert "rank 0 timed out" in out and "(aborted: True)" in out, out
    assert "rank 1 done" in out, out
    # the deferred check times out where it is settled: without graphs in synchronize(),
    # with them in the call that captures, before the ranks exchange whether their
    # captures succeeded (an abort there drops the graph it was deciding on: the twin's
    # NCCL refuses an abort while a graph of its transfers lives)
    where = {"deferred": "synchronize", "capture": "the call"}
    assert scenario not in where or f"rank 0 timed out in {where[scenario]}: " in out, out
    assert scenario not in where or "waited 1.0 s for a deferred metadata all-gather" in out, out


DEVICE_JOB = textwrap.dedent("""
    import os, sys
    from mpi4py import MPI
    host_kind, emulated = sys.argv[1].split(",")
    rank = MPI.COMM_WORLD.Get_rank()
    if emulated == "all" or (emulated == "rank 1" and rank == 1):
        os.environ["GEOCOMM_RANKS_PER_NODE"] = "1"  # one emulated node per rank
    from geocomm.comm.mpi import MPICommunicator
    from geocomm.comm.nccl import NCCLCommunicator
    host = MPI.COMM_WORLD if host_kind == "mpi4py" else MPICommunicator()
    try:
        comm = NCCLCommunicator(host, device=0 if emulated == "device 0" else None)
    except Exception as exc:
        print(f"rank {rank} ERROR {exc}", flush=True)
        sys.exit(0)
    print(f"rank {comm.rank} on device {comm.device.id}", flush=True)
    comm.close()
""")


@pytest.mark.parametrize("host", ["mpi4py", "geocomm"])
@pytest.mark.parametrize("emulated", ["none", "all", "rank 1"])
def test_each_rank_takes_its_host_local_device(tmp_path, host, emulated):
    """Over MPI a rank drives the device of its index among its host's ranks (the twin
    has two devices here): both ranks share this host, so ranks 0 and 1 take devices
    0 and 1, the same over an mpi4py communicator and a geocomm MPICommunicator (the
    latter took torch's rule once, LOCAL_RANK or the current device, which mpiexec
    does not set: every rank on device 0). Nodes emulated by GEOCOMM_RANKS_PER_NODE
    change nothing, on every rank or on one only (they put both ranks on device 0,
    which NCCL refuses, or paired an all-gather with the unique id's)."""
    out, _ = run_job(tmp_path, f"{host},{emulated}", DEVICE_JOB, GEOCOMM_TWIN_DEVICES="2")
    for rank in (0, 1):
        assert f"rank {rank} on device {rank}" in out, out


def test_two_ranks_on_one_gpu_are_refused(tmp_path):
    """As NCCL's init: the twin's NCCL of two devices refuses a clique whose ranks both
    chose device 0 (what guards the choice above)."""
    out, _ = run_job(tmp_path, "geocomm,device 0", DEVICE_JOB, GEOCOMM_TWIN_DEVICES="2")
    for rank in (0, 1):
        assert f"rank {rank} ERROR ncclInvalidUsage: Duplicate GPU detected" in out, out


# geocomm's NCCLCommunicator ending: after captured calls, and on a failed device
ENDING_JOB = textwrap.dedent("""
    import contextlib, sys, threading, time, numpy as np, cupy
    from mpi4py import MPI
    import geocomm
    from geocomm.comm.mpi import MPICommunicator
    from geocomm.comm.nccl import NCCLCommunicator
    world = MPI.COMM_WORLD
    rank, scenario = world.Get_rank(), sys.argv[1]
    comm = NCCLCommunicator(MPICommunicator(world))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.ones(1 << 14, cupy.float32)
        out = cupy.empty_like(x)
        for _ in range(3):  # the third replays a captured graph
            geocomm.allreduce(x, codec="fp8", comm=comm, out=out)
        # "fault": the device lags the host (its queues wait), and a kernel fails while
        # close() waits for the transfers queued behind it
        lagging = cupy._device.hold() if scenario == "fault" else contextlib.nullcontext()
        with lagging:
            geocomm.allreduce(x, codec="fp8", comm=comm, out=out)
            if scenario == "fault":
                threading.Timer(0.5, cupy._device.fail, ["an injected kernel fault"]).start()
            start = time.monotonic()
            try:
                comm.close()
                print(f"rank {rank} closed", flush=True)
            except Exception as exc:
                print(f"rank {rank} {type(exc).__name__} after "
                      f"{time.monotonic() - start:.1f} s: {exc}", flush=True)
""")


def test_close_after_captured_calls_drops_their_graphs_first(tmp_path):
    """NCCL's ncclCommDestroy and ncclCommAbort wait until every CUDA graph that captured
    a call of the communicator is destroyed (commDestroySync: localPersistentRefs), and
    the twin's refuse to: close() drops the communicator's graphs first (it waited for
    good on a GPU, at close or at exit, once a multi-rank call had been captured)."""
    out, _ = run_job(tmp_path, "close", ENDING_JOB)
    assert "rank 0 closed" in out and "rank 1 closed" in out, out


def test_a_device_fault_is_raised_as_itself_not_as_a_lost_peer(tmp_path):
    """CuPy's Event.done reads False on any error status, so a failed device looked like
    a transfer still running: close() waited GEOCOMM_TIMEOUT, then blamed a peer. The
    communicator reads the event's status and raises the device's error at once."""
    out, _ = run_job(tmp_path, "fault", ENDING_JOB, GEOCOMM_TIMEOUT="60")
    for rank in (0, 1):
        assert f"rank {rank} CUDARuntimeError after" in out, out
        assert "an injected kernel fault" in out, out
    seconds = [float(line.split(" after ")[1].split(" s")[0]) for line in out.splitlines()
               if "CUDARuntimeError after" in line]  # fmt: skip
    assert max(seconds) < 30, out  # far below GEOCOMM_TIMEOUT's 60 s
