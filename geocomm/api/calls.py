"""From a caller's arguments to a :class:`~geocomm.engine.call.Call` (docs/design.md,
"The collective").

:func:`prepare` checks the arguments (array type and dtype, op, out, codec,
parts, topology), resolves what the environment and the communicator decide
(the codec for this count, the default communicator, ``GEOCOMM_CHECK``,
``GEOCOMM_TOPOLOGY``) and describes the call as a
:class:`~geocomm.engine.call.Signature`, cached: a call with the same arguments
(count, dtype, op, codec, keys, communicator, ...) gets the same signature back,
and with it everything the engine derived from it at its first call. Then it
picks the call's result array and draws its rounding stream.
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import operator
import os
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from geocomm._environ import switch
from geocomm.codecs import Codec, StatefulCodec, get_codec
from geocomm.codecs.frames import DTYPE_CODES
from geocomm.comm.base import Communicator
from geocomm.comm.metered import MeteredComm
from geocomm.engine import checks, costs
from geocomm.engine.call import KINDS, OPS, TOPOLOGIES, Call, Part, Signature, new_call
from geocomm.engine.layout import array_module, shard_bounds

if TYPE_CHECKING:
    pass

#: Signatures kept per communicator for calls made again (least recently used dropped first).
SIGNATURES_KEPT = 1024


class Options(TypedDict, total=False):
    """The keywords :func:`~geocomm.allreduce` and :func:`~geocomm.reduce_scatter` share.

    Attributes:
        key: names the tensor for stateful codecs (GeoFP8's map, error feedback's
            residual); default: its shape.
        parts: several tensors instead: a sequence of ``(key, shape)`` that tiles the
            flat buffer in order (a DDP bucket), each mapped on its own.
        comm: the communicator (default: :func:`geocomm.get_comm`).
        stage_size: values of the whole buffer per pipeline stage (default: the
            backend's; the bits do not depend on it).
        check: compare the call across ranks first (default: ``GEOCOMM_CHECK``, else
            on); a mismatch raises :class:`geocomm.CollectiveMismatchError`. The check
            is a collective itself: the same on every rank.
        topology: "flat", "node" (exact inside each node, compressed between nodes) or
            "auto" (the cost model's choice; default ``GEOCOMM_TOPOLOGY``, else "auto").
    """

    key: Any
    parts: Sequence[tuple[Any, Sequence[int]]] | None
    comm: Communicator | None
    stage_size: int | None
    check: bool | None
    topology: str | None


# ---------------------------------------------------------------------------
# codecs and communicators

_codecs: dict[str, Codec] = {}
_default_comm: Communicator | None = None


#: The attribute of a communicator that holds the codecs its calls named by id or
#: config: one instance per communicator, since a stateful codec's state is the state
#: of the ranks it was used with (GeoFP8's model-wide allocation spans every key the
#: instance holds, so keys of another communicator would change it on some ranks only).
_CODECS = "_geocomm_codecs"


def resolve_codec(codec: Any, comm: Any = None) -> Codec:
    """A codec instance for an id, config or Codec; ids and configs map to one cached
    instance each per communicator (``comm``, default: the default communicator), so
    stateful codecs keep their per-key state across calls, and never share it with the
    calls of another communicator (one that takes no attributes, and calls before
    :func:`init` without ``comm``, share one process-wide instance per config)."""
    if isinstance(codec, Codec):
        return codec
    config = get_codec(codec).get_config()
    name = json.dumps(config, sort_keys=True)
    comm = comm if comm is not None else _default_comm
    mine = None if comm is None else _kept_on(comm, _CODECS, dict)
    cache: dict[str, Codec] = _codecs if mine is None else mine
    if name not in cache:
        cache[name] = get_codec(config)
    return cache[name]


def group_name(comm: Any) -> Any:
    """A name of ``comm``'s group of ranks, equal for communicators of the same ranks in
    the same order: their ranks in the job (``comm.world_ranks()``, a tuple), else the
    communicator itself (a weak reference; a :class:`MeteredComm` is named by what it
    wraps; one that takes no weak reference, by its ``id``, which a later object may
    reuse)."""
    ranks = getattr(comm, "world_ranks", None)
    found = ranks() if ranks is not None else None
    if found is not None:
        return found if isinstance(found, tuple) else tuple(found)
    while isinstance(comm, MeteredComm):
        comm = comm.comm
    try:
        return weakref.ref(comm)
    except TypeError:
        return ("communicator", id(comm))


def init(comm: Any = None, backend: str = "mpi") -> Communicator:
    """Set and return the default communicator.

    Args:
        comm: a geocomm Communicator, an mpi4py communicator, or None for
            ``MPI.COMM_WORLD``.
        backend: "mpi" (host arrays; CuPy arrays are staged through host memory) or
            "nccl" (CuPy arrays stay on the device: a NCCL communicator over ``comm``,
            or ``comm`` itself when it is a device communicator already).

    Returns:
        The communicator the collectives use when no ``comm=`` is given.
    """
    global _default_comm
    if backend not in ("mpi", "nccl"):
        raise ValueError(f"unknown backend {backend!r} (expected 'mpi' or 'nccl')")
    made: Communicator
    if backend == "nccl" and not (isinstance(comm, Communicator) and comm.device_arrays):
        from geocomm.comm.nccl import NCCLCommunicator

        made = NCCLCommunicator(comm)  # over comm (a host communicator, or MPI's)
    elif isinstance(comm, Communicator):
        made = comm
    else:
        from geocomm.comm.mpi import MPICommunicator

        made = MPICommunicator(comm)
    _default_comm = made
    return made


def get_comm(comm: Communicator | None = None) -> Communicator:
    """``comm`` if given, else the default communicator (made by :func:`init` on first use)."""
    if comm is not None:
        return comm
    return _default_comm if _default_comm is not None else init()


# ---------------------------------------------------------------------------
# argument checks


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


def check_out(out: Any, x: Any, shape: tuple[int, ...] | None = None) -> None:
    """TypeError or ValueError unless ``out`` (if given) can receive a result of x's kind
    and dtype and of ``shape`` (default: x's)."""
    if out is None:
        return
    if type(out) is not type(x) and not isinstance(out, array_module(x).ndarray):
        raise TypeError(
            f"out must be an array like x ({type(x).__name__}), got {type(out).__name__}"
        )
    shape = tuple(x.shape) if shape is None else shape
    if tuple(out.shape) != shape or out.dtype != x.dtype:
        raise ValueError(f"out is {out.dtype}{list(out.shape)}, expected {x.dtype}{list(shape)}")
    if not getattr(out.flags, "writeable", True):
        raise ValueError("out is read-only")
    if not out.flags.c_contiguous and any(
        stride == 0 and n > 1 for stride, n in zip(out.strides, out.shape, strict=True)
    ):
        raise ValueError("out has elements that share memory (a broadcast or expanded view)")


def parts_of(shape: tuple[int, ...], count: int, key: Any, parts: Any) -> tuple[Part, ...]:
    """The tensors of the buffer: ``parts`` is a sequence of (key, shape) that tiles
    the flat buffer in order, each key once (a stateful codec keeps one state a
    key); without it the buffer is one tensor of ``shape``. A key of None stands
    for the tensor's shape."""
    if parts is None:
        return (Part(0, tuple(shape), ("shape", tuple(shape)) if key is None else key),)
    if key is not None:
        raise TypeError("pass either key= or parts=, not both")
    result, offset, seen = [], 0, set()
    for entry in parts:
        try:
            name, part_shape = entry
            part_shape = tuple(operator.index(d) for d in part_shape)
        except (TypeError, ValueError):
            raise TypeError(f"parts entries must be (key, shape) pairs, got {entry!r}") from None
        if any(d < 0 for d in part_shape):
            raise ValueError(f"part {name!r} has a negative dimension: {part_shape}")
        part_key = ("shape", part_shape) if name is None else name
        if repr(part_key) in seen:  # keys are compared across ranks by their repr too
            raise ValueError(
                f"parts name the key {part_key!r} twice: every tensor of a call needs a key "
                f"of its own (a key of None stands for the tensor's shape)"
            )
        seen.add(repr(part_key))
        result.append(Part(offset, part_shape, part_key))
        offset += math.prod(part_shape)
    if offset != count:
        raise ValueError(f"parts hold {offset} values, the buffer {count}")
    return tuple(result)


def requested_topology(topology: str | None) -> str:
    """``topology``, or ``GEOCOMM_TOPOLOGY`` (any case), or "auto"; checked."""
    if topology is not None:
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        return topology
    text = os.environ.get("GEOCOMM_TOPOLOGY", "")
    value = text.strip().lower() or "auto"
    if value not in TOPOLOGIES:
        raise ValueError(f"GEOCOMM_TOPOLOGY={text!r}: expected one of {', '.join(TOPOLOGIES)}")
    return value


def check_enabled(check: bool | None) -> bool:
    """``check``, or ``GEOCOMM_CHECK`` (:func:`geocomm._environ.switch`), else True."""
    if check is not None:
        return check
    return switch("GEOCOMM_CHECK") is not False


# ---------------------------------------------------------------------------
# signatures and calls

#: The attribute of a communicator that holds the signatures of its recent calls by
#: their arguments: on the communicator, so that they go when it goes (their plans
#: hold it, so a cache keyed by it weakly would keep it alive for ever).
_SIGNATURES = "_geocomm_signatures"


def _kept_on(comm: Any, attribute: str, new: Callable[[], Any] | None) -> Any:
    """What ``comm`` keeps under ``attribute`` (its signatures, its codecs), made by
    ``new`` where it has none (``new`` None: nothing made); None for a communicator
    that takes no attributes."""
    kept = getattr(comm, attribute, None)
    if kept is None and new is not None:
        kept = new()
        try:
            setattr(comm, attribute, kept)
        except AttributeError:
            return None
    return kept


def signature(kind: str, x: Any, codec: Any, op: str, options: Options) -> Signature:
    """The :class:`Signature` of a call of ``kind`` on ``x`` (a checked NumPy or CuPy
    array): the cached one when the same arguments came before."""
    unknown = set(options) - set(Options.__annotations__)
    if unknown:
        raise TypeError(f"geocomm.{kind}() got unexpected keyword arguments {sorted(unknown)}")
    if "parts" in options and not isinstance(options["parts"], (tuple, list, type(None))):
        options = {**options, "parts": tuple(options["parts"])}  # read once: a generator
    comm = get_comm(options.get("comm"))
    check = check_enabled(options.get("check"))
    topology = requested_topology(options.get("topology"))
    key = _cache_key(kind, x, codec, op, options, check, topology)
    cache = _kept_on(comm, _SIGNATURES, None) if key is not None else None
    if cache is not None and key is not None:
        cached = cache.get(key)
        if cached is not None:
            cache.move_to_end(key)
            return cached[0]
    result = _describe(kind, x, codec, op, options, comm, check, topology)
    if key is not None:
        cache = _kept_on(comm, _SIGNATURES, collections.OrderedDict)
        if cache is None:
            return result
        cache[key] = (result, codec)  # the codec argument kept: its id is in the key
        if len(cache) > SIGNATURES_KEPT:
            cache.popitem(last=False)
    return result


def _describe(kind: str, x: Any, codec: Any, op: str, options: Options, comm: Communicator,
              check: bool, topology: str) -> Signature:  # fmt: skip
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    resolved = resolve_codec(codec, comm)
    if x.dtype == np.float64 and not resolved.lossless:
        raise TypeError(
            "float64 arrays are not compressed (the formats start from float32); cast to "
            "float32 first or use codec='none' for an exact float64 reduction"
        )
    stage_size = options.get("stage_size")
    if stage_size is not None and (
        isinstance(stage_size, bool) or not isinstance(stage_size, numbers.Integral)
    ):
        raise TypeError(f"stage_size must be an integer, got {stage_size!r}")
    if stage_size is not None and stage_size <= 0:
        raise ValueError(f"stage_size must be positive, got {stage_size}")
    key, parts = options.get("key"), options.get("parts")
    if kind == "allgather":
        key, parts = None, None
    return Signature(
        kind, x.size, x.dtype, op, costs.codec_for(resolved, x.size, comm.backend, comm.size), comm,
        parts_of(x.shape, x.size, key, parts), topology, stage_size, check,
    )  # fmt: skip


def _cache_key(kind: str, x: Any, codec: Any, op: str, options: Options, check: bool,
               topology: str) -> tuple[Any, ...] | None:  # fmt: skip
    """What decides a call's signature, hashable; None when something is not (then the
    call is described afresh)."""
    if isinstance(codec, Codec):
        codec_key: Any = ("instance", id(codec))
    elif isinstance(codec, dict):
        try:
            codec_key = json.dumps(codec, sort_keys=True)
        except TypeError:
            return None
    else:
        codec_key = codec
    parts = options.get("parts")
    try:
        parts_key = None if parts is None else tuple((k, tuple(s)) for k, s in parts)
        key = (kind, x.shape, x.dtype, array_module(x) is np, op, codec_key,
               options.get("key"), parts_key, options.get("stage_size"), check,
               topology)  # fmt: skip
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


def prepare(kind: str, x: Any, out: Any, codec: Any, op: str, options: Options) -> Call:
    """The :class:`Call` of a collective on ``x`` (NumPy or CuPy) with ``out`` (an array
    like ``x``, or None; a reduce-scatter's: this rank's flat shard): checked, its
    signature cached, its flat float32 source, its result array (``out``'s memory where
    the engine can write it directly) and its rounding stream."""
    x = check_array(x)
    sig = signature(kind, x, codec, op, options)
    comm = sig.comm
    shard: tuple[int, ...] | None = None  # a reduce-scatter's result: this rank's shard
    if kind == "reduce_scatter":
        bounds = shard_bounds(sig.count, comm.size)
        shard = (int(bounds[comm.rank + 1] - bounds[comm.rank]),)
    check_out(out, x, shard)
    if isinstance(codec, StatefulCodec):  # a Codec object: its state serves one group
        codec.hold_for(group_name(comm))
    xp = array_module(x)
    exact = sig.codec.lossless
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    # MPI and the C core read aligned memory only: a NumPy view at an odd offset is
    # copied (ascontiguousarray keeps it as it is; CuPy's arrays are always aligned)
    host = xp is np
    flat = x.ndim == 1 and x.dtype == dtype and x.flags.c_contiguous
    source = x if flat else xp.ascontiguousarray(x, dtype=dtype).reshape(-1)
    if host and not source.flags.aligned:
        source = source.copy()
    if kind == "allgather":
        result = xp.empty((comm.size, sig.count), dtype)
    elif shard is not None:  # into out's memory only where it is apart from x's
        result = _direct_result(out, dtype, source, same_ok=False, host=host)
        if result is None:
            result = xp.empty(shard, dtype)
    else:
        # the compressed pipeline writes a range only once it has read it, so it may
        # run in place; MPI and NCCL reductions need distinct buffers
        result = _direct_result(out, dtype, source, same_ok=not exact, host=host)
        if result is None:
            result = xp.empty(sig.count, dtype)
    return new_call(sig, source, result)


def refuse(options: Options) -> None:
    """After this rank refused a call on its own: its part of the call's check
    (:func:`geocomm.engine.checks.refuse`), so that ranks that made the call raise
    CollectiveMismatchError instead of waiting for it. Nothing when the options name
    no communicator this rank can use, or no check (``check=False`` on every rank:
    there is none to pair with)."""
    try:
        comm = get_comm(options.get("comm"))
        check = check_enabled(options.get("check"))
    except (ImportError, RuntimeError, TypeError, ValueError):
        return  # no communicator to tell, or no way to know whether the peers check
    if check and isinstance(comm, Communicator) and comm.size > 1:
        checks.refuse(comm)


def output(call: Call, x: Any, out: Any) -> Any:
    """What the collective returns, from the finished ``call`` on ``x``: ``out`` (written
    unless the engine wrote it directly) or a new array of x's dtype (all-reduce: x's
    shape; reduce-scatter: this rank's flat shard; all-gather: ``(size, *x.shape)``)."""
    kind, result = call.signature.kind, call.result
    if kind == "allgather":
        return result.reshape((call.signature.comm.size, *x.shape)).astype(x.dtype, copy=False)
    if out is not None and (out is result or _same_memory(out, result)):
        return out  # the engine wrote into out's memory
    if kind == "allreduce":
        result = result.reshape(x.shape)
    if out is None:
        return result.astype(x.dtype, copy=False)
    out[...] = result
    return out


def _direct_result(out: Any, dtype: Any, source: Any, same_ok: bool, host: bool) -> Any:
    """A flat view of ``out`` to reduce into, when out is C-contiguous, of
    ``dtype``, aligned (``host``: a NumPy array, which may not be), and either apart
    from ``source`` or (``same_ok``) exactly the same memory; else None (reduce into
    scratch and copy)."""
    if out is None or out.dtype != dtype or not out.flags.c_contiguous or out.size == 0:
        return None
    if host and not out.flags.aligned:
        return None
    flat = out if out.ndim == 1 else out.reshape(-1)
    if out is source or flat is source:
        return flat if same_ok else None
    if array_module(out).may_share_memory(out, source) and not (
        same_ok and _same_memory(out, source)
    ):
        return None
    return flat


def _same_memory(a: Any, b: Any) -> bool:
    """Whether a and b view the same contiguous memory (nothing to copy)."""
    if a.size == 0:
        return True
    if array_module(a) is np:
        pa, pb = a.__array_interface__["data"][0], b.__array_interface__["data"][0]
    else:
        pa, pb = a.data.ptr, b.data.ptr
    return pa == pb and a.nbytes == b.nbytes and b.flags.c_contiguous and a.flags.c_contiguous
