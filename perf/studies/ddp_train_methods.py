"""The DDP study's methods on the ranks (perf/studies/ddp_train.py runs them): the models
with their communication hooks, the hook alone, and the measured gradient error.

Methods: ``default`` (DDP's fp32 all-reduce), ``fp16`` (DDP's
``fp16_compress_hook``), ``powersgd`` (PyTorch's ``powerSGD_hook``, rank
:data:`POWERSGD_RANK`, error feedback and warm start, compressing from step
:data:`POWERSGD_START`), ``nocomm`` (no communication) and any geocomm codec
id (``fp8``, ``nvfp4``, ``geofp8``...: ``geocomm.adapters.torch.geocomm_hook``).

Every hook but DDP's default runs inside :class:`MeasuredHook`, which on the
steps it is told to measure also all-reduces the bucket's own gradients in
fp32 on a side group and compares the hook's result with that exact average:
the measured gradient error, ||result - exact|| / ||exact|| over a step's
buckets. (On PowerSGD's steps the error-feedback memory is part of what the
hook sends; the error is against this step's exact average all the same.)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

POWERSGD_RANK = 1
POWERSGD_START = 2

# DDP rejects a bucket annotation other than dist.GradBucket (a string, with
# "from __future__ import annotations"), so the hooks below leave it out.
HOOK_CALLS = [0]
#: perf_counter() of the step's first hook call (any wrapped method), None before it
FIRST_HOOK: list[float | None] = [None]


def counting_hook(state, bucket):
    """geocomm's hook, counting DDP's buckets."""
    import geocomm.adapters.torch as gt

    HOOK_CALLS[0] += 1
    return gt.geocomm_hook(state, bucket)


def nocomm_hook(state, bucket):
    """Return the local gradient at once: what the step costs without communication."""
    import torch

    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def capture_hook(state, bucket):
    """Keep a copy of every bucket (buffer, parameters, index), communicate nothing."""
    state.append((bucket.buffer().clone(), bucket.parameters(), bucket.index()))
    return nocomm_hook(None, bucket)


class OneBucketAtATime:
    """PowerSGD's hook with one bucket in flight at a time.

    ``powerSGD_hook`` issues a bucket's second and third all-reduce (P, then
    Q) from callbacks; with two buckets in flight those callbacks run in an
    order that differs between ranks, and gloo fails on mismatched sizes
    (``Received data size doesn't match expected size``). So each bucket's hook
    first waits for the previous bucket's result: the same buckets as the other
    methods, reduced one after the other.
    """

    def __init__(self, state: Any):
        self.state = state
        self.last: Any = None

    def __call__(self, state: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        if self.last is not None:
            self.last.wait()
        self.last = powerSGD_hook.powerSGD_hook(self.state, bucket)
        return self.last


class MeasuredHook:
    """A hook and its state, plus the measured error on the steps where ``measure`` is on.

    ``steps`` collects, per measured step, the sums (||result - exact||^2,
    ||exact||^2) over that step's buckets; :meth:`rel_errors` turns them into
    relative errors. ``side`` is a gloo group apart from DDP's, for the exact
    fp32 average.
    """

    def __init__(self, hook: Any, state: Any, side: Any, size: int):
        self.hook, self.state, self.side, self.size = hook, state, side, size
        self.measure = False
        self.steps: list[list[float]] = []

    def start_step(self) -> None:
        if self.measure:
            self.steps.append([0.0, 0.0])

    def rel_errors(self) -> list[float]:
        return [float(np.sqrt(e / n)) if n > 0 else 0.0 for e, n in self.steps]


def measured_hook(wrapper: MeasuredHook, bucket):
    """Run ``wrapper``'s hook; on measured steps compare its result with the exact average."""
    import torch.distributed as dist

    if FIRST_HOOK[0] is None:
        FIRST_HOOK[0] = time.perf_counter()
    if not wrapper.measure:
        return wrapper.hook(wrapper.state, bucket)
    exact = bucket.buffer().clone()
    dist.all_reduce(exact, group=wrapper.side)
    exact = exact.double() / wrapper.size
    record = wrapper.steps[-1]

    def compare(fut):
        value = fut.value()
        got = value[0] if isinstance(value, list) else value
        diff = got.double() - exact
        record[0] += float(diff @ diff)
        record[1] += float(exact @ exact)
        return got

    return wrapper.hook(wrapper.state, bucket).then(compare)


def ddp_model(cfg: Any, args: argparse.Namespace, method: str, side: Any, size: int) -> tuple:
    """(module, DDP model, geocomm hook state or None, MeasuredHook or None, optimizer,
    update(step))."""
    import torch
    from llama import TrainConfig, apply_update, build_model, make_optimizer
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm.adapters.torch as gt

    net = build_model(cfg, args.seed)
    model = DDP(net, bucket_cap_mb=args.bucket_mb)
    state, wrapper = None, None
    if method == "fp16":
        wrapper = MeasuredHook(default_hooks.fp16_compress_hook, None, side, size)
    elif method == "powersgd":
        psgd = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START,
            use_error_feedback=True,
            warm_start=True,
        )
        wrapper = MeasuredHook(OneBucketAtATime(psgd), None, side, size)
    elif method == "nocomm":
        model.register_comm_hook(None, nocomm_hook)
    elif method != "default":
        state = gt.GeocommHookState(net, codec=method, stage_size=args.stage_size)
        wrapper = MeasuredHook(counting_hook, state, side, size)
    if wrapper is not None:
        model.register_comm_hook(wrapper, measured_hook)
    if args.optimizer == "adamw":  # llama.py's: AdamW, clipping, warm-up
        tc = TrainConfig()
        opt = make_optimizer(net, tc)
        return net, model, state, wrapper, opt, lambda step: apply_update(net, opt, tc, step)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    return net, model, state, wrapper, opt, lambda step: opt.step()


def max_over_ranks(values: list[float], group: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def hook_alone(
    args: argparse.Namespace, net: Any, codec: str, data: Any, rank: int, size: int, side: Any
) -> dict[str, Any]:
    """Seconds to reduce one step's buckets with the hook's reducer alone (median of
    ``args.alone_repeats``, slower rank), with a state and codec of its own."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import geocomm
    import geocomm.adapters.torch as gt

    buckets: list[Any] = []
    model = DDP(net, bucket_cap_mb=args.bucket_mb)
    model.register_comm_hook(buckets, capture_hook)
    for step in range(2):  # the second step has DDP's rebuilt buckets
        buckets.clear()
        tokens, targets = data.batches("train", rank, size, step)
        model(tokens, targets).backward()
    # a codec instance of its own: GeoFP8 state apart from the training run's
    state = gt.GeocommHookState(net, codec=geocomm.get_codec(codec), stage_size=args.stage_size)
    times = []
    for _ in range(args.alone_repeats):
        work = [(b.clone(), p, i) for b, p, i in buckets]
        dist.barrier(group=side)
        t = time.perf_counter()
        for buffer, params, index in work:
            state.reduce_bucket(buffer, params, index)
        times.append(time.perf_counter() - t)
    times = max_over_ranks(times, side)
    return {
        "seconds": float(np.median(times)),
        "buckets": len(buckets),
        "bucket_numel": [int(b.numel()) for b, _, _ in buckets],
    }
