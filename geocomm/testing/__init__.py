"""Helpers for tests, studies and perf tools: simulated ranks, metering, timing.

One module per concern, everything importable from ``geocomm.testing``:

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
* :mod:`geocomm.testing.perf`: the helpers of ``perf/`` and ``perf/studies/``:
  :func:`parse_size`, :func:`timed`, :func:`slowest`, :func:`ring_bytes`,
  :func:`breakdown`, :func:`emulated_link`, :func:`launch_command`,
  :func:`busy_loops`, :func:`write_results`, and :func:`yardstick` (two speeds of this machine,
  printed next to every performance table so readers can scale).
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
from geocomm.testing.perf import (
    Yardstick,
    breakdown,
    busy_loops,
    emulated_link,
    launch_command,
    parse_size,
    ring_bytes,
    slowest,
    timed,
    write_results,
    yardstick,
    yardstick_line,
)

__all__ = [
    "LoopbackComm",
    "MeteredComm",
    "Yardstick",
    "breakdown",
    "busy_loops",
    "emulated_link",
    "launch_command",
    "loopback",
    "parse_size",
    "ring_bytes",
    "roundtrip",
    "run_lockstep",
    "run_refresh_locally",
    "simulate_allreduce",
    "simulate_reduce_scatter",
    "slowest",
    "timed",
    "write_results",
    "yardstick",
    "yardstick_line",
]
