"""geocomm.engine.graphs.Graphs on its own (a real GPU or the CPU twin): eager once,
captured on a repeat, replayed after; what a graph keeps alive; keys used in turn.

The communicator is a stand-in with the capture protocol and no transfers: the
bodies here are kernels only.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np

from geocomm.engine.graphs import Graphs


class _Capturable:
    """The capture protocol with nothing to transfer: ``tracked`` counts launches."""

    def __init__(self) -> None:
        self.tracked = 0

    @contextlib.contextmanager
    def capturing(self):
        yield None

    def track(self, stream, captured=None) -> None:
        self.tracked += 1


class _Buffers:
    """Stands for what owns a graph's buffers (a side channel)."""


def test_a_key_runs_eagerly_then_is_captured_then_replays(cp):
    comm = _Capturable()
    graphs = Graphs(comm, cp)
    x = cp.zeros(8, cp.float32)
    ran = []

    def body() -> None:
        ran.append(1)
        x[...] += 1  # in place: no allocation under capture

    for _ in range(5):
        graphs.run("k", body)
    # the body ran in Python twice (eager, then under capture); all five calls added 1
    assert len(ran) == 2 and comm.tracked == 4
    assert np.array_equal(x.get(), np.full(8, 5, np.float32))


def test_a_graph_keeps_what_its_caller_hands_it_until_dropped(cp):
    """The caller's owner of the graph's buffers lives as long as the graph: dropped
    by the caller (a side channel evicted from its plan) it stays, and it goes once
    KEPT newer graphs pushed this one out."""
    graphs = Graphs(_Capturable(), cp)
    x = cp.zeros(8, cp.float32)

    def body() -> None:
        x[...] += 1

    owner = _Buffers()
    alive = weakref.ref(owner)
    for _ in range(2):
        graphs.run(("k", id(owner)), body, keep=owner)
    del owner
    gc.collect()
    assert alive() is not None, "a kept graph keeps its buffers' owner"
    for i in range(Graphs.KEPT):  # newer graphs push the first one out
        for _ in range(2):
            graphs.run(("other", i), body)
    gc.collect()
    assert alive() is None
