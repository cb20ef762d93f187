"""PyTorch integration: a DDP communication hook and torch.distributed set-up.

    import geocomm.adapters.torch as gt
    gt.init_distributed_from_mpi()               # under mpirun (torchrun sets env itself)
    model = DDP(net)
    model.register_comm_hook(gt.GeocommHookState(net, codec="geofp8"), gt.geocomm_hook)

The hook all-reduces every parameter's gradient on its own (so GeoFP8 sees
the 2-D shape and keeps per-parameter geometry, keyed by parameter name)
through the DDP process group and returns the averaged bucket.
"""

# No "from __future__ import annotations": DDP compares the hook's bucket
# annotation with dist.GradBucket itself, not with a string.
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from geocomm.adapters.arrays import allreduce
from geocomm.collectives import resolve_codec
from geocomm.comm.torchdist import TorchDistCommunicator


def init_distributed_from_mpi(backend: str = "gloo", port: int | None = None) -> None:
    """``dist.init_process_group`` for a job started by mpirun/mpiexec.

    Rank and size come from MPI; rank 0's host and a free port are broadcast
    over MPI so no environment needs to be prepared by hand.
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


@dataclass
class GeocommHookState:
    """What the hook needs: the codec, parameter names, the communicator.

    ``module`` gives the names used as GeoFP8 keys; ``group`` is the process
    group (default: DDP's world group).
    """

    module: torch.nn.Module
    codec: Any = "fp8"
    group: Any = None
    check: bool | None = None
    names: dict[int, str] = field(init=False)
    comm: TorchDistCommunicator = field(init=False)

    def __post_init__(self) -> None:
        self.codec = resolve_codec(self.codec)
        self.names = {id(p): name for name, p in self.module.named_parameters()}
        self.comm = TorchDistCommunicator(self.group)


def geocomm_hook(state: GeocommHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: compressed average of every gradient in ``bucket``."""
    buffer = bucket.buffer()
    offset = 0
    for param in bucket.parameters():
        count = param.numel()
        grad = buffer[offset: offset + count].view(param.shape)
        allreduce(grad, codec=state.codec, op="avg", out=grad, key=state.names.get(id(param)),
                  comm=state.comm, check=state.check)
        offset += count
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
