"""What the engine's parts promise each other, as ``typing.Protocol`` classes
(docs/design.md, "The collective" and "Transforming codecs").

The pipelines take any codec with the wire API (:class:`WireCodec`), run their
phases in :func:`geocomm.engine.layout.schedule`'s order (:class:`Phases`) and
map values through a :class:`RangeMap`; the transforming driver
(:mod:`geocomm.engine.transforming`) drives the codec's :class:`MapPlan` objects
and :class:`RefreshRounds`. Nothing here imports the rest of geocomm.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable


class WireCodec(Protocol):
    """The wire API of a codec (:class:`geocomm.codecs.Codec`'s) the pipelines use."""

    def wire_size(self, n: int) -> int: ...

    def encode_wire(
        self, x: Any, wire: Any, *, rounding_stream: int = 0, offset: int = 0
    ) -> None: ...

    def decode_wire(self, wire: Any, out: Any, accumulate: bool = False) -> None: ...

    def decode_wire_onto(self, wire: Any, base: Any, out: Any) -> None: ...


class Phases(Protocol):
    """One call's pipeline, phase by phase: what :func:`~geocomm.engine.layout.run_schedule`
    and ``geocomm.testing.run_lockstep`` drive. Host (:class:`~geocomm.engine.host.Pipeline`)
    and device (:class:`~geocomm.engine.device.BatchedPipeline`) pipelines both offer it."""

    pieces: Any
    gather: bool

    def encode_stage(self, s: int) -> None: ...

    def start_alltoall(self, s: int) -> None: ...

    def reduce_stage(self, s: int) -> None: ...

    def reencode_stage(self, s: int) -> None: ...

    def start_allgather(self, s: int) -> None: ...

    def decode_stage(self, s: int) -> None: ...

    def release(self) -> None: ...


class RangeMap(Protocol):
    """Maps the flat ranges of a buffer while it is reduced (transforming codecs).

    ``read(lo, hi, out)`` returns the values to send for [lo, hi) (the pipeline
    asks for every piece exactly once, before encoding it or adding it up),
    written into ``out`` when it is given;
    ``encoded(lo, hi, values, wire)`` says that ``values`` of [lo, hi) went
    out as ``wire`` (every quantization this rank makes: its pieces of other
    shards, then the sum of its own); ``done(lo, hi)`` says that
    result[lo:hi] (absolute indices) holds its final sum, which the map may
    then take back in place. ``encode(lo, hi, codec, wire, rounding_stream)``
    may stand for read, encode and encoded of a range (True: wire holds its
    bytes), ``decode(lo, hi, codec, wire)`` for the decode of a final range
    and done (True); False: the pipeline takes the steps one by one. Each
    runs between the pipeline's communication steps, so its work overlaps
    them. ``tracks_encoding``: whether ``encoded`` uses what it is told (error
    feedback); when not, a pipeline may encode the owner's sum as it adds it
    up, without storing it. ``split(lo, hi, back)``: the split map
    (:class:`~geocomm.codecs.formats.Split`) of a range that a device
    pipeline's kernels may run themselves, on the way out (``back`` False:
    instead of read and encoded; they read ``values[lo:hi]``, the flat
    input the map reads) or back (instead of done), or None.
    """

    values: Any

    @property
    def tracks_encoding(self) -> bool: ...

    def split(self, lo: int, hi: int, back: bool) -> Any: ...

    def read(self, lo: int, hi: int, out: Any = None) -> Any: ...

    def encoded(self, lo: int, hi: int, values: Any, wire: Any) -> None: ...

    def done(self, lo: int, hi: int) -> None: ...

    def encode(self, lo: int, hi: int, codec: Any, wire: Any, rounding_stream: int) -> bool: ...

    def decode(self, lo: int, hi: int, codec: Any, wire: Any) -> bool: ...


class MapPlan(Protocol):
    """A transforming codec's plan of one tensor (``codec.plan(...)``): ``ranged`` plans map
    piece by piece (``begin`` once, ``forward_range`` per piece), the others the whole
    tensor (``forward``); ``inverse`` maps a final range back with the side sum; ``side`` is
    this rank's side contribution (None: none), which ``begin`` writes into the array it is
    given (of the plan's ``side_shape``, when it has one; None: a new one); ``steps``:
    whether step rounds come first (``codec.step(plan, values)``, before
    ``begin``/``forward``); ``refreshes``: whether refresh rounds follow. A ranged plan's
    ``encode_range`` and ``decode_range`` fuse the map with the codec's encode or decode of
    a range where they can (True) and do nothing where they cannot (False: the caller maps
    and codes in two steps); its ``split(start, length, coef)`` gives a range's split map
    for device kernels (None: the map is not a split). A ranged plan that names
    ``inputs`` (the arrays its map and its step read besides the values and the sides)
    may be replayed from a CUDA graph of its call when it has no refresh: the graph
    reads those arrays where they lie. With ``steps`` it also names, after the step
    rounds, ``pending`` (what they left on the device), which a replay hands to its plan
    with ``resume(pending)``."""

    ranged: bool
    steps: bool
    refreshes: bool
    side: Any

    def begin(self, values: Any, side: Any = None) -> None: ...

    def forward(self, values: Any, out: Any) -> None: ...

    def forward_range(self, values: Any, start: int, out: Any) -> None: ...

    def inverse(self, result: Any, start: int, side_sum: Any) -> None: ...

    def encode_range(
        self, values: Any, start: int, codec: Any, wire: Any, rounding_stream: int, offset: int
    ) -> bool: ...

    def decode_range(self, wire: Any, codec: Any, out: Any, start: int, side_sum: Any) -> bool: ...


#: A step (``codec.step(plan, values)``) or a refresh (``codec.refresh(plan, shard,
#: start, side_sum, alone)``): yields partial sums, is sent their exact sum over ranks
#: (``alone``: the sums as they are), until it returns.
RefreshRounds = Generator[Any, Any, None]


@runtime_checkable
class Capturable(Protocol):
    """A device communicator whose transfers can be captured into a CUDA graph (NCCL's):
    ``capturing()`` is the context in which they are (no bookkeeping of events that only
    exist in the graph); it gives a record of the capture (or None) to pass to
    ``track(stream, captured)`` after each launch of the graph, which takes note of the
    work the launch queued on ``stream`` (its transfers' timeouts are watched like any
    other; a meter counts the captured bytes again). ``check_usable()`` raises
    RuntimeError when it can take no more work (closed, or aborted after a failure):
    a graph of its transfers is not launched then. ``captured_everywhere(ok)``: whether
    the capture that just ended succeeded on every rank (``ok``: on this one), since
    NCCL requires whether a transfer is captured, and which graph replays it, to be
    the same on every rank."""

    def capturing(self) -> AbstractContextManager[Any]: ...

    def track(self, stream: Any, captured: Any = None) -> None: ...

    def check_usable(self) -> None: ...

    def captured_everywhere(self, ok: bool) -> bool: ...
