"""PyTorch DDP (gloo, launched by mpirun) with the geocomm communication hook."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from geocomm.adapters.torch import GeocommHookState, geocomm_hook, init_distributed_from_mpi

pytestmark = [pytest.mark.mpi(min_size=2)]

STEPS = 30


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own micro-batch of a fixed linear-plus-noise regression task."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    w = torch.linspace(-1, 1, 32)
    return x, (x @ w).unsqueeze(1) + 0.01 * torch.randn(64, 1, generator=g)


def _train(codec: str | None) -> tuple[list[float], torch.nn.Module]:
    init_distributed_from_mpi()
    net = _model()
    model = DDP(net)
    if codec is not None:
        model.register_comm_hook(GeocommHookState(net, codec=codec), geocomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, y = _batch(dist.get_rank(), step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses, net


def _params_digest(net: torch.nn.Module) -> bytes:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.digest()


@pytest.mark.parametrize("codec", ["fp8", "nvfp4"])
def test_ddp_hook_trains_and_ranks_agree(comm, codec):
    exact, _ = _train(None)
    compressed, net = _train(codec)
    # training makes progress: the loss falls by more than half
    assert compressed[-1] < 0.5 * compressed[0]
    # and tracks the uncompressed run (same data, same init): the quantization
    # perturbs each step's gradient by a few percent, so the mean loss over the
    # last ten steps stays within 10% of the exact run's
    assert abs(np.mean(compressed[-10:]) - np.mean(exact[-10:])) <= 0.10 * np.mean(exact[-10:])
    # every rank holds bitwise identical parameters
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _params_digest(net))
    assert all(d == digests[0] for d in digests)
