"""The torch.distributed backend "geocomm" (geocomm.adapters.torch.backend).

MPI tests (any number of ranks >= 2) make geocomm groups with
``new_group(backend="geocomm")`` beside the suite's gloo default group. The
non-MPI tests start two ranks torchrun-style (this file run as a script) for
what needs the default group to be geocomm's: ``init_process_group("geocomm")``,
a Hugging Face GPT-2 under DDP, Lightning's ``process_group_backend``.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import geocomm
from geocomm import CollectiveMismatchError
from geocomm.adapters.torch import backend as tb
from geocomm.adapters.torch import init_distributed_from_mpi
from geocomm.codecs.bounds import FP32_UNIT, allreduce_bound
from geocomm.engine.call import FIELDS

MIN_NUMEL = 1024  # the tests' models are small


def _geocomm_group(**config):
    """A new geocomm group over the world, configured for small tensors."""
    init_distributed_from_mpi()
    tb.configure(min_numel=MIN_NUMEL, **config)
    try:
        return dist.new_group(backend=tb.NAME)
    finally:
        tb.reset_configuration()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 1)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].sum(1, keepdim=True)


def _loss(model, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(net: torch.nn.Module, grads: bool = False) -> np.ndarray:
    return (
        torch.cat([(p.grad if grads else p).detach().reshape(-1) for p in net.parameters()])
        .numpy()
        .astype(np.float64)
    )


def _same_on_ranks(values: np.ndarray) -> bool:
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(values.tobytes()).digest())
    return all(d == digests[0] for d in digests)


def _train_ddp(group, steps: int = 6) -> torch.nn.Module:
    net = _mlp()
    model = DDP(net, process_group=group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        loss = _loss(model, dist.get_rank(), step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


pytestmark_mpi = pytest.mark.mpi(min_size=2)


@pytestmark_mpi
def test_ddp_without_hook_is_compressed_within_bound(comm):
    group = _geocomm_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    local = _mlp()
    _loss(local, rank, 0).backward()
    mine = torch.from_numpy(_flat(local, grads=True).astype(np.float32))
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine)
    # DDP divides each bucket by the world size, then sums: the codec sees g_i / N
    inputs = [g.numpy().astype(np.float64) / size for g in every]
    net = _mlp()
    model = DDP(net, process_group=group, bucket_cap_mb=0.01)
    _loss(model, rank, 0).backward()
    got, exact = _flat(net, grads=True), np.sum(inputs, axis=0)
    bound = allreduce_bound(inputs, geocomm.get_codec("fp8")) + 2 * FP32_UNIT * np.abs(exact)
    assert np.all(np.abs(got - exact) <= bound)
    assert np.any(got != exact)  # compressed, not exact
    assert _same_on_ranks(got)
    stats = tb.stats(group)
    assert stats.compressed >= 1 and stats.sent < stats.baseline  # first step: one bucket


@pytestmark_mpi
def test_ddp_trains_identically_on_ranks_close_to_gloo(comm):
    net = _train_ddp(_geocomm_group())
    assert _same_on_ranks(_flat(net))
    reference = _train_ddp(None)  # the suite's gloo default group
    drift = np.abs(_flat(net) - _flat(reference)).max()
    assert 0 < drift < 0.05


@pytest.mark.mpi(min_size=4)
def test_compressed_calls_of_a_job_on_several_nodes_run_flat(comm, monkeypatch):
    """torchrun on two nodes of two ranks sets ``GROUP_RANK`` to the node's rank, which
    makes the default topology ("auto") node-aware. The backend's compressed calls
    travel over a process group outside torch.distributed's registry, which cannot be
    split into the nodes' groups: they run flat, and give the flat call's bits."""
    rank = dist.get_rank() if dist.is_initialized() else comm.rank
    monkeypatch.setenv("GROUP_RANK", str(rank // 2))
    monkeypatch.setenv("GEOCOMM_TOPOLOGY", "auto")
    group = _geocomm_group()
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(1 << 16).astype(np.float32))
    got = x.clone()
    dist.all_reduce(got, group=group)
    want = geocomm.allreduce(x.numpy(), codec="fp8", topology="flat")
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytestmark_mpi
def test_exact_calls_beside_compressed_gradients(comm):
    group = _geocomm_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    big = torch.full((4096,), float(rank + 1))
    pending = dist.all_reduce(big, group=group, async_op=True)  # compressed, queued
    loss = torch.tensor([0.1 * (rank + 1)])
    by_gloo = loss.clone()
    dist.all_reduce(loss, group=group)  # a small float: exact
    dist.all_reduce(by_gloo)  # the suite's gloo default group
    assert torch.equal(loss, by_gloo)
    avg = torch.tensor([float(rank)] * 4)
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=group)  # gloo has no AVG: SUM / N
    assert torch.equal(avg, torch.full((4,), (size - 1) / 2))
    counters = torch.arange(5000, dtype=torch.int64) + rank  # large, but integer
    dist.all_reduce(counters, group=group)
    assert torch.equal(counters, size * torch.arange(5000) + sum(range(size)))
    top = torch.full((5000,), float(rank))
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    assert torch.equal(top, torch.full((5000,), float(size - 1)))
    root = torch.arange(3.0) + rank
    dist.broadcast(root, 0, group=group)
    assert torch.equal(root, torch.arange(3.0))
    gathered = [torch.empty(2) for _ in range(size)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=group)
    assert all(torch.equal(g, torch.full((2,), float(r))) for r, g in enumerate(gathered))
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    assert objects == [{"rank": r} for r in range(size)]
    dist.barrier(group=group)
    pending.wait()
    assert pending.is_completed()
    # fp8 carries small integers exactly
    assert torch.equal(big, torch.full((4096,), float(size * (size + 1) // 2)))
    stats = tb.stats(group)
    assert stats.compressed == 1 and stats.exact >= 7
    assert stats.exact_by_call["allreduce"] == 4


@pytestmark_mpi
def test_a_parameter_is_reduced_in_place_under_no_grad(comm):
    """As gloo does: the backend's worker thread, whose grad mode is its own, writes a
    tensor that requires grad (it refused to before, since a new thread's grad mode is
    on). fp8 carries the small integer sum exactly."""
    group = _geocomm_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    weight = torch.nn.Parameter(torch.full((4096,), float(rank + 1)))
    with torch.no_grad():
        dist.all_reduce(weight, group=group)
    assert torch.equal(weight.detach(), torch.full((4096,), float(size * (size + 1) // 2)))
    assert tb.stats(group).compressed == 1


@pytestmark_mpi
@pytest.mark.parametrize("given", ["id", "object"])
def test_groups_configured_alike_keep_their_own_codec_state(comm, given):
    """A codec's state (GeoFP8's bases, error feedback's residuals) is per group: two
    groups of one configuration never share one codec object, also where a GeoFP8
    object was configured (a state serves one group of ranks; torch makes groups of
    other ranks from one configuration, a DeviceMesh's shard and replica groups). A
    stateless object is used as it is."""
    codec = "geofp8" if given == "id" else geocomm.get_codec("geofp8")
    first, second = _geocomm_group(codec=codec), _geocomm_group(codec=codec)
    assert first.codec == second.codec and first.codec is not second.codec
    assert first.codec is not codec and second.codec is not codec
    fp8 = geocomm.get_codec("fp8")
    assert _geocomm_group(codec=fp8).codec is fp8


@pytestmark_mpi
def test_async_compressed_calls_complete_in_order(comm):
    group = _geocomm_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    tensors = [torch.full((2048 * (i + 1),), float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    for work in reversed(works):
        assert work.wait()
    for i, t in enumerate(tensors):
        assert torch.equal(t, torch.full_like(t, float(sum(r + i for r in range(size)))))
    assert tb.stats(group).compressed == 3


@pytestmark_mpi
@pytest.mark.parametrize("monitored", [False, True])
def test_a_barrier_completes_after_the_groups_earlier_calls(comm, monitored):
    """As gloo's and NCCL's: the compressed calls run on the backend's worker, outside
    the exact group the barrier runs on, which returned with none of 8 done."""
    group = _geocomm_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    tensors = [torch.full((1 << 16,), float(rank + 1)) for _ in range(8)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    if monitored:
        group.monitored_barrier()
    else:
        dist.barrier(group=group)
    assert all(work.is_completed() for work in works)
    total = float(size * (size + 1) // 2)
    assert all(torch.equal(t, torch.full_like(t, total)) for t in tensors)


@pytestmark_mpi
@pytest.mark.parametrize("listed", [False, True])
def test_reduce_scatter_is_compressed_within_bound(comm, listed):
    group = _geocomm_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(size * 1500, generator=g)
    every = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(every, x)
    inputs = [e.numpy().astype(np.float64) for e in every]
    out = torch.empty(1500)
    if listed:
        dist.reduce_scatter(out, list(x.chunk(size)), group=group)
    else:
        dist.reduce_scatter_tensor(out, x, group=group)
    exact = np.sum(inputs, axis=0)
    bound = allreduce_bound(inputs, geocomm.get_codec("fp8")) + FP32_UNIT * np.abs(exact)
    mine = slice(rank * 1500, (rank + 1) * 1500)
    assert np.all(np.abs(out.numpy() - exact[mine]) <= bound[mine])
    assert np.any(out.numpy() != exact[mine])
    assert tb.stats(group).compressed == 1


@pytestmark_mpi
def test_fsdp2_trains_on_the_backend(comm):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = _geocomm_group()
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(8):
        loss = _loss(model, dist.get_rank(), step % 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    full = np.concatenate(
        [p.full_tensor().detach().numpy().reshape(-1) for p in model.parameters()]
    )
    assert _same_on_ranks(full)
    assert tb.stats(group).compressed > 0  # the first layer's reduce-scatter (4224 values)


@pytestmark_mpi
def test_codec_from_the_environment_and_from_configure(comm, monkeypatch):
    monkeypatch.setenv("GEOCOMM_CODEC", "nvfp4")
    monkeypatch.setenv("GEOCOMM_MIN_NUMEL", "300")
    init_distributed_from_mpi()
    from_env = dist.new_group(backend=tb.NAME)
    assert from_env.codec.get_config()["id"] == "nvfp4"
    assert from_env.config.min_numel == 300
    assert tb.configure(codec="bf16").codec == "bf16"  # configure() wins over the environment
    try:
        configured = dist.new_group(backend=tb.NAME)
    finally:
        tb.reset_configuration()
    assert configured.codec.get_config()["id"] == "bf16"
    tb.configure(configured, codec="mxfp8", min_numel=50_000)  # one group, now
    assert configured.codec.get_config()["id"] == "mxfp8"
    t = torch.ones(20_000)
    dist.all_reduce(t, group=configured)  # below the new threshold: exact
    assert tb.stats(configured).compressed == 0
    with pytest.raises(ValueError, match="compress"):
        tb.configure(compress=("all_gather",))


@pytestmark_mpi
def test_state_dict_round_trip_and_world_size_check(comm):
    codec = {"id": "fp8", "error_feedback": True}
    group = _geocomm_group(codec=codec)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    steps = [torch.randn(3000, generator=g) for _ in range(4)]
    for x in steps[:3]:
        dist.all_reduce(x.clone(), group=group)
        tb.step(group)
    saved = tb.state_dict(group)
    assert saved["world_size"] == dist.get_world_size() and saved["codec"]["residuals"]
    straight = steps[3].clone()
    dist.all_reduce(straight, group=group)
    resumed_group = _geocomm_group(codec=codec)
    tb.load_state_dict(saved, resumed_group)
    resumed = steps[3].clone()
    dist.all_reduce(resumed, group=resumed_group)
    assert torch.equal(resumed, straight)  # the residuals carried over
    fresh = steps[3].clone()
    dist.all_reduce(fresh, group=_geocomm_group(codec=codec))
    assert not torch.equal(fresh, straight)
    with pytest.raises(ValueError, match="world size"):
        tb.load_state_dict({**saved, "world_size": saved["world_size"] + 1}, resumed_group)
    with pytest.raises(ValueError, match="codec"):
        tb.load_state_dict(saved, _geocomm_group(codec="fp8"))


@pytestmark_mpi
@pytest.mark.parametrize("codec", ["fp8", "geofp8"])
def test_mismatch_raises_on_every_rank_and_the_group_goes_on(comm, codec):
    """fp8 checks when the call is made (adapters/torch/backend/checks.py), geofp8 (stateful)
    on the worker; either way before any payload moves: a 2000-value fp8 payload
    is over 2000 bytes, a check's all-gather a row of int64 per peer (72 bytes)."""
    group = _geocomm_group(codec=codec)
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(2000 + 100 * rank)  # every rank compresses, counts differ
    before = tb.stats(group).sent
    with pytest.raises(CollectiveMismatchError, match="count"):
        dist.all_reduce(t, group=group)
    assert tb.stats(group).sent - before <= 8 * len(FIELDS) * (size - 1)
    ok = torch.ones(2000)
    dist.all_reduce(ok, group=group)
    assert torch.equal(ok, torch.full((2000,), float(size)))


@pytestmark_mpi
def test_ranks_on_different_codecs_raise_instead_of_waiting(comm):
    """Rank 0 on fp8 (stateless), the others on geofp8 (stateful, which also checks its
    state on the worker): the check every call starts when it is made compares the
    codec configs, so all raise at once rather than wait on different channels."""
    group = _geocomm_group(codec="fp8" if dist.get_rank() == 0 else "geofp8")
    with pytest.raises(CollectiveMismatchError, match="codec config"):
        dist.all_reduce(torch.ones(2000), group=group)


def test_work_wait_keeps_its_timeout():
    """``work.wait(timeout)`` raised nothing and blocked until the job ended; now a job
    still running after a positive timeout raises (as gloo's work does), and a zero
    timeout (torch's default, kNoTimeout) waits for the job."""
    from datetime import timedelta

    from geocomm.adapters.torch.backend.work import FutureWork

    future = torch.futures.Future()
    work = FutureWork(future)
    with pytest.raises(geocomm.CollectiveTimeout, match=r"within 0:00:00\.050000"):
        work.wait(timedelta(milliseconds=50))
    future.set_result([torch.ones(1)])
    assert work.wait(timedelta(seconds=5)) and work.wait(timedelta(0)) and work.wait()


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="min_numel"):
        tb.BackendConfig(min_numel=0)
    with pytest.raises(ValueError, match="compress"):
        tb.BackendConfig(compress="all_reduce")
    with pytest.raises(KeyError, match="unknown codec"):
        tb.configure(codec="no-such-codec")
    assert tb.configure().codec == "fp8"  # nothing was kept
    assert "geocomm" in dist.Backend.backend_list


# ---------------------------------------------------------------------------
# two torchrun-style ranks: the default group is geocomm's


def _two_ranks(scenario: str, timeout: float = 240, **env: str) -> list[str]:
    """Run this file's ``scenario`` on 2 ranks with torchrun's environment and ``env``;
    their outputs."""
    # imported here: the ranks run this file as a script (-P: its folder not on the path)
    from torchrun_ranks import two_torchrun_ranks

    argv = [sys.executable, "-P", __file__, scenario]
    return two_torchrun_ranks(argv, {"GEOCOMM_MIN_NUMEL": str(MIN_NUMEL), **env}, timeout)


def _result(output: str) -> str:
    return [line for line in output.splitlines() if line.startswith("RESULT ")][-1]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def _scenario_gpt2() -> None:
    import transformers

    import geocomm.adapters.torch  # noqa: F401  registers "geocomm"

    dist.init_process_group("cpu:geocomm,cuda:geocomm")
    assert isinstance(dist.group.WORLD, tb.GeocommProcessGroup)
    rank = dist.get_rank()
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config)
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 256, (4, 32), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)  # a scalar: exact
        losses.append(total.item() / 2)
    stats = tb.stats()
    print(f"RESULT {_digest(net)} {stats.compressed} {stats.sent < stats.baseline} {losses}")
    dist.destroy_process_group()


def _scenario_lightning() -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import geocomm.adapters.torch  # noqa: F401  registers "geocomm"

    class Task(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True))
    task = Task()
    trainer = L.Trainer(
        strategy=DDPStrategy(process_group_backend="geocomm", bucket_cap_mb=0.01),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, torch.utils.data.DataLoader(data, batch_size=8))
    stats = tb.stats()
    print(f"RESULT {_digest(task)} {stats.compressed} {dist.get_backend()}")


def _scenario_absent_peer() -> None:
    """Rank 0 makes a compressed all-reduce that rank 1 never makes; rank 1 stays until
    rank 0 is done (GEOCOMM_TEST_FLAG names the file rank 0 writes then)."""
    import os
    import time
    from datetime import timedelta
    from pathlib import Path

    import geocomm.adapters.torch  # noqa: F401  registers "geocomm"

    dist.init_process_group("geocomm", timeout=timedelta(seconds=120))
    flag = Path(os.environ["GEOCOMM_TEST_FLAG"])
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4 * MIN_NUMEL))
            print("RESULT returned", flush=True)
        except Exception as exc:
            print(f"RESULT {time.monotonic() - start:.1f} {type(exc).__name__}: {exc}", flush=True)
        flag.write_text("done")
    else:
        deadline = time.monotonic() + 200
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # the group's peer is gone: no teardown to wait for


def test_a_compressed_call_without_its_peer_fails_after_geocomm_timeout(tmp_path):
    """The metadata check of a compressed call waits for its peers at most
    GEOCOMM_TIMEOUT, as every other wait for a peer does (a regression test: it once
    waited for the group's timeout, here 120 s; torch's default is 30 minutes).
    GEOCOMM_TIMEOUT=4: the call raises CollectiveTimeout for the check after 4 s, and
    far less than 120 s."""
    flag = tmp_path / "done"
    out = _two_ranks("absent_peer", GEOCOMM_TIMEOUT="4", GEOCOMM_TEST_FLAG=str(flag))[0]
    seconds, error = _result(out).split(" ", 2)[1:]
    assert 3.5 <= float(seconds) < 60, out
    assert error.startswith("CollectiveTimeout: ") and "waited 4.0 s for the metadata" in error


def test_gpt2_from_config_trains_under_ddp_on_the_backend():
    pytest.importorskip("transformers")
    results = [_result(out).split(" ", 4) for out in _two_ranks("gpt2")]
    assert results[0][1] == results[1][1]  # parameters bitwise identical
    assert int(results[0][2]) > 0 and results[0][3] == "True"


def test_lightning_process_group_backend_geocomm():
    pytest.importorskip("lightning")
    results = [_result(out).split() for out in _two_ranks("lightning")]
    assert results[0][1] == results[1][1]
    assert int(results[0][2]) > 0 and results[0][3] == "geocomm"


if __name__ == "__main__":
    scenarios = {"gpt2": _scenario_gpt2, "lightning": _scenario_lightning,
                 "absent_peer": _scenario_absent_peer}  # fmt: skip
    scenarios[sys.argv[1]]()


@pytestmark_mpi
def test_an_aborted_group_returns_at_once_and_refuses_compressed_calls(comm):
    """torch's _abort_process_group calls the group's abort() when a peer is gone: it
    returns without waiting for queued calls, and a compressed call made on the group
    afterwards raises at once instead of starting a collective no peer will join."""
    group = _geocomm_group()
    tensor = torch.ones(MIN_NUMEL)
    dist.all_reduce(tensor, group=group)  # a compressed call that works
    dist.distributed_c10d._abort_process_group(group)
    with pytest.raises(RuntimeError, match="was aborted"):
        group.allreduce([tensor])
