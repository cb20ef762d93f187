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

    def check_usable(self) -> None:
        pass

    def captured_everywhere(self, ok: bool) -> bool:
        return ok


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


def test_a_replay_binds_where_its_capture_found_the_arrays(cp):
    """``bind`` comes before every call's work, outside any graph: with None where the
    body runs (eagerly, or under capture, on the current stream before the graph is
    launched on it), with the ``here`` its graph was captured at where a graph
    replays, whatever this call's ``here`` is."""
    graphs = Graphs(_Capturable(), cp)
    x = cp.zeros(8, cp.float32)
    bound = []

    def body() -> None:
        x[...] += 1

    for call in range(4):
        graphs.run("k", body, here=("call", call), bind=bound.append)
    assert bound == [None, None, ("call", 1), ("call", 1)]
    assert np.array_equal(x.get(), np.full(8, 4, np.float32))


def test_a_graph_keeps_what_its_caller_hands_it_until_dropped(cp):
    """The caller's owner of the graph's buffers lives as long as the graph, and from
    the key's first run on (no other array can take an address a key names, so keys
    match alike on every rank): dropped by the caller (a side channel evicted from its
    plan) it stays, and it goes once KEPT newer graphs pushed this one out."""
    graphs = Graphs(_Capturable(), cp)
    x = cp.zeros(8, cp.float32)

    def body() -> None:
        x[...] += 1

    owner = _Buffers()
    alive = weakref.ref(owner)
    key = ("k", id(owner))
    graphs.run(key, body, keep=owner)
    del owner
    gc.collect()
    assert alive() is not None, "a key waiting for its capture keeps its owner"
    graphs.run(key, body, keep=alive())
    gc.collect()
    assert alive() is not None, "a kept graph keeps its buffers' owner"
    for i in range(Graphs.KEPT):  # newer graphs push the first one out
        for _ in range(2):
            graphs.run(("other", i), body)
    gc.collect()
    assert alive() is None


def test_what_a_captured_body_allocates_lives_in_its_graphs_arena(cp):
    """A body may allocate temporaries and return arrays: its eager run counts the bytes,
    its capture takes them from an arena of that size, which the graph keeps (CuPy's
    pool would hand freed blocks to other arrays while replays still write them), and
    every replay returns the captured run's arrays, written anew by the replay."""
    graphs = Graphs(_Capturable(), cp)
    x = cp.asarray(np.arange(8, dtype=np.float32))

    def body():
        doubled = x * 2  # a temporary, dropped at the end of the body
        return doubled + 1

    results = []
    for call in range(4):
        x[...] = float(call)
        results.append(graphs.run("k", body))
        want = np.full(8, 2 * call + 1, np.float32)
        assert np.array_equal(results[-1].get(), want), call
    assert results[2] is results[3], "a replay returns the captured run's arrays"
    arena = graphs.kept["k"][3]
    assert arena is not None and arena.used == arena.nbytes > 0


def test_a_capture_that_outgrows_its_arena_runs_eagerly(cp):
    """A body that allocates more under capture than in its eager run (its key named too
    little of what it depends on) is not kept: the call runs eagerly, with the right
    values, and the plan stops capturing."""
    graphs = Graphs(_Capturable(), cp)
    x = cp.zeros(8, cp.float32)
    sizes = iter([8, 256, 256])  # 32 bytes (one 256-byte block), then 1024

    def body():
        scratch = cp.empty(next(sizes), cp.float32)
        scratch[...] = 1
        x[...] += scratch[:8]

    for _ in range(2):
        graphs.run("k", body)
    assert graphs.comm is None and not graphs.kept
    assert np.array_equal(x.get(), np.full(8, 2, np.float32))


def test_a_body_that_uploads_under_capture_runs_eagerly(cp):
    """A body whose capture CuPy refuses with its own RuntimeError (a host-to-device
    copy while the current stream is capturing: cupy/cuda/memory.pyx) is not captured:
    that call and every later one run eagerly, with the right result."""
    comm = _Capturable()
    graphs = Graphs(comm, cp)
    x = cp.zeros(8, cp.float32)

    def body() -> None:
        x[...] += cp.asarray(np.ones(8, np.float32))  # an upload: refused under capture

    for _ in range(4):
        graphs.run("k", body)
    assert graphs.comm is None and comm.tracked == 0
    assert np.array_equal(x.get(), np.full(8, 4, np.float32))
