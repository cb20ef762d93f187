"""Communicator over a ``torch.distributed`` process group (gloo on CPU).

It lets the DDP communication hook send geocomm's encoded bytes through the
process group DDP already uses, whether the job came from ``torchrun`` or
``mpirun``. Gloo moves data on its own threads, so nonblocking calls overlap
with the codec without help. Uneven all-gathers are padded to the largest
segment (gloo has no all-gather-v). With more than one rank, an uncaught
exception ends the job (:mod:`geocomm.comm.abort`): ``MPI_Abort`` when MPI
runs the ranks (mpirun), else this process exits at once with status 1, which
torchrun answers by stopping the other ranks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from geocomm.comm import abort


class _Work:
    """A torch ``Work`` plus an optional step to run once it has completed."""

    __slots__ = ("_finish", "_work")

    def __init__(self, work: Any, finish: Any = None):
        self._work, self._finish = work, finish

    def _complete(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None

    def test(self) -> bool:
        if self._work.is_completed():
            self._work.wait()
            self._complete()
            return True
        return False

    def wait(self) -> None:
        self._work.wait()
        self._complete()


class TorchDistCommunicator:
    """:class:`geocomm.comm.Communicator` over a torch.distributed group."""

    backend = "torch"

    def __init__(self, group: Any = None):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (init_process_group first, "
                               "or geocomm.adapters.torch.init_distributed_from_mpi())")
        self._torch, self._dist, self.group = torch, dist, group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        abort.register(self)

    def _t(self, array: np.ndarray) -> Any:
        return self._torch.from_numpy(array)

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        # segments are packed in rank order (displacements are running sums)
        work = self._dist.all_to_all_single(
            self._t(recv[: int(np.sum(recv_counts))]), self._t(send[: int(np.sum(send_counts))]),
            output_split_sizes=[int(c) for c in recv_counts],
            input_split_sizes=[int(c) for c in send_counts],
            group=self.group, async_op=True)
        return _Work(work)

    def allgatherv(self, send, recv, counts, displs):
        width = int(np.max(counts)) if len(counts) else 0
        padded = np.zeros(width, np.uint8)
        padded[: send.size] = send[: int(counts[self.rank])]
        gathered = np.empty(self.size * width, np.uint8)
        work = self._dist.all_gather_into_tensor(self._t(gathered), self._t(padded),
                                                 group=self.group, async_op=True)

        def unpad() -> None:
            for j in range(self.size):
                c, d = int(counts[j]), int(displs[j])
                recv[d: d + c] = gathered[j * width: j * width + c]

        return _Work(work, unpad)

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        recv[...] = send
        reduce_op = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}[op]
        self._dist.all_reduce(self._t(recv.reshape(-1)), op=reduce_op, group=self.group)

    def allgather_int64(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, np.int64)
        rows = np.empty((self.size, values.size), np.int64)
        self._dist.all_gather_into_tensor(self._t(rows.reshape(-1)), self._t(values),
                                          group=self.group)
        return rows

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def abort_local(self) -> None:
        """Nothing to release: ending the process frees gloo's sockets."""

    def abort(self, code: int = 1) -> None:
        """MPI_Abort when MPI runs the job, else exit this process now (does not return)."""
        if not abort.mpi_world_abort(code):
            os._exit(code)
