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

    Rank and size come from MPI. With ``MASTER_ADDR`` and ``MASTER_PORT`` both set,
    the group meets there (torch's ``env://``). Otherwise rank 0 opens the group's
    store on ``MASTER_PORT``, else ``port``, else on a port the OS picks as it binds
    (so no other process can take it first), and broadcasts its address over MPI:
    its host is ``MASTER_ADDR`` if set, else rank 0's hostname (127.0.0.1 in a
    1-rank job). ``MASTER_ADDR`` and ``MASTER_PORT`` are then set to that address.
    Does nothing when torch.distributed is already initialized. Every rank raises
    when rank 0 cannot open the store (a ``port`` in use).

    Args:
        backend: the process group's backend: "gloo" (CPU), "nccl" (CUDA), or
            "geocomm" (the compressed backend, :mod:`geocomm.adapters.torch.backend`).
        port: rank 0's port where ``MASTER_PORT`` is unset (default: a free one).

    Example::

        init_distributed_from_mpi("gloo")     # under mpirun or geocomm.launch
    """
    if dist.is_initialized():
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        dist.init_process_group(backend, rank=world.rank, world_size=world.size)
        return
    port = int(os.environ.get("MASTER_PORT", port or 0))
    store = None
    opened: tuple[str, int | str] | None = None  # rank 0's host and port, or why not
    if world.rank == 0:
        local = world.size == 1
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if local else socket.gethostname())
        try:
            store = dist.TCPStore(host, port, world.size, True, wait_for_workers=False)
            opened = (host, store.port)
        except Exception as error:  # every rank must learn it, or the others would wait
            opened = (host, f"rank 0 could not open the store on port {port}: {error}")
    host, chosen = world.bcast(opened, root=0)
    if isinstance(chosen, str):
        raise RuntimeError(chosen)
    if store is None:
        store = dist.TCPStore(host, chosen, world.size, False)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(chosen)
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size)


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
