"""The DDP hook's and FSDP2's collectives on device arrays == on NumPy, bitwise.

On a GPU the hook and ``compress_fsdp`` hand each bucket to
``GradReducer``, which runs ``geocomm.api.allreduce`` /
``reduce_scatter`` with the bucket's ``parts`` (one per tensor; FSDP2: one
per rank's chunk of each parameter), op "avg", over a metered
``TorchDistCommunicator`` of a NCCL group. Here the same calls, with the
layouts the hook and FSDP2 build for a small model, run on device arrays
over a device-mode ``TorchDistCommunicator`` of a gloo group and on NumPy
arrays over a gloo group: bit for bit the same on every rank. (Torch CUDA
tensors themselves need a GPU: perf/gpu_check.py's ddp and torch sections.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gpu_helpers import inputs, twice

import geocomm
from geocomm.adapters.torch import grads
from geocomm.testing import MeteredComm

pytestmark = [pytest.mark.mpi]

#: (name, shape) of the model's parameters, in DDP's bucket order
PARAMS = [
    ("embed.weight", (50, 64)),
    ("l1.weight", (96, 64)),
    ("l1.bias", (96,)),
    ("norm.weight", (96,)),
    ("l2.weight", (72, 96)),
    ("l2.bias", (72,)),
]
SELECTION = grads.Selection.of(["*norm*", "embed.*"], 100)


@pytest.fixture(scope="module")
def comms():
    import torch.distributed as dist

    from geocomm.adapters.torch import init_distributed_from_mpi
    from geocomm.comm.torchdist import TorchDistCommunicator

    if not dist.is_initialized():
        init_distributed_from_mpi("gloo")
    device = TorchDistCommunicator(dist.new_group(backend="gloo"), device_arrays=True)
    host = TorchDistCommunicator(dist.new_group(backend="gloo"))
    assert device.device_arrays and not host.device_arrays
    return MeteredComm(device), MeteredComm(host)


def ddp_layout() -> grads.BufferLayout:
    entries, offset = [], 0
    for name, shape in PARAMS:
        entries.append(grads.Entry(offset, shape, name, name))
        offset += math.prod(shape)
    return grads.BufferLayout(entries, SELECTION)


def fsdp_layout(size: int) -> grads.BufferLayout:
    """FSDP2's reduce-scatter input: one row per rank, each that rank's dim-0 chunk of
    every parameter (as compress_fsdp lays it out)."""
    entries, offset = [], 0
    for name, shape in PARAMS:
        chunk = (-(-shape[0] // size), *shape[1:])
        entries.append(grads.Entry(offset, chunk, name, name))
        offset += math.prod(chunk)
    return grads.BufferLayout(entries, SELECTION, rows=size)


def reduce_bucket(layout, values, codec, comm, kind):
    """What GradReducer runs per group: the compressed group with parts, the plain one
    exactly; returns the reduced groups' flat results."""
    results = []
    for group, group_codec in ((layout.compressed, codec), (layout.plain, "none")):
        flat = (
            values[group.ranges[0][0] : group.ranges[0][0] + group.numel * group.rows]
            if group.rows == 1 and len(group.ranges) == 1
            else None
        )
        if flat is None:  # gather the group's columns, as ColumnGroup.take does
            rows = values.reshape(group.rows, -1)
            pieces = [rows[:, a:b] for a, b in group.ranges]
            flat = (
                np.concatenate(pieces, axis=1).reshape(-1)
                if isinstance(values, np.ndarray)
                else _device_concat(pieces)
            )
        parts = group.parts() if group_codec is codec else None
        if kind == "allreduce":
            results.append(
                geocomm.api.allreduce(
                    flat, codec=group_codec, op="avg", out=flat, parts=parts, comm=comm, check=False
                )
            )
        else:
            results.append(
                geocomm.api.reduce_scatter(
                    flat, codec=group_codec, op="avg", parts=parts, comm=comm, check=False
                )
            )
    return results


def _device_concat(pieces):
    import cupy

    return cupy.ascontiguousarray(
        cupy.concatenate([cupy.ascontiguousarray(p) for p in pieces], axis=1)
    ).reshape(-1)


@pytest.mark.parametrize(
    "codec",
    [
        "fp8",
        "nvfp4",
        {"id": "geofp8", "min_dim": 8, "min_numel": 0, "refresh": 2},
        {"id": "fp8", "error_feedback": True},
    ],
)
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
def test_hook_collectives_on_device_arrays(cp, comms, codec, kind):
    device_comm, host_comm = comms
    rank, size = host_comm.rank, host_comm.size
    layout = ddp_layout() if kind == "allreduce" else fsdp_layout(size)
    dev_codec, host_codec = geocomm.get_codec(codec), geocomm.get_codec(codec)
    for step in range(3):  # GeoFP8's cold start and a refresh; error feedback's residual
        x = inputs(rank, layout.numel, tag=10 + step)
        got, want = twice(
            lambda device, x=x: reduce_bucket(
                layout,
                cp.asarray(x) if device else x,
                dev_codec if device else host_codec,
                device_comm if device else host_comm,
                kind,
            )
        )
        for g, w in zip(got, want, strict=True):
            g = g.get()
            assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), (
                f"{kind} {codec} step {step}: {np.count_nonzero(g != w)} values differ"
            )
    assert device_comm.sent == host_comm.sent  # the same bytes moved
