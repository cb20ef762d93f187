"""The twin has teeth: each of these mutations of the GPU path, none visible on the
CPU path, makes a device collective fail loudly on the twin.

Every scenario is a real 2-rank job (geocomm.launch) running one fp8 all-reduce of
device arrays over NCCLCommunicator with one mutation applied in-process:

* ``no-wait-recv``: the batched pipeline no longer orders its kernels after the
  NCCL transfer that filled their input (``BatchedPipeline._wait`` does nothing);
* ``no-wait-send``: the NCCL stream no longer waits for the encode that filled
  its send buffer (``NCCLCommunicator._start`` skips its event wait);
* ``loose-bound``: a kernel's bound loosens by one (the batched decode's store
  of four values takes ``s.count + 1 - i`` of them: it writes one value past its
  piece).

The unmutated job must pass, so each failure is the mutation's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from gpu_helpers import ON_TWIN, on_ranks

pytestmark = pytest.mark.skipif(not ON_TWIN, reason="mutations are caught by the twin's checks")

JOB = textwrap.dedent("""
    import sys
    import numpy as np
    import cupy
    import geocomm
    from geocomm.comm.nccl import NCCLCommunicator
    from geocomm.engine import device

    mutation = sys.argv[1]
    if mutation == "no-wait-recv":
        device.BatchedPipeline._wait = lambda self, requests, s: requests.pop(s, None)
    elif mutation == "no-wait-send":
        NCCLCommunicator._start = lambda self: None
    elif mutation == "loose-bound":
        text = device.kernel_source()
        store = "    }}\\n    gc_store4_f32(out + s.values + i, s.count{} - i, v);"
        assert text.count(store.format("")) == 1, "the decode's store is not one line"
        loose = text.replace(store.format(""), store.format(" + 1"), 1)
        assert loose != text, "the mutated line is not in gc_pipeline.cu"
        device.kernel_source = lambda: loose
    comm = NCCLCommunicator()
    x = np.random.default_rng(comm.rank).standard_normal(20_011).astype(np.float32)
    codec = {"id": "mxfp8", "fmt": "e4m3"} if mutation == "loose-bound" else "fp8"
    try:
        got = geocomm.allreduce(cupy.asarray(x), codec=codec, comm=comm, stage_size=4096)
        print("RESULT", float(np.abs(got.get()).sum()), flush=True)
    except Exception as exc:
        print("CAUGHT", type(exc).__name__, exc, flush=True)
""")


def run(tmp_path, mutation: str) -> str:
    script = tmp_path / "mutated_job.py"
    script.write_text(JOB)
    command = on_ranks([sys.executable, "-P", str(script), mutation], 2, timeout_s=240)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def test_the_unmutated_job_passes(tmp_path):
    out = run(tmp_path, "none")
    assert out.count("RESULT") == 2 and "CAUGHT" not in out, out


@pytest.mark.parametrize(
    "mutation,expected",
    [
        ("no-wait-recv", "StreamOrderError"),
        ("no-wait-send", "StreamOrderError"),
        ("loose-bound", "past its end"),
    ],
)
def test_a_mutation_is_caught(tmp_path, mutation, expected):
    out = run(tmp_path, mutation)
    assert "CAUGHT" in out and expected in out, out
