"""Helpers for tests, studies and perf tools: simulated ranks, metering, timing.

* :func:`simulate_allreduce` / :func:`simulate_reduce_scatter`: the
  collectives' algorithm (both quantizations, the owner's own piece exact, the
  transforming-codec protocol with its exact side sums and refresh rounds) on
  N simulated ranks, each with its own codec instance, for arrays of any
  namespace that speaks the array API (NumPy, array-api-strict, CuPy). What
  it returns is what :func:`geocomm.allreduce` returns on N real ranks, bit
  for bit (tests check that), for round-to-nearest codecs without error
  feedback.
* :class:`MeteredComm`: wraps a communicator and counts the bytes each
  collective call sends, so studies can report wire and side-channel bytes
  without reaching into the pipeline.
* :func:`loopback` and :func:`run_lockstep`: N ranks' pipelines in one
  process, phase by phase, over communicators that copy between the ranks'
  buffers (NumPy or CuPy): the batched GPU pipeline at several ranks on one
  device or on a CPU.
* Perf helpers shared by ``perf/`` and ``perf/studies/``: :func:`parse_size`,
  :func:`timed` and :func:`slowest` (the slowest rank's time, nccl-tests
  style), :func:`ring_bytes`, :func:`breakdown` (encode, communication and
  decode timed apart against the pipelined call), :func:`emulated_link` and
  :func:`launch_command` (how the job was started), :func:`busy_loops` (a
  slower machine), and :func:`yardstick`: two speeds of this machine measured
  in the run, printed next to every performance table so readers can scale.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from geocomm.codecs import Codec, TransformingCodec, get_codec
from geocomm.comm.metered import MeteredComm
from geocomm.engine.exact import SMALL_SUM_VALUES
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import DEFAULT_CHUNK_ELEMS, Pieces, schedule, shard_bounds

__all__ = ["LoopbackComm", "MeteredComm", "Yardstick", "breakdown", "busy_loops",
           "emulated_link", "launch_command", "loopback", "parse_size", "ring_bytes",
           "roundtrip", "run_lockstep", "run_refresh_locally", "simulate_allreduce",
           "simulate_reduce_scatter", "slowest", "timed", "yardstick", "yardstick_line"]


def _host(a: Any) -> np.ndarray:
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        return a.get()
    return a if isinstance(a, np.ndarray) else np.from_dlpack(a)


def roundtrip(codec: Codec, values: Any) -> np.ndarray:
    """decode(encode(values)) through the codec's wire format (flat float32, host)."""
    flat = np.ascontiguousarray(_host(values), np.float32).reshape(-1)
    wire = np.empty(codec.wire_size(flat.size), np.uint8)
    codec.encode_wire(flat, wire)
    out = np.empty(flat.size, np.float32)
    codec.decode_wire(wire, out)
    return out


def run_refresh_locally(codec: TransformingCodec, plan: Any, values: Any, side_sum: Any) -> None:
    """A plan's refresh as one rank alone runs it: ``values`` is the whole result
    (the rank's shard is everything) and each partial sum is its own total."""
    rounds = codec.refresh(plan, values, 0, side_sum)
    value = next(rounds, None)
    while value is not None:
        value = _send(rounds, value)


def _ordered_sum(values: Sequence[Any]) -> Any:
    """The collectives' exact sum (:func:`geocomm.engine.exact.exact_sum`): small ones add
    every rank's values in rank order; larger ones, per shard, the owner's values
    first, then the others in rank order."""
    xp = array_namespace(*values)
    size = len(values)
    count = values[0].shape[0]
    if count * size <= SMALL_SUM_VALUES:
        total = values[0]
        for other in values[1:]:
            total = total + other
        return total
    bounds = shard_bounds(count, size)
    total = xp.zeros(count, dtype=xp.float32)
    for owner, (lo, hi) in enumerate(itertools.pairwise(int(b) for b in bounds)):
        acc = values[owner][lo:hi]
        for rank in range(size):
            if rank != owner:
                acc = acc + values[rank][lo:hi]
        total[lo:hi] = acc
    return total


def _plans(codecs: Sequence[Codec], xs: Sequence[Any], shape: tuple[int, ...], key: Any,
           bounds: Sequence[int]) -> tuple[list[Any], list[Any]]:
    """Every rank's plan and mapped flat values (its input when there is no plan)."""
    plans, mapped = [], []
    for codec, x in zip(codecs, xs, strict=True):
        xp = array_namespace(x)
        flat = xp.reshape(xp.astype(x, xp.float32), (-1,))
        plan = codec.plan(flat, shape, key, bounds) if isinstance(
            codec, TransformingCodec) else None
        out = flat
        if plan is not None:
            out = xp.empty_like(flat)
            plan.forward(flat, out)
        plans.append(plan)
        mapped.append(out)
    return plans, mapped


def _side_sum(plans: Sequence[Any]) -> Any:
    if plans[0] is None or plans[0].side is None:
        return None
    xp = array_namespace(plans[0].side)
    shape = plans[0].side.shape
    return xp.reshape(_ordered_sum([xp.reshape(p.side, (-1,)) for p in plans]), shape)


def _refresh(codecs: Sequence[Codec], plans: Sequence[Any], shards: Sequence[Any],
             los: Sequence[int], side_sum: Any) -> None:
    """Drive every rank's refresh rounds in lockstep, summing their yields in order."""
    if plans[0] is None or not plans[0].refreshes:
        return
    rounds = [c.refresh(p, s, lo, side_sum)
              for c, p, s, lo in zip(codecs, plans, shards, los, strict=True)]
    values = [next(r, None) for r in rounds]
    while values[0] is not None:
        xp = array_namespace(values[0])
        shape = values[0].shape
        total = xp.reshape(_ordered_sum([xp.reshape(v, (-1,)) for v in values]), shape)
        values = [_send(r, total) for r in rounds]


def _send(rounds: Any, total: Any) -> Any:
    try:
        return rounds.send(total)
    except StopIteration:
        return None


def _reduce_shards(codecs: Sequence[Codec], mapped: Sequence[Any], bounds: np.ndarray,
                   gather: bool) -> list[np.ndarray]:
    """Per owner, its shard of the pipeline's sum: its own piece exact, the others
    quantized once, summed in rank order (and re-quantized when ``gather``)."""
    size = len(mapped)
    host = [np.ascontiguousarray(_host(m), np.float32) for m in mapped]
    shards = []
    for owner, (lo, hi) in enumerate(itertools.pairwise(int(b) for b in bounds)):
        acc = host[owner][lo:hi].copy()
        for rank in range(size):
            if rank != owner:
                acc += roundtrip(codecs[rank], host[rank][lo:hi])
        shards.append(roundtrip(codecs[owner], acc) if gather else acc)
    return shards


def simulate_allreduce(codecs: Sequence[Codec], xs: Sequence[Any], key: Any = None) -> Any:
    """The sum that :func:`geocomm.allreduce` returns on ``len(xs)`` ranks.

    Rank i uses ``codecs[i]`` (its own state, as separate processes would)
    and input ``xs[i]``; shards follow np.array_split. ``key`` None stands for
    the shape, as in the collectives. Returns an array of xs[0]'s namespace and
    shape, identical on every simulated rank (the codecs' states advance).
    """
    size = len(xs)
    xp = array_namespace(*xs)
    shape = tuple(xs[0].shape)
    count = math.prod(shape)
    key = ("shape", shape) if key is None else key
    bounds = shard_bounds(count, size)
    plans, mapped = _plans(codecs, xs, shape, key, bounds)
    total = xp.asarray(np.concatenate(_reduce_shards(codecs, mapped, bounds, gather=True)))
    side_sum = _side_sum(plans)
    if plans[0] is not None:
        plans[0].inverse(total, 0, side_sum)  # identical on every rank: invert once
    shards = [total[int(bounds[r]): int(bounds[r + 1])] for r in range(size)]
    _refresh(codecs, plans, shards, [int(bounds[r]) for r in range(size)], side_sum)
    return xp.reshape(total, shape)


def simulate_reduce_scatter(codecs: Sequence[Codec], xs: Sequence[Any], key: Any = None
                            ) -> list[Any]:
    """Every rank's shard that :func:`geocomm.reduce_scatter` returns (flat, in rank order)."""
    size = len(xs)
    xp = array_namespace(*xs)
    shape = tuple(xs[0].shape)
    key = ("shape", shape) if key is None else key
    bounds = shard_bounds(math.prod(shape), size)
    plans, mapped = _plans(codecs, xs, shape, key, bounds)
    shards = [xp.asarray(s) for s in _reduce_shards(codecs, mapped, bounds, gather=False)]
    side_sum = _side_sum(plans)
    los = [int(bounds[r]) for r in range(size)]
    for plan, shard, lo in zip(plans, shards, los, strict=True):
        if plan is not None and shard.shape[0]:
            plan.inverse(shard, lo, side_sum)
    _refresh(codecs, plans, shards, los, side_sum)
    return shards


# ---------------------------------------------------------------------------
# several ranks in one process


class _Exchange:
    """One collective call of every rank: what each posted, and whether it has moved."""

    def __init__(self, size: int):
        self.posts: list[Any] = [None] * size
        self.moved = False

    def move(self) -> None:
        """Copy every posted send segment into its receiver's buffer (once all posted)."""
        for r, (_, _, _, recv, recv_counts, recv_displs) in enumerate(self.posts):
            for p, (send, send_counts, send_displs, *_) in enumerate(self.posts):
                count = int(send_counts[r])
                if count != int(recv_counts[p]):
                    raise ValueError(f"rank {p} sends {count} bytes to rank {r}, "
                                     f"which expects {int(recv_counts[p])}")
                if count:
                    at, to = int(send_displs[r]), int(recv_displs[p])
                    recv[to: to + count] = send[at: at + count]
        self.moved = True


class _LoopbackRequest:
    def __init__(self, exchange: _Exchange):
        self.exchange = exchange

    def test(self) -> bool:
        return self.exchange.moved

    def wait(self) -> None:
        if not self.exchange.moved:
            raise RuntimeError("a loopback collective waited before every rank posted it")

    wait_stream = wait  # the copies ran in order on the one current stream


class LoopbackComm:
    """Rank ``rank`` of ``size`` ranks in this process (see :func:`loopback`).

    The k-th collective call of every rank forms one exchange; when the last
    rank posts it, every segment is copied to its receiver (on the current
    stream for CuPy buffers), so the send buffers are read as they were when
    posted, as NCCL reads them in stream order. ``backend`` is what the
    communicator reports (the batched pipeline checks only ``wait_stream``).
    """

    def __init__(self, hub: list[_Exchange], rank: int, size: int, backend: str):
        self.hub, self.rank, self.size, self.backend = hub, rank, size, backend
        self.calls = 0

    def alltoallv(self, send, send_counts, send_displs, recv, recv_counts, recv_displs):
        if self.calls == len(self.hub):
            self.hub.append(_Exchange(self.size))
        exchange = self.hub[self.calls]
        self.calls += 1
        exchange.posts[self.rank] = (send, send_counts, send_displs, recv, recv_counts,
                                     recv_displs)
        if all(post is not None for post in exchange.posts):
            exchange.move()
        return _LoopbackRequest(exchange)

    def allgatherv(self, send, recv, counts, displs):
        mine = int(counts[self.rank])
        return self.alltoallv(send, np.full(self.size, mine), np.zeros(self.size, np.int64),
                              recv, counts, displs)


def loopback(size: int, backend: str = "loopback") -> list[LoopbackComm]:
    """``size`` communicators of one loopback group, rank 0 first."""
    hub: list[_Exchange] = []
    return [LoopbackComm(hub, rank, size, backend) for rank in range(size)]


def run_lockstep(pipelines: Sequence[Any]) -> None:
    """Run every rank's pipeline (one per rank, in rank order) phase by phase:
    each phase of the schedule on every rank before the next phase, so every
    collective is posted by all ranks before any rank waits for it."""
    first = pipelines[0]
    for phase, stage in schedule(first.pieces.stages, first.gather):
        for pipe in pipelines:
            getattr(pipe, phase)(stage)
    for pipe in pipelines:
        pipe.release()


# ---------------------------------------------------------------------------
# perf helpers (perf/*.py and perf/studies/*.py)


def parse_size(text: str) -> int:
    """'8', '1K', '128M', '1G' -> bytes (binary multiples, like nccl-tests)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def ring_bytes(nbytes: int, size: int) -> int:
    """Bytes a rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N of them."""
    return 2 * (size - 1) * nbytes // size


def slowest(comm: Any, value: float) -> float:
    """The largest of every rank's ``value`` (a collective: every rank calls it)."""
    mine, worst = np.array([value], np.float64), np.empty(1)
    comm.allreduce(mine, worst, "max")
    return float(worst[0])


def timed(comm: Any, fn: Callable[[], Any], iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls after a barrier, the
    slowest rank's (as nccl-tests reports)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest(comm, (time.perf_counter() - start) / max(iters, 1))


def breakdown(comm: Any, codec: Codec, x: np.ndarray, chunk: int | None, gather: bool,
              repeats: int = 3) -> dict[str, float]:
    """Seconds of one compressed all-reduce (``gather=False``: reduce-scatter) of ``x``
    taken apart: ``encode``, ``comm`` and ``decode`` run one after the other
    (no overlap), and ``pipelined``, the same call with its stages overlapped.
    Each is the best of ``repeats`` runs, the slowest rank's; a plain codec only
    (no geometry map)."""
    runs = [_breakdown_once(comm, codec, x, chunk, gather) for _ in range(repeats)]
    return {part: min(run[part] for run in runs) for part in runs[0]}


def _breakdown_once(comm: Any, codec: Codec, x: np.ndarray, chunk: int | None,
                    gather: bool) -> dict[str, float]:
    source = np.ascontiguousarray(x, np.float32).reshape(-1)
    pieces = Pieces.plan(source.size, comm.size, chunk or DEFAULT_CHUNK_ELEMS)
    bounds = pieces.bounds
    offset = 0 if gather else int(bounds[comm.rank])
    length = source.size if gather else int(bounds[comm.rank + 1] - bounds[comm.rank])
    result = np.empty(length, np.float32)
    parts = dict.fromkeys(("encode", "comm", "decode", "pipelined"), 0.0)

    def clock(part: str, fn: Callable[..., Any], *args: Any) -> None:
        start = time.perf_counter()
        fn(*args)
        parts[part] += time.perf_counter() - start

    pipe = Pipeline(comm, codec, pieces, source, result, offset, gather)
    comm.barrier()
    for s in range(pieces.stages):
        clock("encode", pipe.encode_stage, s)
        clock("comm", lambda s=s: (pipe.start_alltoall(s), pipe.a2a_req[s].wait()))
        clock("decode", pipe.reduce_stage, s)
        if gather:
            clock("encode", pipe.reencode_stage, s)
            clock("comm", lambda s=s: (pipe.start_allgather(s), pipe.ag_req[s].wait()))
            clock("decode", pipe.decode_stage, s)
    pipelined = Pipeline(comm, codec, pieces, source, result, offset, gather)
    comm.barrier()
    clock("pipelined", pipelined.run)
    mine, worst = np.array(list(parts.values())), np.empty(len(parts))
    comm.allreduce(mine, worst, "max")
    return dict(zip(parts, worst.tolist(), strict=True))


def emulated_link() -> str | None:
    """The rate (and delay) of ``perf/emulated_link.py``'s link; None when unshaped."""
    return os.environ.get("GEOCOMM_LINK")


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` CPU-spinning processes during the block: an emulated slower machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def launch_command(nranks: int) -> str:
    """The command line that reproduces this run of ``nranks`` ranks, launcher included."""
    link = emulated_link()
    plain = " --plain" if link and link.endswith(" plain") else ""
    launcher = (f"python perf/emulated_link.py --rate {link.split()[0]}{plain} -n {nranks}"
                if link else f"python -m geocomm.launch -n {nranks}")
    return " ".join([launcher, "--", "python", *sys.argv])


@dataclass(frozen=True)
class Yardstick:
    """Two speeds of the machine a run measured, so readers can scale its numbers
    to theirs: ``copy_GBps``, ``np.copyto`` of ``mib`` MiB of float32 into a
    preallocated array (memory bandwidth), and ``fp8_encode_GBps``, geocomm's
    E4M3 block-128 encode of the same values (codec speed); both in GB/s of
    float32 input (1 GB = 1e9 bytes), one thread, median of the timed calls.
    """

    copy_GBps: float
    fp8_encode_GBps: float
    mib: int = 64

    def __str__(self) -> str:
        return (f"np.copyto {self.copy_GBps:.2f} GB/s, fp8 E4M3 block-128 encode "
                f"{self.fp8_encode_GBps:.2f} GB/s ({self.mib} MiB of fp32, one thread)")


def yardstick(comm: Any = None, mib: int = 64, repeats: int = 5) -> Yardstick | None:
    """Measure :class:`Yardstick` here and now (about half a second at 64 MiB).

    Call it in the run whose numbers it accompanies and store it with them.
    With ``comm`` (a collective: every rank calls it), rank 0 measures while
    the others wait in a barrier, so that no rank competes with it for the
    memory bus; rank 0 gets the result, the others None.
    """
    if comm is not None:
        ruler = yardstick(None, mib, repeats) if comm.rank == 0 else None
        comm.barrier()
        return ruler
    x = np.random.default_rng(0).standard_normal((mib << 20) // 4, dtype=np.float32)
    copy = np.empty_like(x)
    codec = get_codec("fp8", fmt="e4m3", block=128)
    wire = np.empty(codec.wire_size(x.size), np.uint8)

    def gbps(fn: Callable[[], Any]) -> float:
        fn()  # warm-up: page faults, lazy initialisation
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return x.nbytes / float(np.median(times)) / 1e9

    return Yardstick(gbps(lambda: np.copyto(copy, x)),
                     gbps(lambda: codec.encode_wire(x, wire)), mib)


def yardstick_line(record: dict[str, Any] | None) -> str:
    """A markdown sentence for a stored yardstick (``dataclasses.asdict`` of a
    :class:`Yardstick`; None for a result recorded before yardsticks existed)."""
    if not record:
        return "Machine yardstick: not measured in this run."
    return f"Machine yardstick, measured in this run: {Yardstick(**record)}."
