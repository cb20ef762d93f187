"""Every GPU route of the public collectives on device arrays == NumPy over MPI, bitwise.

The device arrays (CuPy, or its CPU twin) travel over ``NCCLCommunicator``
and over a ``TorchDistCommunicator`` in device mode (on the twin: a gloo
group, whose transfers the communicator orders with the streams as it must
for host-visible memory); the reference is the same call on NumPy arrays over
the MPI communicator. Both run the same algorithm with the same arithmetic
(the C core on the host, the CUDA kernels, or the twin's host build of the
same kernels), so every bit must agree, on every rank: that is the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import inputs, twice

import geocomm
from geocomm.comm.mpi import MPICommunicator

pytestmark = [pytest.mark.mpi]

#: every format, both fp8 walks (teams up to 1024 values per block, tiles above and
#: for block 0), both MX scale rules, stochastic rounding, error feedback
CODECS = {
    "none": "none",
    "bf16": "bf16",
    "fp8": {"id": "fp8", "fmt": "e4m3", "block": 128},
    "fp8-e5m2-0": {"id": "fp8", "fmt": "e5m2", "block": 0},
    "fp8-tiles": {"id": "fp8", "fmt": "e4m3", "block": 4097},
    "nvfp4": "nvfp4",
    "mxfp8": {"id": "mxfp8", "fmt": "e4m3"},
    "mxfp8-e5m2-rceil": {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
    "mxfp4": "mxfp4",
    "fp8-sr": {"id": "fp8", "fmt": "e4m3", "block": 128, "rounding": "stochastic", "seed": 5},
    "nvfp4-sr": {"id": "nvfp4", "rounding": "stochastic", "seed": 6},
    "mxfp4-sr": {"id": "mxfp4", "rounding": "stochastic", "seed": 7},
    "fp8-ef": {"id": "fp8", "fmt": "e4m3", "block": 128, "error_feedback": True},
}
SIZE = 20_011  # ragged: no block, superblock or shard boundary falls on it evenly
STAGE = 4_096  # several pipeline stages per call


@pytest.fixture(scope="module")
def mpi_comm():
    return MPICommunicator()


@pytest.fixture(scope="module")
def nccl_comm():
    from geocomm.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator()
    yield comm
    comm.close()


@pytest.fixture(scope="module")
def torch_comm():
    import torch.distributed as dist

    from geocomm.adapters.torch import init_distributed_from_mpi
    from geocomm.comm.torchdist import TorchDistCommunicator

    if not dist.is_initialized():
        init_distributed_from_mpi("gloo")
    return TorchDistCommunicator(dist.new_group(backend="gloo"), device_arrays=True)


@pytest.fixture(scope="module")
def gloo_comm(torch_comm):
    """NumPy arrays over a gloo group: the reference of codec "none" over torch, whose
    plain all-reduce sums in gloo's order (MPI's differs from 3 ranks on)."""
    import torch.distributed as dist

    from geocomm.comm.torchdist import TorchDistCommunicator

    return TorchDistCommunicator(dist.new_group(backend="gloo"))


@pytest.fixture(params=["nccl", "torch"])
def device_comm(request):
    return request.getfixturevalue(f"{request.param}_comm")


@pytest.fixture
def reference_comm(request, device_comm, mpi_comm):
    """The communicator of the NumPy reference: MPI, except for the plain all-reduce
    (codec "none") over torch, which is gloo's sum."""
    name = request.node.callspec.params.get("name")
    if name == "none" and device_comm.device_arrays and hasattr(device_comm, "group"):
        return request.getfixturevalue("gloo_comm")
    return mpi_comm


def codec_pair(config):
    """Two codec instances of one config: one for the device calls, one for the
    reference (stateful codecs keep per-call state)."""
    return geocomm.get_codec(config), geocomm.get_codec(config)


def assert_bits(device_result, host_result, what: str) -> None:
    got = device_result.get() if hasattr(device_result, "get") else device_result
    want = np.asarray(host_result)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
        f"{what}: {np.count_nonzero(got != want)} values differ from NumPy over MPI"
    )


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce(cp, device_comm, reference_comm, name, op):
    dev, host = codec_pair(CODECS[name])
    x = inputs(reference_comm.rank, SIZE)
    for call in range(2):  # error feedback: the second call sends the first's residual
        got, want = twice(
            lambda device: geocomm.allreduce(
                cp.asarray(x) if device else x,
                codec=dev if device else host,
                op=op,
                comm=device_comm if device else reference_comm,
                stage_size=STAGE,
            )
        )
        assert_bits(got, want, f"allreduce {name} {op} call {call}")


@pytest.mark.parametrize("name", list(CODECS))
def test_reduce_scatter(cp, device_comm, reference_comm, name):
    dev, host = codec_pair(CODECS[name])
    x = inputs(reference_comm.rank, SIZE, tag=1)
    got, want = twice(
        lambda device: geocomm.reduce_scatter(
            cp.asarray(x) if device else x,
            codec=dev if device else host,
            comm=device_comm if device else reference_comm,
            stage_size=STAGE,
        )
    )
    assert_bits(got, want, f"reduce_scatter {name}")


@pytest.mark.parametrize("name", ["none", "fp8", "nvfp4", "mxfp4", "fp8-sr"])
def test_allgather(cp, device_comm, mpi_comm, name):
    dev, host = codec_pair(CODECS[name])
    x = inputs(mpi_comm.rank, 3_001, tag=2)
    got, want = twice(
        lambda device: geocomm.allgather(
            cp.asarray(x) if device else x,
            codec=dev if device else host,
            comm=device_comm if device else mpi_comm,
        )
    )
    assert_bits(got, want, f"allgather {name}")


def test_allreduce_in_place_and_out(cp, device_comm, mpi_comm):
    dev, host = codec_pair(CODECS["fp8"])
    x = inputs(mpi_comm.rank, SIZE, tag=3)
    y = cp.asarray(x)
    got = geocomm.allreduce(y, codec=dev, out=y, comm=device_comm, stage_size=STAGE)
    assert got is y
    assert_bits(y, geocomm.allreduce(x, codec=host, comm=mpi_comm, stage_size=STAGE), "in place")


@pytest.mark.parametrize(
    "config",
    [
        {"id": "geofp8", "min_dim": 8, "min_numel": 0, "refresh": 2},
        {"id": "geofp8", "min_dim": 8, "min_numel": 0, "refresh": 2, "transform": "whiten"},
        {"id": "geofp8", "min_dim": 8, "min_numel": 0, "refresh": 2, "error_feedback": True},
    ],
)
def test_geofp8_with_refreshes(cp, device_comm, mpi_comm, config, monkeypatch):
    """Five calls per key (cold start, then power steps every 2 calls), two keys in one
    buffer (as a DDP bucket) and a reduce-scatter: results and state checksums agree,
    for the split, the whitening and the split with error feedback. Each matrix is of
    rank 3 plus noise, its row space turning after three calls, so the keys map (the
    split kernels, the power step, the residual's read) rather than go plain."""
    from geocomm.engine.transforming import PartsMap

    dev, host = codec_pair(config)
    shapes = [(96, 80), (40, 64)]
    parts = [("w1", shapes[0]), ("w2", shapes[1])]
    split, in_kernels = PartsMap.split, []

    def counted(self, lo, hi, back):
        found = split(self, lo, hi, back)
        in_kernels.append(found is not None)  # only the device pipeline asks
        return found

    monkeypatch.setattr(PartsMap, "split", counted)
    for call in range(5):
        tensors = []
        for i, (m, n) in enumerate(shapes):
            rows = np.random.default_rng([i, call // 3]).standard_normal((3, n))
            rank = np.random.default_rng([mpi_comm.rank, call, i])
            tensors.append(
                10 * rank.standard_normal((m, 3)) @ rows + 0.05 * rank.standard_normal((m, n))
            )
        x = np.concatenate([t.reshape(-1) for t in tensors]).astype(np.float32)
        got = geocomm.allreduce(
            cp.asarray(x), codec=dev, parts=parts, comm=device_comm, stage_size=2_048
        )
        want = geocomm.allreduce(x, codec=host, parts=parts, comm=mpi_comm, stage_size=2_048)
        assert_bits(got, want, f"geofp8 call {call}")
        shard = geocomm.reduce_scatter(cp.asarray(x), codec=dev, parts=parts, comm=device_comm)
        assert_bits(
            shard,
            geocomm.reduce_scatter(x, codec=host, parts=parts, comm=mpi_comm),
            f"geofp8 reduce_scatter call {call}",
        )
    assert dev.state_checksum() == host.state_checksum()
    # the split and its error feedback ran maps inside the device kernels
    assert any(in_kernels) == (config.get("transform") != "whiten")


def test_geofp8_steps_past_nonfinite_gradients(cp, device_comm, mpi_comm):
    """A power step on a call whose gradient holds inf and NaN (on one rank) is decided
    on the device, without the host: its energy is not finite, so the state does not
    take the step's basis, which the call still maps with (non-finite sums read as 0).
    Every call gives NumPy's bits where the result is finite and the same non-finite
    positions, and the states agree; the next finite call steps again."""
    # refresh_max 1: a power step at every call after the first, the non-finite one too
    dev, host = codec_pair({"id": "geofp8", "min_dim": 8, "min_numel": 0, "refresh_max": 1})
    m, n = 96, 80
    rows = np.random.default_rng(5).standard_normal((3, n))
    for call in range(5):
        rank = np.random.default_rng([mpi_comm.rank, call])
        x = 10 * rank.standard_normal((m, 3)) @ rows + 0.05 * rank.standard_normal((m, n))
        x = x.astype(np.float32).reshape(-1)
        if call == 2 and mpi_comm.rank == 0:
            x[7], x[m * n // 2] = np.inf, np.nan
        before = dev.state_info("w")
        parts = [("w", (m, n))]
        got = geocomm.allreduce(cp.asarray(x), codec=dev, parts=parts, comm=device_comm)
        want = geocomm.allreduce(x, codec=host, parts=parts, comm=mpi_comm)
        got = got.get()
        bad = ~np.isfinite(want)
        assert np.array_equal(bad, ~np.isfinite(got)), call
        assert np.array_equal(got[~bad].view(np.uint32), want[~bad].view(np.uint32)), call
        assert bad.sum() == (2 if call == 2 else 0), call  # inf/NaN stay where they were
        after = dev.state_info("w")
        if call == 2:
            assert after["refreshed"] == before["refreshed"], "a non-finite step was taken"
        elif call > 0:  # a step the state takes, the one after the non-finite call too
            assert after["refreshed"] == after["calls"], (call, after)
    assert dev.state_checksum() == host.state_checksum()


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "mxfp4", "fp8-sr", "fp8-ef"])
def test_node_aware_routes(cp, torch_comm, mpi_comm, name, monkeypatch):
    """``topology="node"`` on device arrays (the exact node-local steps with the device
    sum, the compressed pipeline between nodes, the node-local all-gather) == the
    same on NumPy over MPI, bitwise: nodes of 2 ranks by ``GEOCOMM_RANKS_PER_NODE``
    (3 ranks: uneven nodes of 2 and 1; 1-2 ranks: one node, which runs flat). The
    NCCL communicator has no node layout, so the route is the torch one."""
    monkeypatch.setenv("GEOCOMM_RANKS_PER_NODE", "2")
    dev, host = codec_pair(CODECS[name])
    parts = [("w1", (96, 80)), ("w2", (40, 64)), ("b", (7,))]
    n = 96 * 80 + 40 * 64 + 7
    for call in range(2):  # error feedback: the second call sends the first's residual
        x = inputs(mpi_comm.rank, n, tag=10 + call)
        got, want = twice(
            lambda device, x=x: geocomm.allreduce(
                cp.asarray(x) if device else x,
                codec=dev if device else host,
                parts=parts,
                comm=torch_comm if device else mpi_comm,
                stage_size=STAGE,
                topology="node",
            )
        )
        assert_bits(got, want, f"node-aware allreduce {name} call {call}")
        got, want = twice(
            lambda device, x=x: geocomm.reduce_scatter(
                cp.asarray(x) if device else x,
                codec=dev if device else host,
                parts=parts,
                comm=torch_comm if device else mpi_comm,
                topology="node",
            )
        )
        assert_bits(got, want, f"node-aware reduce_scatter {name} call {call}")


def test_init_with_backend_nccl_over_a_host_communicator_makes_a_nccl_one(cp):
    """geocomm.init(comm, backend="nccl") with a geocomm host communicator makes the NCCL
    communicator over it (the backend was ignored: CuPy arrays went through the host),
    and a device communicator is taken as it is; the default comes back after."""
    from geocomm.api import calls
    from geocomm.comm.nccl import NCCLCommunicator

    before = calls._default_comm
    try:
        host = MPICommunicator()
        made = geocomm.init(host, backend="nccl")
        assert isinstance(made, NCCLCommunicator) and made.host is host
        assert geocomm.init(made, backend="nccl") is made
        x = cp.asarray(inputs(made.rank, 1000))
        want = geocomm.allreduce(inputs(made.rank, 1000), codec="fp8", comm=host)
        np.testing.assert_array_equal(geocomm.allreduce(x, codec="fp8").get(), want)
        made.close()
        with pytest.raises(ValueError, match="unknown backend"):
            geocomm.init(host, backend="gloo")
    finally:
        calls._default_comm = before
