"""The perf helpers of geocomm.testing: sizes, ring bytes, timing across ranks, yardstick,
background load."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

from geocomm import get_codec
from geocomm.testing import (
    Yardstick,
    breakdown,
    busy_loops,
    parse_size,
    ring_bytes,
    slowest,
    timed,
    yardstick,
    yardstick_line,
)


def test_parse_size_binary_multiples():
    assert [parse_size(t) for t in ("8", "1K", "1.5k", "128M", "1G")] == [
        8,
        1024,
        1536,
        128 << 20,
        1 << 30,
    ]


def _children_cpu_seconds() -> float:
    times = os.times()
    return times.children_user + times.children_system


def test_busy_loops_spin_while_open_and_are_reaped_after():
    before = _children_cpu_seconds()
    with busy_loops(2) as procs:
        time.sleep(0.5)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)  # killed and waited for
    # children's CPU time counts once they are reaped: two loops spinning for 0.5 s
    # while this process sleeps get at least one core between them, well over 0.2 s
    assert _children_cpu_seconds() - before > 0.2


def test_ring_bytes_is_two_n_minus_one_over_n():
    assert ring_bytes(1000, 1) == 0
    assert ring_bytes(1000, 2) == 1000
    assert ring_bytes(1000, 4) == 1500


def test_yardstick_measures_and_round_trips_through_json():
    ruler = yardstick(mib=1, repeats=2)
    assert ruler.copy_GBps > 0 and ruler.fp8_encode_GBps > 0 and ruler.mib == 1
    record = dataclasses.asdict(ruler)
    assert Yardstick(**record) == ruler
    assert str(ruler) in yardstick_line(record)
    assert "not measured" in yardstick_line(None)


@pytest.mark.mpi
def test_slowest_and_timed_take_the_slowest_rank(comm):
    assert slowest(comm, float(comm.rank)) == comm.size - 1
    calls = []
    seconds = timed(comm, lambda: calls.append(1), iters=3)
    assert len(calls) == 3 and seconds >= 0


@pytest.mark.mpi
def test_yardstick_over_ranks_is_measured_on_rank_zero(comm):
    ruler = yardstick(comm, mib=1, repeats=1)
    assert (ruler is not None) == (comm.rank == 0)


@pytest.mark.mpi
@pytest.mark.parametrize("gather", [True, False])
def test_breakdown_times_every_phase(comm, gather):
    x = np.random.default_rng(comm.rank).standard_normal(5000, np.float32)
    parts = breakdown(comm, get_codec("fp8"), x, stage_size=1024, gather=gather, repeats=1)
    assert set(parts) == {"encode", "comm", "decode", "pipelined"}
    assert all(v >= 0 for v in parts.values()) and parts["pipelined"] > 0
