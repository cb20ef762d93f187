"""GeoFP8's results do not depend on a rank's BLAS: a real job with mixed settings.

One rank runs with one OpenBLAS thread, the other with two and another
OPENBLAS_CORETYPE; 50 geofp8 all-reduces, with the split and with the
whitening, must give bitwise identical results on both and never trip the
state check (tests/jobs/geo_blas_job.py). It holds by
construction: every number that enters the map or the state comes from the
fixed-order native kernels, never from a BLAS. Single-process test: it
launches its own mpiexec (MPMD, one environment per rank).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from geocomm.launch import mpiexec_command

JOB = Path(__file__).resolve().parents[1] / "jobs" / "geo_blas_job.py"


def test_mixed_blas_ranks_agree_bit_for_bit():
    argv, env = mpiexec_command(1, ["COMMAND"])
    mpiexec, flags = argv[0], argv[3:-1]  # the launcher's flags, without "-n 1" and COMMAND
    envs = [
        {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        {"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2", "OPENBLAS_CORETYPE": "Sandybridge"},
    ]
    cmd = [mpiexec, *flags]
    for i, extra in enumerate(envs):
        if i:
            cmd.append(":")
        cmd += ["-n", "1"]
        for key, value in extra.items():
            cmd += ["-x", f"{key}={value}"]
        cmd += [sys.executable, str(JOB)]
    env = {
        k: v
        for k, v in env.items()
        if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "geofp8 results identical on all ranks: True" in out, out
    assert "geofp8 whitening results identical on all ranks: True" in out, out
    assert "CollectiveMismatchError" not in out
