"""``cupy.cuda.nccl`` of the twin: NCCL's communicator over MPI, ordered on streams.

``get_unique_id`` names the root's world rank and a counter; the ranks of
``NcclCommunicator(nranks, uid, rank)`` find each other through the root
(point-to-point on ``MPI.COMM_WORLD``) and make an MPI communicator of their
own (``Create_group``: only the clique takes part). ``send``/``recv`` inside
``groupStart``/``groupEnd`` (or alone) and ``allReduce`` queue one operation
on the given stream: when the stream reaches it, it posts the MPI transfers
and completes them, so a transfer runs after the work queued before it and
the work queued after it waits, exactly as NCCL orders them. The k-th send
from A to B matches B's k-th receive from A (MPI's order per pair, as
NCCL's). Calls that do not match fail clearly instead of hanging: a size
mismatch is an error at once, a missing peer call an error after
``GEOCOMM_TWIN_NCCL_TIMEOUT`` seconds (default: ``GEOCOMM_TIMEOUT``'s, else 300;
a real GPU's NCCL waits for good, so tests of geocomm's own timeouts set it
longer) or when the communicator is aborted; either becomes the device's sticky
error. Needs MPI_THREAD_MULTIPLE
(mpi4py's default), since streams transfer on their own threads.

NCCL's rule for CUDA graphs is checked too: whether a call is captured is a
collective property, so a call queued eagerly must meet eager calls on its
peers, and a replayed one calls that the peers captured in the same capture
(the k-th capture of this communicator whose graph was launched, on each rank:
a capture numbered when its graph is first launched, so that one whose graph
is dropped unlaunched, as geocomm drops a capture that failed on another rank,
takes no number). Every transfer carries how it was queued (an eager call, or
capture k), and one received from a call queued otherwise fails, naming both.
So that launch order stands for capture order, a graph's first launch while a
graph of an earlier capture of the communicator lives unlaunched is refused:
the twin could not tell two such graphs apart across ranks (NCCL itself allows
it where every rank launches alike; geocomm launches a graph as soon as it is
captured).
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from cupy import _device, _memory

__all__ = [
    "NCCL_FLOAT32",
    "NCCL_FLOAT64",
    "NCCL_MAX",
    "NCCL_SUM",
    "NCCL_UINT8",
    "NcclCommunicator",
    "NcclError",
    "available",
    "get_unique_id",
    "groupEnd",
    "groupStart",
]

available = True
(
    NCCL_INT8,
    NCCL_UINT8,
    NCCL_INT32,
    NCCL_UINT32,
    NCCL_INT64,
    NCCL_UINT64,
    NCCL_FLOAT16,
    NCCL_FLOAT32,
    NCCL_FLOAT64,
) = 0, 1, 2, 3, 4, 5, 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = range(4)
_DTYPES = {
    NCCL_UINT8: np.uint8,
    NCCL_FLOAT32: np.float32,
    NCCL_FLOAT64: np.float64,
    NCCL_INT32: np.int32,
    NCCL_INT64: np.int64,
}
_BOOT_TAG = 0x6E63
#: the MPI tag of an eager call's transfers; capture k's are _EAGER_TAG + 1 + k % _CAPTURES
_EAGER_TAG = 1
_CAPTURES = 30000


class NcclError(RuntimeError):
    """A twin NCCL call failed (mismatch, timeout, abort, bad argument)."""


def _mpi() -> Any:
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise NcclError(
            "the NCCL twin moves bytes on stream threads and needs "
            "MPI_THREAD_MULTIPLE (mpi4py's default request)"
        )
    return MPI


_uid_counter = itertools.count()


def get_unique_id() -> tuple:
    mpi = _mpi()
    return ("geocomm-twin-nccl", mpi.COMM_WORLD.Get_rank(), next(_uid_counter))


def _timeout() -> float:
    text = os.environ.get("GEOCOMM_TWIN_NCCL_TIMEOUT") or os.environ.get("GEOCOMM_TIMEOUT", "")
    value = float(text) if text else 300.0
    return value if value > 0 else float("inf")


class _Group(threading.local):
    depth = 0
    ops: list


_group = _Group()


def groupStart() -> None:
    if _group.depth == 0:
        _group.ops = []
    _group.depth += 1


def groupEnd() -> None:
    if _group.depth == 0:
        raise NcclError("ncclGroupEnd without ncclGroupStart")
    _group.depth -= 1
    if _group.depth == 0:
        ops, _group.ops = _group.ops, []
        _launch(ops)


def _submit(op: tuple) -> None:
    if _group.depth:
        _group.ops.append(op)
    else:
        _launch([op])


def _launch(ops: list) -> None:
    """Queue the group's operations, one stream operation per (communicator, stream)."""
    by_target: dict[tuple[int, int], list] = {}
    for op in ops:
        by_target.setdefault((id(op[1]), op[2]), []).append(op)
    for (_, stream_ptr), group in by_target.items():
        comm = group[0][1]
        stream = _device.stream_of(stream_ptr)
        reads = [acc for op in group for acc in op[4] if op[0] != "recv"]
        writes = [acc for op in group for acc in op[4] if op[0] == "recv"] + [
            acc for op in group if op[0] == "allreduce" for acc in op[5]
        ]
        stream.enqueue(
            lambda g=group, c=comm: c._run(g), f"NCCL group on rank {comm.rank}", reads, writes
        )


def _span(ptr: int, count: int, dtype: int) -> tuple[np.ndarray, _device.Access]:
    if dtype not in _DTYPES:
        raise NcclError(f"the NCCL twin has no datatype {dtype}")
    item = np.dtype(_DTYPES[dtype])
    nbytes = int(count) * item.itemsize
    alloc, off = _memory.find(ptr, nbytes)
    view = alloc.payload[off : off + nbytes].view(item)
    return view, _device.Access(alloc, off, off + nbytes)


def _tag(mode: int) -> int:
    return _EAGER_TAG if mode == 0 else _EAGER_TAG + 1 + mode % _CAPTURES


def _queued(mode: int) -> str:
    return "queued eagerly" if mode == 0 else f"captured in capture {mode}"


def _queued_tag(tag: int) -> str:
    return "eager transfer" if tag == _EAGER_TAG else f"transfer of capture {tag - _EAGER_TAG - 1}"


class _CaptureNumber:
    """The numbers of one capture of communicator ``comm``: ``order``, its place among
    the communicator's captures, and the next of its launch counter when its graph is
    first launched (``take``, on the host), read as an int when the launch's transfers
    run. Alive while its graph is (the graph's transfers hold it)."""

    def __init__(self, comm: NcclCommunicator):
        self._comm, self._number = comm, 0
        self.order = next(comm._captured)
        comm._numbers.add(self)

    def _earlier_unlaunched(self) -> list[int]:
        numbers = self._comm._numbers
        return sorted(n.order for n in numbers if n.order < self.order and not n._number)

    def take(self) -> None:
        if self._number:
            return
        if self._earlier_unlaunched():
            gc.collect()  # a dropped graph in a reference cycle is no longer alive
        earlier = self._earlier_unlaunched()
        if earlier:
            raise NcclError(
                f"twin: the graph of capture {self.order} of this communicator is launched "
                f"before the graph of capture {earlier[0]}, which lives and was never "
                "launched: the twin numbers captures by their first launch, so it refuses "
                "launches out of capture order"
            )
        self._number = next(self._comm._captures)

    def __int__(self) -> int:
        assert self._number, "twin: a captured transfer ran before its graph was launched"
        return self._number


class NcclCommunicator:
    """``NcclCommunicator(nranks, uid, rank)`` over an MPI communicator of the clique."""

    def __init__(self, nranks: int, uid: tuple, rank: int):
        mpi = _mpi()
        if not (isinstance(uid, tuple) and len(uid) == 3 and uid[0] == "geocomm-twin-nccl"):
            raise NcclError(f"not a twin NCCL unique id: {uid!r}")
        self.nranks, self.rank = int(nranks), int(rank)
        world = mpi.COMM_WORLD
        root, counter = int(uid[1]), int(uid[2])
        tag = _BOOT_TAG + counter % 4096
        me = world.Get_rank()
        if self.rank == 0:
            if me != root:
                raise NcclError(f"rank 0 of the clique is world rank {me}, the id's root {root}")
            members = [me] + [None] * (self.nranks - 1)
            for _ in range(self.nranks - 1):
                r, w = world.recv(source=mpi.ANY_SOURCE, tag=tag)
                members[r] = w
            for w in members[1:]:
                world.send(members, dest=w, tag=tag)
        else:
            world.send((self.rank, me), dest=root, tag=tag)
            members = world.recv(source=root, tag=tag)
        self._comm = world.Create_group(world.Get_group().Incl(members), tag)
        self._mpi = mpi
        # NCCL's init refuses two ranks of one clique on one GPU (the twin's ranks share
        # this host; devices as cupy.cuda.Device() names them now). A twin of one device
        # (the default) stands for a GPU per rank: the suite's ranks all use device 0
        from cupy._core import _current_device, device_count

        devices = self._comm.allgather(_current_device())
        for r, d in enumerate(devices):
            if device_count() > 1 and devices.index(d) != r:
                raise NcclError(
                    f"ncclInvalidUsage: Duplicate GPU detected : rank {devices.index(d)} "
                    f"and rank {r} both on CUDA device {d}"
                )
        self._aborted = threading.Event()
        self._destroyed = False
        self._captures = itertools.count(1)  # its launched captures, in first-launch order
        self._captured = itertools.count(1)  # its captures, in capture order
        self._numbers: weakref.WeakSet[_CaptureNumber] = weakref.WeakSet()  # of live graphs
        #: the graphs that captured a call of this communicator (NCCL's persistent plans:
        #: comm->localPersistentRefs, dropped only when such a graph is destroyed)
        self._graphs: weakref.WeakSet = weakref.WeakSet()

    def _check(self) -> None:
        _device.check_failure()
        if self._destroyed:
            raise NcclError("ncclInvalidUsage: the communicator was destroyed or aborted")

    def _peer(self, peer: int) -> int:
        if not 0 <= int(peer) < self.nranks:
            raise NcclError(f"ncclInvalidArgument: peer {peer} of {self.nranks} ranks")
        return int(peer)

    def _mode(self, stream: int) -> int | _CaptureNumber:
        """How a call on ``stream`` is queued: 0 eagerly, else the number of its capture
        (k > 0: this communicator's k-th capture whose graph was launched; a replay of
        the graph runs the call as captured), given at the graph's first launch."""
        capture = _device.stream_of(int(stream)).capture
        if capture is None:
            return 0
        numbers = capture.__dict__.setdefault("nccl_numbers", {})
        if id(self) not in numbers:
            number = numbers[id(self)] = _CaptureNumber(self)
            capture.__dict__.setdefault("on_graph", []).append(self._graphs.add)
            capture.__dict__.setdefault("on_launch", []).append(number.take)
        return numbers[id(self)]

    # -- calls ------------------------------------------------------------------
    def send(self, ptr: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._check()
        view, acc = _span(ptr, count, datatype)
        _submit(("send", self, int(stream), self._peer(peer), [acc], view, self._mode(stream)))

    def recv(self, ptr: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._check()
        view, acc = _span(ptr, count, datatype)
        _submit(("recv", self, int(stream), self._peer(peer), [acc], view, self._mode(stream)))

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        self._check()
        if op not in (NCCL_SUM, NCCL_MAX):
            raise NcclError(f"the NCCL twin reduces with sum or max, got op {op}")
        send, s_acc = _span(sendbuf, count, datatype)
        recv, r_acc = _span(recvbuf, count, datatype)
        _submit(
            (
                "allreduce",
                self,
                int(stream),
                (int(count), datatype, op, self._mode(stream)),
                [s_acc],
                [r_acc],
                send,
                recv,
            )
        )

    def _check_no_graphs(self, what: str) -> None:
        """NCCL's ncclCommDestroy and ncclCommAbort (commReclaim -> commDestroySync) poll
        ``while (comm->localPersistentRefs != 0)``: they return only once every CUDA graph
        that captured a call of the communicator was destroyed. A GPU would wait for good
        here; the twin says so."""
        if len(self._graphs):
            gc.collect()
        alive = len(self._graphs)
        if alive:
            raise NcclError(
                f"twin: {what} with {alive} CUDA graph(s) alive that captured calls of this "
                "communicator: NCCL's commDestroySync waits until every such graph is "
                "destroyed (localPersistentRefs), so on a GPU this call never returns"
            )

    def abort(self) -> None:
        """Cancel what is queued: transfers still waiting fail at once."""
        self._aborted.set()
        if not self._destroyed:  # CuPy's abort() and destroy() do nothing the second time
            self._destroyed = True
            self._check_no_graphs("ncclCommAbort")

    def destroy(self) -> None:
        if not self._destroyed:
            self._destroyed = True
            self._check_no_graphs("ncclCommDestroy")

    # -- on the stream ------------------------------------------------------------
    def _run(self, ops: list) -> None:
        comm = self._comm
        requests, expected = [], []
        for op in ops:
            if op[0] == "send":
                requests.append(comm.Isend(op[5], dest=op[3], tag=_tag(int(op[6]))))
                expected.append(None)
            elif op[0] == "recv":
                requests.append(comm.Irecv(op[5], source=op[3], tag=self._mpi.ANY_TAG))
                expected.append((op[3], op[5].nbytes, int(op[6])))
        self._complete(requests, expected, "send/recv group")
        for op in ops:
            if op[0] == "allreduce":
                count, datatype, reduce_op, mode = op[3]
                self._allreduce(count, datatype, reduce_op, int(mode), op[6], op[7])

    def _complete(self, requests: list, expected: list, what: str) -> None:
        if not requests:
            return
        deadline = time.monotonic() + _timeout()
        statuses = [self._mpi.Status() for _ in requests]
        while True:
            try:
                done = self._mpi.Request.Testall(requests, statuses)
            except self._mpi.Exception as exc:
                raise NcclError(
                    f"rank {self.rank}: {what}: a transfer does not match its peer's "
                    f"({exc.Get_error_string()})"
                ) from None
            if done:
                break
            if self._aborted.is_set() or time.monotonic() > deadline:
                for request in requests:
                    if request != self._mpi.REQUEST_NULL:
                        try:
                            request.Cancel()
                        except self._mpi.Exception:  # a collective's: MPI cannot cancel it
                            pass
                why = (
                    "the communicator was aborted"
                    if self._aborted.is_set()
                    else f"no matching call from a peer within {_timeout():.0f} s"
                )
                raise NcclError(f"rank {self.rank}: {what} did not complete: {why}")
            time.sleep(2e-4)
        for status, want in zip(statuses, expected, strict=True):
            if want is None:
                continue
            if status.Get_tag() != _tag(want[2]):
                raise NcclError(
                    f"rank {self.rank}: {what}: a transfer {_queued(want[2])} met rank "
                    f"{want[0]}'s {_queued_tag(status.Get_tag())}: NCCL needs a call captured "
                    "alike on every rank (and the graphs of one capture replayed together)"
                )
            if status.Get_count(self._mpi.BYTE) != want[1]:
                raise NcclError(
                    f"rank {self.rank}: {what}: expected {want[1]} bytes from rank {want[0]}, "
                    f"it sent {status.Get_count(self._mpi.BYTE)} (the calls do not match)"
                )

    def _allreduce(
        self, count: int, datatype: int, op: int, mode: int, send: np.ndarray, recv: np.ndarray
    ) -> None:
        mpi, comm = self._mpi, self._comm
        mine = np.array([count, datatype, op, mode], np.int64)
        rows = np.empty((self.nranks, 4), np.int64)
        self._complete([comm.Iallgather(mine, rows)], [None], "allReduce descriptor")
        if (rows != mine).any():
            raise NcclError(
                f"rank {self.rank}: allReduce calls differ across ranks (count, datatype, "
                f"op and capture (0: eager) per rank: {rows.tolist()}); NCCL needs a call "
                "captured alike on every rank"
            )
        reduce_op = mpi.SUM if op == NCCL_SUM else mpi.MAX
        staged = np.array(send)  # a copy (send may be recv); alive until the transfer ends
        self._complete([comm.Iallreduce(staged, recv, op=reduce_op)], [None], "allReduce")
