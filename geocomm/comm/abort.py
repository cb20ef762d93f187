"""One failing rank ends the whole job, under any launcher.

Without help, a rank that dies of an uncaught exception leaves its peers
waiting in their next collective until ``GEOCOMM_TIMEOUT`` (300 s), and under
plain ``mpiexec`` the failing rank itself then waits in ``MPI_Finalize`` for
them. ``python -m mpi4py`` avoids that by calling ``MPI_Abort``; this module
does the same without it, for ``mpiexec``/``mpirun``, ``srun`` and ``torchrun``.

When geocomm builds a communicator of more than one rank (``geocomm.init``,
:class:`~geocomm.comm.mpi.MPICommunicator`,
:class:`~geocomm.comm.nccl.NCCLCommunicator`,
:class:`~geocomm.comm.torchdist.TorchDistCommunicator`), it calls
:func:`register`, which installs two hooks once per process:

* ``sys.excepthook`` (an uncaught exception in the main thread) and
* ``threading.excepthook`` (in any other thread; ``SystemExit`` excepted, as
  in Python's own hook).

Each first runs the hook that was installed before it (by default: print the
traceback), then calls :func:`abort_job`: every live registered communicator
releases what would block this process (``abort_local``: NCCL's
``ncclCommAbort`` cancels queued GPU work), then the newest one ends every
rank (``abort``: ``MPI_Abort``). ``GEOCOMM_ABORT_ON_ERROR=0`` turns this off
(checked when a communicator registers and again when an exception arrives).
``sys.exit(n)`` in the main thread reaches neither hook (Python exits without one):
``python -m mpi4py`` aborts on a non-zero ``n``; geocomm alone does not.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref
from typing import Any, Protocol

from geocomm._environ import switch

ENV_VAR = "GEOCOMM_ABORT_ON_ERROR"
#: exit status of a job aborted by an uncaught exception (KeyboardInterrupt: 128 + SIGINT)
EXIT_STATUS = 1
_INTERRUPT_STATUS = 130


class Abortable(Protocol):
    """What a communicator offers to :func:`abort_job`."""

    size: int

    def abort_local(self) -> None:
        """Release this rank's resources that could block the exit (no collective)."""

    def abort(self, code: int) -> None:
        """End every rank of the job with exit status ``code``; does not return."""


_targets: list[weakref.ReferenceType] = []
_lock = threading.Lock()
_aborting = False


def enabled() -> bool:
    """Whether uncaught exceptions abort the job (``GEOCOMM_ABORT_ON_ERROR``, on unless
    set off: :func:`geocomm._environ.switch`)."""
    return switch(ENV_VAR) is not False


def register(comm: Abortable) -> bool:
    """Make an uncaught exception in this process abort ``comm``'s job.

    Does nothing (returns False) for a single-rank communicator or when
    disabled. Keeps only a weak reference: a communicator that is gone is
    skipped. Installs the hooks (idempotent).
    """
    if comm.size <= 1 or not enabled():
        return False
    with _lock:
        _targets[:] = [r for r in _targets if r() is not None and r() is not comm]
        _targets.append(weakref.ref(comm))
    install()
    return True


def live_targets() -> list[Abortable]:
    """The registered communicators that still exist, oldest first."""
    with _lock:
        return [c for c in (r() for r in _targets) if c is not None]


def _mark(hook: Any) -> Any:
    hook._geocomm_abort = True
    return hook


def _ours(hook: Any) -> bool:
    return getattr(hook, "_geocomm_abort", False)


def install() -> None:
    """Wrap ``sys.excepthook`` and ``threading.excepthook`` (once; a no-op when
    geocomm's hook is already the current one). Each wrapper keeps the hook it
    replaced and calls it first."""
    with _lock:
        if not _ours(sys.excepthook):
            sys.excepthook = _wrap_sys(sys.excepthook)
        if not _ours(threading.excepthook):
            threading.excepthook = _wrap_threading(threading.excepthook)


def _wrap_sys(previous: Any) -> Any:
    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            previous(exc_type, exc, tb)
        except Exception:  # a broken previous hook must not hide the failure
            traceback.print_exception(exc_type, exc, tb)
        finally:
            status = _INTERRUPT_STATUS if issubclass(exc_type, KeyboardInterrupt) else EXIT_STATUS
            _abort_if_enabled(status, f"uncaught {exc_type.__name__} in the main thread")

    return _mark(excepthook)


def _wrap_threading(previous: Any) -> Any:
    def excepthook(args: Any) -> None:
        try:
            previous(args)
        except Exception:  # a broken previous hook must not hide the failure
            traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
        finally:
            # threading's own hook ignores SystemExit: a thread may end itself that way
            if not issubclass(args.exc_type, SystemExit):
                name = getattr(args.thread, "name", "?")
                _abort_if_enabled(
                    EXIT_STATUS, f"uncaught {args.exc_type.__name__} in thread {name!r}"
                )

    return _mark(excepthook)


def _abort_if_enabled(code: int, reason: str) -> None:
    try:
        on = enabled()
    except ValueError:  # set to nonsense since registration: abort, the default
        on = True
    if on:
        abort_job(code, reason)


def abort_job(code: int = EXIT_STATUS, reason: str = "a rank failed") -> None:
    """End the job through the registered communicators (see the module docstring).

    Flushes stdout and stderr first (an abort skips Python's own flushing).
    Only the first call acts: a second failing thread returns at once. With
    no live communicator, or when every ``abort`` raises, it falls back to
    ``MPI_Abort(MPI_COMM_WORLD)`` if MPI runs with several ranks, and last to
    ending this process with ``code`` (``os._exit``), which mpiexec, srun and
    torchrun also treat as the job failing.
    """
    global _aborting
    with _lock:
        if _aborting:
            return
        _aborting = True
    targets = live_targets()
    ranks = f"{max(c.size for c in targets)} ranks, " if targets else ""
    _write(
        f"geocomm: {reason}; aborting the job ({ranks}exit status {code}; "
        f"{ENV_VAR}=0 disables this)\n"
    )
    for comm in targets:
        try:
            comm.abort_local()
        except Exception as exc:  # keep going: ending the job matters more
            _write(f"geocomm: releasing {type(comm).__name__} failed: {exc!r}\n")
    for comm in reversed(targets):
        try:
            comm.abort(code)
        except Exception as exc:
            _write(f"geocomm: {type(comm).__name__}.abort failed: {exc!r}\n")
    try:
        mpi_world_abort(code)
    except Exception as exc:
        _write(f"geocomm: MPI_Abort failed: {exc!r}\n")
    _write("geocomm: no communicator could abort the job; exiting this rank\n")
    os._exit(code)


def _write(text: str) -> None:
    """Flush stdout, then write ``text`` to stderr and flush it (an abort skips
    Python's own flushing); a closed or broken stream must not stop the abort."""
    for step in (sys.stdout.flush, lambda: sys.stderr.write(text), sys.stderr.flush):
        try:
            step()
        except Exception:
            pass


def mpi_running() -> bool:
    """Whether mpi4py has initialised MPI and not yet finalised it (MPI calls
    outside that window, e.g. in a thread failing at exit, are erroneous)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def mpi_abort(comm: Any, code: int) -> None:
    """``comm.Abort(code)`` (does not return), or RuntimeError once MPI is finalised."""
    if not mpi_running():
        raise RuntimeError("MPI is not running (finalised or never initialised)")
    comm.Abort(code)


def mpi_world_abort(code: int) -> bool:
    """``MPI_Abort(MPI_COMM_WORLD)`` when MPI runs with more than one rank (it
    does not return then); False otherwise."""
    if not mpi_running():
        return False
    world = sys.modules["mpi4py.MPI"].COMM_WORLD
    if world.Get_size() <= 1:
        return False
    mpi_abort(world, code)
    return True


def _reset_for_tests() -> None:
    """Forget registered communicators and the abort-in-progress flag (tests only)."""
    global _aborting
    with _lock:
        _targets.clear()
        _aborting = False
