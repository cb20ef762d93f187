"""Communicator over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs).

It lets the DDP and FSDP2 integrations (:mod:`geocomm.adapters.torch`) send
geocomm's encoded bytes through a torch process group, whether the job came
from ``torchrun`` or ``mpirun``. Gloo moves data on its own threads, so
nonblocking calls overlap with the codec without help. Every transfer is one
torch collective on every rank (``all_to_all_single``, an all-gather), so the
ranks always post matching calls: segments packed in rank order travel in
place; any other layout (displacements in any order, holes, send and receive
in one buffer) goes through packed scratch, unpacked once it has arrived.
Uneven all-gathers are padded to the largest segment (gloo has no
all-gather-v).

Device mode (``backend == "nccl"``, so the collectives keep CuPy arrays on the
device and run the batched pipeline of :mod:`geocomm.engine.device`): the
default over a NCCL group, or ``device_arrays=True`` for any group that can
move the device arrays' memory. The arrays reach torch through DLPack, and
what orders a transfer depends on the tensor torch makes of them:

* CUDA tensors: each collective runs with torch's current stream set to
  CuPy's current stream (``torch.cuda.ExternalStream``), so ProcessGroupNCCL
  orders the transfer after the work queued there (the encode that filled
  the send buffer); a request's ``wait_stream()`` makes CuPy's current stream
  wait for it the same way (torch's ``Work.wait()`` on a NCCL work only makes
  torch's current stream wait), without blocking the host, like
  :class:`geocomm.comm.nccl.NCCLCommunicator`'s requests;
* host (CPU) tensors, device arrays whose memory torch reads as host memory:
  the host first waits for CuPy's current stream, since gloo reads the memory
  at once, and ``wait_stream()`` waits on the host (at most
  ``GEOCOMM_TIMEOUT``) for the transfer, as there is no stream to order on.

NumPy arrays work in either mode (device mode then waits on the host). A
request keeps its buffers and scratch alive until it completed (``test()``,
``wait()``, ``wait_stream()``); on a GPU drop it only once the stream that
allocated them waits for it (CuPy's pool hands memory out again on that
stream only). The metadata all-gather goes through the group's device and
back (NCCL has no host tensors). With more than one rank, an uncaught
exception ends the job (:mod:`geocomm.comm.abort`): ``MPI_Abort`` when MPI
runs the ranks (mpirun), else this process exits at once with status 1, which
torchrun answers by stopping the other ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from geocomm.comm import abort
from geocomm.comm.base import wait

#: how long a completed transfer waits, at most, for torch to release its tensors
#: (gloo's thread does it within microseconds, unless the scheduler holds it back)
RELEASE_WAIT_S = 0.1
#: how many completed transfers found their tensors still held after RELEASE_WAIT_S
late_releases = 0
#: how long the exit waits, at most, for torch to release the tensors of late ones
EXIT_RELEASE_WAIT_S = 10.0
#: the host tensors of late releases, kept alive until torch released them
_unreleased: list = []

#: DLPack device types of CUDA memory (``DLDeviceType``: kDLCUDA, kDLCUDAManaged)
DLPACK_CUDA = (2, 13)


def _array_module(array: Any) -> Any:
    """numpy for NumPy arrays, else cupy (the only device arrays the collectives pass)."""
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy


def _on_cupy_stream(torch: Any, device: Any, stream: Any = None) -> contextlib.ExitStack:
    """CuPy's ``stream`` (default: its current one) current, and torch's current stream
    of ``device`` set to it: torch work queued inside is ordered with CuPy's."""
    import cupy

    stack = contextlib.ExitStack()
    if stream is not None:
        stack.enter_context(stream)
    ptr = cupy.cuda.get_current_stream().ptr
    stack.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(ptr, device=device)))
    return stack


def _held_by_torch(tensor: Any) -> bool:
    return bool(tensor._use_count() > 1)  # ours (the Python object's) and torch's


def _await_release(held: tuple) -> bool:
    """Wait (GIL released, at most RELEASE_WAIT_S) until torch holds none of the host
    tensors in ``held`` any more, once their work completed and the caller dropped
    it; whether it did. A late one is counted in ``late_releases``, and its tensors
    are kept until torch released them, which the exit waits for.

    gloo's worker thread keeps a completed work, and with it the work's tensors,
    for a moment longer. Whoever drops a tensor's last C++ reference releases its
    Python object, so gloo's thread would take the GIL for that; if this process
    is finalizing by then (a transfer waited for just before exit), it aborts
    ("terminate called without an active exception"). Waiting here, while Python
    is alive, makes that release happen now; a loaded machine may hold gloo's
    thread back longer, and then the last reference stays ours until
    :func:`_release_at_exit`. CUDA tensors are left alone: their work completes on
    the stream, later than the host may wait for.
    """
    global late_releases
    host = [t for t in held if isinstance(t, _torch().Tensor) and t.device.type == "cpu"]
    deadline = None
    for tensor in host:
        while _held_by_torch(tensor):
            now = time.monotonic()
            deadline = deadline if deadline is not None else now + RELEASE_WAIT_S
            if now > deadline:
                late_releases += 1
                if late_releases == 1:  # torch's exit handlers exist by now, and
                    atexit.register(_release_at_exit)  # this one runs before them
                _unreleased[:] = [t for t in _unreleased if _held_by_torch(t)]
                _unreleased.extend(host)
                return False
            time.sleep(0)
    return True


def _release_at_exit() -> None:
    """Wait (at most EXIT_RELEASE_WAIT_S) until torch released the tensors of late
    releases, then drop them, while Python is still alive."""
    deadline = time.monotonic() + EXIT_RELEASE_WAIT_S
    while any(_held_by_torch(t) for t in _unreleased) and time.monotonic() < deadline:
        time.sleep(1e-3)
    _unreleased.clear()


class TorchWork:
    """A torch ``Work`` (None: nothing to move) plus a step to run once it completed.

    ``keep``: the arrays and the tensors the transfer reads or writes, held until
    it completed and torch released them (:func:`_await_release`). A work of CUDA
    tensors (NCCL) is ordered on the stream: ``test()`` completes it at once
    (``Work.wait()`` makes the current stream wait; a finish step that reads on the
    host synchronizes). A work of host tensors (gloo) completes on gloo's thread:
    ``wait_for`` sleeps in torch's ``Work.wait`` (GIL released), so
    :func:`geocomm.comm.base.wait` does not poll, and no Python runs on torch's
    threads (a future's callback would: its wrapper takes the GIL again after the
    callback ran, which aborts a process that is finalizing by then).
    """

    __slots__ = ("_finish", "_keep", "_on_stream", "_poll", "_work")

    def __init__(self, work: Any, finish: Any = None, keep: tuple = (), poll: bool = False):
        self._work, self._finish, self._keep = work, finish, keep
        tensor = _torch().Tensor
        cuda = any(isinstance(t, tensor) and t.device.type == "cuda" for t in keep)
        #: ``poll``: the host waits for a work of CUDA tensors too, polling torch's
        #: ``is_completed`` (a query of its event), as for what the host reads
        self._poll = poll and cuda
        self._on_stream = cuda and not poll

    def wait_for(self, seconds: float) -> bool:
        """Block at most ``seconds`` for completion; True when done (failed included)."""
        if self._work is None or self._on_stream:
            return True
        if self._poll:
            time.sleep(min(seconds, 1e-3))
            return bool(self._work.is_completed())
        with contextlib.suppress(RuntimeError):  # timed out, or failed: is_completed says
            self._work.wait(datetime.timedelta(seconds=seconds))
        return self._work.is_completed()

    def _complete(self) -> None:
        """torch's ``Work.wait()``, torch's release of the tensors, then the finish
        step; once."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            _await_release(self._keep)
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep = ()

    def test(self) -> bool:
        if self._work is None or self._on_stream or self._work.is_completed():
            self._complete()
            return True
        return False

    def wait(self) -> None:
        self._complete()


class _DeviceWork(TorchWork):
    """A request of a device-mode communicator: a :class:`TorchWork` that also offers
    ``wait_stream()``. ``device``: the CUDA device of its tensors, None for host
    tensors; ``rank`` names this rank in a timeout."""

    __slots__ = ("_device", "_rank")

    def __init__(self, work: Any, finish: Any, keep: tuple, device: Any, rank: int):
        super().__init__(work, finish, keep)
        self._device, self._rank = device, rank

    def _complete(self, stream: Any = None) -> None:
        if self._device is None:
            super()._complete()
            return
        # torch's Work.wait() orders torch's current stream: make that CuPy's (or
        # ``stream``), where the finish step's copies then run too
        with _on_cupy_stream(_torch(), self._device, stream):
            super()._complete()

    def wait_stream(self, stream: Any = None) -> None:
        """Order ``stream`` (a CuPy stream; default: the current one) after the transfer.

        CUDA tensors: a stream wait, no host block (as
        :meth:`geocomm.comm.nccl._NCCLRequest.wait_stream`); the finish step
        (unpacking) is queued on ``stream`` after it. Host tensors: no stream to
        order on, so the host waits for the transfer (at most ``GEOCOMM_TIMEOUT``,
        then :class:`~geocomm.comm.base.CollectiveTimeout`) and runs the finish step.
        """
        if self._device is None:
            wait(self, "a torch.distributed transfer", self._rank)
        else:
            self._complete(stream)

    def wait(self) -> None:
        """Block the host until the transfer (and the finish step) completed."""
        if self._device is None:
            super().wait()
            return
        self.wait_stream()
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _torch() -> Any:
    import torch

    return torch


def _packed_base(counts: np.ndarray, displs: np.ndarray) -> int | None:
    """The offset from which the non-empty segments lie packed in rank order (segment j
    at base + sum(counts[:j])), or None when they do not."""
    starts = np.cumsum(counts) - counts
    full = counts > 0
    if not full.any():
        return 0
    bases = displs[full] - starts[full]
    return int(bases[0]) if (bases == bases[0]).all() else None


def _copies(dst: Any, dst_at: np.ndarray, src: Any, src_at: np.ndarray, counts: np.ndarray) -> None:
    """dst[dst_at[j]: + counts[j]] = src[src_at[j]: + counts[j]] for every non-empty j,
    merging segments contiguous in both into one copy, and segments that all read
    the same bytes into one broadcast."""
    full = np.flatnonzero(counts > 0)
    if full.size == 0:
        return
    c, d, s = counts[full], dst_at[full], src_at[full]
    if (
        full.size > 1 and (c == c[0]).all() and (s == s[0]).all() and (np.diff(d) == c[0]).all()
    ):  # one source segment to consecutive places
        n, at, start = int(c[0]), int(d[0]), int(s[0])
        dst[at : at + full.size * n].reshape(full.size, n)[...] = src[start : start + n]
        return
    run = 0  # copy runs [run, k) contiguous in both
    for k in range(1, full.size + 1):
        if k < full.size and d[k] == d[k - 1] + c[k - 1] and s[k] == s[k - 1] + c[k - 1]:
            continue
        n = int(d[k - 1] + c[k - 1] - d[run])
        dst[int(d[run]) : int(d[run]) + n] = src[int(s[run]) : int(s[run]) + n]
        run = k


def _may_overlap(a: Any, b: Any) -> bool:
    """Whether two arrays of one kind (NumPy, or CuPy) may share memory."""
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        return False
    return bool(_array_module(a).may_share_memory(a, b))


def _detached(dist: Any, group: Any) -> bool:
    """Whether ``group`` is a ``ProcessGroup`` that torch.distributed's registry does not
    know: one built from a store with a backend registered on it by hand, as
    :mod:`geocomm.adapters.torch.backend` builds for its own traffic (the collectives
    accept such a group; ``get_rank`` and ``get_backend`` do not)."""
    if group is None or not isinstance(group, dist.ProcessGroup):
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return True
    return False


class TorchDistCommunicator:
    """:class:`geocomm.comm.Communicator` over a torch.distributed group.

    ``device_arrays``: whether the collectives keep CuPy arrays on the device
    (see the module docstring): None (default) means exactly when the group's
    backend is NCCL; True for any group that can move the device arrays' memory;
    False needs a group that moves host memory. ``backend`` is the group's
    ("nccl" or "gloo").
    ``group`` may also be a ``ProcessGroup`` outside torch.distributed's registry
    (made from a store, its backend registered by hand); rank, size and backend
    then come from the group object, and no default group is needed; ``ranks``
    then names the group's global ranks, where known (:meth:`world_ranks`; a
    registered group's are torch's, which ``ranks`` must equal).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        device_arrays: bool | None = None,
        ranks: Sequence[int] | None = None,
    ):
        import torch
        import torch.distributed as dist

        detached = _detached(dist, group)
        if not detached and not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised (init_process_group first, "
                "or geocomm.adapters.torch.init_distributed_from_mpi())"
            )
        self._torch, self._dist, self.group = torch, dist, group
        # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if detached:  # rank, size and backend from the group itself
            self.rank, self.size = int(group.rank()), int(group.size())
            nccl = group.name() == "nccl"
        else:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            nccl = dist.get_backend(group) == "nccl"
            registered = dist.get_process_group_ranks(
                group if group is not None else dist.group.WORLD
            )
            if ranks is not None and list(ranks) != list(registered):
                raise ValueError(f"ranks {list(ranks)} are not the group's, {registered}")
            ranks = registered
        if ranks is not None and len(ranks) != self.size:
            raise ValueError(f"ranks names {len(ranks)} ranks of a group of {self.size}")
        self._world_ranks = None if ranks is None else tuple(int(r) for r in ranks)
        if device_arrays is None:
            device_arrays = nccl
        elif not device_arrays and nccl:
            raise ValueError(
                "device_arrays=False needs a group that moves host memory (gloo); "
                "a NCCL group moves device arrays only"
            )
        self.device_arrays = bool(device_arrays)
        self.backend = "nccl" if nccl else "gloo"
        # where the metadata all-gather's tensors live
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )
        abort.register(self)

    # -- helpers ---------------------------------------------------------------

    def _t(self, array: Any) -> Any:
        """The array as a torch tensor sharing its memory (CuPy through DLPack)."""
        if isinstance(array, np.ndarray):
            return self._torch.from_numpy(array)
        return self._torch.from_dlpack(array)

    def _check_bytes(self, a: Any, name: str) -> None:
        if getattr(a, "dtype", None) != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
            got = f"{type(a).__name__} of dtype {getattr(a, 'dtype', None)}"
            raise TypeError(f"{name} must be a 1-D C-contiguous uint8 array, got {got}")

    def _segments(
        self, buf: Any, counts: Any, displs: Any, name: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-rank byte counts and displacements, checked against the buffer size."""
        counts = np.asarray(counts, np.int64).ravel()
        displs = np.asarray(displs, np.int64).ravel()
        if counts.size != self.size or displs.size != self.size:
            raise ValueError(
                f"{name}: counts and displacements need {self.size} entries, "
                f"got {counts.size} and {displs.size}"
            )
        if (counts < 0).any() or (displs < 0).any() or (counts + displs > buf.nbytes).any():
            raise ValueError(
                f"{name}: a segment lies outside the {buf.nbytes}-byte buffer "
                f"(counts {counts.tolist()}, displacements {displs.tolist()})"
            )
        return counts, displs

    def _host_wait(self, array: Any) -> None:
        """Before torch gets ``array``: when its tensor will be a host (CPU) tensor of a
        device array (memory torch reads as host memory), the host waits for CuPy's
        current stream, since gloo reads (and writes) the memory at once. CUDA
        tensors are ordered on the stream instead (:meth:`_ordered`); NumPy arrays
        have nothing to wait for. The tensor's device type is the array's DLPack
        device type, read before the export."""
        if isinstance(array, np.ndarray) or array.__dlpack_device__()[0] in DLPACK_CUDA:
            return
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    def _ordered(self, tensor: Any) -> contextlib.AbstractContextManager:
        """Where torch queues a transfer of ``tensor`` so that it reads what the caller
        queued before: CUDA tensors on CuPy's current stream (torch's current stream
        set to it, which ProcessGroupNCCL's stream then waits for); host tensors
        (after :meth:`_host_wait`) need nothing."""
        if tensor.device.type == "cuda":
            return _on_cupy_stream(self._torch, tensor.device)
        return contextlib.nullcontext()

    def _request(self, work: Any, tensor: Any, finish: Any = None, keep: tuple = ()) -> TorchWork:
        if not self.device_arrays:
            return TorchWork(work, finish, keep)
        device = tensor.device if tensor is not None and tensor.device.type == "cuda" else None
        return _DeviceWork(work, finish, keep, device, self.rank)

    # -- Communicator protocol -------------------------------------------------

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        """Start an all-to-all of uint8 segments (counts and displacements in bytes).

        ``send_counts[j]`` bytes of ``send`` from ``send_displs[j]`` go to rank j,
        which puts them at its ``recv_displs[rank]``; any displacements, holes and
        zero counts, the own segment included (its counts must agree). ``send``
        and ``recv`` may share memory, even be one buffer: every segment is sent as
        it was at the call and received segments are written after the transfer.
        One ``all_to_all_single`` on every rank: segments packed in rank order,
        in buffers apart, travel in place, others through packed scratch."""
        self._check_bytes(send, "send")
        self._check_bytes(recv, "recv")
        s_counts, s_displs = self._segments(send, send_counts, send_displs, "send")
        r_counts, r_displs = self._segments(recv, recv_counts, recv_displs, "recv")
        me = self.rank
        if s_counts[me] != r_counts[me]:
            raise ValueError(
                f"rank {me} sends {s_counts[me]} bytes to itself but expects {r_counts[me]}"
            )
        xp = _array_module(send)
        s_total, r_total = int(s_counts.sum()), int(r_counts.sum())
        s_base, r_base = _packed_base(s_counts, s_displs), _packed_base(r_counts, r_displs)
        if s_base is None:  # pack the segments in rank order
            source = xp.empty(s_total, np.uint8)
            _copies(source, np.cumsum(s_counts) - s_counts, send, s_displs, s_counts)
        else:
            source = send[s_base : s_base + s_total]
        finish = None
        if r_base is None or _may_overlap(send, recv):
            target = xp.empty(r_total, np.uint8)

            def finish() -> None:  # unpack what arrived
                _copies(recv, r_displs, target, np.cumsum(r_counts) - r_counts, r_counts)
        else:
            target = recv[r_base : r_base + r_total]
        self._host_wait(source)
        src, dst = self._t(source), self._t(target)
        with self._ordered(src):
            work = self._dist.all_to_all_single(
                dst,
                src,
                output_split_sizes=r_counts.tolist(),
                input_split_sizes=s_counts.tolist(),
                group=self.group,
                async_op=True,
            )
        return self._request(work, src, finish, (send, recv, source, target, src, dst))

    def allgatherv(self, send, recv, counts, displs):
        """Start an all-gather: ``counts[rank]`` bytes of ``send`` land at ``displs[rank]``
        of every rank's ``recv``. Equal segments packed in rank order go straight into
        ``recv``; others are padded to the largest and unpacked once they arrived."""
        self._check_bytes(send, "send")
        self._check_bytes(recv, "recv")
        counts, displs = self._segments(recv, counts, displs, "recv")
        mine = int(counts[self.rank])
        if mine > send.nbytes:
            raise ValueError(f"send holds {send.nbytes} bytes, counts[{self.rank}] is {mine}")
        width = int(counts.max()) if counts.size else 0
        if width == 0:  # the counts are every rank's: nothing moves anywhere
            return self._request(None, None)
        xp = _array_module(send)
        if (
            (counts == width).all()
            and np.array_equal(displs, np.arange(self.size) * width)
            and not _may_overlap(send, recv)
        ):
            # equal segments packed in rank order (the pipeline's usual stage): no padding
            self._host_wait(send)
            src, dst = self._t(send[:width]), self._t(recv[: self.size * width])
            with self._ordered(src):
                work = self._all_gather(dst, src, group=self.group, async_op=True)
            return self._request(work, src, keep=(send, recv, src, dst))
        padded = xp.zeros(width, np.uint8)
        padded[:mine] = send[:mine]
        gathered = xp.empty(self.size * width, np.uint8)
        self._host_wait(padded)
        src, dst = self._t(padded), self._t(gathered)
        with self._ordered(src):
            work = self._all_gather(dst, src, group=self.group, async_op=True)

        def unpad() -> None:
            _copies(recv, displs, gathered, np.arange(self.size) * width, counts)

        return self._request(work, src, unpad, (send, recv, padded, gathered, src, dst))

    def allreduce(self, send: Any, recv: Any, op: str) -> None:
        """Blocking all-reduce (``op`` "sum" or "max") of float32/float64 arrays; device
        arrays are ordered like the other transfers (CUDA: on CuPy's current stream)."""
        ops = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
        recv[...] = send
        flat = recv.reshape(-1)
        self._host_wait(flat)
        tensor = self._t(flat)
        with self._ordered(tensor):
            # no name kept for the torch work: TorchWork drops the only reference
            request = TorchWork(
                self._dist.all_reduce(tensor, op=ops[op], group=self.group, async_op=True),
                keep=(tensor,),
            )
            wait(request, "an all-reduce", self.rank)

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        request, rows = self.start_allgather_int64(values)
        wait(request, "a metadata all-gather", self.rank)
        return rows

    def start_allgather_int64(self, values: np.ndarray) -> tuple[TorchWork, np.ndarray]:
        """Start the all-gather of a small int64 vector: (its request, the (size, len)
        rows it fills once complete; a NCCL group's rows are copied to the host then)."""
        values = np.ascontiguousarray(values, np.int64)
        rows = np.empty((self.size, values.size), np.int64)
        send = self._t(values).to(self.device)
        gathered = self._t(rows.reshape(-1)).to(self.device)
        work = self._all_gather(gathered, send, group=self.group, async_op=True)
        finish = None
        if self.device.type != "cpu":

            def finish() -> None:
                rows.reshape(-1)[...] = gathered.cpu().numpy()

        # polled on the host, a NCCL group's too: the rows are the host's to read
        return TorchWork(work, finish, (send, gathered), poll=True), rows

    def barrier(self) -> None:
        """Every rank's arrival, waited for at most GEOCOMM_TIMEOUT."""
        wait(TorchWork(self._dist.barrier(group=self.group, async_op=True)), "a barrier", self.rank)

    def world_ranks(self) -> tuple[int, ...] | None:
        """The group's global ranks, in group rank order (None: a group outside
        torch.distributed's registry made without ``ranks``)."""
        return self._world_ranks

    def node_key(self) -> int:
        """This rank's node from torch's launcher: ``GROUP_RANK`` (torchrun's node rank),
        else ``RANK - LOCAL_RANK``; -1 (unknown) when neither is set."""
        env = os.environ
        if env.get("GROUP_RANK", "").isdigit():
            return int(env["GROUP_RANK"])
        if env.get("RANK", "").isdigit() and env.get("LOCAL_RANK", "").isdigit():
            return int(env["RANK"]) - int(env["LOCAL_RANK"])
        return -1

    def subgroups(self, groups: list[list[int]]) -> TorchDistCommunicator:
        """A communicator over a new process group (this group's backend) of the ranks of
        the group of ``groups`` (a partition of this group's ranks) that holds this
        rank. ``new_group`` with local synchronization: only that group's ranks take
        part, each at the same point of its collectives (every rank passes the same
        ``groups``)."""
        world = self._dist.get_process_group_ranks(
            self.group if self.group is not None else self._dist.group.WORLD
        )
        mine = next(g for g in groups if self.rank in g)
        group = self._dist.new_group(
            ranks=[world[r] for r in mine],
            backend=self._dist.get_backend(self.group),
            use_local_synchronization=True,
        )
        return TorchDistCommunicator(group, device_arrays=self.device_arrays)

    def abort_local(self) -> None:
        """Nothing to release: ending the process frees gloo's sockets."""

    def abort(self, code: int = 1) -> None:
        """MPI_Abort when MPI runs the job, else exit this process now (does not return)."""
        if not abort.mpi_world_abort(code):
            os._exit(code)
