"""A stateful Codec object's state serves one group of ranks
(``StatefulCodec.hold_for``): named by the communicator's ``world_ranks()``, or by
the communicator itself where it cannot name its ranks (a loopback here). The MPI
cases, groups of other world ranks, are in tests/comm/test_communicators.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import geocomm
from geocomm import get_codec
from geocomm.comm.metered import MeteredComm
from geocomm.testing import loopback

X = np.random.default_rng(0).standard_normal((96, 80)).astype(np.float32)


def reduce(codec, comm) -> np.ndarray:
    return geocomm.allreduce(X, codec=codec, key="w", comm=comm, check=False)


def test_a_communicator_without_world_ranks_is_named_by_itself():
    """A loopback communicator cannot name its ranks: the codec serves that object,
    and a MeteredComm over it (what the DDP hook wraps a ``comm=`` in, anew each
    time), and no other communicator while it exists; once it is gone, any."""
    codec = get_codec("geofp8", min_dim=8, min_numel=0)
    (first,), (second,) = loopback(1), loopback(1)
    reduce(codec, first)
    assert np.isfinite(reduce(codec, MeteredComm(first))).all()  # the same group
    with pytest.raises(ValueError, match=r"does not name its ranks.*reset_state\(\)"):
        reduce(codec, second)
    del first
    gc.collect()
    assert np.isfinite(reduce(codec, second)).all()  # the state carried over, now second's


def test_reset_state_frees_the_codec_for_another_group():
    """reset_state() forgets the state and its group: the next group's call takes it,
    and the first group's is then refused."""
    codec = get_codec("geofp8", min_dim=8, min_numel=0)
    (first,), (second,) = loopback(1), loopback(1)
    reduce(codec, first)
    codec.reset_state()
    reduce(codec, second)
    with pytest.raises(ValueError, match="holds the state of the calls of"):
        reduce(codec, first)


def test_a_refused_call_leaves_the_codec_free():
    """A call refused on its arguments (float64 into a lossy codec) does not take the
    codec for its communicator."""
    codec = get_codec("geofp8", min_dim=8, min_numel=0)
    (first,), (second,) = loopback(1), loopback(1)
    with pytest.raises(TypeError, match="float64"):
        geocomm.allreduce(X.astype(np.float64), codec=codec, comm=first, check=False)
    reduce(codec, second)
