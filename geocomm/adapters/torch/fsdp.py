"""FSDP2 (``fully_shard``): compressed gradient reduce-scatter and replica all-reduce.

    from torch.distributed.fsdp import fully_shard
    import geocomm.adapters.torch as gt
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    fsdp = gt.compress_fsdp(model, codec="fp8")
    ...
    fsdp.last_step                               # bytes, ratio, error estimate

FSDP2's public hooks (torch 2.9 to 2.15, :mod:`geocomm.adapters.torch.support`):

* ``FSDPModule.set_custom_reduce_scatter(comm)``: FSDP calls
  ``comm(output_tensor, input_tensor, group, op)`` once per module and
  backward, on its reduce-scatter stream. ``input_tensor`` is FSDP's flat
  buffer of ``group.size()`` equal rows: row r holds rank r's chunk of every
  gradient of the module (dim 0 padded to a multiple of the group size,
  ``torch.chunk`` layout), in the module's parameter order; ``output_tensor``
  receives this rank's row of the reduced buffer. :class:`GeocommReduceScatter`
  reduce-scatters it through ``geocomm.reduce_scatter`` with ``parts=``: every
  chunk is a tensor of its own (key ``(name, r)``, its own 2-D shape), so
  GeoFP8's maps are shard-local and right-sided. Rows are exactly the
  ``np.array_split`` shards, so no value crosses to another rank's shard.
* ``FSDPModule.set_all_reduce_hook(hook)``: ``hook(reduce_output)`` runs after
  the reduce-scatter on this rank's reduced shard. With replicas (HSDP-style:
  FSDP over a 1-D mesh of the shard ranks, ``replicate_group`` the ranks
  holding the same shard), :class:`GeocommAllReduceHook` averages the shard
  over the replicas with one compressed all-reduce (keys ``(name, "replica",
  shard rank)``). Do not use a 2-D HSDP mesh with it: FSDP's own replica
  all-reduce would then run as well. Under ``set_requires_all_reduce(False)``
  it sends nothing and keeps the shard for the next all-reducing backward.

From torch 2.13 FSDP includes zero gradients for parameters without one
(``set_reduce_scatter_unused_params(True)``), so every call has the module's
full layout. Older releases leave such parameters out of the buffer: a call whose
buffer is short then raises, naming torch 2.13 (every rank alike, since the
layout is FSDP's on every rank). Calls run on the calling thread: FSDP waits for
the reduce-scatter anyway (on GPUs, geocomm's kernels are ordered on FSDP's
reduce-scatter stream, and the bytes travel through a NCCL group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# the interface set_custom_reduce_scatter names (private, the same from torch 2.9 to 2.15);
# FSDP only calls allocate and __call__
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter

from geocomm.adapters.torch import checkpoints, grads, support
from geocomm.adapters.torch.distributed import dedicated_comm
from geocomm.adapters.torch.telemetry import StepStats, Telemetry
from geocomm.codecs import Codec, StatefulCodec, get_codec

__all__ = ["FSDPCompression", "GeocommAllReduceHook", "GeocommReduceScatter", "compress_fsdp"]


def _op_name(op: Any) -> str:
    """geocomm's op for FSDP's reduce op: AVG and SUM (FSDP pre/post-divides for SUM)."""
    if op == dist.ReduceOp.AVG:
        return "avg"
    if op == dist.ReduceOp.SUM:
        return "sum"
    raise ValueError(
        f"geocomm's FSDP2 reduce-scatter supports ReduceOp AVG and SUM, got {op!r} "
        "(a custom set_gradient_divide_factor makes FSDP use PREMUL_SUM; use "
        "set_force_sum_reduction_for_comms(True) with it)"
    )


class _Completed:
    """A finished ``dist.Work`` stand-in for callers that pass ``async_op=True``."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FSDPCompression:
    """What :func:`compress_fsdp` installed: the reducers, their (metered)
    communicators and the shared :class:`Telemetry`. A step closes once every
    installed reduce-scatter and all-reduce hook has run. ``installed``: whether
    the hooks are in place (at :func:`compress_fsdp`, or at the first forward when
    it was called before ``fully_shard``)."""

    def __init__(self, telemetry: Telemetry, model: nn.Module, codec: Codec):
        self.telemetry = telemetry
        self.model, self.codec = model, codec
        #: the replica all-reduce's own instance of a stateful codec (None: stateless,
        #: shared): a codec's state (GeoFP8's model-wide allocation over every key it
        #: holds) must be that of one communicator's ranks, and the shard ranks hold
        #: other replica keys than each other
        self.replica_codec: StatefulCodec | None = None
        self._replica_state: tuple[Any, Any] = (None, None)  # loaded before the install
        self.reduce_scatters: list[GeocommReduceScatter] = []
        self.all_reduce_hooks: list[GeocommAllReduceHook] = []
        self.installed = False
        #: whether FSDP fills in zeros for parameters without a gradient (torch >= 2.13)
        self.unused_params = False
        self._expected = 0
        self._done = 0
        self._expected_size: int | None = None

    def world_size(self) -> int | None:
        """Ranks over which the gradients are reduced (shard ranks x replicas), or None
        before the hooks are installed."""
        if not self.reduce_scatters and not self.all_reduce_hooks:
            return None
        size = self.reduce_scatters[0].reducer.comm.size if self.reduce_scatters else 1
        if self.all_reduce_hooks:
            size *= self.all_reduce_hooks[0].reducer.comm.size
        return size

    def state_dict(self) -> dict[str, Any]:
        """The codec's state for a checkpoint, as
        :meth:`~geocomm.adapters.torch.GeocommHookState.state_dict` (GeoFP8 bases and
        call counts, error-feedback residuals, rounding call counts, world size and
        parameters). Call between steps on every rank: each saves its own."""
        layout = checkpoints.parameter_layout(self.model)
        state = checkpoints.codec_state(self.codec, self.world_size(), layout)
        replica = self.replica_codec
        if replica is not None:
            state["replica_codec"] = checkpoints.to_torch(replica.state_dict())
        return state

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output before the first step of a resumed job;
        ValueError for another codec, parameter layout or world size."""
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        xp = checkpoints.namespace(device)
        self._expected_size = checkpoints.load_codec_state(
            self.codec, data, checkpoints.parameter_layout(self.model), "compress_fsdp", xp
        )
        self._replica_state = (data.get("replica_codec"), xp)
        self._load_replica_state()
        self._check_size()

    def _load_replica_state(self) -> None:
        """Load a checkpoint's replica codec state once the replica codec exists; once
        installed without one (no replicas, or a stateless codec), refuse it."""
        state, xp = self._replica_state
        if state is not None and self.replica_codec is None and self.installed:
            raise ValueError(
                "compress_fsdp: the saved state holds a replica all-reduce's codec state, "
                "and this model has no replica all-reduce of a stateful codec"
            )
        if state is None or self.replica_codec is None:
            return
        self._replica_state = (None, np)
        checkpoints.load_stateful(self.replica_codec, state, xp)

    def _check_size(self) -> None:
        size = self.world_size()
        if size is not None:
            checkpoints.check_world_size(self._expected_size, size, "compress_fsdp")

    @property
    def last_step(self) -> StepStats | None:
        return self.telemetry.last_step

    def _expect(self, calls: int) -> None:
        self._expected += calls

    def _ran(self) -> None:
        self._done += 1
        if self._done >= self._expected:
            self._done = 0
            self.telemetry.end_step()


class _ModuleReduction:
    """One FSDP2 module's reduction: the layout of its chunks, the reducer (codec and
    communicator), its index and the :class:`FSDPCompression` told when it ran."""

    def __init__(
        self,
        layout: grads.BufferLayout,
        reducer: grads.GradReducer,
        index: int,
        owner: FSDPCompression,
    ):
        self.layout, self.reducer, self.index, self.owner = layout, reducer, index, owner


class GeocommReduceScatter(_ModuleReduction, _ReduceScatter):
    """FSDP2 custom reduce-scatter (``set_custom_reduce_scatter``) through geocomm.

    ``layout``: the module's chunks (one row per rank); ``reducer``: codec and
    communicator over the shard ranks.
    """

    def allocate(
        self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        if group.size() != self.reducer.comm.size:
            raise ValueError(
                f"FSDP reduce-scatter over {group.size()} ranks, geocomm's "
                f"communicator has {self.reducer.comm.size}"
            )
        if input_tensor.numel() < self.layout.numel and not self.owner.unused_params:
            raise ValueError(
                f"FSDP module {self.index}: a parameter got no gradient, and torch "
                f"{torch.__version__} leaves such parameters out of FSDP's reduce-scatter "
                "(compress_fsdp keeps every parameter's key and place from torch 2.13 on, "
                "where set_reduce_scatter_unused_params fills in zeros); use torch >= 2.13 "
                "or give every parameter a gradient in every step"
            )
        self.reducer.reduce_scatter(
            self.layout,
            input_tensor,
            output_tensor,
            self.index,
            _op_name(op),
            what=f"FSDP module {self.index}",
        )
        self.owner._ran()
        return _Completed() if async_op else None


class GeocommAllReduceHook(_ModuleReduction):
    """FSDP2 all-reduce hook (``set_all_reduce_hook``) of ``module``: reduces this
    rank's reduced shard over the replicas, in place, with one compressed all-reduce,
    as native HSDP's all-reduce would: an average, or with a custom
    ``set_gradient_divide_factor`` a sum (FSDP's division by that factor after the hook
    is then the whole division, over shards and replicas alike).

    Under ``set_requires_all_reduce(False)`` (gradient accumulation that reduce-scatters
    every micro-batch and all-reduces only the last) it sends nothing, as native HSDP:
    it adds the shard to :attr:`partial` and leaves zeros for FSDP to add to the
    gradient; the next all-reducing call adds :attr:`partial` to its shard first."""

    def __init__(self, module: nn.Module, *args: Any):
        super().__init__(*args)
        self.module = module
        #: the shards of the micro-batches not all-reduced yet, summed (None: none)
        self.partial: torch.Tensor | None = None

    def __call__(self, reduce_output: torch.Tensor) -> None:
        group = _param_group(self.module)
        if group is not None and not group.all_reduce_grads:
            if self.partial is None:
                self.partial = reduce_output.clone()
            else:
                self.partial += reduce_output
            reduce_output.zero_()
            self.owner._ran()
            return
        if self.partial is not None:
            reduce_output += self.partial
            self.partial = None
        divide_factor = None if group is None else group.gradient_divide_factor
        self.reducer.allreduce(
            self.layout,
            reduce_output,
            self.index,
            "avg" if divide_factor is None else "sum",
            what=f"FSDP module {self.index} replica all-reduce",
        )
        self.owner._ran()


def _param_group(module: nn.Module) -> Any:
    """The module's FSDP parameter group (one, where an all-reduce hook is set), which
    holds what FSDP has no getters for: ``set_gradient_divide_factor``'s
    ``gradient_divide_factor`` (None: unset) and ``set_requires_all_reduce``'s
    ``all_reduce_grads`` (``_fsdp_param_group`` in torch 2.9 to 2.15)."""
    state = module._get_fsdp_state()  # type: ignore[operator]  # an FSDPModule's method
    return state._fsdp_param_group


def _managed_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters ``fully_shard(module)`` manages, in FSDP's order: a post-order
    walk of the submodules that stops at nested FSDP modules, each module's own
    parameters once (FSDP's ``_get_managed_states``), those it shards: the
    ``ignored_params`` of ``fully_shard`` stay plain tensors, outside its buffers."""
    from torch.distributed.tensor import DTensor

    modules: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        if m is not module and isinstance(m, FSDPModule):
            return
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen:
                walk(child)
        modules.append(m)

    walk(module)
    params: list[nn.Parameter] = []
    visited: set[int] = set()
    for m in modules:
        for p in m.parameters(recurse=False):
            if id(p) not in visited and isinstance(p, DTensor):
                visited.add(id(p))
                params.append(p)
    return params


def _shard_dims(param: Any) -> tuple[Any, int, int]:
    """(mesh, mesh dim, tensor dim) of a sharded parameter's Shard placement."""
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    dims = [(i, p.dim) for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(dims) != 1:
        raise ValueError(f"expected one Shard placement, got {param.placements}")
    if mesh.ndim != 1:
        raise ValueError(
            "compress_fsdp needs FSDP over a 1-D mesh of the shard ranks (pass the replicas "
            "as replicate_group); with a 2-D HSDP mesh FSDP's own all-reduce would run too"
        )
    return mesh, dims[0][0], dims[0][1]


def _chunk_shape(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    """One rank's chunk of a gradient in FSDP's reduce-scatter input: ``dim``
    split in ``size`` (dim 0 padded up to a multiple of size)."""
    chunk = list(shape)
    chunk[dim] = -(-chunk[dim] // size)
    return tuple(chunk)


def compress_fsdp(
    model: nn.Module,
    codec: Any = "fp8",
    *,
    replicate_group: Any = None,
    comm: Any = None,
    replicate_comm: Any = None,
    exclude: Sequence[str] = (),
    min_numel: int = 0,
    check: bool | None = None,
    error_sample: int | None = None,
    stage_size: int | None = None,
    history: int = 100,
    log_every: int = 0,
) -> FSDPCompression:
    """Make every FSDP2 module of ``model`` reduce its gradients through geocomm.

    Call on every rank, at the same point: after ``fully_shard`` (the hooks go in
    now), or before it, even before the default process group exists (they go
    in at the model's first forward, on every rank alike).

    Args:
        model: the model, whose ``fully_shard`` modules get a compressed
            reduce-scatter each (FSDP2's ``set_custom_reduce_scatter``).
        codec: codec id, config or Codec (default "fp8"): an id or config makes
            this model's own codec, with state of its own (GeoFP8's bases, error feedback's
            residuals); a Codec is used as it is, so one shared by two models shares its
            state between them.
        replicate_group: the ranks holding the same shard (HSDP-style replicas):
            a compressed all-reduce of each reduced shard over them
            (``set_all_reduce_hook``); None: no replicas.
        comm: a geocomm communicator over the shard ranks (default: a new process
            group over FSDP's mesh group).
        replicate_comm: a geocomm communicator over the replicas, instead of
            ``replicate_group``.
        exclude: name patterns of parameters whose chunks travel exact
            (:class:`~geocomm.adapters.torch.Selection`); a module's excluded
            chunks share one exact collective.
        min_numel: parameters with fewer values (the whole parameter's, not a
            chunk's) travel exact too.
        check, error_sample, stage_size, history, log_every: as for
            :class:`~geocomm.adapters.torch.GeocommHookState`.

    Returns:
        The :class:`FSDPCompression`: ``last_step`` and ``telemetry`` per step,
        ``state_dict`` / ``load_state_dict`` for checkpoints.

    Raises:
        ValueError: (at the first forward) the model has no ``fully_shard`` module.

    Example::

        fully_shard(model)
        fsdp = compress_fsdp(model, codec="geofp8")
    """
    codec = get_codec(codec)  # a bad codec fails here, before any collective
    owner = FSDPCompression(Telemetry(history, log_every), model, codec)
    selection = grads.Selection.of(exclude, min_numel)
    settings = _Settings(
        replicate_group, comm, replicate_comm, selection, check, error_sample, stage_size
    )
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        _install(owner, settings)
        return owner

    def install_at_first_forward(module: nn.Module, args: Any) -> None:
        handle.remove()
        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                "compress_fsdp: the model has no fully_shard module at its first forward"
            )
        _install(owner, settings)

    handle = model.register_forward_pre_hook(install_at_first_forward, prepend=True)
    return owner


@dataclass(frozen=True)
class _Settings:
    """compress_fsdp's arguments that :func:`_install` uses."""

    replicate_group: Any
    comm: Any
    replicate_comm: Any
    selection: grads.Selection
    check: bool | None
    error_sample: int | None
    stage_size: int | None


def _install(owner: FSDPCompression, settings: _Settings) -> None:
    """Set geocomm's reduce-scatter (and replica all-reduce hook) on every FSDP module
    of ``owner.model``, making the communicators over FSDP's mesh group now."""
    model, codec, selection = owner.model, owner.codec, settings.selection
    options = (settings.check, settings.error_sample, settings.stage_size, owner.telemetry)
    names = {id(p): n for n, p in model.named_parameters()}
    shard_reducer = replica_reducer = None
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for index, module in enumerate(modules):
        params = [p for p in _managed_params(module) if p.requires_grad]
        if not params:
            continue
        mesh, mesh_dim, _ = _shard_dims(params[0])
        size = mesh.size(mesh_dim)
        device = params[0].device
        if shard_reducer is None:
            base = (
                settings.comm
                if settings.comm is not None
                else dedicated_comm(mesh.get_group(mesh_dim), device)
            )
            shard_reducer = grads.GradReducer(codec, base, *options)
            if settings.replicate_group is not None or settings.replicate_comm is not None:
                base = (
                    settings.replicate_comm
                    if settings.replicate_comm is not None
                    else dedicated_comm(settings.replicate_group, device)
                )
                replica = shard_reducer.codec
                if isinstance(replica, StatefulCodec):  # one for every module's replicas
                    if owner.replica_codec is None:
                        made = get_codec(replica.get_config())
                        assert isinstance(made, StatefulCodec)  # the same config
                        owner.replica_codec = made
                    replica = owner.replica_codec
                replica_reducer = grads.GradReducer(replica, base, *options)
        if size != shard_reducer.comm.size:
            raise ValueError(
                f"FSDP module {index} shards over {size} ranks, an earlier one over "
                f"{shard_reducer.comm.size}; compress_fsdp needs one shard mesh"
            )
        shard_rank = shard_reducer.comm.rank
        entries, replica_entries, offset = [], [], 0
        for p in params:
            name = names[id(p)]
            _, _, dim = _shard_dims(p)
            chunk = _chunk_shape(p.shape, dim, size)
            entries.append(grads.Entry(offset, chunk, name, name, p.numel()))
            replica_key = (name, "replica", shard_rank)
            replica_entries.append(grads.Entry(offset, chunk, replica_key, name, p.numel()))
            offset += math.prod(chunk)
        if size > 1:
            layout = grads.BufferLayout(entries, selection, rows=size)
            rs = GeocommReduceScatter(layout, shard_reducer, index, owner)
            support.require(module, "set_custom_reduce_scatter", "2.9", "compress_fsdp")(rs)
            owner.reduce_scatters.append(rs)
            owner._expect(1)
        unused = getattr(module, "set_reduce_scatter_unused_params", None)  # torch >= 2.13
        if unused is not None:
            unused(True, recurse=False)
        owner.unused_params = unused is not None
        if replica_reducer is not None:
            layout = grads.BufferLayout(replica_entries, selection)
            hook = GeocommAllReduceHook(module, layout, replica_reducer, index, owner)
            support.require(module, "set_all_reduce_hook", "2.7", "compress_fsdp")(hook)
            owner.all_reduce_hooks.append(hook)
            owner._expect(1)
    owner.installed = True
    owner._load_replica_state()
    owner._check_size()
