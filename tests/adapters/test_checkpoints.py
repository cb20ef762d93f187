"""Frameworks own the process group: the DDP hook's state and the FSDP2 compression made
before it exists, and codec state that survives a checkpoint (issue 21).

A resumed job must give the bits of one that ran straight through: GeoFP8's bases
and call counts and error feedback's residuals are part of the training state, as
much as the optimizer's moments are. Each "job" below starts as a fresh process
would: a fresh codec instance and fresh stochastic-rounding call counts.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from geocomm.adapters.torch import (
    GeocommHookState,
    compress_fsdp,
    geocomm_hook,
    init_distributed_from_mpi,
)
from geocomm.codecs import get_codec
from geocomm.engine import call as calls

pytestmark = [pytest.mark.mpi(min_size=2)]

CODECS = {
    "geofp8": {"id": "geofp8", "refresh": 2},  # refreshes inside the 4 steps before the save
    "fp8-error-feedback": {"id": "fp8", "error_feedback": True},
    "nvfp4-stochastic": {"id": "nvfp4", "rounding": "stochastic", "seed": 5},
}
STEPS, SAVE_AT = 8, 4


def _net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
        torch.nn.Linear(96, 2),
    )  # fmt: skip


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(32, 48, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :2].sin())
    opt.zero_grad()
    loss.backward()
    opt.step()


def _digest(net: torch.nn.Module) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in net.parameters()]


def _ranks_agree(net: torch.nn.Module) -> bool:
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(net))
    return all(d == digests[0] for d in digests)


def _saved(obj: object) -> object:
    """``obj`` through torch.save and torch.load with torch's default weights_only=True."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


class _DDPJob:
    """A fresh DDP job (model, Adam, hook state with a codec of its own)."""

    def __init__(self, config: dict, **ddp):
        calls.reset_call_counts()
        self.net = _net()
        self.state = GeocommHookState(self.net, codec=get_codec(config), error_sample=0)
        self.model = DDP(self.net, **ddp)
        self.model.register_comm_hook(self.state, geocomm_hook)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def run(self, steps: range) -> None:
        for step in steps:
            _step(self.model, self.opt, step)

    def save(self) -> object:
        return _saved(
            {"model": self.net.state_dict(), "opt": self.opt.state_dict(),
             "geocomm": self.state.state_dict()}
        )  # fmt: skip

    def load(self, data) -> None:
        self.net.load_state_dict(data["model"])
        self.opt.load_state_dict(data["opt"])
        self.state.load_state_dict(data["geocomm"])


def test_hook_state_is_made_before_the_process_group(comm):
    # Lightning, Accelerate and other trainers build the strategy (with the hook's
    # state) before they create the default process group, and wrap the model later
    if dist.is_initialized():
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)  # a new group on a port of its own
    net = _net()
    state = GeocommHookState(net, codec="geofp8")
    assert not state.reducer.connected
    init_distributed_from_mpi()
    model = DDP(net, bucket_cap_mb=0.02)
    model.register_comm_hook(state, geocomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        _step(model, opt, step)
    assert state.reducer.connected and len(state.telemetry.history) == 3
    assert state.last_step.ratio > 3  # the buckets really went compressed
    assert _ranks_agree(net)


@pytest.mark.parametrize("name", list(CODECS))
def test_ddp_resume_gives_the_bits_of_a_straight_run(comm, name):
    init_distributed_from_mpi()
    straight = _DDPJob(CODECS[name])
    straight.run(range(STEPS))

    first = _DDPJob(CODECS[name])
    first.run(range(SAVE_AT))
    checkpoint = first.save()
    resumed = _DDPJob(CODECS[name])  # a new process: fresh codec, fresh call counts
    resumed.load(checkpoint)
    resumed.run(range(SAVE_AT, STEPS))
    assert _digest(resumed.net) == _digest(straight.net)
    assert _ranks_agree(resumed.net)

    # without the codec state the resumed job drifts off: the state is what carries it
    bare = _DDPJob(CODECS[name])
    bare.net.load_state_dict(checkpoint["model"])
    bare.opt.load_state_dict(checkpoint["opt"])
    bare.run(range(SAVE_AT, STEPS))
    assert _digest(bare.net) != _digest(straight.net)


def test_ddp_resume_over_several_buckets_that_ddp_never_rebuilds(comm):
    """DDP rebuilds its buckets after a job's first step (from the order its gradients
    arrived) unless it looks for unused parameters, so a resumed job's first step
    groups several buckets as the straight job's first step did, not as its step at
    the save did (docs/torch.md, "Checkpoints"). With find_unused_parameters=True
    the first buckets stay, and the resumed job gives the straight job's bits."""
    init_distributed_from_mpi()
    config = CODECS["fp8-error-feedback"]
    ddp = {"bucket_cap_mb": 0.02, "find_unused_parameters": True}
    straight = _DDPJob(config, **ddp)
    straight.run(range(STEPS))
    assert len(straight.state.last_step.buckets) > 1  # the parameters span buckets
    first = _DDPJob(config, **ddp)
    first.run(range(SAVE_AT))
    checkpoint = first.save()
    resumed = _DDPJob(config, **ddp)
    resumed.load(checkpoint)
    resumed.run(range(SAVE_AT, STEPS))
    assert _digest(resumed.net) == _digest(straight.net)


def test_loading_into_another_job_raises(comm):
    init_distributed_from_mpi()
    job = _DDPJob(CODECS["geofp8"])
    job.run(range(2))
    data = job.save()["geocomm"]
    with pytest.raises(ValueError, match=r"ranks, this job has"):
        _DDPJob(CODECS["geofp8"]).state.load_state_dict({**data, "world_size": 7})
    other = GeocommHookState(torch.nn.Linear(48, 3), codec=get_codec(CODECS["geofp8"]))
    with pytest.raises(ValueError, match="parameter layout"):
        other.load_state_dict(data)
    with pytest.raises(ValueError, match="codec"):
        _DDPJob(CODECS["fp8-error-feedback"]).state.load_state_dict(data)


def _fsdp_job(config: dict, before_shard: bool):
    calls.reset_call_counts()
    net = _net()
    fsdp = compress_fsdp(net, get_codec(config), error_sample=0) if before_shard else None
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    if fsdp is None:
        fsdp = compress_fsdp(net, get_codec(config), error_sample=0)
    return net, fsdp, torch.optim.Adam(net.parameters(), lr=1e-2)


def _full_digest(net: torch.nn.Module) -> list[bytes]:
    return [p.full_tensor().detach().numpy().tobytes() for p in net.parameters()]


@pytest.mark.parametrize("name", ["geofp8", "fp8-error-feedback"])
def test_fsdp_resume_gives_the_bits_of_a_straight_run(comm, name):
    init_distributed_from_mpi()
    net, fsdp, opt = _fsdp_job(CODECS[name], before_shard=True)
    assert not fsdp.installed  # compress_fsdp before fully_shard: hooks at the 1st forward
    for step in range(STEPS):
        _step(net, opt, step)
    assert fsdp.installed and len(fsdp.telemetry.history) == STEPS
    straight = _full_digest(net)

    net, fsdp, opt = _fsdp_job(CODECS[name], before_shard=False)
    for step in range(SAVE_AT):
        _step(net, opt, step)
    # each rank saves its own shards and its own codec state (DCP would do the same)
    data = _saved({"model": net.state_dict(), "opt": opt.state_dict(),
                   "geocomm": fsdp.state_dict()})  # fmt: skip
    net, fsdp, opt = _fsdp_job(CODECS[name], before_shard=False)
    net.load_state_dict(data["model"])
    opt.load_state_dict(data["opt"])
    fsdp.load_state_dict(data["geocomm"])
    for step in range(SAVE_AT, STEPS):
        _step(net, opt, step)
    assert _full_digest(net) == straight
