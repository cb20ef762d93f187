"""TorchDistCommunicator's byte movers and device mode, over gloo from MPI, against MPI.

Run at 1 to 4 ranks (``-m mpi``): any counts and displacements (out of rank
order, holes, zero counts, send and receive in one buffer) give MPI's bytes;
the batched pipeline's all-gather, an all-to-all in place on one buffer,
moves every rank's body to its slot; and with ``device_arrays=True`` (backend
"nccl", requests with ``wait_stream()``) the whole batched pipeline of
:mod:`geocomm.engine.device`, run on NumPy arrays by its host kernels, gives
:func:`geocomm.allreduce`'s bits over MPI. The unmarked tests check the
helpers that need no ranks: the copy plans, the fp32 helpers' bits (subnormals
kept, the residual's bits unchanged) and the new kernels' PTX.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import geocomm
from geocomm import get_codec
from geocomm.comm import torchdist
from geocomm.comm.base import CollectiveTimeout, wait, wait_ordered
from geocomm.engine import device as gp
from geocomm.engine import device_tables as gpl
from geocomm.engine.arithmetic import add_into, residual_of
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import Pieces
from geocomm.kernels import cuda

try:
    from mpi4py import MPI
except ImportError:  # the helpers' tests run without MPI
    MPI = None

# ---------------------------------------------------------------------------
# helpers that need no ranks


class _GlooLikeWork:
    """A torch ``Work`` as gloo's behaves: ``wait(timeout)`` raises "Operation timed
    out!" while pending, the work's own error once failed; done after ``polls`` waits."""

    def __init__(self, polls: int, error: Exception | None = None):
        self.polls, self.error, self.waits = polls, error, 0

    def is_completed(self) -> bool:
        return self.waits >= self.polls

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if not self.is_completed():
            if timeout is None:
                self.waits = self.polls
            else:
                raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True


def test_a_host_request_sleeps_in_work_wait_and_finishes_once():
    """wait_for is torch's Work.wait with a timeout (no future callback runs Python on
    gloo's thread): False while the work is pending, True once it completed or failed;
    the finish step runs once, after completion, and a failed work raises its error."""
    import torch

    finished = []
    request = torchdist.TorchWork(
        _GlooLikeWork(polls=2), lambda: finished.append(1), (torch.zeros(4),)
    )
    assert not request.test()
    assert [request.wait_for(0.01) for _ in range(2)] == [False, True]
    assert request.test() and request.test() and finished == [1]
    # torch raises a failed transfer's error as a RuntimeError (DistBackendError)
    failed = torchdist.TorchWork(_GlooLikeWork(polls=2, error=RuntimeError("peer gone")))
    assert not failed.wait_for(0.01)
    assert failed.wait_for(0.01)  # completed, by failing
    with pytest.raises(RuntimeError, match="peer gone"):
        failed.test()
    assert torchdist.TorchWork(None).test()


def test_a_late_release_keeps_its_tensors_until_torch_lets_go(monkeypatch):
    """A transfer whose host tensors torch still holds after RELEASE_WAIT_S is counted,
    and its tensors stay referenced here (so gloo's thread never drops the last one,
    which would abort a finalizing process) until the exit handler saw them released,
    or waited EXIT_RELEASE_WAIT_S."""
    import torch

    monkeypatch.setattr(torchdist, "RELEASE_WAIT_S", 0.0)
    monkeypatch.setattr(torchdist, "EXIT_RELEASE_WAIT_S", 0.05)
    monkeypatch.setattr(torchdist, "_unreleased", [])
    late = torchdist.late_releases
    tensor, other = torch.zeros(4), torch.ones(4)
    # a C++ reference to the tensor, as gloo's completed work keeps: autograd's saved one
    gloo = torch.ones(4, requires_grad=True) * tensor
    assert tensor._use_count() == 2
    assert torchdist._await_release((other,))  # nobody else holds it: no wait
    assert not torchdist._await_release((tensor, other))
    assert torchdist.late_releases == late + 1
    assert [t is tensor or t is other for t in torchdist._unreleased] == [True, True]
    del gloo  # torch lets go
    assert tensor._use_count() == 1
    torchdist._release_at_exit()
    assert torchdist._unreleased == []
    # one torch never lets go: the exit gives up after EXIT_RELEASE_WAIT_S
    held = torch.zeros(4)
    kept = torch.ones(4, requires_grad=True) * held
    torchdist._unreleased.append(held)
    torchdist._release_at_exit()
    assert torchdist._unreleased == [] and held._use_count() == 2 and kept.grad_fn


def test_packed_base():
    base = torchdist._packed_base
    c = np.array([3, 0, 2, 4])
    assert base(c, np.array([0, 3, 3, 5])) == 0
    assert base(c, np.array([7, 99, 10, 12])) == 7  # a zero count's displacement is free
    assert base(c, np.array([0, 3, 4, 6])) is None  # a hole
    assert base(c, np.array([6, 0, 0, 2])) is None  # out of rank order
    assert base(np.zeros(3, int), np.array([5, 1, 2])) == 0


@pytest.mark.parametrize("layout", ["runs", "broadcast", "scattered"])
def test_copies_follow_every_segment(layout):
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 200, dtype=np.uint8)
    counts = np.array([5, 0, 7, 3, 6])
    if layout == "runs":  # contiguous in both: one copy, same bytes
        src_at, dst_at = np.array([10, 15, 15, 22, 25]), np.array([0, 5, 5, 12, 15])
    elif layout == "broadcast":  # one source segment to consecutive places
        counts = np.array([4, 4, 0, 4])
        src_at, dst_at = np.array([30, 30, 1, 30]), np.array([0, 4, 8, 8])
    else:
        src_at, dst_at = np.array([100, 0, 50, 3, 180]), np.array([40, 0, 1, 90, 60])
    dst = np.full(120, 0xAB, np.uint8)
    want = dst.copy()
    for c, d, s in zip(counts, dst_at, src_at, strict=True):
        want[d : d + c] = src[s : s + c]
    torchdist._copies(dst, dst_at, src, src_at, counts)
    assert np.array_equal(dst, want)


def _f32_pool(rng: np.random.Generator, n: int) -> np.ndarray:
    """Normal, huge, tiny and subnormal values of both signs, zeros, infinities, NaNs."""
    normal = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 120, n))).astype(np.float32)
    sub = (
        rng.integers(1, 1 << 23, n, dtype=np.uint32)
        | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    ).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45], np.float32)
    return rng.choice(np.concatenate([normal, sub, special]), n)


def test_fp32_helpers_keep_subnormals_and_the_residual_bits():
    """add_into is NumPy's ``+=``, a NaN sum written as a GPU's (0x7fffffff, whatever the
    operands' NaNs: an encoder puts a NaN's sign in its code); residual_of gives what
    error feedback always computed
    (``sent *= -1; sent += values``), the IEEE ``values - decoded`` (``np.subtract``),
    wherever that is finite, and 0 elsewhere (a non-finite value is sent once, not on
    every later call)."""
    rng = np.random.default_rng(2)
    n = 1 << 16
    a, b = _f32_pool(rng, n), _f32_pool(rng, n)
    with np.errstate(all="ignore"):
        b[:64] = np.float32(np.inf) - np.float32(np.inf)  # both NaN, different payloads
        a[:64] = np.nan
        acc = a.copy()
        add_into(acc, b)
        want = a.copy()
        want += b
        want[np.isnan(want)] = np.uint32(0x7FFFFFFF).view(np.float32)
        assert np.array_equal(acc.view(np.uint32), want.view(np.uint32))
        tiny = np.finfo(np.float32).tiny
        subnormal = np.isfinite(acc) & (acc != 0) & (np.abs(acc) < tiny)
        assert subnormal.sum() > 1000  # kept, not flushed

        decoded = b.copy()
        residual_of(a, decoded)
        old = b.copy()
        old *= -1
        old += a
        ieee = np.subtract(a, b)
    finite = np.isfinite(ieee)
    assert (~finite).sum() > 64  # NaN and inf operands, and overflowing differences
    assert np.array_equal(decoded.view(np.uint32)[finite], old.view(np.uint32)[finite])
    assert np.array_equal(decoded.view(np.uint32)[finite], ieee.view(np.uint32)[finite])
    assert np.array_equal(decoded[~finite], np.zeros((~finite).sum(), np.float32))


def test_fp32_helpers_name_what_is_missing_for_device_arrays():
    if cuda.available:
        pytest.skip("CuPy and a device are present")
    with pytest.raises(cuda.CudaUnavailable):
        cuda.add(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(cuda.CudaUnavailable):
        cuda.residual(np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32))


def _nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc (CUDA toolkit) not found")
def test_add_and_sub_kernels_are_ieee_in_ptx(tmp_path):
    """gc_add_f32 and gc_residual_f32 are one .rn add per value, bounds-checked, no .ftz."""
    path = tmp_path / "gc_cuda.cu"
    path.write_text(cuda.kernel_source())
    ptx = tmp_path / "gc_cuda.ptx"
    proc = subprocess.run(
        [
            _nvcc(),
            "-ptx",
            "-arch=compute_80",
            "-fmad=false",
            "-ftz=false",
            "-prec-div=true",
            str(path),
            "-o",
            str(ptx),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    for name in ("gc_add_f32", "gc_residual_f32"):
        body = re.search(rf"\.entry {name}\b(.*?)\n}}", text, re.S)
        assert body is not None, f"{name} is missing"
        ops = re.findall(r"^\s*((?:add|sub|neg|mul|fma)\.\S*f32)", body[1], re.M)
        assert ops and all(op in ("add.rn.f32", "sub.rn.f32", "neg.f32") for op in ops), ops
        assert "setp" in body[1]  # the i < n check


# ---------------------------------------------------------------------------
# over ranks: gloo from MPI, against MPI


@pytest.fixture(scope="module")
def group():
    """A gloo process group of every rank (torch.distributed set up from MPI)."""
    if MPI is None:
        pytest.skip("mpi4py is not installed")
    import torch.distributed as dist

    from geocomm.adapters.torch import init_distributed_from_mpi

    init_distributed_from_mpi()
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo")


@pytest.fixture(scope="module")
def mpi_comm():
    from geocomm.comm.mpi import MPICommunicator

    return MPICommunicator(MPI.COMM_WORLD)


@pytest.fixture(params=[None, True], ids=["host", "device_arrays"])
def torch_comm(request, group):
    return torchdist.TorchDistCommunicator(group, device_arrays=request.param)


def _layout(rng: np.random.Generator, sizes: list[int], at: int = 0) -> tuple[np.ndarray, int]:
    """Displacements of segments of ``sizes`` in a random order with random holes from
    byte ``at`` on; returns them and the end."""
    displs = np.zeros(len(sizes), np.int64)
    for j in rng.permutation(len(sizes)):
        at += int(rng.integers(0, 5))  # a hole (or none)
        displs[j] = at
        at += sizes[j]
    return displs, at + int(rng.integers(0, 5))


def _exchange_plan(size: int, seed: int) -> np.ndarray:
    """counts[i, j]: bytes rank i sends rank j (some zero), the same on every rank."""
    rng = np.random.default_rng([seed, size])
    counts = rng.integers(0, 40, (size, size))
    counts[rng.random((size, size)) < 0.3] = 0
    return counts


@pytest.mark.mpi
@pytest.mark.parametrize("seed", range(4))
def test_alltoallv_any_displacements_as_mpi(torch_comm, mpi_comm, seed):
    """Segments out of rank order with holes and zero counts, into a receive buffer
    whose holes must keep their bytes: the bytes MPI gives, on every rank."""
    comm, rank = torch_comm, mpi_comm.rank
    counts = _exchange_plan(comm.size, seed)
    rng = np.random.default_rng([seed, rank, 7])
    send_displs, send_end = _layout(rng, counts[rank].tolist())
    recv_displs, recv_end = _layout(rng, counts[:, rank].tolist(), at=int(rng.integers(0, 9)))
    send = rng.integers(0, 256, send_end, dtype=np.uint8)
    recv = np.full(recv_end, 0xAB, np.uint8)
    want = recv.copy()
    mpi_comm.alltoallv(send, counts[rank], send_displs, want, counts[:, rank], recv_displs).wait()
    sent = send.copy()
    request = comm.alltoallv(send, counts[rank], send_displs, recv, counts[:, rank], recv_displs)
    wait(request, "the test's all-to-all", rank)
    assert np.array_equal(recv, want)
    assert np.array_equal(send, sent)


@pytest.mark.mpi
@pytest.mark.parametrize("seed", range(4))
def test_alltoallv_in_place_on_one_buffer_as_mpi(torch_comm, mpi_comm, seed):
    """Send and receive segments interleaved (disjoint) in ONE buffer: what MPI puts
    into a separate copy of it, which keeps the sent bytes as they were."""
    comm, rank = torch_comm, mpi_comm.rank
    counts = _exchange_plan(comm.size, seed + 10)
    rng = np.random.default_rng([seed, rank, 8])
    sizes = counts[rank].tolist() + counts[:, rank].tolist()
    displs, end = _layout(rng, sizes)
    send_displs, recv_displs = displs[: comm.size], displs[comm.size :]
    buf = rng.integers(0, 256, end, dtype=np.uint8)
    want = buf.copy()
    mpi_comm.alltoallv(
        buf.copy(), counts[rank], send_displs, want, counts[:, rank], recv_displs
    ).wait()
    wait(
        comm.alltoallv(buf, counts[rank], send_displs, buf, counts[:, rank], recv_displs),
        "the test",
        rank,
    )
    assert np.array_equal(buf, want)


@pytest.mark.mpi
@pytest.mark.parametrize("count", [30_011, 4096 * 3 + 5, 7])
def test_batched_allgather_pattern_moves_every_body(torch_comm, count):
    """device_tables.call_tables's all-gather (an all-to-all in place on one buffer: the own
    body, at its slot, to every other rank; every other body into its slot) leaves
    every rank's body at that rank's slot, for every stage."""
    comm = torch_comm
    fmt = gpl.wire_format(get_codec({"id": "fp8", "fmt": "e4m3", "block": 128}))
    pieces = Pieces.cut(count, comm.size, 4096 * comm.size)
    plans = [gpl.call_tables(fmt, pieces, r) for r in range(comm.size)]
    for s in range(pieces.stages):
        ex = plans[comm.rank].stages[s].allgather
        bodies = [
            np.random.default_rng([s, j, count]).integers(
                0, 256, plans[j].stages[s].own_bytes, dtype=np.uint8
            )
            for j in range(comm.size)
        ]
        displs = ex.recv_displs
        buf = np.full(plans[comm.rank].gather_bytes + 3, 0xAB, np.uint8)
        mine = displs[comm.rank]
        buf[mine : mine + bodies[comm.rank].size] = bodies[comm.rank]
        if comm.size > 1:
            request = comm.alltoallv(
                buf, ex.send_counts, ex.send_displs, buf, ex.recv_counts, ex.recv_displs
            )
            wait(request, "the test's all-gather", comm.rank)
        for j in range(comm.size):
            at = int(displs[j])
            assert np.array_equal(buf[at : at + bodies[j].size], bodies[j]), (s, j)
        end = int(displs[-1]) + bodies[-1].size
        assert (buf[end:] == 0xAB).all()


@pytest.mark.mpi
def test_allgatherv_uneven_out_of_order_as_mpi(torch_comm, mpi_comm):
    comm, rank = torch_comm, mpi_comm.rank
    counts = np.array([(5 * j + 3) % 11 for j in range(comm.size)], np.int64)
    rng = np.random.default_rng([comm.size, 9])  # the same layout on every rank
    displs, end = _layout(rng, counts.tolist())
    send = np.random.default_rng([rank, 9]).integers(0, 256, counts[rank] + 2, dtype=np.uint8)
    want = np.full(end, 0xAB, np.uint8)
    got = want.copy()
    mpi_comm.allgatherv(send[: counts[rank]], want, counts, displs).wait()
    wait(comm.allgatherv(send, got, counts, displs), "the test", rank)
    assert np.array_equal(got, want)


@pytest.mark.mpi
def test_device_mode_and_its_requests(group):
    host = torchdist.TorchDistCommunicator(group)
    device = torchdist.TorchDistCommunicator(group, device_arrays=True)
    assert (host.backend, host.device_arrays) == ("gloo", False)
    assert (device.backend, device.device_arrays) == ("gloo", True)  # the transport it is
    n = device.size
    buf = np.zeros(4 * n, np.uint8)
    counts, displs = np.full(n, 4), np.arange(n) * 4
    for comm, offers in ((host, False), (device, True)):
        request = comm.alltoallv(buf.copy(), counts, displs, buf, counts, displs)
        assert hasattr(request, "wait_stream") is offers
        (request.wait_stream if offers else request.wait)()
        assert request.test()
        gathered = comm.allgatherv(buf[:4], np.zeros(4 * n, np.uint8), counts, displs)
        assert hasattr(gathered, "wait_stream") is offers
        wait_ordered(gathered, "the test", comm.rank)


@pytest.mark.mpi
def test_bad_segments_are_value_errors(torch_comm):
    comm, n = torch_comm, torch_comm.size
    buf = np.zeros(8 * n, np.uint8)
    ok = np.full(n, 8), np.arange(n) * 8
    with pytest.raises(ValueError, match="entries"):
        comm.alltoallv(buf, ok[0][:-1], ok[1], buf.copy(), *ok)
    with pytest.raises(ValueError, match="outside"):
        comm.alltoallv(buf, ok[0], ok[1] + 1, buf.copy(), *ok)
    with pytest.raises(ValueError, match="outside"):
        comm.alltoallv(buf, ok[0], ok[1], buf.copy(), np.full(n, -1), ok[1])
    with pytest.raises(ValueError, match="itself"):
        counts = ok[0].copy()
        counts[comm.rank] = 3
        comm.alltoallv(buf, ok[0], ok[1], buf.copy(), counts, ok[1])
    with pytest.raises(ValueError, match="outside"):
        comm.allgatherv(buf[:8], buf[:4], ok[0], ok[1])
    with pytest.raises(TypeError, match="uint8"):
        comm.alltoallv(buf.view(np.int16), ok[0], ok[1], buf.copy(), *ok)
    with pytest.raises(ValueError, match="op"):
        comm.allreduce(np.zeros(2, np.float32), np.zeros(2, np.float32), "avg")


CODECS = {
    "none": "none",
    "fp8": {"id": "fp8", "fmt": "e4m3", "block": 128},
    "fp8-block0-e5m2": {"id": "fp8", "fmt": "e5m2", "block": 0},
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
    "bf16": "bf16",
}


def _inputs(rank: int, count: int) -> np.ndarray:
    rng = np.random.default_rng([rank, count, 11])
    scale = np.repeat(np.exp2(rng.integers(-12, 13, -(-count // 700))), 700)[:count]
    x = (rng.standard_normal(count) * scale).astype(np.float32)
    x[rng.integers(0, count, 2)] = [np.inf, 1e-42]
    return x


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("in_place", [False, True])
def test_batched_pipeline_over_device_mode_torchdist(group, mpi_comm, name, in_place):
    """The batched pipeline (HostKernels on NumPy arrays) over a gloo TorchDistCommunicator
    with device_arrays=True, several stages: the host-driven pipeline's bits over MPI,
    which are geocomm.allreduce's (the lossless codec's all-reduce is MPI's own sum)."""
    comm = torchdist.TorchDistCommunicator(group, device_arrays=True)
    codec = get_codec(CODECS[name])
    count = 30_011
    x = _inputs(comm.rank, count)
    # several stages (one for block 0: its one scale a body makes each shard one piece)
    pieces = Pieces.cut(count, comm.size, 4096 * comm.size, codec.scale_span())
    want = np.full(count, np.nan, np.float32)
    Pipeline(mpi_comm, codec, pieces, x, want, 0, True).run()
    if name != "none":
        assert_bits_equal(
            geocomm.allreduce(x, codec=codec, comm=mpi_comm, stage_size=4096 * comm.size), want
        )
    source = x.copy()
    out = source if in_place else np.full(count, np.nan, np.float32)
    gp.BatchedPipeline(
        comm, gpl.wire_format(codec), pieces, source, out, 0, True, kernels=gp.HostKernels()
    ).run()
    assert_bits_equal(out, want)


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{np.count_nonzero(~same)} of {got.size} values differ"


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["fp8", "none", {"id": "geofp8", "min_dim": 8, "min_numel": 0}])
def test_collectives_over_device_mode_torchdist(group, mpi_comm, codec):
    """geocomm.allreduce on NumPy arrays over a device-mode torchdist communicator (the
    host pipeline, waits through wait_stream, exact side sums): MPI's bits."""
    comm = torchdist.TorchDistCommunicator(group, device_arrays=True)
    mine, reference = get_codec(codec), get_codec(codec)
    for step in range(3):  # multiples of 1/64 below 2^5: the sums of MPI and gloo are exact
        noise = np.random.default_rng([comm.rank, step, 12]).standard_normal((97, 83))
        x = (np.round(noise * 64) / 64).astype(np.float32)
        got = geocomm.allreduce(x, codec=mine, key="w", comm=comm, stage_size=4096)
        want = geocomm.allreduce(x, codec=reference, key="w", comm=mpi_comm, stage_size=4096)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), step


@pytest.mark.mpi(min_size=2)
def test_a_late_peer_times_out_the_host_waits(group, monkeypatch):
    """The plain all-reduce and the barrier wait at most GEOCOMM_TIMEOUT, as every other
    call does (they waited in torch's Work.wait(), bounded only by the process group's
    own timeout: 30 minutes by default). Rank 1 comes late, once the others gave up on
    each after 0.5 s (it waits for them on MPI, so their give-up is what lets it go on:
    a call that waited for rank 1 would never return); their calls complete when rank
    1's arrive (gloo keeps them)."""
    comm = torchdist.TorchDistCommunicator(group)
    x, out = np.ones(64, np.float32), np.empty(64, np.float32)
    if comm.rank == 1:
        monkeypatch.setenv("GEOCOMM_TIMEOUT", "60")  # its own calls are not late
        MPI.COMM_WORLD.barrier()
        comm.allreduce(x, out, "sum")
        comm.barrier()
    else:
        monkeypatch.setenv("GEOCOMM_TIMEOUT", "0.5")
        with pytest.raises(CollectiveTimeout, match="all-reduce"):
            comm.allreduce(x, out, "sum")
        with pytest.raises(CollectiveTimeout, match="barrier"):
            comm.barrier()
        monkeypatch.setenv("GEOCOMM_TIMEOUT", "60")
        MPI.COMM_WORLD.barrier()
    MPI.COMM_WORLD.barrier()
