"""Subnormal values keep their bits on the device as on the CPU (defect: CuPy's own
elementwise kernels flush them, -ftz=true).

A gradient with whole blocks of subnormal values (|x| < 2^-126) makes
error-feedback residuals, side sums and exact sums subnormal. The CPU keeps
them (IEEE); geocomm's device arithmetic must too, so the device results and
codec state equal the NumPy path's bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import inputs, twice

import geocomm
from geocomm.comm.mpi import MPICommunicator
from geocomm.engine.exact import exact_sum

pytestmark = [pytest.mark.mpi]


@pytest.fixture(scope="module")
def comms():
    from geocomm.comm.nccl import NCCLCommunicator

    nccl = NCCLCommunicator()
    yield nccl, MPICommunicator()
    nccl.close()


def subnormal_gradient(rank: int, n: int, tag: int) -> np.ndarray:
    x = inputs(rank, n, tag)
    rng = np.random.default_rng([rank, tag, 99])
    tiny = (rng.standard_normal(n // 2) * 2.0**-132).astype(np.float32)  # subnormal
    x[: n // 2] = tiny
    return x


@pytest.mark.parametrize("route", ["gathered", "sharded"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_exact_sum_of_subnormals(cp, comms, monkeypatch, fmt, route):
    """Either route of an exact sum gives the device the host's bits (the sums are
    rank-ordered fp32 additions of subnormals, which CuPy's own kernels would flush)."""
    from geocomm.engine import exact

    monkeypatch.setattr(exact, "gathers", lambda *args: route == "gathered")
    nccl, mpi = comms
    values = (np.random.default_rng(mpi.rank).standard_normal(5003) * 2.0**-128).astype(np.float32)
    got = exact_sum(nccl, cp.asarray(values), fmt).get()
    want = exact_sum(mpi, values, fmt)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.count_nonzero((want != 0) & (np.abs(want) < 2.0**-126)) > 4000  # subnormal sums


@pytest.mark.parametrize(
    "config",
    [
        {"id": "fp8", "fmt": "e4m3", "block": 32, "error_feedback": True},
        {"id": "nvfp4", "error_feedback": True},
    ],
)
def test_error_feedback_residuals_keep_subnormals(cp, comms, config):
    nccl, mpi = comms
    dev, host = geocomm.get_codec(config), geocomm.get_codec(config)
    for call in range(3):
        x = subnormal_gradient(mpi.rank, 8_191, tag=call)
        got, want = twice(
            lambda device, x=x: geocomm.allreduce(
                cp.asarray(x) if device else x,
                codec=dev if device else host,
                comm=nccl if device else mpi,
                stage_size=2_048,
            )
        )
        assert np.array_equal(got.get().view(np.uint32), want.view(np.uint32)), f"call {call}"
    dev_state, host_state = dev.state_dict(), host.state_dict()
    assert dev.state_checksum() == host.state_checksum(), (dev_state.keys(), host_state.keys())
