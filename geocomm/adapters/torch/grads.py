"""What the DDP hook and the FSDP2 reduce-scatter share: how a flat gradient buffer
becomes (at most) one compressed and one plain collective, when the ranks compare
metadata (the per-step telemetry is :mod:`geocomm.adapters.torch.telemetry`).

A buffer holds ``rows`` rows of ``width`` values; every row lists the same
tensors in the same order (a DDP bucket: one row of whole parameters; an
FSDP2 reduce-scatter input: one row per rank, each row that rank's chunk of
every parameter). :class:`BufferLayout` splits the tensors by :class:`Selection`
into a compressed and a plain :class:`ColumnGroup`; :class:`GradReducer` runs
one collective per non-empty group, through a
:class:`~geocomm.comm.metered.MeteredComm` so every byte is counted.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from geocomm import api
from geocomm._environ import switch
from geocomm.adapters.torch.telemetry import BucketStats, ErrorSample, Telemetry, sample_budget
from geocomm.codecs import get_codec
from geocomm.comm.metered import MeteredComm
from geocomm.engine.call import CollectiveMismatchError, Part
from geocomm.engine.checks import check_consistent

LOG = logging.getLogger("geocomm.torch")

#: numpy dtypes of the gradient dtypes geocomm reduces (for the metadata fingerprint)
NUMPY_DTYPES = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """TypeError unless gradients of ``dtype`` can be reduced (:data:`NUMPY_DTYPES`)."""
    if dtype not in NUMPY_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in NUMPY_DTYPES)
        raise TypeError(f"{what} holds {dtype} gradients; geocomm reduces {names}")


# ---------------------------------------------------------------------------
# which parameters are compressed


@dataclass(frozen=True)
class Selection:
    """Which tensors travel compressed: those whose name matches no ``exclude``
    pattern (:func:`fnmatch.fnmatchcase`, e.g. ``"*embed*"``, ``"*norm*"``,
    ``"head.*"``) and whose parameter holds at least ``min_numel`` values (the whole
    parameter's, for FSDP's chunks as for DDP's). The others are reduced exactly
    (the plain collective)."""

    exclude: tuple[str, ...] = ()
    min_numel: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str) or not all(isinstance(p, str) for p in self.exclude):
            raise TypeError(f"exclude must be a sequence of name patterns, got {self.exclude!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative integer, got {self.min_numel!r}")

    @classmethod
    def of(cls, exclude: Any, min_numel: int) -> Selection:
        """From user arguments: a lone string is refused, not split into characters."""
        # a lone string reaches __post_init__, which refuses it
        return cls(exclude if isinstance(exclude, str) else tuple(exclude), min_numel)  # type: ignore[arg-type]

    def compressed(self, name: str, numel: int) -> bool:
        return numel >= self.min_numel and not any(
            fnmatch.fnmatchcase(name, p) for p in self.exclude
        )


# ---------------------------------------------------------------------------
# layouts


@dataclass(frozen=True)
class Entry(Part):
    """One tensor of a row, a :class:`~geocomm.engine.call.Part` (values ``offset``
    on, viewed as ``shape``; ``key`` for the codec's per-tensor state) with the
    ``name`` :class:`Selection` matches and the values of the whole parameter it
    holds (``param_numel``; 0: the tensor is the whole parameter, not a shard's
    chunk of it), which :class:`Selection` compares with ``min_numel``."""

    name: str = ""
    param_numel: int = 0

    @property
    def numel(self) -> int:
        return self.size


class ColumnGroup:
    """Tensors of a row that share one collective.

    Their columns are merged into ranges; :meth:`take` gives their values as one
    flat buffer (row after row: a view when the group is all of a one-row
    buffer or one range of it, else a copy) and :meth:`put` writes results back.
    """

    def __init__(self, entries: Sequence[Entry], rows: int, width: int):
        self.entries = tuple(entries)
        self.rows, self.width = rows, width
        self.numel = sum(e.numel for e in self.entries)  # per row
        ranges: list[list[int]] = []
        for e in self.entries:
            if ranges and ranges[-1][1] == e.offset:
                ranges[-1][1] += e.numel
            else:
                ranges.append([e.offset, e.offset + e.numel])
        self.ranges = tuple((a, b) for a, b in ranges)

    def parts(self) -> list[tuple[Any, tuple[int, ...]]]:
        """(key, shape) of every tensor of the flat buffer, row after row; with
        several rows the key of row r is ``(key, r)`` (each rank's chunk of a
        parameter is a tensor of its own)."""
        if self.rows == 1:
            return [(e.key, e.shape) for e in self.entries]
        return [((e.key, r), e.shape) for r in range(self.rows) for e in self.entries]

    def _direct(self) -> bool:
        return len(self.ranges) == 1 and (self.rows == 1 or self.ranges[0] == (0, self.width))

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The group's values of ``rows`` (rows, width), flat and contiguous."""
        if self._direct():
            a, b = self.ranges[0]
            return rows[:, a:b].reshape(-1)
        return torch.cat([rows[:, a:b] for a, b in self.ranges], dim=1).reshape(-1)

    def put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write flat ``values`` (rows.shape[0] rows of the group) into ``rows``."""
        values = values.view(rows.shape[0], self.numel)
        at = 0
        for a, b in self.ranges:
            target = rows[:, a:b]
            if target.data_ptr() != values[:, at : at + b - a].data_ptr():
                target.copy_(values[:, at : at + b - a])
            at += b - a


class BufferLayout:
    """A buffer of ``rows`` rows of the tensors ``entries`` (in row order), split
    into the ``compressed`` and ``plain`` groups (either may be None). ``order``:
    a sort key that lays out each group's tensors in the collective in an order of
    their own instead of row order (so two buffers holding the same tensors in
    different orders give the same bits, see GeocommHookState.layout)."""

    def __init__(
        self,
        entries: Sequence[Entry],
        selection: Selection,
        rows: int = 1,
        order: Callable[[Entry], Any] | None = None,
    ):
        self.entries, self.rows = tuple(entries), rows
        self.width = sum(e.numel for e in self.entries)
        offset = 0
        for e in self.entries:
            if e.offset != offset:
                raise ValueError(f"tensor {e.name!r} starts at {e.offset}, expected {offset}")
            offset += e.numel
        chosen = [selection.compressed(e.name, e.param_numel or e.numel) for e in self.entries]
        comp = [e for e, c in zip(self.entries, chosen, strict=True) if c]
        plain = [e for e, c in zip(self.entries, chosen, strict=True) if not c]
        if order is not None:
            comp, plain = sorted(comp, key=order), sorted(plain, key=order)
        self.compressed = ColumnGroup(comp, rows, self.width) if comp else None
        self.plain = ColumnGroup(plain, rows, self.width) if plain else None

    @property
    def numel(self) -> int:
        return self.rows * self.width

    def fingerprint_parts(self) -> tuple[Part, ...]:
        """Every tensor as a :class:`~geocomm.engine.call.Part` for the metadata check:
        compressed ones under their codec key, plain ones marked as plain."""
        plain = {e.offset for e in self.plain.entries} if self.plain else set()
        parts = []
        for r in range(self.rows):
            for e in self.entries:
                key = e.key if self.rows == 1 else (e.key, r)
                parts.append(
                    Part(
                        r * self.width + e.offset,
                        e.shape,
                        ("plain", key) if e.offset in plain else key,
                    )
                )
        return tuple(parts)


# ---------------------------------------------------------------------------
# the reducer


def check_policy(check: bool | None) -> str:
    """When the ranks compare metadata: ``"first"`` call per layout (the default),
    ``"always"`` (check=True, or ``GEOCOMM_CHECK=1`` set explicitly: debugging),
    ``"never"`` (check=False or ``GEOCOMM_CHECK=0``)."""
    if check is not None:
        return "always" if check else "never"
    env = switch("GEOCOMM_CHECK")  # geocomm._environ: on, off, or unset
    if env is None:
        return "first"
    return "always" if env else "never"


def baseline_bytes(kind: str, numel: int, itemsize: int, size: int) -> int:
    """Bytes one rank sends in the uncompressed ring all-reduce (or reduce-scatter)."""
    factor = 2 if kind == "allreduce" else 1
    return factor * (size - 1) * numel * itemsize // size


class GradReducer:
    """Reduces buffers laid out by :class:`BufferLayout`: the compressed group in one
    collective of ``codec`` (``parts=`` keeps every tensor's key and shape),
    the plain group in one exact collective; metadata compared per
    :func:`check_policy`; a :class:`BucketStats` per reduction into
    ``telemetry``. ``stage_size``: pipeline stage size (None: the collectives'
    choice for the backend, docs/design.md, "Training integration"). ``comm``:
    a communicator; or ``connect``: a function of no arguments that makes one,
    called at the first use of :attr:`comm` (so a reducer can exist before the
    process group does).
    Not thread-safe: one thread drives it (collective order must be the same on
    every rank).
    """

    def __init__(
        self,
        codec: Any,
        comm: Any,
        check: bool | None = None,
        error_sample: int | None = None,
        stage_size: int | None = None,
        telemetry: Telemetry | None = None,
        *,
        connect: Callable[[], Any] | None = None,
    ):
        self.codec = get_codec(codec)
        if (comm is None) == (connect is None):
            raise TypeError("GradReducer takes a comm or a connect function, one of them")
        self._connect = connect
        self._comm = (
            None if comm is None else comm if isinstance(comm, MeteredComm) else MeteredComm(comm)
        )
        self.policy = check_policy(check)
        self.error_sample = error_sample
        self.stage_size = stage_size
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self._checked: set[Any] = set()

    @property
    def comm(self) -> MeteredComm:
        """The (metered) communicator, made now if it was given as a function."""
        if self._comm is None:
            assert self._connect is not None
            base = self._connect()
            self._comm = base if isinstance(base, MeteredComm) else MeteredComm(base)
            self._connect = None
        return self._comm

    @property
    def connected(self) -> bool:
        """Whether the communicator exists yet."""
        return self._comm is not None

    def _check(
        self, kind: str, layout: BufferLayout, dtype: torch.dtype, op: str, what: str
    ) -> None:
        key = (kind, id(layout), dtype, op)
        if self.policy == "never" or (self.policy == "first" and key in self._checked):
            return
        try:
            check_consistent(
                self.comm,
                kind,
                layout.numel,
                NUMPY_DTYPES[dtype],
                op,
                self.codec,
                layout.fingerprint_parts(),
            )
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(f"{what}: {exc}") from exc
        self._checked.add(key)

    def _start(self) -> tuple[float, int, int]:
        return time.perf_counter(), self.comm.sent, self.comm.calls

    def _finish(
        self,
        start: tuple[float, int, int],
        index: int,
        kind: str,
        layout: BufferLayout,
        dtype: torch.dtype,
        collectives: int,
        rel_error: float | None,
    ) -> BucketStats:
        t0, sent0, calls0 = start
        itemsize = torch.empty((), dtype=dtype).element_size()
        stats = BucketStats(
            index,
            kind,
            layout.numel,
            layout.rows * (layout.compressed.numel if layout.compressed else 0),
            collectives,
            self.comm.calls - calls0,
            self.comm.sent - sent0,
            baseline_bytes(kind, layout.numel, itemsize, self.comm.size),
            rel_error,
            time.perf_counter() - t0,
        )
        self.telemetry.record(stats)
        return stats

    def _options(self, group: ColumnGroup, codec: Any) -> dict[str, Any]:
        """The keywords of one group's collective: the tensors' keys when it is compressed,
        no metadata check (the reducer compares whole layouts)."""
        parts = group.parts() if codec is self.codec else None
        return {
            "codec": codec,
            "parts": parts,
            "comm": self.comm,
            "check": False,
            "stage_size": self.stage_size,
        }

    def allreduce(
        self,
        layout: BufferLayout,
        buffer: torch.Tensor,
        index: int = 0,
        op: str = "avg",
        what: str = "bucket",
    ) -> BucketStats:
        """Reduce the flat ``buffer`` (one row of ``layout``) in place over the ranks."""
        check_dtype(buffer.dtype, what)
        if buffer.numel() != layout.numel or layout.rows != 1:
            raise ValueError(
                f"{what}: buffer of {buffer.numel()} values, layout of "
                f"{layout.numel} in {layout.rows} rows"
            )
        start = self._start()
        self._check("allreduce", layout, buffer.dtype, op, what)
        rows = buffer.view(1, -1)
        rel_error, collectives = None, 0
        for group, codec in ((layout.compressed, self.codec), (layout.plain, "none")):
            if group is None:
                continue
            values = group.take(rows)
            sample = (
                ErrorSample(
                    self.codec, values, 0, values.numel(), sample_budget(self.error_sample, values)
                )
                if group is layout.compressed
                else None
            )
            api.allreduce(values, op=op, out=values, **self._options(group, codec))
            if sample is not None:
                rel_error = sample.estimate(values, 0, self.comm.size, op == "avg", True)
            group.put(rows, values)
            collectives += 1
        return self._finish(start, index, "allreduce", layout, buffer.dtype, collectives, rel_error)

    def reduce_scatter(
        self,
        layout: BufferLayout,
        source: torch.Tensor,
        out: torch.Tensor,
        index: int = 0,
        op: str = "avg",
        what: str = "module",
    ) -> BucketStats:
        """Reduce-scatter ``source`` (``layout.rows`` = ranks rows) into this rank's
        ``out`` (its row of the reduced buffer)."""
        check_dtype(source.dtype, what)
        size, rank = self.comm.size, self.comm.rank
        if layout.rows != size or source.numel() != layout.numel or out.numel() != layout.width:
            raise ValueError(
                f"{what}: reduce-scatter of {source.numel()} values into {out.numel()} on "
                f"{size} ranks, but the layout has {layout.rows} rows of {layout.width} "
                "values (the parameters that require grad must stay those compress_fsdp "
                "laid out: freezing or unfreezing one changes FSDP's buffers)"
            )
        start = self._start()
        self._check("reduce_scatter", layout, source.dtype, op, what)
        rows, out_rows = source.view(size, -1), out.view(1, -1)
        rel_error, collectives = None, 0
        for group, codec in ((layout.compressed, self.codec), (layout.plain, "none")):
            if group is None:
                continue
            values = group.take(rows)
            lo, hi = rank * group.numel, (rank + 1) * group.numel
            sample = (
                ErrorSample(self.codec, values, lo, hi, sample_budget(self.error_sample, values))
                if group is layout.compressed
                else None
            )
            # into out's own columns where they are one range (put then copies nothing)
            (a, b), one = group.ranges[0], len(group.ranges) == 1
            target = out_rows[0, a:b] if one and out_rows.dtype == values.dtype else None
            shard = api.reduce_scatter(values, op=op, out=target, **self._options(group, codec))
            if sample is not None:
                rel_error = sample.estimate(shard, lo, size, op == "avg", False)
            group.put(out_rows, shard)
            collectives += 1
        return self._finish(
            start, index, "reduce_scatter", layout, source.dtype, collectives, rel_error
        )
