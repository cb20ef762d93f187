"""Helpers for tests and studies: simulated ranks and loopback ranks.

* :mod:`geocomm.testing.oracle`: :func:`simulate_allreduce` /
  :func:`simulate_reduce_scatter`, the collectives' result on N simulated
  ranks, bit for bit what N real ranks return (round-to-nearest codecs without
  error feedback), and :func:`roundtrip`, :func:`run_refresh_locally`.
* :class:`MeteredComm` (:mod:`geocomm.comm.metered`, where production code
  imports it from): wraps a communicator and counts the bytes each
  collective call sends, so studies can report wire and side-channel bytes
  without reaching into the pipeline.
* :mod:`geocomm.testing.loopback`: :func:`loopback` and :func:`run_lockstep`,
  N ranks' pipelines in one process, phase by phase, over communicators that
  copy between the ranks' buffers (NumPy or CuPy).

The measurement helpers of the perf tools and studies (timers, yardsticks,
result files) are not part of the package: they live in ``perf/lab.py``.
"""

from __future__ import annotations

from geocomm.comm.metered import MeteredComm
from geocomm.testing.loopback import LoopbackComm, loopback, run_lockstep
from geocomm.testing.oracle import (
    roundtrip,
    run_refresh_locally,
    simulate_allreduce,
    simulate_reduce_scatter,
)

__all__ = [
    "LoopbackComm",
    "MeteredComm",
    "loopback",
    "roundtrip",
    "run_lockstep",
    "run_refresh_locally",
    "simulate_allreduce",
    "simulate_reduce_scatter",
]
