"""NCCL communicator over CuPy arrays (``cupy.cuda.nccl``); a host communicator
bootstraps it.

The host communicator (MPI, by default over ``MPI.COMM_WORLD``; or a
torch.distributed gloo group, for jobs that torchrun or a framework started)
carries what is not GPU data: rank 0's NCCL unique id to every rank, the
collectives' small metadata all-gathers, barriers, and ending the job on a
failure. Over MPI each process drives the GPU ``index % device count``, its
index among the ranks on its machine (``node_key()``); over
torch.distributed the device ``LOCAL_RANK`` names, else CuPy's current one.
Encoded bytes travel as ``ncclUint8`` with grouped ``ncclSend``/``ncclRecv``
per peer (the rank's own segment is a device-to-device copy); NCCL is never
asked to sum codes.

Streams: transfers run on the communicator's own non-blocking stream, which
first waits for the work already queued on the caller's current stream (the
encode that produced the send buffer). The returned request records an event
after the transfer: ``wait_stream()`` makes the caller's current stream wait
on it without blocking the host (what the collectives do: the batched
pipeline of :mod:`geocomm.engine.device` never waits on the host), ``test()``
polls it, ``wait()`` also blocks the host until it completed. A request keeps
its buffers alive until it is dropped; drop it only once the stream that
allocated them waits for it (CuPy's pool hands memory out again on that
stream only, so its later work runs after the transfer). ``allreduce`` (the
uncompressed baseline) runs on the current stream, ordered like any CuPy
operation.

Failures and timeouts: since a collective returns with its transfers queued,
``GEOCOMM_TIMEOUT`` bounds what the host waits for, not each transfer:

* every call into the communicator first checks, without blocking, the
  oldest transfer still queued: if it was queued more than the timeout ago,
  a peer failed or never called; the NCCL communicator is aborted (which
  cancels the transfers, so the streams waiting on them drain instead of
  keeping the GPU, and ``ncclCommDestroy`` at exit, waiting forever) and
  :class:`~geocomm.comm.base.CollectiveTimeout` is raised;
* ``synchronize()``, ``barrier()`` and ``close()`` block until the queued
  transfers complete, at most the timeout, then abort and raise likewise, as
  does a request's ``wait()``; first they run :attr:`NCCLCommunicator.settlers`
  (the collectives' cross-rank checks still in flight: a call found to differ
  across ranks raises there, instead of its transfers timing out or its result
  going unnoticed);
* the host side (the collectives' metadata all-gather, barrier) waits with the
  same timeout, so a rank whose peer died fails at its next call there.

A caller that synchronizes the device itself (``cupy.cuda.Device().
synchronize()``) behind a transfer whose peer is gone waits without bound:
call ``synchronize()`` first. The communicator refuses work once aborted.
With more than one rank an uncaught exception aborts NCCL, then the MPI job
(:mod:`geocomm.comm.abort`).

The module imports without CuPy; ``available`` (computed on first access) says
whether CuPy, NCCL and a CUDA device are usable, and constructing
:class:`NCCLCommunicator` without them raises an ImportError naming what is
missing.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import gc
import os
import pickle
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from geocomm.comm import abort, nodes
from geocomm.comm.base import CollectiveTimeout, Communicator, timeout_seconds, wait
from geocomm.comm.mpi import require_mpi
from geocomm.kernels import cuda_build

_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX"}
_DTYPES = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float64): "NCCL_FLOAT64"}


def nccl_wheel_library(paths: list[str] | None = None) -> Path | None:
    """``libnccl.so.2`` of an installed nvidia-nccl-cu12 or nvidia-nccl-cu13 wheel (both put
    it at ``nvidia/nccl/lib/`` of their site directory) on ``paths`` (default
    ``sys.path``), or None."""
    for entry in sys.path if paths is None else paths:
        candidate = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _probe() -> tuple[Any, Any, str]:
    """(cupy, cupy.cuda.nccl, "") when usable, else (None, None, why not). An NCCL wheel's
    library is loaded first, where one is installed, so CuPy's NCCL binding links to it
    whichever CUDA major it was built for (older CuPy releases look on the loader's
    path only)."""
    try:
        import cupy
    except ImportError as exc:
        return None, None, f"CuPy is not installed ({exc})"
    library = nccl_wheel_library()
    if library is not None:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return None, None, f"CuPy's NCCL module does not import ({exc})"
    if not getattr(nccl, "available", False):
        return None, None, f"CuPy finds no NCCL ({cuda_build.cuda_extra()} brings one)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return None, None, f"CuPy found no usable CUDA device ({exc})"
    if count < 1:
        return None, None, "CuPy found no CUDA device"
    return cupy, nccl, ""


def __getattr__(name: str) -> Any:
    if name == "available":
        return _probe()[0] is not None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def require_nccl() -> tuple[Any, Any]:
    """(cupy, cupy.cuda.nccl), or an ImportError naming what is missing."""
    cupy, nccl, why = _probe()
    if cupy is None:
        raise ImportError(
            "geocomm's NCCL backend needs CuPy with NCCL, mpi4py and a CUDA device: "
            f"{cuda_build.cuda_extra()} and 'geocomm[mpi]'. {why}."
        )
    return cupy, nccl


#: cudaErrorNotReady: what cudaEventQuery returns while the work before an event runs
_NOT_READY = 600


def _completed(event: Any) -> bool:
    """Whether the work before ``event`` completed. CuPy's ``Event.done`` is
    ``runtime.eventQuery(ptr) == 0`` and so reads False on any error status (a kernel
    fault, the sticky error of the context): every poll would take a failed device for
    a transfer still running until GEOCOMM_TIMEOUT, then report a lost peer. Any
    status but cudaSuccess and cudaErrorNotReady raises the device's error instead."""
    status = _event_status(event)
    if status == 0:
        return True
    if status == _NOT_READY:
        return False
    event.synchronize()  # returns the sticky error at once: raised with CUDA's message
    raise _runtime().CUDARuntimeError(status)


def _event_status(event: Any) -> int:
    """cudaEventQuery's status of a CuPy event (CuPy returns it; it raises nothing)."""
    return int(_runtime().eventQuery(event.ptr))


@functools.cache
def _runtime() -> Any:
    """``cupy.cuda.runtime``, imported on the first poll (the module imports without
    CuPy)."""
    from cupy.cuda import runtime

    return runtime


class _NCCLRequest:
    """Completion of work queued on the communicator stream.

    ``on_timeout`` is called by :func:`geocomm.comm.base.wait` before it
    raises: it aborts the communicator, which cancels the queued transfers.
    """

    __slots__ = ("_buffers", "_event", "on_timeout")

    def __init__(self, event: Any, buffers: tuple, on_timeout: Any = None):
        self._event = event
        self._buffers = buffers
        self.on_timeout = on_timeout

    def test(self) -> bool:
        done = _completed(self._event)
        if done:
            self._buffers = ()
        return done

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for the transfer; no host block."""
        if stream is None:
            import cupy

            stream = cupy.cuda.get_current_stream()
        stream.wait_event(self._event)

    def wait(self) -> None:
        self.wait_stream()
        self._event.synchronize()
        self._buffers = ()


#: The communicators alive, whose graphs go at exit before CuPy's NcclCommunicator
#: destroys its NCCL communicator in whatever order teardown frees objects.
_alive: weakref.WeakSet[NCCLCommunicator] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    for comm in list(_alive):
        comm._release_graphs(drained=False)


def _machine_index(comm: Any) -> int:
    """``comm.rank``'s index among the ranks on its machine, from every rank's
    ``node_key()`` (one all-gather that waits at most GEOCOMM_TIMEOUT, where an MPI
    ``Split_type`` blocked for good on a missing peer). The physical machine, never
    the emulated nodes of GEOCOMM_RANKS_PER_NODE: those would put two ranks of one
    machine on one GPU, which NCCL refuses."""
    keys = comm.allgather_int64(np.array([comm.node_key()], np.int64))[:, 0]
    return nodes.NodeLayout.from_keys(keys).local_index(comm.rank)


#: int64 words that carry a pickled NCCL unique id from rank 0 (its length first)
_ID_WORDS = 256


def _shared_from_rank_0(host: Communicator, value: Any) -> Any:
    """Rank 0's ``value`` on every rank of ``host``, through one int64 all-gather (the
    value pickled: an NCCL unique id of a few hundred bytes, or the twin's)."""
    words = np.zeros(_ID_WORDS, np.int64)
    if host.rank == 0:
        data = pickle.dumps(value)
        if len(data) > 8 * (_ID_WORDS - 1):
            raise ValueError(f"a unique id of {len(data)} bytes does not fit the broadcast")
        words[0] = len(data)
        words[1:].view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
    row = host.allgather_int64(words)[0]
    return pickle.loads(row[1:].view(np.uint8)[: int(row[0])].tobytes())


class NCCLCommunicator:
    """:class:`geocomm.comm.Communicator` over NCCL for CuPy arrays.

    Args:
        host: the communicator of host memory whose processes form the NCCL clique
            and that carries its bootstrap, metadata all-gathers, barriers and the
            job's end: an mpi4py communicator, a geocomm host communicator
            (:class:`~geocomm.comm.mpi.MPICommunicator`, or a
            :class:`~geocomm.comm.torchdist.TorchDistCommunicator` over a gloo group
            under torchrun), or None for ``MPI.COMM_WORLD``.
        device: the CUDA device index (default: see the module docstring).
    """

    backend = "nccl"
    device_arrays = True

    def __init__(self, host: Any = None, device: int | None = None):
        cupy, nccl = require_nccl()
        self._cupy, self._nccl = cupy, nccl
        from geocomm.comm.mpi import MPICommunicator

        if host is None or not isinstance(host, Communicator):
            host = MPICommunicator(require_mpi().COMM_WORLD if host is None else host)
        if isinstance(host, MPICommunicator):
            if device is None:
                device = _machine_index(host)
        elif device is None:
            local = os.environ.get("LOCAL_RANK", "")
            device = int(local) if local.isdigit() else cupy.cuda.Device().id
        if host.device_arrays:
            raise ValueError("an NCCL communicator's host side moves host memory")
        self.host: Communicator = host
        self.rank: int = host.rank
        self.size: int = host.size
        self.device = cupy.cuda.Device(device % cupy.cuda.runtime.getDeviceCount())
        self.device.use()
        uid = _shared_from_rank_0(host, nccl.get_unique_id() if self.rank == 0 else None)
        self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.aborted = self.closed = False
        self.queued: collections.deque = collections.deque()  # (monotonic time, event)
        #: what finishes host work deferred on this communicator (the collectives'
        #: cross-rank checks in flight): run, in order, by synchronize(), barrier() and
        #: close() before they wait for the transfers; each raises on what it finds
        self.settlers: list[Callable[[], None]] = []
        self._capturing = False
        #: what holds CUDA graphs of this communicator's transfers (engine.graphs.Graphs):
        #: NCCL's ncclCommDestroy and ncclCommAbort wait until every such graph is
        #: destroyed (commDestroySync polls comm->localPersistentRefs), so close() and
        #: abort_local() drop them first
        self._graph_holders: weakref.WeakSet = weakref.WeakSet()
        _alive.add(self)
        abort.register(self)

    def world_ranks(self) -> tuple[int, ...] | None:
        """The ranks of this communicator's processes in the job: its host's (None:
        unknown)."""
        ranks = getattr(self.host, "world_ranks", None)
        return None if ranks is None else ranks()

    # -- helpers ---------------------------------------------------------------

    def _check_bytes(self, a: Any, name: str) -> None:
        if not isinstance(a, self._cupy.ndarray) or a.dtype != np.uint8 or not a.flags.c_contiguous:
            got = f"{type(a).__name__} of dtype {getattr(a, 'dtype', None)}"
            raise TypeError(f"{name} must be a C-contiguous uint8 cupy array, got {got}")
        if a.device != self.device:
            raise ValueError(f"{name} is on {a.device}, the communicator on {self.device}")

    def _segments(self, buf: Any, counts: Any, displs: Any, name: str) -> list[tuple[int, int]]:
        """Per-rank (byte offset, byte count), checked against the buffer size."""
        counts = np.asarray(counts, np.int64).ravel()
        displs = np.asarray(displs, np.int64).ravel()
        if counts.size != self.size or displs.size != self.size:
            raise ValueError(f"{name}: counts and displacements need {self.size} entries")
        if (counts < 0).any() or (displs < 0).any() or (counts + displs > buf.nbytes).any():
            raise ValueError(f"{name}: a segment lies outside the {buf.nbytes}-byte buffer")
        return [(int(d), int(c)) for d, c in zip(displs, counts, strict=True)]

    def check_usable(self) -> None:
        """RuntimeError unless the communicator can take work (not closed or aborted)."""
        if self.aborted or self.closed:
            why = "aborted (after a timeout or failure)" if self.aborted else "closed"
            raise RuntimeError(
                f"rank {self.rank}: this NCCL communicator was {why}; create a new one"
            )

    def _check_overdue(self) -> None:
        """Abort and raise CollectiveTimeout when the oldest transfer still queued was
        queued more than GEOCOMM_TIMEOUT ago (a non-blocking look at its event)."""
        while self.queued and _completed(self.queued[0][1]):
            self.queued.popleft()
        if not self.queued:
            return
        waited = time.monotonic() - self.queued[0][0]
        if waited > timeout_seconds():
            self.abort_local()
            raise CollectiveTimeout(
                f"geocomm: rank {self.rank}: an NCCL transfer queued {waited:.1f} s ago has "
                "not completed; a peer rank failed, exited or never called it "
                "(GEOCOMM_TIMEOUT sets the limit)"
            )

    def _start(self) -> None:
        """Order the communicator stream after the work queued so far on the current stream."""
        self.check_usable()
        if not self._capturing:
            self._check_overdue()
        self.stream.wait_event(self._cupy.cuda.get_current_stream().record())

    def _copy(self, dst: Any, dst_off: int, src: Any, src_off: int, nbytes: int) -> None:
        if nbytes:
            self._cupy.cuda.runtime.memcpyAsync(
                dst.data.ptr + dst_off,
                src.data.ptr + src_off,
                nbytes,
                self._cupy.cuda.runtime.memcpyDeviceToDevice,
                self.stream.ptr,
            )

    def _exchange(
        self, sends: list[tuple[int, int]], send: Any, recvs: list[tuple[int, int]], recv: Any
    ) -> _NCCLRequest:
        """Send segment sends[p] of ``send`` to each peer p and receive recvs[p] from it."""
        (s_off, s_cnt), (r_off, r_cnt) = sends[self.rank], recvs[self.rank]
        if s_cnt != r_cnt:
            raise ValueError(f"rank {self.rank} sends {s_cnt} bytes to itself but expects {r_cnt}")
        with self.device:
            self._start()
            self._copy(recv, r_off, send, s_off, s_cnt)
            nccl, uint8, stream = self._nccl, self._nccl.NCCL_UINT8, self.stream.ptr
            nccl.groupStart()
            try:
                for peer in range(self.size):
                    if peer == self.rank:
                        continue
                    off, cnt = sends[peer]
                    if cnt:
                        self.nccl_comm.send(send.data.ptr + off, cnt, uint8, peer, stream)
                    off, cnt = recvs[peer]
                    if cnt:
                        self.nccl_comm.recv(recv.data.ptr + off, cnt, uint8, peer, stream)
            finally:
                nccl.groupEnd()
            done = self.stream.record()
            if not self._capturing:  # an event of a graph under capture is no real event
                self.queued.append((time.monotonic(), done))
            return _NCCLRequest(done, (send, recv), self.abort_local)

    # -- CUDA graphs --------------------------------------------------------------

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:  # yields no record: nothing to count again
        """The transfers started inside are being captured into a CUDA graph (the caller
        captures the current stream): they are not queued work to watch, and nothing is
        queried meanwhile. A graph launch is watched through :meth:`track`."""
        self.check_usable()
        self._check_overdue()
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def captured_everywhere(self, ok: bool) -> bool:
        """Whether every rank's capture of the same call succeeded (``ok``: this rank's):
        one all-gather of a flag over the host (:meth:`allgather_int64`: at most
        GEOCOMM_TIMEOUT, then this communicator is aborted), after the cross-rank checks
        still in flight are settled (a call that differs across ranks raises
        CollectiveMismatchError here, as it would later, rather than leaving a peer to
        pair its next call's check with this flag). NCCL requires a transfer to be
        captured on every rank or on none, so a capture that failed on one rank (an
        operation CUDA refused under capture) is given up on all."""
        if self.size == 1:
            return ok
        self._settle()
        return bool(self.allgather_int64(np.array([int(ok)], np.int64)).all())

    def hold_graphs(self, holder: Any) -> None:
        """``holder`` (with ``release()``) keeps CUDA graphs of this communicator's
        transfers: released before the NCCL communicator is destroyed or aborted."""
        self._graph_holders.add(holder)

    def _release_graphs(self, drained: bool) -> None:
        holders = list(self._graph_holders)
        self._graph_holders.clear()
        for holder in holders:
            holder.release(drained)
        if holders:  # a graph in a reference cycle must be gone before NCCL waits for it
            gc.collect()

    def track(self, stream: Any, captured: Any = None) -> None:
        """Watch the work queued on ``stream`` so far (a launched graph's transfers) like
        this communicator's own: overdue after ``GEOCOMM_TIMEOUT``, waited for by
        :meth:`synchronize`. Replays start no transfer of their own, so the finished
        ones are let go (and the oldest checked for its timeout) here."""
        self._check_overdue()
        self.queued.append((time.monotonic(), stream.record()))

    # -- Communicator protocol -------------------------------------------------

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        """Start an all-to-all of uint8 segments (counts/displacements in bytes)."""
        self._check_bytes(send, "send")
        self._check_bytes(recv, "recv")
        sends = self._segments(send, send_counts, send_displs, "send")
        recvs = self._segments(recv, recv_counts, recv_displs, "recv")
        return self._exchange(sends, send, recvs, recv)

    def allgatherv(self, send, recv, counts, displs):
        """Start an all-gather: ``counts[rank]`` bytes of ``send`` land at ``displs[rank]``."""
        self._check_bytes(send, "send")
        self._check_bytes(recv, "recv")
        recvs = self._segments(recv, counts, displs, "recv")
        mine = recvs[self.rank][1]
        if mine > send.nbytes:
            raise ValueError(f"send holds {send.nbytes} bytes, counts[{self.rank}] is {mine}")
        return self._exchange([(0, mine)] * self.size, send, recvs, recv)

    def allreduce(self, send: Any, recv: Any, op: str) -> None:
        """All-reduce (``op`` "sum" or "max") of float32/float64 cupy arrays (current stream)."""
        self.check_usable()
        self._check_overdue()
        cupy = self._cupy
        for name, a in (("send", send), ("recv", recv)):
            if (
                not isinstance(a, cupy.ndarray)
                or a.dtype not in _DTYPES
                or not a.flags.c_contiguous
            ):
                got = f"{type(a).__name__} of dtype {getattr(a, 'dtype', None)}"
                raise TypeError(
                    f"{name} must be a C-contiguous float32/float64 cupy array, got {got}"
                )
        if send.dtype != recv.dtype or send.size != recv.size:
            raise ValueError(
                f"send ({send.dtype}, {send.size}) and recv ({recv.dtype}, {recv.size}) differ"
            )
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        with self.device:
            stream = cupy.cuda.get_current_stream()
            self.nccl_comm.allReduce(
                send.data.ptr,
                recv.data.ptr,
                send.size,
                getattr(self._nccl, _DTYPES[send.dtype]),
                getattr(self._nccl, _OPS[op]),
                stream.ptr,
            )
            if not self._capturing:  # watched like the grouped transfers
                self.queued.append((time.monotonic(), stream.record()))

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        """All-gather of a small host int64 vector over the host communicator (waits at
        most GEOCOMM_TIMEOUT, then aborts this communicator: a peer is gone); returns
        (size, len) rows."""
        try:
            return self.host.allgather_int64(values)
        except CollectiveTimeout:
            self.abort_local()
            raise

    def start_allgather_int64(self, values: np.ndarray) -> tuple[Any, np.ndarray]:
        """Start the all-gather of a small host int64 vector over the host communicator:
        (its request, the (size, len) rows it fills); the caller tests or waits for it
        (and aborts this communicator when that times out)."""
        return self.host.start_allgather_int64(values)  # type: ignore[attr-defined]

    def barrier(self) -> None:
        """Wait for this rank's queued transfers, then for every rank (the host's
        barrier); each wait is bounded by GEOCOMM_TIMEOUT."""
        self.synchronize()
        self.host.barrier()

    def synchronize(self) -> None:
        """Block until this rank's queued transfers completed: at most GEOCOMM_TIMEOUT,
        then abort the communicator and raise CollectiveTimeout (unlike a device
        synchronization, never forever)."""
        self.check_usable()
        self._settle()
        self._drain()

    def _settle(self) -> None:
        for settle in self.settlers:
            settle()

    def _drain(self) -> None:
        """Wait (at most GEOCOMM_TIMEOUT, then abort) for the work queued on the
        communicator stream and the graph launches it tracks; unlike
        stream.synchronize(), never forever."""
        with self.device:
            events = [self.stream.record(), *(event for _, event in self.queued)]
        for event in events:
            wait(_NCCLRequest(event, (), self.abort_local), "the queued NCCL transfers", self.rank)
        self.queued.clear()

    def abort_local(self) -> None:
        """ncclCommAbort: cancel this rank's queued NCCL work and free the
        communicator, without ending the job (idempotent)."""
        if not (self.aborted or self.closed):
            self.aborted = True
            self._release_graphs(drained=False)  # a launch still running ends once NCCL aborts
            with self.device:
                self.nccl_comm.abort()

    def abort(self, code: int = 1) -> None:
        """Abort NCCL, then end the job through the host communicator (does not return)."""
        try:
            self.abort_local()
        finally:
            self.host.abort(code)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Finish queued transfers and free the NCCL communicator (no-op once
        aborted or closed); a transfer stuck on a missing peer aborts the
        communicator and raises CollectiveTimeout instead of hanging."""
        if self.aborted or self.closed:
            return
        self._settle()
        self._drain()
        self.closed = True
        self._release_graphs(drained=True)
        self.nccl_comm.destroy()
