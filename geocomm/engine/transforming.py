"""How the collectives drive a transforming codec (docs/design.md, "Transforming codecs").

The codec plans and maps; this module runs its protocol for a buffer of
tensors: :func:`plan_parts` plans every tensor and :func:`step_parts` runs
the basis steps of the plans that take one (one exact sum per round for all
tensors);
:class:`SideChannel` holds the plans' side contributions end to end,
:meth:`SideChannel.begin` has the ranged plans write theirs there (their
whole-tensor step) and :meth:`SideChannel.sum` sums them exactly in one
collective; :class:`PartsMap` maps pieces for the pipeline as they travel
and back as their sums become final, and :func:`refresh` runs the refresh
rounds of all tensors, one exact sum per round (:func:`run_rounds` drives
the steps' and the refreshes' rounds).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from geocomm.comm.base import Communicator
from geocomm.engine.arithmetic import add_into, copy_into, residual_of
from geocomm.engine.exact import ExactSum, exact_sum
from geocomm.engine.layout import array_module
from geocomm.engine.protocols import WireCodec


def plan_parts(
    codec: Any, values: Any, parts: list[Any], bounds: np.ndarray
) -> list[tuple[Any, Any]]:
    """Plan every part with ``codec`` (None: no part is mapped); return the (part, plan)
    pairs that have a plan.

    Plans with ``steps`` then run the codec's ``step`` rounds (:func:`step_parts`;
    their bases turn towards this call's gradients). Ranged plans then take
    their whole-tensor step (:meth:`SideChannel.begin`) and map piece by piece
    (:class:`PartsMap`); the others map their whole tensor when the map is built.
    """
    planned: list[tuple[Any, Any]] = []
    if codec is None:
        return planned
    for part in parts:
        lo, hi = part.offset, part.offset + part.size
        # the shard offsets as the tensor sees them: from its first value, within it
        local = np.clip(np.asarray(bounds) - lo, 0, part.size)
        plan = codec.plan(values[lo:hi], part.shape, part.key, local)
        if plan is not None:
            planned.append((part, plan))
    return planned


def step_parts(
    comm: Communicator, codec: Any, values: Any, planned: list[tuple[Any, Any]]
) -> list[Any]:
    """Run the codec's ``step`` rounds of the plans with ``steps`` over ``comm`` (one
    exact sum per round for all of them); return what each such plan took from its
    step (its ``pending``), in their order, for :func:`resume_steps`."""
    stepping = [(part, plan) for part, plan in planned if plan.steps]
    steps = [
        codec.step(plan, values[part.offset : part.offset + part.size]) for part, plan in stepping
    ]
    run_rounds(comm, codec, steps)
    return [plan.pending for _, plan in stepping]


def resume_steps(planned: list[tuple[Any, Any]], taken: list[Any]) -> None:
    """Hand the plans with ``steps`` what :func:`step_parts` returned for the call whose
    work a CUDA graph replays for theirs (the arrays the graph writes; a plan that
    stepped itself is handed its own)."""
    stepping = [plan for _, plan in planned if plan.steps]
    for plan, pending in zip(stepping, taken, strict=True):
        plan.resume(pending)


def side_layout(planned: list[tuple[Any, Any]]) -> tuple[tuple[int, ...] | None, ...]:
    """The shape of each plan's side (None: it has none), once its steps ran: what a
    :class:`SideChannel` is made for. Ranged plans name theirs before computing it
    (``side_shape``); the others compute it here (``side``)."""
    layout: list[tuple[int, ...] | None] = []
    for _, plan in planned:
        shape = getattr(plan, "side_shape", None) if plan.ranged else None
        if shape is None:
            side = plan.side
            shape = None if side is None else tuple(side.shape)
        layout.append(shape)
    return tuple(layout)


class SideChannel:
    """The side contributions of one :func:`side_layout`, end to end in one buffer of
    namespace ``xp``, and their exact sum over ``comm`` in the codec's ``side_format``:
    made once per signature and layout, so a steady call allocates nothing for them.

    :meth:`begin` has the ranged plans write their side into their slot (their
    whole-tensor step, before the pipeline maps pieces); :meth:`sum` copies the
    others' in, sums every slot in one collective and returns each plan's summed
    side (None where it has none), views of the sum's buffer: they hold until the
    channel's next sum.
    """

    def __init__(self, comm: Communicator, fmt: str, layout: tuple[Any, ...], xp: Any):
        sizes = [0 if shape is None else int(np.prod(shape)) for shape in layout]
        self.values = xp.empty(sum(sizes), dtype=np.float32)
        self.exact = ExactSum(comm, self.values.size, fmt, xp)
        self.layout = layout
        self.scratch: Any = None  # the plans' begin scratch (:meth:`begin`)
        starts = np.cumsum([0, *sizes])[:-1]
        self.spans = [(int(a), int(a + size)) for a, size in zip(starts, sizes, strict=True)]

    def _slots(self, flat: Any) -> list[Any]:
        return [
            None if shape is None else flat[a:b].reshape(shape)
            for shape, (a, b) in zip(self.layout, self.spans, strict=True)
        ]

    def reserve(self, planned: list[tuple[Any, Any]]) -> None:
        """Make the scratch :meth:`begin` needs for ``planned``, as large as the largest
        ``plan.scratch_size`` (kept: the layout's later calls allocate none)."""
        need = max((p.scratch_size for _, p in planned if p.ranged), default=0)
        if need and (self.scratch is None or self.scratch.size < need):
            self.scratch = array_module(self.values).empty(need, dtype=np.float32)

    def begin(self, planned: list[tuple[Any, Any]], values: Any) -> None:
        """The ranged plans' whole-tensor step, each writing its side into its slot, with
        the channel's scratch (made by :meth:`reserve` first, outside any graph)."""
        for (part, plan), slot in zip(planned, self._slots(self.values), strict=True):
            if plan.ranged:
                plan.begin(values[part.offset : part.offset + part.size], slot, self.scratch)

    def sum(self, planned: list[tuple[Any, Any]]) -> list[Any]:
        """The exact sums of the plans' sides (after :meth:`begin`), one collective:
        :meth:`summed`."""
        if self.values.size:
            for (_, plan), slot in zip(planned, self._slots(self.values), strict=True):
                if slot is not None and plan.side is not slot:
                    slot[...] = plan.side
            self.exact(self.values)
        return self.summed()

    def summed(self) -> list[Any]:
        """Each plan's summed side from the last :meth:`sum` (None where it has none)."""
        return self._slots(self.exact.total)


class PartsMap:
    """The pipeline's :class:`~geocomm.engine.protocols.RangeMap` over a buffer of tensors.

    ``read`` returns the mapped values of a range, written into ``out`` or a
    scratch that lives until the next read (``scratch``, float32 of the values'
    namespace: the caller's, so a steady call allocates none; None: made when a
    read first needs it, and grown as needed; ranged plans map there and then;
    tensors without a plan are copied), plus the error-feedback ``residual`` if
    there is one. Whole-tensor plans map their tensors up front: into ``result``
    when it holds the whole buffer (an all-reduce: the pipeline reads a range
    before it writes it), else into a buffer of the tensor's size; a range
    inside one such tensor is read from there without a copy.
    ``encoded`` stores in the residual what a quantization lost (decoding
    with ``codec``); ``done`` maps a finished range of ``result`` (which
    starts at ``offset``) back, for ranged plans. Whole-tensor plans are
    inverted by :meth:`finish`. ``encode`` and ``decode`` hand a range that
    lies inside one ranged plan's tensor to the plan's fused calls (the map
    and the codec in one pass; no scratch), ``encode`` unless a residual is
    kept; ``split`` gives such a range's map to a device pipeline's kernels.
    """

    def __init__(
        self,
        values: Any,
        result: Any,
        offset: int,
        parts: list[Any],
        planned: list[tuple[Any, Any]],
        side_sums: list[Any],
        residual: Any = None,
        codec: WireCodec | None = None,
        scratch: Any = None,
    ):
        self.values, self.result, self.offset = values, result, offset
        self.mapped: dict[int, Any] = {}  # what whole-tensor plans mapped, by id(part)
        self.residual, self.codec = residual, codec
        plans = {
            id(part): (plan, side) for (part, plan), side in zip(planned, side_sums, strict=True)
        }
        self.parts = [(p, *plans.get(id(p), (None, None))) for p in parts]
        self.starts = [p.offset for p in parts]
        self.scratch = scratch
        in_result = offset == 0 and result.shape[0] == values.shape[0]
        for part, plan in planned:
            if plan.ranged:
                continue
            lo, hi = part.offset, part.offset + part.size
            target = result[lo:hi] if in_result else array_module(values).empty_like(values[lo:hi])
            plan.forward(values[lo:hi], target)
            self.mapped[id(part)] = target

    def _mapped_inside(self, lo: int, hi: int) -> Any:
        """A whole-tensor plan's own mapped values of [lo, hi) when the range lies
        inside its tensor, else None."""
        for part, plan, _, a, b in self._overlaps(lo, hi):
            if plan is not None and not plan.ranged and (a, b) == (lo, hi):
                return self.mapped[id(part)][lo - part.offset : hi - part.offset]
        return None

    def _scratch(self, length: int) -> Any:
        if self.scratch is None or self.scratch.shape[0] < length:
            self.scratch = array_module(self.values).empty(length, dtype=np.float32)
        return self.scratch[:length]

    def _overlaps(self, lo: int, hi: int) -> Any:
        """(part, plan, side sum, a, b) for every part meeting [lo, hi), [a, b) the overlap."""
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while i < len(self.parts) and self.parts[i][0].offset < hi:
            part, plan, side = self.parts[i]
            a, b = max(lo, part.offset), min(hi, part.offset + part.size)
            if a < b:
                yield part, plan, side, a, b
            i += 1

    @property
    def tracks_encoding(self) -> bool:
        return self.residual is not None

    def read(self, lo: int, hi: int, out: Any = None) -> Any:
        inside = self._mapped_inside(lo, hi)
        if out is None:
            out = inside if inside is not None else self._scratch(hi - lo)
        for part, plan, _, a, b in self._overlaps(lo, hi):
            if plan is not None and plan.ranged:
                plan.forward_range(self.values[a:b], a - part.offset, out[a - lo : b - lo])
            elif plan is None:
                copy_into(out[a - lo : b - lo], self.values[a:b])
            elif out is not inside:  # a whole-tensor plan's values, mapped up front
                out[a - lo : b - lo] = self.mapped[id(part)][a - part.offset : b - part.offset]
        if self.residual is not None:
            add_into(out, self.residual[lo:hi])
        return out

    def encoded(self, lo: int, hi: int, values: Any, wire: Any) -> None:
        if self.residual is not None:
            assert self.codec is not None, "a residual comes with the codec of its wire"
            sent = self.residual[lo:hi]
            self.codec.decode_wire(wire, sent)
            residual_of(values, sent)  # residual = values - decode(wire), finite

    def _sole(self, lo: int, hi: int) -> Any:
        """(part, plan, side sum) when [lo, hi) lies inside one tensor with a ranged
        plan, else None."""
        overlaps = list(self._overlaps(lo, hi))
        if len(overlaps) != 1:
            return None
        part, plan, side, a, b = overlaps[0]
        if plan is None or not plan.ranged or (a, b) != (lo, hi):
            return None
        return part, plan, side

    def encode(self, lo: int, hi: int, codec: Any, wire: Any, rounding_stream: int) -> bool:
        sole = None if self.residual is not None else self._sole(lo, hi)
        if sole is None:
            return False
        part, plan, _ = sole
        return bool(
            plan.encode_range(
                self.values[lo:hi], lo - part.offset, codec, wire, rounding_stream, lo
            )
        )

    def decode(self, lo: int, hi: int, codec: Any, wire: Any) -> bool:
        sole = self._sole(lo, hi)
        if sole is None:
            return False
        part, plan, side = sole
        out = self.result[lo - self.offset : hi - self.offset]
        return bool(plan.decode_range(wire, codec, out, lo - part.offset, side))

    def split(self, lo: int, hi: int, back: bool) -> Any:
        """The split map of [lo, hi) when the range lies inside one tensor whose ranged
        plan has one: with this rank's coefficients on the way out (None when a
        residual is kept: its update needs the values sent), with the summed ones on
        the way back; else None."""
        if not back and self.residual is not None:
            return None
        sole = self._sole(lo, hi)
        if sole is None:
            return None
        part, plan, side = sole
        return plan.split(lo - part.offset, hi - lo, side if back else plan.side)

    def done(self, lo: int, hi: int) -> None:
        for part, plan, side, a, b in self._overlaps(lo, hi):
            if plan is not None and plan.ranged:
                plan.inverse(self.result[a - self.offset : b - self.offset], a - part.offset, side)

    def finish(self, lo: int, hi: int) -> None:
        """Invert the whole-tensor plans over the result's range [lo, hi)."""
        for part, plan, side, a, b in self._overlaps(lo, hi):
            if plan is not None and not plan.ranged:
                plan.inverse(self.result[a - self.offset : b - self.offset], a - part.offset, side)


def refresh(
    comm: Communicator | None,
    codec: Any,
    planned: list[tuple[Any, Any]],
    side_sums: list[Any],
    result: Any,
    lo: int,
    hi: int,
) -> None:
    """Run the refresh rounds of every plan that asks for one, all tensors' partial
    sums in one exact sum per round. ``result[lo - lo:...]`` is this rank's shard
    [lo, hi) of the summed buffer, in the tensors' own coordinates. ``comm``
    None: every rank holds the whole buffer (an all-reduce) and refreshes from
    it alone, with the same bits everywhere and nothing sent."""
    rounds = []
    alone = comm is None
    for (part, plan), side_sum in zip(planned, side_sums, strict=True):
        if not plan.refreshes:
            continue
        a = min(max(lo, part.offset), part.offset + part.size)
        b = min(max(hi, part.offset), part.offset + part.size)
        shard = result[a - lo : b - lo]
        rounds.append(codec.refresh(plan, shard, a - part.offset, side_sum, alone=alone))
    if rounds:
        run_rounds(comm, codec, rounds)
        codec.flush()


def run_rounds(comm: Communicator | None, codec: Any, rounds: list[Any]) -> None:
    """Drive generators of rounds in lockstep: each round's yields of all of them
    travel in one exact sum in the codec's ``side_format`` and every sum goes back
    into its generator, until all have returned (the sums stay in the yields'
    namespace: nothing comes to the host). ``comm`` None: every yield is its own
    total (nothing is sent)."""
    pending = [(r, _advance(r, None)) for r in rounds]
    pending = [(r, v) for r, v in pending if v is not None]
    while pending:
        xp = array_module(pending[0][1])
        # one slice per yield (CuPy joins more than 8 arrays with a table of addresses
        # uploaded from the host, which a CUDA graph of the call could not replay)
        partial = xp.empty(sum(v.size for _, v in pending), dtype=np.float32)
        at = 0
        for _, value in pending:
            partial[at : at + value.size] = value.reshape(-1)
            at += value.size
        total = partial if comm is None else exact_sum(comm, partial, codec.side_format)
        nxt, at = [], 0
        for r, value in pending:
            sent = _advance(r, total[at : at + value.size].reshape(value.shape))
            at += value.size
            if sent is not None:
                nxt.append((r, sent))
        pending = nxt


def _advance(rounds: Any, total: Any) -> Any:
    """The next partial sums of a generator of rounds (None once it is done)."""
    try:
        return next(rounds) if total is None else rounds.send(total)
    except StopIteration:
        return None
