"""Process groups for geocomm's torch integrations: ``init_process_group`` from MPI,
and the dedicated groups geocomm's traffic travels on."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from geocomm.comm.base import Communicator
from geocomm.comm.torchdist import TorchDistCommunicator

__all__ = ["dedicated_comm", "init_distributed_from_mpi"]


def init_distributed_from_mpi(backend: str = "gloo", port: int | None = None) -> None:
    """``dist.init_process_group`` for a job started by an MPI launcher.

    Rank and size come from MPI; rank 0's host and a free port are broadcast over
    MPI, so no environment needs to be prepared by hand (``MASTER_ADDR`` and
    ``MASTER_PORT`` already set are kept). Does nothing when torch.distributed
    is already initialized.

    Args:
        backend: the process group's backend: "gloo" (CPU), "nccl" (CUDA), or
            "geocomm" (the compressed backend, :mod:`geocomm.adapters.torch.backend`).
        port: rank 0's port (default: a free one).

    Example::

        init_distributed_from_mpi("gloo")     # under mpirun or geocomm.launch
    """
    if dist.is_initialized():
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    address = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("", port or 0))
            address = (socket.gethostname(), s.getsockname()[1])
    host, chosen = world.bcast(address, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if world.size == 1 else host)
    os.environ.setdefault("MASTER_PORT", str(chosen))
    dist.init_process_group(backend, rank=world.rank, world_size=world.size)


def dedicated_comm(group: Any = None, device: Any = "cpu") -> Communicator:
    """A communicator of its own over the ranks of ``group`` (default: the world), for
    tensors on ``device``.

    Args:
        group: the torch.distributed group whose ranks take part.
        device: a torch device (or its name): CPU tensors travel over a new gloo group;
            CUDA tensors over geocomm's NCCL communicator (CuPy), on that device,
            bootstrapped over a new gloo group. Its transfers can be captured, so a
            steady call replays as one CUDA graph (docs/design.md, "The collective").

    Returns:
        A :class:`~geocomm.comm.torchdist.TorchDistCommunicator` (CPU) or
        :class:`~geocomm.comm.nccl.NCCLCommunicator` (CUDA). Every rank of ``group`` must
        call it, in the same order as its other ``new_group`` calls.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    host = TorchDistCommunicator(
        dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    )
    device = torch.device(device)
    if device.type != "cuda":
        return host
    from geocomm.comm.nccl import NCCLCommunicator

    index = device.index if device.index is not None else torch.cuda.current_device()
    return NCCLCommunicator(host, device=index)
