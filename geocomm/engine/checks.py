"""The cross-rank check of a call (docs/design.md, "The collective").

Before a call moves, the ranks compare its fingerprint
(:func:`geocomm.engine.call.fingerprint`: collective, count, dtype, op, codec
config, tensors and keys, the keys' codec state, topology, stage size), so that mismatched
calls or diverged codec state fail with
:class:`~geocomm.engine.call.CollectiveMismatchError` on every rank instead of
hanging or returning garbage.

* The first call of a signature, and every call on a communicator that moves
  host memory, compares at once: one tiny all-gather, then the call.
* Later calls on a device communicator (one offering
  ``start_allgather_int64``: NCCL's, over its host communicator) post the
  all-gather and go on,
  so the host never waits for the other ranks' hosts; each call first looks at
  the checks still in flight without blocking, and waits for the oldest once
  more than :data:`IN_FLIGHT` are. A mismatch found then raises on that later
  call. On such a communicator every mismatch aborts it first, wherever it is
  found: a peer whose call was a known signature has queued its transfers
  already, and they would pair with this rank's next call's (or never complete).
  A communicator with ``settlers`` (NCCL's) finishes the checks still in flight in
  ``synchronize()``, ``barrier()`` and ``close()``, so the job's last calls are
  checked too.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any

import numpy as np

from geocomm.codecs import ErrorFeedbackCodec, StatefulCodec
from geocomm.comm.base import CollectiveTimeout, Communicator, wait
from geocomm.engine.call import (
    REFUSED,
    STATE,
    Call,
    CollectiveMismatchError,
    Part,
    Signature,
    call_fingerprint,
    fingerprint,
    raise_on_mismatch,
    refused_row,
    state_checksum,
)

#: Checks a device communicator keeps in flight before the host waits for the oldest.
IN_FLIGHT = 4

_CHECKED = "checked"
_in_flight: weakref.WeakKeyDictionary[Any, collections.deque[Any]] = weakref.WeakKeyDictionary()


def verify(call: Call) -> None:
    """Compare ``call``'s fingerprint across its communicator's ranks (nothing when
    the signature says ``check=False``); raise CollectiveMismatchError on mismatch."""
    signature = call.signature
    if not signature.check:
        return
    comm = signature.comm
    row = fingerprint(signature) if _has_state(signature) else signature.fingerprint
    start = getattr(comm, "start_allgather_int64", None) if comm.device_arrays else None
    pending = _in_flight.get(comm)
    if start is None or _CHECKED not in signature.plans:
        if pending:
            _settle(comm, pending, 0)
        rows = comm.allgather_int64(row)
        try:
            raise_on_mismatch(signature.kind, rows)
        except CollectiveMismatchError:
            if start is not None:
                _abort(comm)
            raise
        signature.plans[_CHECKED] = True
        return
    if pending is None:
        pending = _in_flight[comm] = collections.deque()
        settlers = getattr(comm, "settlers", None)
        if settlers is not None:
            settlers.append(functools.partial(_settle, comm, pending, 0))
    _settle(comm, pending, IN_FLIGHT, block=False)
    pending.append((signature.kind, *start(row)))
    _settle(comm, pending, IN_FLIGHT)


def refuse(comm: Communicator) -> None:
    """Post this rank's part of the check of a call it refused on its own (a
    :func:`~geocomm.engine.call.refused_row`), so that ranks that made the call raise
    CollectiveMismatchError instead of waiting for it; the caller then raises its own
    error. Waits for the peers' rows like any check: a peer that never calls leaves
    this rank to GEOCOMM_TIMEOUT's CollectiveTimeout (raised during the caller's
    error, which it names as its context), after which the communicator is
    unusable. A device communicator that defers checks is aborted when a peer made
    the call: that peer may have queued its transfers (and aborts too,
    :func:`verify`)."""
    pending = _in_flight.get(comm)
    if pending:
        _settle(comm, pending, 0)
    rows = comm.allgather_int64(refused_row())
    deferring = comm.device_arrays and hasattr(comm, "start_allgather_int64")
    if deferring and (rows[:, 0] != REFUSED).any():
        _abort(comm)


def _settle(
    comm: Communicator, pending: collections.deque[Any], keep: int, block: bool = True
) -> None:
    """Finish the checks in flight on ``comm`` until at most ``keep`` are left (oldest
    first; ``block`` False: only those already complete); a mismatch or a timeout
    drops the rest, aborts the communicator and raises."""
    while pending:
        kind, request, rows = pending[0]
        try:
            if not request.test():
                if not block or len(pending) <= keep:
                    return
                wait(request, "a deferred metadata all-gather", comm.rank)
            pending.popleft()
            raise_on_mismatch(kind, rows)
        except (CollectiveTimeout, CollectiveMismatchError):  # a peer is gone or differs
            pending.clear()
            _abort(comm)
            raise


def _abort(comm: Communicator) -> None:
    """Abort ``comm`` (a device communicator that defers its checks: a peer may have
    queued its transfers already)."""
    abort = getattr(comm, "abort_local", None)
    if abort is not None:
        abort()


def verify_flat_state(call: Call) -> None:
    """A call that could have gone node-aware but runs flat compares, at once, the
    error-feedback residuals' state its first check left out (:func:`verify`)."""
    signature = call.signature
    if signature.check and signature.topology != "flat":
        row = fingerprint(signature, flat=True)
        raise_on_mismatch(signature.kind, signature.comm.allgather_int64(row))


def check_consistent(
    comm: Communicator,
    kind: str,
    count: int,
    dtype: np.dtype,
    op: str,
    codec: Any,
    parts: tuple[Part, ...],
    topology: str = "flat",
) -> None:
    """Compare one call's fingerprint across ``comm``'s ranks now (what adapters that
    keep their own check policy call); raise CollectiveMismatchError on mismatch."""
    row = call_fingerprint(kind, count, dtype, op, codec, parts, topology)
    name = ErrorFeedbackCodec.residual_name(kind, parts)
    row[STATE] = state_checksum(codec, parts, topology == "flat", name)
    raise_on_mismatch(kind, comm.allgather_int64(row))


def _has_state(signature: Signature) -> bool:
    return isinstance(signature.codec, StatefulCodec)
