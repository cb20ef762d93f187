"""One collective call as the engine runs it (docs/design.md, "The collective").

The API layer (:mod:`geocomm.api`) checks the caller's arguments and describes
each distinct call once, as a :class:`Signature`: what every rank must agree on
(collective, count, dtype, op, codec, tensors and keys, topology) plus the
communicator, stage size and check policy; then, per invocation, a :class:`Call`:
the signature, the flat values, where the result goes and the stochastic-rounding
stream. Both are immutable. The engine (:func:`geocomm.engine.run.run`) runs a
call and keeps what it derives from a signature (pieces, tables, buffers, CUDA
graphs) for the next call with the same one.

Also here: the tensors of a buffer (:class:`Part`), the cross-rank fingerprint
of a signature, and the per-key call counts behind the rounding streams, which
every rank counts alike.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np

from geocomm.codecs import Codec, ErrorFeedbackCodec, StatefulCodec
from geocomm.codecs.frames import DTYPE_CODES
from geocomm.comm.base import Communicator
from geocomm.comm.nodes import ENV_RANKS_PER_NODE
from geocomm.engine.costs import ENV_INTER, ENV_INTRA
from geocomm.kernels.native import mix64

#: The collectives a call can be.
KINDS = ("allreduce", "reduce_scatter", "allgather")
#: The reductions.
OPS = ("sum", "avg")
#: Requested topologies (docs/design.md, "Node-aware collectives").
TOPOLOGIES = ("flat", "node", "auto")


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with different arguments (or diverged codec state)."""


@dataclass(frozen=True)
class Part:
    """One tensor of a flat buffer: values [offset, offset + size) viewed as ``shape``,
    named ``key`` (a transforming codec keeps the key's state)."""

    offset: int
    shape: tuple[int, ...]
    key: Any

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class Signature:
    """What identifies a collective call, checked and resolved once.

    Attributes:
        kind: "allreduce", "reduce_scatter" or "allgather".
        count: values of the flat buffer.
        dtype: the caller's dtype (float32, float16, bfloat16, or float64 for an exact
            call); the engine computes in float32 (float64 exact).
        op: "sum" or "avg".
        codec: the codec that carries ``count`` values on ``comm`` (``auto`` resolved:
            :func:`geocomm.engine.costs.codec_for`).
        comm: the communicator (held weakly: a signature kept for later calls does
            not keep its communicator, and the process group under it, alive).
        parts: the tensors that tile the buffer, in order.
        topology: the requested topology ("flat", "node" or "auto").
        stage_size: values per pipeline stage; None: the backend's choice.
        check: whether the ranks compare the call's fingerprint before it moves.

    Signatures compare by identity: the API keeps one per distinct call, and the
    engine keys what it derives from a signature (its plan) by it.
    """

    kind: str
    count: int
    dtype: np.dtype
    op: str
    codec: Codec
    communicator: InitVar[Communicator]
    parts: tuple[Part, ...]
    topology: str = "flat"
    stage_size: int | None = None
    check: bool = True
    #: the engine's per-signature plans (pieces, tables, buffers, graphs), made lazily
    plans: dict[str, Any] = field(default_factory=dict, repr=False)
    _comm: Any = field(init=False, repr=False)

    def __post_init__(self, communicator: Communicator) -> None:
        object.__setattr__(self, "_comm", weakref.ref(communicator))

    @property
    def comm(self) -> Communicator:
        comm: Communicator | None = self._comm()
        if comm is None:
            raise RuntimeError("the communicator of this call no longer exists")
        return comm

    @functools.cached_property
    def stochastic(self) -> bool:
        """Whether the codec rounds stochastically (each call then draws a rounding stream)."""
        return self.codec.get_config().get("rounding") == "stochastic"

    @functools.cached_property
    def call_count_name(self) -> str:
        """What this call's stochastic-rounding streams are counted under
        (:func:`rounding_stream`): the codec's config and the tensors' keys."""
        return json.dumps([self.codec.get_config(), [repr(p.key) for p in self.parts]],
                          sort_keys=True)  # fmt: skip

    @functools.cached_property
    def residual_name(self) -> str:
        """What an error-feedback codec keeps this call's residual under
        (:meth:`~geocomm.codecs.feedback.ErrorFeedbackCodec.residual_name`)."""
        return ErrorFeedbackCodec.residual_name(self.kind, self.parts)

    @functools.cached_property
    def call_count_hash(self) -> int:
        """CRC-32 of :attr:`call_count_name`: the stream's high bits are the call count."""
        return zlib.crc32(self.call_count_name.encode())

    @functools.cached_property
    def fingerprint(self) -> np.ndarray:
        """The int64 row that identifies this call across ranks, the codec state left
        out (:func:`fingerprint`)."""
        return fingerprint(self, with_state=False)


@dataclass(frozen=True)
class Call:
    """One invocation of a :class:`Signature`.

    Attributes:
        signature: what the call is.
        source: flat C-contiguous float32 values (float64 for an exact float64 call),
            NumPy or CuPy.
        result: where the result goes, of ``source``'s kind: the whole reduced buffer
            (all-reduce; may be ``source`` itself for a compressed call), this rank's
            shard (reduce-scatter), or ``size`` rows (all-gather).
        rounding_stream: the call's stochastic-rounding stream (0: round to nearest).
    """

    signature: Signature
    source: Any
    result: Any
    rounding_stream: int = 0


def new_call(signature: Signature, source: Any, result: Any) -> Call:
    """A :class:`Call` of ``signature``, its rounding stream drawn from the call counts."""
    if not signature.stochastic:
        return Call(signature, source, result)
    return Call(signature, source, result, rounding_stream(signature))


def shard_parts(parts: tuple[Part, ...], ranges: list[tuple[int, int]]) -> tuple[Part, ...]:
    """The tensors of the buffer made of ``ranges`` of the flat buffer of ``parts``,
    laid end to end (what a node-aware collective sends across nodes). Each part's
    cut is split at whole rows (first dimension) so transforming codecs keep 2-D
    views: a partial first row, the whole rows, a partial last row; each piece's
    key is ``(key, "node", offset of the piece in its tensor)``, the same on every
    rank that moves it (docs/design.md, "Node-aware collectives")."""
    result: list[Part] = []
    at = 0
    for lo, hi in ranges:
        for p in parts:
            a, b = max(lo, p.offset), min(hi, p.offset + p.size)
            if a >= b:
                continue
            row = math.prod(p.shape[1:]) if len(p.shape) >= 2 else 0
            cuts = [a, b]
            if row:
                first = p.offset + -(-(a - p.offset) // row) * row
                last = p.offset + (b - p.offset) // row * row
                if first < last:
                    cuts = sorted({a, first, last, b})
            for c, d in itertools.pairwise(cuts):
                whole = row and (c - p.offset) % row == 0 and (d - c) % row == 0
                shape = ((d - c) // row, *p.shape[1:]) if whole else (d - c,)
                result.append(Part(at + c - lo, shape, (p.key, "node", c - p.offset)))
        at += hi - lo
    return tuple(result)


# ---------------------------------------------------------------------------
# the cross-rank fingerprint

#: What each column of a fingerprint row is.
FIELDS = ("collective", "count", "dtype", "op", "codec config", "parts or key", "codec state",
          "topology", "stage size", "node settings")  # fmt: skip
STATE = FIELDS.index("codec state")
#: The environment variables that decide how a call runs beyond its arguments (its
#: node layout, the links ``auto`` weighs): in the fingerprint of the calls that read
#: them, since ranks that set them apart would run other collectives (and the node
#: layout's would block for good).
NODE_SETTINGS = (ENV_RANKS_PER_NODE, ENV_INTRA, ENV_INTER)


def node_settings(kind: str, codec: Codec, topology: str) -> int:
    """CRC32 of the :data:`NODE_SETTINGS` a call reads (each stripped; unset is empty):
    none for an all-gather, a lossless codec or ``topology="flat"``, the ranks per
    node for ``"node"``, all three for ``"auto"``."""
    if kind == "allgather" or codec.lossless or topology == "flat":
        return 0
    names = NODE_SETTINGS if topology == "auto" else (ENV_RANKS_PER_NODE,)
    text = "\0".join(os.environ.get(name, "").strip() for name in names)
    return zlib.crc32(text.encode())


def fingerprint(
    signature: Signature, with_state: bool = True, flat: bool | None = None
) -> np.ndarray:
    """The int64 row that identifies ``signature`` on this rank (:func:`call_fingerprint`;
    ``flat``: whether the call runs flat, default: whether its topology is "flat").
    With the state, the signature's own row (computed once) with its state filled in."""
    s = signature
    if not with_state:
        return call_fingerprint(
            s.kind, s.count, s.dtype, s.op, s.codec, s.parts, s.topology, s.stage_size
        )
    row: np.ndarray = s.fingerprint.copy()
    flat = s.topology == "flat" if flat is None else flat
    row[STATE] = state_checksum(s.codec, s.parts, flat, s.residual_name)
    return row


def call_fingerprint(kind: str, count: int, dtype: np.dtype, op: str, codec: Codec,
                     parts: tuple[Part, ...], topology: str,
                     stage_size: int | None = None) -> np.ndarray:  # fmt: skip
    """The int64 row that identifies a call on this rank, one column per :data:`FIELDS`
    entry, the codec state 0 (:func:`state_checksum` fills it): ranks whose rows are
    equal make the same call. ``stage_size``: the one the caller asked for (None, 0 in
    the row: the backend's, which every rank derives alike); the pipeline's pieces,
    and so every transfer's size, follow from it."""
    config = json.dumps(codec.get_config(), sort_keys=True).encode()
    layout = json.dumps([(repr(p.key), p.shape) for p in parts]).encode()
    return np.array(
        [
            zlib.crc32(kind.encode()),
            count,
            DTYPE_CODES[np.dtype(dtype)],
            OPS.index(op),
            zlib.crc32(config),
            zlib.crc32(layout),
            0,
            zlib.crc32(topology.encode()),
            stage_size or 0,
            node_settings(kind, codec, topology),
        ],
        dtype=np.int64,
    )


def state_checksum(
    codec: Codec | None, parts: tuple[Part, ...], flat: bool, residual_name: str
) -> int:
    """CRC32 of ``codec``'s state for a call on ``parts`` (0 for a stateless codec): the
    map's state of its keys and, for a flat call, the count of calls of its
    error-feedback residual (kept under ``residual_name``). A call that may run
    node-aware (``flat`` False) keeps its residuals per local index (checked across
    nodes), and so do the node-aware calls before a flat one: no other call's
    residual is every rank's."""
    state = 0
    if isinstance(codec, ErrorFeedbackCodec):
        if flat:
            calls = codec.calls_of(residual_name)
            state = zlib.crc32(f"{residual_name}:{calls}".encode())
        codec = codec.mapping_codec
    if not isinstance(codec, StatefulCodec):
        return state
    for p in parts:
        state = zlib.crc32(codec.state_checksum(p.key).to_bytes(4, "little"), state)
    return state


#: The fingerprint row of a rank that refused a call on its own (every crc32 is >= 0).
REFUSED = -1


def refused_row() -> np.ndarray:
    """The row a rank posts for a call it refused before the ranks compared."""
    return np.full(len(FIELDS), REFUSED, dtype=np.int64)


def raise_on_mismatch(kind: str, rows: np.ndarray) -> None:
    """Raise CollectiveMismatchError unless every rank's fingerprint (one row per rank,
    gathered) equals rank 0's; every rank holding the rows raises alike."""
    raw = rows.tobytes()  # the steady state, equal rows: one comparison of bytes
    if raw == raw[: len(raw) // rows.shape[0]] * rows.shape[0] and rows[0, 0] != REFUSED:
        return
    refused = np.nonzero(rows[:, 0] == REFUSED)[0]
    if refused.size:
        raise CollectiveMismatchError(
            f"geocomm.{kind}: ranks {refused.tolist()} refused this call on their own "
            "(their error says why) and did not take part"
        )
    bad = np.nonzero((rows != rows[0]).any(axis=1))[0]
    if bad.size:
        diffs = [FIELDS[f] for f in np.nonzero(rows[bad[0]] != rows[0])[0]]
        detail = ""
        if "count" in diffs:
            counts = ", ".join(f"rank {r}: count={rows[r, 1]}" for r in range(rows.shape[0]))
            detail = f" ({counts})"
        raise CollectiveMismatchError(
            f"geocomm.{kind}: ranks {bad.tolist()} differ from rank 0 in {', '.join(diffs)}"
            f"{detail}; every rank must pass the same count, dtype, op, codec, keys and "
            f"topology, set {', '.join(NODE_SETTINGS)} alike (where the topology is "
            "not flat), and stateful codecs must hold the same state"
        )


# ---------------------------------------------------------------------------
# call counts and stochastic-rounding streams

_calls: dict[str, int] = {}


def rounding_stream(signature: Signature) -> int:
    """A new call's stochastic-rounding stream (0 when the codec rounds to nearest): a
    hash of the codec config and the tensors' keys, and the number of calls made so
    far with them (counted now), which every rank counts alike."""
    if not signature.stochastic:
        return 0
    name = signature.call_count_name
    count = _calls.get(name, 0)
    _calls[name] = count + 1
    return mix64(signature.call_count_hash ^ (count << 32))


def reset_call_counts() -> None:
    """Forget the calls counted per codec and keys: the next one draws a first call's
    stochastic-rounding stream (every rank must reset alike)."""
    _calls.clear()


@contextlib.contextmanager
def saved_call_counts() -> Iterator[None]:
    """Put the call counts back after the body: a call repeated after it draws the same
    stochastic-rounding streams (two routes of one call in one process)."""
    saved = dict(_calls)
    try:
        yield
    finally:
        _calls.clear()
        _calls.update(saved)


def call_counts(config: dict[str, Any]) -> dict[str, int]:
    """The call counts of every key called with a codec of ``config`` (for checkpoints:
    a resumed job restores them with :func:`restore_call_counts` and draws the
    stochastic-rounding streams an uninterrupted job would)."""
    return {name: n for name, n in _calls.items() if json.loads(name)[0] == config}


def restore_call_counts(counts: dict[str, int]) -> None:
    """Set the call counts :func:`call_counts` returned (other keys keep theirs)."""
    _calls.update({str(name): int(n) for name, n in counts.items()})
