"""perf/gpu_check.py's ``ddp`` and ``fsdp`` sections: geocomm's DDP hook and FSDP2 on
CUDA over a 1-rank NCCL default group, docs/torch.md's training examples among them.

``ddp``: the hook's buckets in fp32, fp16 and bf16 models (gpu_check_device.ddp_rows),
then docs/torch.md's DDP example (tests/examples/train_ddp.py). ``fsdp`` (issue 39):
docs/torch.md's FSDP2 example (tests/examples/train_fsdp.py). Each example runs as docs/torch.md
writes it (its model, seed, batches, AdamW at lr 1e-3, 20 steps) on ``device``,
twice: uncompressed, and compressed with fp8, docs/torch.md's codec for DDP (its FSDP2
example shows "geofp8"; fp8 here, whose bound the check applies). The row holds:

* ``vs_cpu_mpi``: every compressed collective's result == geocomm's fp8 average of
  the same values (copied as the collective got them) on the CPU over MPI, bit for
  bit, at every step;
* ``exact_calls_exact``: the tensors the example sends exact (DDP: norms, biases
  and tensors under ``min_numel``; FSDP2: biases, ``exclude=("*.bias",)``) come out
  unchanged: the exact average over one rank;
* ``within_fp8_bound``: every compressed value within fp8's derived all-reduce
  bound of its input (geocomm.codecs.bounds.allreduce_bound), and ``compressed``:
  some value changed;
* ``losses``: each step's loss within fp8's relative bound of the uncompressed
  run's, 2U (U = 2^-4, E4M3's half ulp, once for each of the all-reduce's two
  roundings): to first order the gap is the gradients' relative error (at most
  2U per value, less for AdamW, which rescales each update) times the loss's
  relative change over the run (below 1 here), so a larger gap means a bug (a
  lost block, a wrong scale), not rounding; and both runs train (the last loss
  below the first).

On one rank FSDP2 has nothing to reduce-scatter (it copies the gradients), so
compress_fsdp installs no reduce-scatter there: the compressed call is the replica
all-reduce hook over the same 1-rank group (``replicate_group``, the HSDP path),
one compressed all-reduce per module. With a CPU ``device`` and a 1-rank gloo
default group (tests/test_gpu_check_ddp.py) the same rows run without a GPU.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from gpu_check_common import all_equal, value_diff
from gpu_check_device import (
    _torch_bits,
    ddp_rows,
    mlp,
    one_rank_nccl_section,
    one_rank_reference,
)

#: the examples' loop length (docs/torch.md)
STEPS = 20


def check_ddp(ctx: Any, steps: int = 3) -> dict[str, Any]:
    """geocomm_hook in a 1-rank DDP over a NCCL process group: the buckets of
    :func:`gpu_check_device.ddp_rows`, then docs/torch.md's example (:func:`ddp_example_row`)."""
    return one_rank_nccl_section(
        ctx,
        "a 1-rank DDP",
        "dtype",
        lambda d: [*ddp_rows(d, ctx.mpi(), ctx.args.seed, steps), ddp_example_row(d, ctx.mpi())],
    )


def check_fsdp(ctx: Any) -> dict[str, Any]:
    """docs/torch.md's FSDP2 example on a 1-rank NCCL group, compressed: :func:`fsdp_rows`."""
    return one_rank_nccl_section(ctx, "a 1-rank FSDP2", "dtype", lambda d: fsdp_rows(d, ctx.mpi()))


# ---------------------------------------------------------------------------
# the README's loop


def host_copy(t: Any) -> Any:
    """A CPU copy of tensor ``t`` (``.cpu()`` of a CPU tensor would be ``t`` itself)."""
    return t.detach().to("cpu", copy=True)


def readme_batch(step: int, device: Any, rank: int = 0) -> tuple[Any, Any]:
    """The examples' micro-batch of ``step`` (drawn on the CPU, as they draw it)."""
    import torch

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(100 * step + rank))
    return x.to(device), (x[:, 0] > 0).long().to(device)


def train(
    model: Any, device: Any, steps: int, after_backward: Callable[[int], None] | None = None
) -> list[float]:
    """The examples' loop on ``device``: cross-entropy, AdamW at lr 1e-3; the losses.
    ``after_backward(step)`` runs once the gradients are reduced, before the step."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = readme_batch(step, device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if after_backward is not None:
            after_backward(step)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


class Calls:
    """What the compressed collectives got and gave, compared as they happen: one
    flat CPU copy of the values before and after each call, and the ``layout``
    (geocomm.adapters.torch.grads.BufferLayout) that split them."""

    def __init__(self, mpi: Any, stage_size: int | None):
        self.mpi, self.stage_size = mpi, stage_size
        self.count = 0
        self.vs_cpu_mpi: list[dict[str, Any]] = []
        self.exact: list[dict[str, Any]] = []
        self.bounded: list[bool] = []
        self.changed = False

    def compare(self, layout: Any, before: Any, after: Any) -> None:
        from geocomm.codecs import get_codec
        from geocomm.codecs.bounds import allreduce_bound

        self.count += 1
        want = one_rank_reference(layout, before, self.mpi, self.stage_size)
        self.vs_cpu_mpi.append(value_diff(_torch_bits(after), _torch_bits(want)))
        rows, got = before.reshape(1, -1), after.reshape(1, -1)
        if layout.plain is not None:
            plain = [_torch_bits(layout.plain.take(t).reshape(-1)) for t in (got, rows)]
            self.exact.append(value_diff(*plain))
        if layout.compressed is not None:
            x, y = (_torch_bits(layout.compressed.take(t)).astype(np.float64) for t in (rows, got))
            bound = allreduce_bound([x], get_codec("fp8"))
            self.bounded.append(bool(np.all(np.abs(y - x) <= bound)))
            self.changed |= bool(np.any(y != x))

    def fields(self) -> dict[str, Any]:
        """The row's comparisons (first failing one of each kind, else the first)."""

        def first(diffs: list[dict[str, Any]]) -> dict[str, Any]:
            if not diffs:
                return {"equal": False, "why": "no call seen"}
            return next((d for d in diffs if not d["equal"]), diffs[0])

        return {
            "calls": self.count,
            "vs_cpu_mpi": first(self.vs_cpu_mpi),
            "exact_calls_exact": first(self.exact),
            "within_fp8_bound": {"equal": bool(self.bounded) and all(self.bounded)},
            "compressed": {"equal": self.changed},
        }


def loss_check(compressed: list[float], plain: list[float]) -> dict[str, Any]:
    """The ``losses`` comparison (module docstring): per step within 2U relative."""
    from geocomm.codecs import get_codec
    from geocomm.codecs.bounds import error_constants

    limit = 2 * error_constants(get_codec("fp8"))[0]
    gap = max(abs(c - p) / abs(p) for c, p in zip(compressed, plain, strict=True))
    trains = compressed[-1] < compressed[0] and plain[-1] < plain[0]
    return {
        "equal": gap <= limit and trains,
        "largest_relative_gap": gap,
        "limit": limit,
        "compressed": compressed,
        "uncompressed": plain,
    }


def example_row(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"dtype": name}
    try:
        row.update(run())
        row["ok"] = all_equal(row)
    except Exception:
        row.update(ok=False, error=traceback.format_exc())
    return row


# ---------------------------------------------------------------------------
# the examples


def ddp_example_row(device: Any, mpi: Any, steps: int = STEPS) -> dict[str, Any]:
    """docs/torch.md's DDP example (tests/examples/train_ddp.py) on ``device``: the module
    docstring's row."""

    def run() -> dict[str, Any]:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import geocomm.adapters.torch as gt

        ids = [device.index] if device.type == "cuda" else None

        def net() -> Any:
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Linear(512, 1024),
                torch.nn.GELU(),
                torch.nn.LayerNorm(1024),
                torch.nn.Linear(1024, 10),
            ).to(device)

        plain = train(DDP(net(), device_ids=ids, bucket_cap_mb=4), device, steps)
        local = net()
        model = DDP(local, device_ids=ids, bucket_cap_mb=4)
        state = gt.GeocommHookState(
            local, codec="fp8", exclude=("*norm*", "*.bias"), min_numel=4096
        )
        calls = Calls(mpi, state.reducer.stage_size)
        seen: list[tuple[Any, list[Any], int]] = []

        def hook(state, bucket):  # no annotation: DDP checks it
            seen.append((host_copy(bucket.buffer()), bucket.parameters(), bucket.index()))
            return gt.geocomm_hook(state, bucket)

        def after_backward(step: int) -> None:
            for before, params, index in seen:
                after = host_copy(torch.cat([p.grad.reshape(-1) for p in params]))
                calls.compare(state.layout(params, index), before, after)
            seen.clear()

        model.register_comm_hook(state, hook)
        try:
            losses = train(model, device, steps, after_backward)
        finally:
            state.close()
        return {"example": "train_ddp.py", **calls.fields(), "losses": loss_check(losses, plain)}

    return example_row("README DDP example (fp32)", run)


def fsdp_rows(device: Any, mpi: Any, steps: int = STEPS) -> list[dict[str, Any]]:
    """docs/torch.md's FSDP2 example (tests/examples/train_fsdp.py) on ``device``, one
    rank: the module docstring's row."""

    def run() -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        import geocomm.adapters.torch as gt

        def sharded() -> Any:
            torch.manual_seed(0)
            model = mlp(10).to(device)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            return model

        plain = train(sharded(), device, steps)
        model = sharded()
        fsdp = gt.compress_fsdp(
            model, codec="fp8", replicate_group=dist.group.WORLD, exclude=("*.bias",)
        )
        reducer = fsdp.all_reduce_hooks[0].reducer  # one for every module's hook
        calls = Calls(mpi, reducer.stage_size)
        reduce = reducer.allreduce

        def compared(layout: Any, buffer: Any, *args: Any, **kwargs: Any) -> Any:
            # on FSDP's all-reduce stream, where the hook runs: the copies are ordered
            # before and after geocomm's work on it, and .cpu() waits for them
            before = host_copy(buffer)
            stats = reduce(layout, buffer, *args, **kwargs)
            calls.compare(layout, before, host_copy(buffer))
            return stats

        reducer.allreduce = compared
        losses = train(model, device, steps)
        return {
            "example": "train_fsdp.py",
            "hooks": len(fsdp.all_reduce_hooks),
            **calls.fields(),
            "losses": loss_check(losses, plain),
        }

    return [example_row("README FSDP2 example (fp32)", run)]
