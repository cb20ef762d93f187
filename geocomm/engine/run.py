"""Running a call (docs/design.md, "The collective"): the engine's front.

:func:`run` takes a :class:`~geocomm.engine.call.Call` from the API layer and
chooses how it runs:

* a lossless codec: the communicator's own exact all-reduce (float64 too);
* an all-gather: every rank encodes its values once, every rank decodes all;
* an all-reduce or reduce-scatter: node-aware when the signature's topology
  and the cost model say so (:mod:`geocomm.engine.hierarchical`), else flat:
  the staged pipeline, on the device (:class:`~geocomm.engine.device.DevicePlan`:
  CuPy arrays over a device communicator whose codec sends a native format) or
  on the host (:class:`~geocomm.engine.host.Pipeline`), with the transforming
  codecs' and error feedback's protocols (:mod:`geocomm.engine.transforming`).

What a signature needs beyond the call itself (the node communicators, the
pieces, the device plan) is made at its first call and kept in
``signature.plans`` for the next ones.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from geocomm.codecs import Codec, ErrorFeedbackCodec, TransformingCodec
from geocomm.comm.base import Communicator, wait_ordered
from geocomm.comm.nodes import NodeComms, node_comms, node_layout
from geocomm.engine import checks, costs, device
from geocomm.engine.arithmetic import divide
from geocomm.engine.call import Call, Part, Signature, new_call, shard_parts
from geocomm.engine.device_tables import wire_format
from geocomm.engine.graphs import Graphs
from geocomm.engine.hierarchical import node_allreduce, node_reduce_scatter
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import (
    PIECE_ALIGN,
    CallBytes,
    Pieces,
    array_module,
    call_bytes,
    segments,
    shard_bounds,
)
from geocomm.engine.layout import stage_size as backend_stage_size
from geocomm.engine.transforming import (
    PartsMap,
    SideChannel,
    plan_parts,
    refresh,
    resume_steps,
    side_layout,
    step_parts,
)

_NODES, _ACROSS, _FLAT = "nodes", "across", "flat"


def run(call: Call) -> None:
    """Run ``call``: afterwards ``call.result`` holds the result, bitwise identical on
    every rank (for CuPy arrays: queued on the current stream, like any CuPy
    operation). Raises CollectiveMismatchError when the ranks' calls differ."""
    signature = call.signature
    if array_module(call.source) is not np and not signature.comm.device_arrays:
        _staged(call)
        return
    checks.verify(call)
    averaged = False
    if signature.codec.lossless:
        _exact(call)
    elif signature.kind == "allgather":
        _gathered(call)
    else:
        averaged = _reduced(call)
    if signature.op == "avg" and not averaged:
        divide(call.result, signature.comm.size)


def _staged(call: Call) -> None:
    """CuPy arrays on a communicator of host memory (MPI is not assumed CUDA-aware):
    the call runs on host copies, and the result goes back to the device."""
    import cupy

    source = cupy.asnumpy(call.source)
    result = np.empty(call.result.shape, call.result.dtype)
    run(Call(call.signature, source, result, call.rounding_stream))
    call.result[...] = cupy.asarray(result)


# ---------------------------------------------------------------------------
# exact calls and all-gathers


def _exact(call: Call) -> None:
    """The lossless codec: the communicator's own reduction (``source`` and ``result``
    apart), or an all-gather of the values' bytes."""
    signature, source = call.signature, call.source
    comm = signature.comm
    if signature.kind == "allgather":
        _gather_bytes(comm, source.view(np.uint8), call.result.reshape(-1).view(np.uint8))
    elif signature.kind == "allreduce":
        comm.allreduce(source, call.result, "sum")
    else:
        total = array_module(source).empty_like(source)
        comm.allreduce(source, total, "sum")
        lo, hi = _shard(signature.count, comm)
        call.result[...] = total[lo:hi]


def _gathered(call: Call) -> None:
    """All-gather through a lossy codec: each rank encodes its own values once; every
    rank decodes all of them from the same bytes."""
    signature, xp = call.signature, array_module(call.source)
    comm, codec = signature.comm, signature.codec
    seg = codec.wire_size(signature.count)
    send = xp.empty(seg, np.uint8)
    codec.encode_wire(call.source, send, rounding_stream=call.rounding_stream)
    recv = xp.empty(comm.size * seg, np.uint8)
    _gather_bytes(comm, send, recv)
    rows = call.result.reshape(comm.size, signature.count)
    for j in range(comm.size):
        codec.decode_wire(recv[j * seg : (j + 1) * seg], rows[j])


def _gather_bytes(comm: Communicator, send: Any, recv: Any) -> None:
    counts, displs = segments([send.size] * comm.size)
    wait_ordered(comm.allgatherv(send, recv, counts, displs), "an all-gather", comm.rank)


def _shard(count: int, comm: Communicator) -> tuple[int, int]:
    bounds = shard_bounds(count, comm.size)
    return int(bounds[comm.rank]), int(bounds[comm.rank + 1])


# ---------------------------------------------------------------------------
# reductions: node-aware or flat


def _reduced(call: Call) -> bool:
    """A compressed all-reduce or reduce-scatter; True when it also averaged (the
    device pipeline divides inside its CUDA graph)."""
    signature = call.signature
    nodes = _two_levels(signature)
    if nodes is None:
        if isinstance(signature.codec, ErrorFeedbackCodec):
            checks.verify_flat_state(call)
        lo = 0 if signature.kind == "allreduce" else _shard(signature.count, signature.comm)[0]
        divisor = signature.comm.size if signature.op == "avg" else 0
        return compressed(signature, call.source, call.result, lo, call.rounding_stream, divisor)
    across = signature.plans.get(_ACROSS)
    if across is None:
        across = signature.plans[_ACROSS] = _Across(nodes, signature)
    if signature.kind == "allreduce":
        node_allreduce(nodes, call.source, call.result, across)
    else:
        call.result[...] = node_reduce_scatter(nodes, call.source, across)
    return False


def _two_levels(signature: Signature) -> NodeComms | None:
    """The node communicators when ``signature`` runs node-aware, else None (flat):
    never for "flat", on one rank, an unknown layout, one node or one rank per node, or
    a communicator without sub-communicators; for "auto" when the cost model
    (:func:`geocomm.engine.costs.node_aware_pays`) says so. Every input is the same on
    every rank (the layout is gathered), so every rank decides alike. Decided at the
    signature's first call (the environment's link speeds then)."""
    if _NODES in signature.plans:
        nodes: NodeComms | None = signature.plans[_NODES]
        return nodes
    comm, codec = signature.comm, signature.codec
    nodes = None
    if signature.topology != "flat" and comm.size > 1:
        layout = node_layout(comm)
        if layout is not None and not layout.trivial:
            ratio = codec.wire_size(PIECE_ALIGN) / (4 * PIECE_ALIGN)
            pays = signature.topology == "node" or costs.node_aware_pays(
                comm.backend, 4.0 * signature.count, layout.sizes(), ratio, dict(os.environ)
            )
            nodes = node_comms(comm, layout) if pays else None
    signature.plans[_NODES] = nodes
    return nodes


class _Across:
    """The compressed step between nodes, as :mod:`geocomm.engine.hierarchical` calls it:
    ``across(kind, values, ranges, result, offset)`` reduces ``values`` (the node's
    exact sums of ``ranges`` of the buffer, end to end) over ``nodes.cross`` as tensors
    of their own (keys and state of their own: :func:`shard_parts`), checked like any
    call when the signature is."""

    def __init__(self, nodes: NodeComms, signature: Signature):
        self.nodes, self.signature = nodes, signature
        self.signatures: dict[tuple[str, tuple[tuple[int, int], ...]], Signature] = {}

    def __call__(
        self, kind: str, values: Any, ranges: list[tuple[int, int]], result: Any, offset: int
    ) -> None:
        key = (kind, tuple(ranges))
        cross = self.signatures.get(key)
        if cross is None:
            s = self.signature
            cross = self.signatures[key] = Signature(
                kind, values.size, np.dtype(np.float32), "sum", s.codec, self.nodes.cross,
                shard_parts(s.parts, ranges), "flat", s.stage_size, s.check,
            )  # fmt: skip
        call = new_call(cross, values, result)
        checks.verify(call)
        compressed(cross, values, result, offset, call.rounding_stream)  # a sum: no divisor


# ---------------------------------------------------------------------------
# the flat compressed pipeline


class FlatPlan:
    """The flat compressed path of one signature, made at its first call: shard bounds,
    pieces, the host pipeline's stages (:func:`~geocomm.engine.layout.call_bytes`,
    at its first host call), and, when its arrays live on the device, the device plans
    (:class:`~geocomm.engine.device.DevicePlan`, one for calls with a map and one
    without); for a stateful codec also the side channels of its calls (one per layout
    of sides, :class:`~geocomm.engine.transforming.SideChannel`), the read scratch of
    its maps and the CUDA graphs of its steady mapped calls (:meth:`mapped`)."""

    #: side channels kept per signature (by layout), oldest dropped first
    CHANNELS_KEPT = 4

    def __init__(self, signature: Signature, offset: int):
        comm, codec, count = signature.comm, signature.codec, signature.count
        self.comm, self.codec, self.kind, self.offset = comm, codec, signature.kind, offset
        self.gather = signature.kind == "allreduce"
        self.bounds = shard_bounds(count, comm.size)
        stage = signature.stage_size or default_stage_size(comm, codec, count)
        self.pieces = Pieces.cut(count, comm.size, stage, codec.scale_span())
        self.fmt = wire_format(codec) if comm.device_arrays else None
        self.device_plans: dict[bool, device.DevicePlan] = {}
        self.host_layout: CallBytes | None = None  # the host pipeline's stages
        #: whether calls may map their tensors or keep residuals (a stateful codec)
        self.stateful = isinstance(codec, (TransformingCodec, ErrorFeedbackCodec))
        self.channels: dict[tuple[Any, ...], SideChannel] = {}
        self.scratch: Any = None  # the maps' read scratch, one piece long
        self.mapped_graphs: Graphs | None = None

    def device_plan(self, staged: bool, xp: Any) -> device.DevicePlan | None:
        """The device plan of calls with a map (``staged``) or without, made at the first
        such call; None when the call runs on the host."""
        if self.fmt is None or xp is np:
            return None
        plan = self.device_plans.get(staged)
        if plan is None:
            plan = self.device_plans[staged] = device.DevicePlan(
                self.comm, self.fmt, self.pieces, self.offset, self.gather, staged, xp
            )
        return plan

    def pipeline(
        self, source: Any, result: Any, mapper: Any, rounding_stream: int, divisor: int = 0
    ) -> bool:
        """One pass of the staged algorithm: on the device when the arrays live there and
        the codec sends a native format, else on the host; the same bits. ``divisor``:
        the device pipeline divides the result by it (an average); True if it did."""
        plan = self.device_plan(mapper is not None, array_module(source))
        if plan is None:
            if self.host_layout is None:
                self.host_layout = call_bytes(self.codec.wire_size, self.pieces, self.comm.rank)
            Pipeline(
                self.comm, self.codec, self.pieces, source, result, self.offset, self.gather,
                mapper, rounding_stream, self.host_layout,
            ).run()  # fmt: skip
            return False
        plan.run(source, result, mapper, rounding_stream, divisor)
        return bool(divisor)

    def _channel(self, codec: TransformingCodec | None, planned: list[Any], xp: Any) -> Any:
        """The side channel of ``planned``'s layout, made at its first call."""
        layout = side_layout(planned)
        channel = self.channels.pop(layout, None)  # put back last: the newest
        if channel is None:
            fmt = "fp32" if codec is None else codec.side_format
            channel = SideChannel(self.comm, fmt, layout, xp)
        self.channels[layout] = channel
        while len(self.channels) > self.CHANNELS_KEPT:
            self.channels.pop(next(iter(self.channels)))
        return channel

    def mapped(
        self,
        call: tuple[Any, Any, int, int],
        codec: TransformingCodec | None,
        parts: list[Part],
        planned: list[tuple[Any, Any]],
        residual: Any,
    ) -> tuple[list[Any], bool]:
        """A call with a map or a residual, ``call`` = (source, result, rounding stream,
        divisor): the plans' step rounds (:func:`step_parts`), the ranged plans'
        whole-tensor steps and the side sum (:class:`SideChannel`), the pipeline through
        a :class:`PartsMap`, the whole-tensor plans' inverses. Returns (the summed
        sides, whether it divided).

        On the device, a call whose every plan maps ranges from arrays it names (its
        ``inputs``) with no refresh (GeoFP8's split, with or without a power step)
        and keeps no residual depends on nothing but device memory: the call's arrays
        (its kernels move with them: :meth:`~geocomm.engine.device.DevicePlan.moving`),
        the signature's buffers and the plans' inputs (the side's and the steps' exact
        sums are kernels and collectives a graph captures). It runs through
        :attr:`mapped_graphs` keyed by the buffers and inputs, which the key's graph
        (or its first eager run) keeps alive, so a key is the same on every rank
        whenever the calls are, as NCCL requires, and by which plans step (one graph
        launch once it repeats, the average inside; what a step allocates lives in the
        graph's arena, and a replay hands the plans what the captured steps left:
        :func:`resume_steps`). Other calls run eagerly and leave the average to the
        caller (a refresh reads the sum).
        """
        source, result, rounding_stream, divisor = call
        xp = array_module(source)
        plan = self.device_plan(True, xp)
        # every plan maps ranges from arrays it names, with no refresh from the result
        capturable = all(p.ranged and not p.refreshes and hasattr(p, "inputs") for _, p in planned)
        if not capturable:  # a whole-tensor plan's side (the channel's layout) needs its step
            step_parts(self.comm, codec, source, planned)
        channel = self._channel(codec, planned, xp)
        channel.reserve(planned)  # before the body: a graph's arena holds what it allocates
        if self.scratch is None:
            self.scratch = xp.empty(self.pieces.piece, dtype=np.float32)

        def body(divide_by: int) -> list[Any]:
            with contextlib.nullcontext() if plan is None else plan.moving(source, result):
                taken = step_parts(self.comm, codec, source, planned) if capturable else []
                channel.begin(planned, source)
                mapper = PartsMap(
                    source, result, self.offset, parts, planned, channel.sum(planned),
                    residual, self.codec, self.scratch,
                )  # fmt: skip
                if plan is None:
                    self.pipeline(source, result, mapper, rounding_stream)
                else:
                    plan.eager(source, result, mapper, rounding_stream)
                mapper.finish(self.offset, self.offset + result.size)
                if divide_by:
                    divide(result, divide_by)
                return taken

        if plan is not None:  # outside any graph: its stream's order
            plan.prepare()
        steady = capturable and residual is None
        if plan is None or not steady:
            if plan is not None:
                plan.bind(source, result, rounding_stream)
            body(0)
            return channel.summed(), False
        if self.mapped_graphs is None:
            self.mapped_graphs = Graphs(self.comm, xp)
        arrays = [a for _, p in planned for a in p.inputs]
        inputs = tuple((p.steps, int(a.data.ptr), a.shape) for _, p in planned for a in p.inputs)
        scratch = channel.scratch
        at = 0 if scratch is None else int(scratch.data.ptr)
        key = (divisor, id(channel), at, inputs)
        bound, here = plan, (int(source.data.ptr), int(result.data.ptr))

        def bind(origin: tuple[int, int] | None) -> None:
            bound.bind(source, result, rounding_stream, origin, here)

        # the key's arrays stay alive with its graph (or while it waits for its capture):
        # no other array can take their addresses, so keys match alike on every rank
        taken = self.mapped_graphs.run(
            key, lambda: body(divisor), keep=(channel, scratch, arrays), here=here, bind=bind
        )
        if taken:  # a replay's plans take what its graph's steps write
            resume_steps(planned, taken)
        return channel.summed(), bool(divisor)


def compressed(
    signature: Signature,
    source: Any,
    result: Any,
    offset: int,
    rounding_stream: int,
    divisor: int = 0,
) -> bool:
    """Reduce flat float32 ``source`` through the signature's lossy codec into ``result``
    (index ``offset`` on: the buffer, or this rank's shard for a reduce-scatter), with
    the transforming and error-feedback protocols. Ranged maps write each piece they
    read into a scratch piece that stays in the cache; whole-tensor maps write their
    tensor into the result when it holds the whole buffer (:class:`PartsMap`).
    ``result`` may be ``source`` (a range is read before the pipeline writes it).
    ``divisor``: divide the result by it where the device pipeline can (a call with
    no map); True if it did."""
    plan: FlatPlan | None = signature.plans.get(_FLAT)
    if plan is None:
        plan = signature.plans[_FLAT] = FlatPlan(signature, offset)
    if not plan.stateful:
        return plan.pipeline(source, result, None, rounding_stream, divisor)
    comm, codec, parts = plan.comm, plan.codec, signature.parts
    count = signature.count
    xp = array_module(source)
    mapping_codec, residual = _stateful(codec, signature.residual_name, count, xp)
    planned = plan_parts(mapping_codec, source, list(parts), plan.bounds)
    if not planned and residual is None:
        return plan.pipeline(source, result, None, rounding_stream, divisor)
    call = (source, result, rounding_stream, divisor)
    sums, divided = plan.mapped(call, mapping_codec, list(parts), planned, residual)
    if plan.gather and offset == 0 and result.size == count:  # every rank holds the whole sum
        refresh(None, mapping_codec, planned, sums, result, 0, count)
        return divided
    lo, hi = int(plan.bounds[comm.rank]), int(plan.bounds[comm.rank + 1])
    refresh(comm, mapping_codec, planned, sums, result[lo - offset : hi - offset], lo, hi)
    return divided


def default_stage_size(comm: Communicator, codec: Codec, count: int) -> int:
    """The backend's stage size for ``count`` values (docs/design.md, "The collective")."""
    return backend_stage_size(
        comm.backend, count, comm.size, codec.wire_size(PIECE_ALIGN) / (4 * PIECE_ALIGN)
    )


def _stateful(
    codec: Codec, residual_name: str, count: int, xp: Any
) -> tuple[TransformingCodec | None, Any]:
    """(the codec that maps the tensors or None, the error-feedback residual of this
    call's tensors, kept under ``residual_name``, or None)."""
    if isinstance(codec, ErrorFeedbackCodec):
        return codec.mapping_codec, codec.residual(residual_name, count, xp)
    return (codec if isinstance(codec, TransformingCodec) else None), None
