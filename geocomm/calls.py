"""What identifies a collective call on every rank (docs/design.md, "The collective").

The tensors of a buffer (:class:`Part`), the argument checks the public
collectives share, the cross-rank fingerprint check that raises
:class:`CollectiveMismatchError`, and the per-codec call counts that draw each
call's stochastic-rounding stream. Nothing here holds a communicator beyond the
one tiny all-gather of :func:`check_consistent`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from geocomm.codecs import Codec, ErrorFeedbackCodec, StatefulCodec, TransformingCodec
from geocomm.codecs.frames import DTYPE_CODES
from geocomm.comm.base import Communicator
from geocomm.engine.layout import array_module, mix64

OPS = ("sum", "avg")


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with different arguments."""


# ---------------------------------------------------------------------------
# tensors of a buffer


@dataclass(frozen=True)
class Part:
    """One tensor of a flat buffer: values [offset, offset + size) viewed as ``shape``,
    named ``key`` for transforming codecs (the key's state is keyed by it)."""

    offset: int
    shape: tuple[int, ...]
    key: Any

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def parts_of(
    shape: tuple[int, ...], count: int, key: Any, parts: Sequence[Any] | None
) -> list[Part]:
    """The tensors of the buffer: ``parts`` is a sequence of (key, shape) that tiles
    the flat buffer in order; without it the buffer is one tensor of ``shape``.
    A key of None stands for the tensor's shape."""
    if parts is None:
        return [Part(0, tuple(shape), ("shape", tuple(shape)) if key is None else key)]
    if key is not None:
        raise TypeError("pass either key= or parts=, not both")
    result, offset = [], 0
    for entry in parts:
        try:
            name, part_shape = entry
            part_shape = tuple(int(d) for d in part_shape)
        except (TypeError, ValueError):
            raise TypeError(f"parts entries must be (key, shape) pairs, got {entry!r}") from None
        if any(d < 0 for d in part_shape):
            raise ValueError(f"part {name!r} has a negative dimension: {part_shape}")
        result.append(Part(offset, part_shape, ("shape", part_shape) if name is None else name))
        offset += math.prod(part_shape)
    if offset != count:
        raise ValueError(f"parts hold {offset} values, the buffer {count}")
    return result


# ---------------------------------------------------------------------------
# argument handling


def check_array(x: Any, name: str = "x") -> Any:
    """x if it is a NumPy or CuPy array of a supported float dtype, else TypeError."""
    if not isinstance(x, np.ndarray) and array_module(x) is np:
        raise TypeError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; geocomm collectives take float32, "
            "float16, bfloat16 or (codec 'none') float64"
        )
    return x


def as_float32(x: Any) -> Any:
    """Flat contiguous float32 values of x (a copy unless x already is one)."""
    return array_module(x).ascontiguousarray(x, dtype=np.float32).reshape(-1)


def check_out(out: Any, x: Any) -> None:
    if out is None:
        return
    shape, dtype = x.shape, x.dtype
    if type(out) is not type(x):
        raise TypeError(
            f"out must be an array like x ({type(x).__name__}), got {type(out).__name__}"
        )
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out is {out.dtype}{list(out.shape)}, expected {dtype}{list(shape)}")
    if not getattr(out.flags, "writeable", True):
        raise ValueError("out is read-only")


def shard_parts(parts: list[Part], ranges: list[tuple[int, int]]) -> list[Part]:
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
    return result


def call_fingerprint(kind: str, count: int, dtype: np.dtype, op: str, codec: Codec,
                     parts: list[Part], topology: str = "flat",
                     with_state: bool = True) -> np.ndarray:  # fmt: skip
    """The int64 row that identifies a call on this rank (collective, count, dtype, op,
    codec config, parts and keys, the keys' codec state unless ``with_state`` is
    false, topology), one per field: ranks whose rows are equal make the same call."""
    config = json.dumps(codec.get_config(), sort_keys=True).encode()
    signature = json.dumps([(repr(p.key), p.shape) for p in parts]).encode()
    state = 0
    if isinstance(codec, ErrorFeedbackCodec) and topology != "flat":
        # node-aware residuals are per local index (checked across nodes); the map's
        # state of this call's keys is every rank's
        codec = codec.mapping_codec  # type: ignore[assignment]
    if with_state and isinstance(codec, StatefulCodec):
        for p in parts:
            state = zlib.crc32(codec.state_checksum(p.key).to_bytes(4, "little"), state)
    return np.array(
        [
            zlib.crc32(kind.encode()),
            count,
            DTYPE_CODES[dtype],
            OPS.index(op),
            zlib.crc32(config),
            zlib.crc32(signature),
            state,
            zlib.crc32(topology.encode()),
        ],
        dtype=np.int64,
    )


_FIELDS = (
    "collective",
    "count",
    "dtype",
    "op",
    "codec config",
    "parts or key",
    "codec state",
    "topology",
)


def raise_on_mismatch(kind: str, rows: np.ndarray) -> None:
    """Raise CollectiveMismatchError unless every rank's :func:`call_fingerprint` (one
    row per rank, gathered) equals rank 0's; every rank holding the rows raises alike."""
    bad = np.nonzero((rows != rows[0]).any(axis=1))[0]
    if bad.size:
        diffs = [_FIELDS[f] for f in np.nonzero(rows[bad[0]] != rows[0])[0]]
        detail = ", ".join(f"rank {r}: count={rows[r, 1]}" for r in range(rows.shape[0]))
        raise CollectiveMismatchError(
            f"geocomm.{kind}: ranks {bad.tolist()} differ from rank 0 in {', '.join(diffs)} "
            f"({detail}); every rank must pass the same count, dtype, op, codec, keys and "
            "topology, and "
            "transforming codecs must hold the same state"
        )


def check_consistent(
    comm: Communicator,
    kind: str,
    count: int,
    dtype: np.dtype,
    op: str,
    codec: Codec,
    parts: list[Part],
    topology: str = "flat",
) -> None:
    """Raise CollectiveMismatchError on every rank if the ranks' calls differ
    (``topology``: the requested one, ``"flat"``, ``"node"`` or ``"auto"``)."""
    row = call_fingerprint(kind, count, dtype, op, codec, parts, topology)
    raise_on_mismatch(kind, comm.allgather_int64(row))


_calls: dict[str, int] = {}


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


def stateful_parts(
    codec: Codec, kind: str, parts: list[Part], count: int, xp: Any
) -> tuple[TransformingCodec | None, Any]:
    """(the codec that maps the tensors or None, the error-feedback residual of this
    call's signature or None)."""
    if isinstance(codec, ErrorFeedbackCodec):
        signature = json.dumps([kind, [(repr(p.key), p.shape) for p in parts]])
        return codec.mapping_codec, codec.residual(signature, count, xp)
    return (codec if isinstance(codec, TransformingCodec) else None), None


def rounding_stream(codec: Codec, parts: list[Part]) -> int:
    """The call's stochastic-rounding stream (0 when the codec rounds to nearest):
    a hash of the codec config and the tensors' keys, and the number of calls made
    so far with them, which every rank counts alike."""
    config = codec.get_config()
    if config.get("rounding") != "stochastic":
        return 0
    name = json.dumps([config, [repr(p.key) for p in parts]], sort_keys=True)
    count = _calls.get(name, 0)
    _calls[name] = count + 1
    return mix64(zlib.crc32(name.encode()) ^ (count << 32))


def check_enabled(check: bool | None) -> bool:
    if check is not None:
        return check
    return os.environ.get("GEOCOMM_CHECK", "1") not in ("0", "false", "no")
