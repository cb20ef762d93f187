"""The abort-on-error hooks (geocomm.comm.abort) and NCCL's timeout abort, in one process.

Fake communicators record what the hooks do; their ``abort`` raises
:class:`Aborted` (a BaseException, so it passes the hook's ``except
Exception``) where a real one would end the process. The real multi-rank
behaviour is checked by tests/comm/test_faults.py under plain mpiexec.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from geocomm.comm import abort
from geocomm.comm.base import CollectiveTimeout, wait


class Aborted(BaseException):
    """Stands for 'the process ended' in these tests."""


class FakeComm:
    def __init__(self, size: int, log: list, name: str = "comm", abort_raises: bool = False):
        self.size, self.log, self.name, self.abort_raises = size, log, name, abort_raises

    def abort_local(self) -> None:
        self.log.append((self.name, "abort_local"))

    def abort(self, code: int) -> None:
        self.log.append((self.name, "abort", code))
        if self.abort_raises:
            raise RuntimeError("MPI_Abort unavailable")
        raise Aborted(code)


@pytest.fixture
def hooks(monkeypatch):
    """Fresh hook state: geocomm's registry empty, the Python hooks replaced by
    recorders (restored afterwards), os._exit and MPI_Abort(WORLD) faked."""
    log: list = []
    monkeypatch.delenv(abort.ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "excepthook", lambda *a: log.append(("previous sys", a[0])))
    monkeypatch.setattr(
        threading, "excepthook", lambda args: log.append(("previous threading", args.exc_type))
    )

    def fake_exit(code):
        log.append(("os._exit", code))
        raise Aborted(code)

    monkeypatch.setattr(abort.os, "_exit", fake_exit)
    monkeypatch.setattr(abort, "mpi_world_abort", lambda code: log.append(("world", code)))
    abort._reset_for_tests()
    yield log
    abort._reset_for_tests()


def raise_in_main(exc: BaseException) -> None:
    """What the interpreter does with an uncaught exception of the main thread."""
    sys.excepthook(type(exc), exc, None)


def raise_in_thread(exc: BaseException) -> None:
    thread = threading.Thread(name="worker")
    threading.excepthook(threading.ExceptHookArgs([type(exc), exc, None, thread]))


def test_single_rank_installs_nothing(hooks):
    before = sys.excepthook, threading.excepthook
    assert abort.register(FakeComm(1, hooks)) is False
    assert (sys.excepthook, threading.excepthook) == before


def test_main_thread_exception_prints_then_aborts(hooks):
    comm = FakeComm(3, hooks)
    assert abort.register(comm) is True
    with pytest.raises(Aborted) as info:
        raise_in_main(RuntimeError("boom"))
    assert info.value.args == (abort.EXIT_STATUS,)
    # the previous hook (Python's prints the traceback) runs before the abort
    assert hooks == [("previous sys", RuntimeError), ("comm", "abort_local"), ("comm", "abort", 1)]


def test_keyboard_interrupt_exits_like_sigint(hooks):
    comm = FakeComm(2, hooks)
    abort.register(comm)
    with pytest.raises(Aborted) as info:
        raise_in_main(KeyboardInterrupt())
    assert info.value.args == (130,)  # 128 + SIGINT, as python -m mpi4py


def test_thread_exception_aborts_but_system_exit_does_not(hooks):
    comm = FakeComm(2, hooks)  # registered by weak reference: keep it alive
    abort.register(comm)
    raise_in_thread(SystemExit(0))  # threading ignores SystemExit; so do we
    assert hooks == [("previous threading", SystemExit)]
    with pytest.raises(Aborted):
        raise_in_thread(ValueError("worker died"))
    assert hooks[1:] == [
        ("previous threading", ValueError),
        ("comm", "abort_local"),
        ("comm", "abort", 1),
    ]


def test_install_is_idempotent_and_chains_once(hooks):
    first, second = FakeComm(2, hooks, "a"), FakeComm(2, hooks, "b")
    abort.register(first)
    hook = sys.excepthook, threading.excepthook
    abort.register(second)
    abort.register(second)  # registering again does not duplicate it
    abort.install()
    assert (sys.excepthook, threading.excepthook) == hook
    with pytest.raises(Aborted):
        raise_in_main(RuntimeError())
    # one previous-hook call; every communicator releases its side (NCCL), then
    # the newest one ends the job and nothing runs after it
    assert hooks == [
        ("previous sys", RuntimeError),
        ("a", "abort_local"),
        ("b", "abort_local"),
        ("b", "abort", 1),
    ]


def test_hook_installed_over_a_later_hook_does_not_recurse(hooks):
    comm = FakeComm(2, hooks)
    abort.register(comm)
    ours = sys.excepthook

    def user_hook(*args):  # a later hook that chains to the one it replaced
        hooks.append(("user", args[0]))
        ours(*args)

    sys.excepthook = user_hook
    abort.install()  # wraps user_hook, which calls the first wrapper: no loop
    with pytest.raises(Aborted):
        raise_in_main(RuntimeError())
    assert hooks[0] == ("user", RuntimeError) and hooks[1] == ("previous sys", RuntimeError)


def test_environment_variable_turns_it_off(hooks, monkeypatch):
    monkeypatch.setenv(abort.ENV_VAR, "0")
    before = sys.excepthook
    assert abort.register(FakeComm(4, hooks)) is False
    assert sys.excepthook is before
    # hooks installed while enabled also stand down once it is set to 0
    monkeypatch.setenv(abort.ENV_VAR, "1")
    comm = FakeComm(4, hooks)
    abort.register(comm)
    monkeypatch.setenv(abort.ENV_VAR, "off")
    raise_in_main(RuntimeError())
    assert hooks == [("previous sys", RuntimeError)]


def test_failing_abort_falls_back_to_world_abort_then_exit(hooks):
    comm = FakeComm(2, hooks, abort_raises=True)
    abort.register(comm)
    with pytest.raises(Aborted):
        raise_in_main(RuntimeError())
    assert hooks[-3:] == [("comm", "abort", 1), ("world", 1), ("os._exit", 1)]


def test_dead_communicator_is_skipped(hooks):
    abort.register(FakeComm(2, hooks))  # no reference kept: collected at once
    assert abort.live_targets() == []
    with pytest.raises(Aborted):
        raise_in_main(RuntimeError())
    assert hooks == [("previous sys", RuntimeError), ("world", 1), ("os._exit", 1)]


def test_second_failure_during_abort_returns(hooks):
    comm = FakeComm(2, hooks)
    abort.register(comm)
    with pytest.raises(Aborted):
        raise_in_main(RuntimeError())
    raise_in_thread(RuntimeError())  # the abort is under way: do not start another
    assert hooks.count(("comm", "abort", 1)) == 1


def test_mpi_communicator_registers(hooks):
    from mpi4py import MPI

    from geocomm.comm.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF)  # one rank: nothing to abort
    assert abort.live_targets() == []
    world = MPICommunicator()
    assert (world in abort.live_targets()) == (world.size > 1)
    del comm


# ---------------------------------------------------------------------------
# NCCL: a timed-out transfer aborts the communicator (no CuPy needed: fakes)


class _Event:
    done = False  # the transfer never completes: a peer is missing


class _NcclHandle:
    def __init__(self, log):
        self.log = log

    def abort(self):
        self.log.append("ncclCommAbort")

    def destroy(self):
        self.log.append("ncclCommDestroy")


class _MpiComm:
    def __init__(self, log):
        self.log = log

    def Abort(self, code):
        self.log.append(("MPI_Abort", code))
        raise Aborted(code)

    def Iallgather(self, send, recv):
        return _PendingMpiRequest()

    def Ibarrier(self):
        return _PendingMpiRequest()


class _PendingMpiRequest:
    def Test(self):
        return False

    def Wait(self):
        raise AssertionError("would block forever")


def fake_nccl_comm(log: list, size: int = 2):
    """An NCCLCommunicator built around fakes (the constructor needs CuPy and a GPU)."""
    from geocomm.comm.mpi import MPICommunicator
    from geocomm.comm.nccl import NCCLCommunicator

    host = MPICommunicator.__new__(MPICommunicator)  # its MPI side: a fake MPI communicator
    host.comm, host.rank, host.size = _MpiComm(log), 0, size
    comm = NCCLCommunicator.__new__(NCCLCommunicator)
    comm.rank, comm.size = 0, size
    comm.device = contextlib.nullcontext()
    comm.nccl_comm, comm.host = _NcclHandle(log), host
    comm.aborted = comm.closed = False
    comm.queued = collections.deque()
    comm._graph_holders = weakref.WeakSet()
    return comm


@pytest.fixture(autouse=True)
def _fake_event_status(monkeypatch):
    """cudaEventQuery of the fake events: 0 (done) or 600 (cudaErrorNotReady)."""
    import geocomm.comm.nccl as nccl_mod

    monkeypatch.setattr(nccl_mod, "_event_status", lambda event: 0 if event.done else 600)


class _DoneEvent:
    done = True


def test_nccl_overdue_transfer_aborts_at_the_next_call(monkeypatch):
    """Collectives return with their transfers queued; the next call into the
    communicator looks (without blocking) at the oldest one still queued and, past
    GEOCOMM_TIMEOUT, aborts NCCL and raises instead of queueing behind it."""
    monkeypatch.setenv("GEOCOMM_TIMEOUT", "30")  # wide: the young one stays young on a stall
    log: list = []
    comm = fake_nccl_comm(log)
    now = time.monotonic()
    comm.queued.extend([(now - 90, _DoneEvent()), (now, _Event())])
    comm._check_overdue()  # the completed one is forgotten, the pending one is young
    assert len(comm.queued) == 1 and log == []
    comm.queued.appendleft((now - 60, _Event()))
    with pytest.raises(CollectiveTimeout, match=r"queued \d+\.\d s ago"):
        comm._check_overdue()
    assert log == ["ncclCommAbort"] and comm.aborted
    with pytest.raises(RuntimeError, match="aborted"):
        comm.synchronize()


def test_nccl_timeout_aborts_the_communicator(monkeypatch):
    from geocomm.comm.nccl import _NCCLRequest

    log: list = []
    comm = fake_nccl_comm(log)
    request = _NCCLRequest(_Event(), (), comm.abort_local)
    with pytest.raises(CollectiveTimeout, match="rank 0 waited"):
        wait(request, "the all-to-all of stage 0", comm.rank, timeout=0.01)
    assert log == ["ncclCommAbort"] and comm.aborted
    comm.abort_local()  # idempotent
    comm.close()  # nothing left to destroy
    assert log == ["ncclCommAbort"]
    with pytest.raises(RuntimeError, match="aborted"):
        comm.allreduce(None, None, "sum")
    with pytest.raises(RuntimeError, match="aborted"):
        comm._start()


def test_nccl_abort_releases_nccl_before_mpi():
    log: list = []
    comm = fake_nccl_comm(log)
    with pytest.raises(Aborted):
        comm.abort(3)
    assert log == ["ncclCommAbort", ("MPI_Abort", 3)]


def test_nccl_metadata_allgather_times_out(monkeypatch):
    """The MPI side of the NCCL communicator waits with GEOCOMM_TIMEOUT too
    (it used to block in MPI_Allgather forever)."""
    monkeypatch.setenv("GEOCOMM_TIMEOUT", "0.01")
    comm = fake_nccl_comm([])
    with pytest.raises(CollectiveTimeout, match="metadata all-gather"):
        comm.allgather_int64(np.arange(3))


def test_no_mpi_abort_once_mpi_is_finalized(monkeypatch):
    """A thread failing after MPI_Finalize must not call MPI (erroneous): the
    communicator's abort raises, and abort_job falls back to ending the process."""
    log: list = []
    monkeypatch.setattr(abort, "mpi_running", lambda: False)
    with pytest.raises(RuntimeError, match="MPI is not running"):
        abort.mpi_abort(_MpiComm(log), 1)
    assert abort.mpi_world_abort(1) is False
    assert log == []


def test_broken_previous_hook_still_prints_and_aborts(hooks, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("hook bug")

    monkeypatch.setattr(sys, "excepthook", broken)
    comm = FakeComm(2, hooks)
    abort.register(comm)
    with pytest.raises(Aborted):
        raise_in_main(ValueError("the real failure"))
    err = capsys.readouterr().err
    assert "ValueError: the real failure" in err and "aborting the job (2 ranks" in err
