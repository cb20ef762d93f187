"""FSDP2 (fully_shard, gloo, launched by mpirun) with geocomm's compressed reduce-scatter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import geocomm
from geocomm import CollectiveMismatchError
from geocomm.adapters.torch import compress_fsdp, init_distributed_from_mpi
from geocomm.codecs.bounds import FP32_UNIT, allreduce_bound, reduce_scatter_bound
from geocomm.engine.layout import DEFAULT_STAGE_SIZE, Pieces, wire_bytes

pytestmark = [pytest.mark.mpi(min_size=2)]


def _mlp() -> torch.nn.Module:
    """Linear layers of 256 x 64, 256 x 256 (GeoFP8-eligible chunks) and 3 x 256 with
    biases; 3 and 129 rows do not divide by 2 or 4 ranks (FSDP pads dim 0)."""
    torch.manual_seed(2)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 129),
        torch.nn.Tanh(),
        torch.nn.Linear(129, 3),
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own micro-batch of a fixed regression task (a smooth target)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 64, generator=g)
    return x, torch.stack([x[:, :8].sum(1), x[:, 8:16].tanh().sum(1), x[:, 0] * x[:, 1]], 1)


def _loss(model: torch.nn.Module, rank: int, step: int, dtype=torch.float32) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _sharded(mesh=None, mp: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    init_distributed_from_mpi()
    model = _mlp()
    kwargs = {"mesh": mesh} if mesh is not None else {}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _exact_grads(rank: int, step: int) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Every rank's own full gradient (flat, fp64, for the bounds) and, per
    parameter, the exact average over the ranks."""
    net = _mlp()
    _loss(net, rank, step).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    inputs = [e.double().numpy() for e in every]
    mean, at, exact = np.mean(inputs, axis=0), 0, {}
    for name, p in net.named_parameters():
        exact[name] = mean[at : at + p.numel()].reshape(p.shape)
        at += p.numel()
    return inputs, exact


def _my_rows(full: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This rank's FSDP shard of a full tensor (torch.chunk along dim 0; ranks past
    the last chunk hold no rows)."""
    chunks = torch.chunk(torch.from_numpy(full), size, dim=0)
    return chunks[rank].numpy() if rank < len(chunks) else full[:0]


def test_compressed_reduce_scatter_is_what_runs(comm):
    model = _sharded()
    rank, size = dist.get_rank(), dist.get_world_size()
    fsdp = compress_fsdp(model, "fp8")
    codec = geocomm.get_codec("fp8")
    metered = fsdp.reduce_scatters[0].reducer.comm  # shared by every module
    assert all(rs.reducer.comm is metered for rs in fsdp.reduce_scatters)
    for step in range(2):
        sent0, calls0 = metered.sent, metered.calls
        _loss(model, rank, step).backward()
        stats = fsdp.last_step
        # one compressed reduce-scatter per sharded module (the four Linear layers)
        assert stats.step == step and len(stats.buckets) == 4 == stats.collectives
        # the communicator saw exactly those reduce-scatters: one all-to-all per
        # pipeline stage, carrying the fp8 wire bytes of each module's flat buffer
        plans = [
            Pieces.cut(rs.layout.numel, size, DEFAULT_STAGE_SIZE)  # the host's stage
            for rs in fsdp.reduce_scatters
        ]
        assert metered.calls - calls0 == sum(p.stages for p in plans)
        expected = sum(wire_bytes(codec, p, rank, gather=False) for p in plans)
        assert metered.sent - sent0 == expected == stats.bytes_sent
        assert stats.ratio == pytest.approx(4 / (1 + 4 / 128), rel=0.02)
        model.zero_grad()


def test_gradient_within_derived_bound(comm):
    model = _sharded()
    rank, size = dist.get_rank(), dist.get_world_size()
    compress_fsdp(model, "fp8")
    inputs, exact = _exact_grads(rank, 0)
    _loss(model, rank, 0).backward()
    # reduce_scatter_bound bounds the sum with A = max |x| of what it is given: the
    # whole gradient's max bounds every encoded piece's; FSDP's average divides the
    # bound by N and rounds once more
    full = reduce_scatter_bound(inputs, geocomm.get_codec("fp8")) / size
    at, differs = 0, False
    for name, p in model.named_parameters():
        want = _my_rows(exact[name], rank, size)
        bound = _my_rows(
            full[at : at + p.numel()].reshape(p.shape), rank, size
        ) + FP32_UNIT * np.abs(want)
        got = p.grad.to_local().double().numpy()
        assert got.shape == want.shape
        assert np.all(np.abs(got - want) <= bound), name
        differs |= bool(np.any(got != want))
        at += p.numel()
    assert differs  # compressed, not exact


def _train(codec, steps: int, **kwargs) -> list[float]:
    model = _sharded()
    rank, size = dist.get_rank(), dist.get_world_size()
    if codec is not None:
        compress_fsdp(model, codec, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for step in range(steps):
        loss = _loss(model, rank, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / size)
    return losses


@pytest.mark.parametrize("codec", ["fp8", "geofp8"])
def test_training_tracks_uncompressed_fsdp(comm, codec):
    steps = 40
    exact = _train(None, steps)
    compressed = _train(codec, steps)
    assert compressed[-1] < 0.5 * compressed[0]  # it trains
    # each step's gradient carries a relative error of about 2% (the telemetry's
    # estimate for fp8 E4M3 here), unbiased: over 40 SGD steps the mean loss of
    # the last ten steps moved by 0.002-0.016% (fp8 and geofp8, 2 and 4 ranks),
    # so a 1% limit fails on real divergence, not on quantization noise
    last = np.mean(exact[-10:])
    assert abs(np.mean(compressed[-10:]) - last) <= 0.01 * last


def test_geofp8_keys_every_chunk_of_every_parameter(comm):
    model = _sharded()
    size = dist.get_world_size()
    fsdp = compress_fsdp(model, "geofp8")
    for step in range(2):
        _loss(model, dist.get_rank(), step).backward()
        model.zero_grad()
    codec = fsdp.reduce_scatters[0].reducer.codec
    keys = {k for k, _ in codec.state_dict()["keys"]}
    names = {n for n, _ in model.named_parameters()}
    mapped = {k[0] for k in keys}
    # the 256 x 256 matrix's chunks (128 or 64 rows) are large enough to be mapped
    assert "2.weight" in mapped
    # each rank's chunk of a parameter is a tensor of its own, keyed (name, chunk);
    # chunks have one padded shape, so a mapped parameter has every chunk keyed
    assert all(isinstance(k, tuple) and len(k) == 2 and k[0] in names for k in keys)
    for name in mapped:
        assert {k for k in keys if k[0] == name} == {(name, r) for r in range(size)}


def test_exclusions_go_plain(comm):
    model = _sharded()
    rank, size = dist.get_rank(), dist.get_world_size()
    fsdp = compress_fsdp(model, "fp8", exclude=("*.bias",))
    inputs, exact = _exact_grads(rank, 0)
    _loss(model, rank, 0).backward()
    abs_sum = np.sum(np.abs(inputs), axis=0)
    assert [b.collectives for b in fsdp.last_step.buckets] == [2, 2, 2, 2]
    at = 0
    for name, p in model.named_parameters():
        got = p.grad.to_local().double().numpy()
        want = _my_rows(exact[name], rank, size)
        if name.endswith(".bias"):
            # exact: an fp32 sum of N terms and one division, at most 2^-24 sum |g_i|
            tol = FP32_UNIT * _my_rows(abs_sum[at : at + p.numel()].reshape(p.shape), rank, size)
            assert np.all(np.abs(got - want) <= tol), name
        elif got.size:  # a rank past the last chunk of a short matrix holds no rows
            assert np.any(got != want), name
        at += p.numel()


def test_min_numel_counts_the_whole_parameter_as_the_ddp_hook_does(comm):
    """``min_numel`` compares a parameter's values, not one rank's chunk of them: the
    64 x 256 weight (16384 values, chunks of 16384 / N) travels compressed at
    ``min_numel=16384`` on any number of ranks, and the 3 x 129 weight (387) does not.
    The replica all-reduce decides alike."""
    init_distributed_from_mpi()
    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, size), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh["shard"])
    fsdp = compress_fsdp(model, "fp8", min_numel=16384, replicate_group=mesh.get_group("replicate"))
    for reductions in (fsdp.reduce_scatters, fsdp.all_reduce_hooks):
        compressed = {
            e.name for r in reductions if r.layout.compressed for e in r.layout.compressed.entries
        }
        assert compressed == {"0.weight", "2.weight", "4.weight"}


def test_ignored_parameters_stay_out_of_the_compressed_reduce_scatter(comm):
    """``fully_shard(..., ignored_params=...)`` leaves a parameter plain, outside FSDP's
    buffers and its reduce-scatter (its gradient stays this rank's own): the compressed
    reduce-scatter lays out the sharded ones only, and they still get FSDP's average
    within fp8's bound."""
    init_distributed_from_mpi()
    model = _mlp()
    rank, size = dist.get_rank(), dist.get_world_size()
    ignored = model[2].bias
    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, ignored_params={ignored} if i == 2 else None)
    fully_shard(model)
    fsdp = compress_fsdp(model, "fp8")
    inputs, exact = _exact_grads(rank, 0)
    _loss(model, rank, 0).backward()
    full = reduce_scatter_bound(inputs, geocomm.get_codec("fp8")) / size
    at = 0
    for name, p in model.named_parameters():
        if p is ignored:  # this rank's own gradient, untouched by any collective
            assert not isinstance(p.grad, torch.distributed.tensor.DTensor)
            assert fsdp.last_step.collectives == 4
        else:
            want = _my_rows(exact[name], rank, size)
            bound = _my_rows(full[at : at + p.numel()].reshape(p.shape), rank, size)
            got = p.grad.to_local().double().numpy()
            assert np.all(np.abs(got - want) <= bound + FP32_UNIT * np.abs(want)), name
        at += p.numel()


def test_bf16_reduce_dtype(comm):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = _sharded(mp=mp)
    rank = dist.get_rank()
    fsdp = compress_fsdp(model, "fp8")
    _loss(model, rank, 0, torch.bfloat16).backward()
    stats = fsdp.last_step
    assert len(stats.buckets) == 4
    # the wire carries fp8 either way; the baseline is a bf16 reduce-scatter
    assert stats.ratio == pytest.approx(2 / (1 + 4 / 128), rel=0.02)
    for p in model.parameters():
        assert torch.isfinite(p.grad.to_local()).all()


def test_replica_all_reduce_hook(comm):
    """HSDP-style: FSDP over a 1-D mesh of one rank each, the world as replicas."""
    init_distributed_from_mpi()
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size, 1), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh["shard"])
    fsdp = compress_fsdp(model, "fp8", replicate_group=mesh.get_group("replicate"))
    inputs, exact = _exact_grads(rank, 0)
    _loss(model, rank, 0).backward()
    stats = fsdp.last_step
    assert len(stats.buckets) == 4 == stats.collectives
    assert all(b.kind == "allreduce" for b in stats.buckets)
    full = allreduce_bound(inputs, geocomm.get_codec("fp8")) / size
    got = np.concatenate(
        [p.grad.to_local().double().numpy().reshape(-1) for p in model.parameters()]
    )
    want = np.concatenate([exact[n].reshape(-1) for n, _ in model.named_parameters()])
    assert np.all(np.abs(got - want) <= full + FP32_UNIT * np.abs(want))
    # every replica holds the same bits
    rows = [torch.empty(got.size, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(rows, torch.from_numpy(got))
    assert all(torch.equal(r, rows[0]) for r in rows)


def test_replicas_accumulate_micro_batches_without_an_all_reduce(comm):
    """Gradient accumulation as FSDP documents it for HSDP: under
    ``set_requires_all_reduce(False)`` a backward reduce-scatters but sends nothing to
    the replicas, and the next all-reducing backward sends the sum of both micro-batches.
    The lossless codec makes the gradient the exact average over the ranks of the two
    micro-batches' sums, up to fp32's rounding (each rank's two additions of its
    micro-batches, its N - 1 additions of the ranks' sums and the division: at most N + 2
    roundings of 2^-24 of the sum of magnitudes, over N)."""
    init_distributed_from_mpi()
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size, 1), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh["shard"])
    fsdp = compress_fsdp(model, "none", replicate_group=mesh.get_group("replicate"))
    model.set_requires_all_reduce(False)
    _loss(model, rank, 0).backward()
    assert fsdp.last_step.collectives == 0 and fsdp.last_step.buckets == []
    assert all(p.grad.to_local().abs().max() == 0 for p in model.parameters())
    model.set_requires_all_reduce(True)
    _loss(model, rank, 1).backward()
    assert fsdp.last_step.collectives == 4
    assert all(hook.partial is None for hook in fsdp.all_reduce_hooks)
    micro_batches = np.array([_exact_grads(rank, step)[0] for step in (0, 1)])  # step, rank
    want = np.mean(micro_batches.sum(axis=0), axis=0)
    magnitudes = np.abs(micro_batches).sum(axis=(0, 1))
    got = np.concatenate(
        [p.grad.to_local().double().numpy().reshape(-1) for p in model.parameters()]
    )
    assert np.all(np.abs(got - want) <= (size + 2) * FP32_UNIT * magnitudes / size)


@pytest.mark.mpi(min_size=4)
def test_replica_all_reduce_sums_under_a_custom_divide_factor(comm):
    """With ``set_gradient_divide_factor(F)`` (and sum-only comms, which F needs here)
    FSDP divides each reduced shard by F after the all-reduce hook, and native HSDP's
    all-reduce sums: F is the whole divisor. The replicas' all-reduce sums too, so the
    gradient is the ranks' sum over F (here F = 2 N: half the average). The lossless
    codec makes that exact up to fp32's rounding of the sums (N + 2 roundings of at
    most 2^-24 of the sum of magnitudes; an average over the replicas would be off by
    a factor N / 2)."""
    init_distributed_from_mpi()
    rank, size = dist.get_rank(), dist.get_world_size()
    if size % 2:
        pytest.skip("two shards per replica")
    mesh = init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh["shard"])
    compress_fsdp(model, "none", replicate_group=mesh.get_group("replicate"))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(2.0 * size)
            module.set_force_sum_reduction_for_comms(True)
    inputs, exact = _exact_grads(rank, 0)
    _loss(model, rank, 0).backward()
    shard = mesh["shard"].get_local_rank()
    magnitudes, at = np.sum(np.abs(inputs), axis=0), 0
    for name, p in model.named_parameters():
        want = _my_rows(exact[name] / 2, shard, 2)
        scale = _my_rows(magnitudes[at : at + p.numel()].reshape(p.shape), shard, 2)
        got = p.grad.to_local().double().numpy()
        assert np.all(np.abs(got - want) <= (size + 2) * FP32_UNIT * scale / (2 * size)), name
        at += p.numel()


@pytest.mark.mpi(min_size=4)
def test_hsdp_gives_the_replicas_a_geofp8_state_of_their_own(comm):
    """HSDP with GeoFP8: the shard ranks' reduce-scatter and the replicas' all-reduce
    each keep their own codec state. Shared, GeoFP8's allocation of directions over
    every key the instance held differed between the ranks of one replica group (each
    shard rank holds other replica keys), so their side channels differed in size:
    gloo's "collective mismatch" and a SIGABRT at the second step on 4 ranks. The
    replica state is saved with the rest and loads into a resumed job."""
    init_distributed_from_mpi()
    rank, size = dist.get_rank(), dist.get_world_size()
    if size % 2:
        pytest.skip("two shards per replica")
    mesh = init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("replicate", "shard"))
    config = {"id": "geofp8", "min_dim": 8, "min_numel": 0}
    model = _sharded(mesh["shard"])
    fsdp = compress_fsdp(model, config, replicate_group=mesh.get_group("replicate"))
    assert fsdp.replica_codec is not None and fsdp.replica_codec is not fsdp.codec
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    fresh = geocomm.get_codec(config).state_checksum()
    assert fsdp.replica_codec.state_checksum() != fresh  # the replicas' keys hold state
    replicas = mesh.get_group("replicate")
    for p in model.parameters():  # the replicas of a shard hold the same bits
        mine = p.to_local().detach().clone()
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(replicas))]
        dist.all_gather(rows, mine, group=replicas)
        assert all(torch.equal(r, rows[0]) for r in rows)
    saved = fsdp.state_dict()
    resumed_model = _sharded(mesh["shard"])
    resumed = compress_fsdp(resumed_model, config, replicate_group=replicas)
    resumed.load_state_dict(saved)
    assert resumed.replica_codec.state_checksum() == fsdp.replica_codec.state_checksum()
    unreplicated = compress_fsdp(_sharded(mesh["shard"]), config)  # nothing to load it into
    with pytest.raises(ValueError, match="replica all-reduce"):
        unreplicated.load_state_dict(saved)


def test_unfreezing_after_install_is_refused_naming_the_cause(comm):
    """compress_fsdp lays out the parameters that require grad when it installs; one
    unfrozen later changes FSDP's reduce-scatter buffer. Every rank refuses it alike,
    and the error says why (it named sizes only)."""
    init_distributed_from_mpi()
    model = _mlp()
    model[2].weight.requires_grad_(False)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    compress_fsdp(model, "fp8")
    _loss(model, dist.get_rank(), 0).backward()
    model[2].weight.requires_grad_(True)
    with pytest.raises(ValueError, match="freezing or unfreezing one"):
        _loss(model, dist.get_rank(), 1).backward()


def test_premul_sum_is_refused_clearly(comm):
    model = _sharded()
    compress_fsdp(model, "fp8")
    # a factor other than the group size makes FSDP ask for PREMUL_SUM
    model[0].set_gradient_divide_factor(dist.get_world_size() + 1.0)
    with pytest.raises(ValueError, match="AVG and SUM"):
        _loss(model, dist.get_rank(), 0).backward()


def test_mismatched_layouts_raise_on_every_rank(comm):
    model = _sharded()
    rank = dist.get_rank()
    compress_fsdp(model, "fp8", exclude=("*.bias",) if rank == 0 else ())
    with pytest.raises(CollectiveMismatchError, match="differ from rank 0 in parts or key"):
        _loss(model, rank, 0).backward()


def test_bad_codec_fails_before_any_collective(comm):
    model = _sharded()
    with pytest.raises(KeyError, match="nope"):
        compress_fsdp(model, "nope")


def test_a_parameter_without_gradient_keeps_its_place_or_names_the_torch_it_needs(comm):
    """A module whose parameter gets no gradient: from torch 2.13 FSDP fills in zeros
    (set_reduce_scatter_unused_params) and the step runs with the module's full layout;
    older releases leave the parameter out of the buffer, and the call raises a
    ValueError that names torch 2.13 instead of reducing values under the wrong keys.
    CI runs this on the support window's oldest (2.9) and newest release."""
    from geocomm.adapters.torch import support

    class Partly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = torch.nn.Linear(64, 64), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    init_distributed_from_mpi()
    torch.manual_seed(5)
    model = Partly()
    fully_shard(model)
    fsdp = compress_fsdp(model, "fp8")
    x, _ = _batch(dist.get_rank(), 0)

    def step() -> None:
        model(x).square().mean().backward()

    if support.torch_version() >= (2, 13):
        step()
        assert fsdp.last_step is not None and fsdp.unused_params
        assert float(model.unused.weight.grad.to_local().abs().sum()) == 0.0
    else:
        with pytest.raises(ValueError, match=r"torch >= 2\.13"):
            step()
