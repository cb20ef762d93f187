"""The torch.distributed backend's metadata check, started when a call is made.

A compressed call's check (:func:`geocomm.engine.checks.check_consistent`: one tiny
all-gather of every rank's :func:`~geocomm.engine.call.call_fingerprint`) run on the
worker just before the call would leave the link idle for a round trip after
every call, behind the previous call's bytes. :class:`EarlyChecks` instead
starts the all-gather on a gloo group of its own when the call is submitted, in
submission order (the same on every rank), so the round trip overlaps the
previous call's transfer; the worker waits for it, and raises on a mismatch,
before the call's own bytes move, so a mismatched call never sends.

The early row leaves the codec state out: a stateful codec's keys' state may
still change in a call queued before, so calls of a stateful codec also check
that state on the worker (``check=True`` into the collective). Every call takes
the early check whatever its codec, so ranks that disagree on the codec raise
there, instead of waiting on two different channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from geocomm.adapters.torch.grads import NUMPY_DTYPES
from geocomm.api.calls import parts_of
from geocomm.codecs.base import Codec, StatefulCodec
from geocomm.comm.base import wait as wait_bounded
from geocomm.comm.torchdist import TorchWork
from geocomm.engine.call import call_fingerprint, raise_on_mismatch

#: the topology of the backend's compressed calls: flat on any number of nodes (their
#: process group lies outside torch.distributed's registry, which cannot make
#: sub-groups of it)
TOPOLOGY = "flat"

#: what an early check's ``wait`` is: raises CollectiveMismatchError if ranks differ
Wait = Callable[[], None]


class EarlyChecks:
    """Starts the metadata check of a compressed call on ``group`` (a gloo
    ``ProcessGroup`` of ``size`` ranks used for nothing else)."""

    def __init__(self, group: Any, size: int):
        self.group, self.size = group, size
        self.sent = 0  # bytes this rank sent in checks (the ring all-gather's)

    @staticmethod
    def complete(codec: Codec) -> bool:
        """Whether the early check is the whole check for a call of ``codec`` (as the
        collective resolves it for the call's count): the codec keeps no state."""
        return not isinstance(codec, StatefulCodec)

    def start(
        self, kind: str, tensor: torch.Tensor, op: str, codec: Codec, key: Any,
        stage_size: int | None = None,
    ) -> Wait:  # fmt: skip
        """Start the all-gather of this rank's fingerprint of the call (``kind``:
        "allreduce" or "reduce_scatter"; ``codec`` as the collective resolves it;
        ``stage_size`` as configured) and return the function that waits for it and
        compares the rows."""
        shape = tuple(tensor.shape)
        row = call_fingerprint(
            kind,
            tensor.numel(),
            np.dtype(NUMPY_DTYPES[tensor.dtype]),
            op,
            codec,
            parts_of(shape, tensor.numel(), key, None),
            TOPOLOGY,
            stage_size,
        )
        send = torch.from_numpy(row)
        rows = torch.empty((self.size, row.size), dtype=torch.int64)
        outputs = list(rows.unbind(0))
        request = TorchWork(self.group.allgather([outputs], [send]), keep=(send, *outputs))
        self.sent += row.nbytes * (self.size - 1)

        rank = self.group.rank()

        def wait() -> None:
            # at most GEOCOMM_TIMEOUT, like every other wait for a peer (torch's own
            # Work.wait() would wait for the group's timeout, 30 minutes by default)
            wait_bounded(request, f"the metadata check of a compressed {kind}", rank)
            raise_on_mismatch(kind, rows.numpy())

        return wait
