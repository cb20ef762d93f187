"""The public collectives: all-reduce, reduce-scatter and all-gather of any array kind
(docs/design.md, "The collective").

Each converts its arrays (:class:`~geocomm.api.arrays.Operands`), builds the call
(:func:`~geocomm.api.calls.prepare`; a call it refuses, it refuses to its peers
too), hands it to the engine
(:func:`geocomm.engine.run.run`) and returns the result as the caller's kind.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from geocomm.api.arrays import Operands
from geocomm.api.calls import Options, output, prepare, refuse
from geocomm.comm.base import Communicator
from geocomm.engine.call import Call
from geocomm.engine.run import run

if TYPE_CHECKING:
    from typing_extensions import Unpack


def allreduce(
    x: Any, codec: Any = None, op: str = "sum", out: Any = None, **options: Unpack[Options]
) -> Any:
    """All-reduce ``x`` over the ranks through ``codec``.

    Args:
        x: float32, float16 or bfloat16 array of any shape and strides (float64 with
            ``codec="none"``): NumPy, torch (CPU or CUDA), CuPy, JAX (CPU) or any
            DLPack producer.
        codec: codec id ("fp8", "nvfp4", "geofp8", ...), config dict or Codec; None or
            "none": the plain, exact collective.
        op: "sum" or "avg".
        out: array like ``x`` (may be ``x`` itself) to write the result into.
        **options: ``key``, ``parts``, ``comm``, ``stage_size``, ``check``,
            ``topology`` (:class:`~geocomm.api.calls.Options`).

    Returns:
        The reduced array: ``out`` if given, else a new array of x's kind, dtype, shape
        and device; bitwise identical on every rank.

    Raises:
        CollectiveMismatchError: the ranks' calls differ (count, dtype, op, codec, keys,
            topology or a stateful codec's state).

    Example::

        avg = geocomm.allreduce(grad, codec="fp8", op="avg")
    """
    with contextlib.ExitStack() as stack:
        arrays, call = _prepared(stack, "allreduce", x, out, codec, op, options)
        run(call)
        return arrays.finish(output(call, arrays.x, arrays.out))


def reduce_scatter(
    x: Any, codec: Any = None, op: str = "sum", out: Any = None, **options: Unpack[Options]
) -> Any:
    """This rank's shard of the reduced flat ``x`` (``np.array_split`` convention).

    Each rank's pieces are quantized once on the way to the shard's owner, which sums
    them in fp32 and keeps that sum (no second quantization). A transforming codec maps
    every tensor on every rank and the owner maps its shard back.

    Args:
        x, codec, op, **options: as for :func:`allreduce`.
        out: a 1-D array of x's kind and dtype, the shard's length, to write the shard
            into (written directly where its memory is apart from x's, so a device call
            into the same ``out`` every time can replay one CUDA graph).

    Returns:
        A 1-D array of x's kind and dtype: ``out`` if given.
    """
    with contextlib.ExitStack() as stack:
        arrays, call = _prepared(stack, "reduce_scatter", x, out, codec, op, options)
        run(call)
        return arrays.finish(output(call, arrays.x, arrays.out))


def allgather(
    x: Any, codec: Any = None, *, comm: Communicator | None = None, check: bool | None = None
) -> Any:
    """Every rank's ``x`` (the same shape on all ranks), stacked.

    Each rank encodes its own array once; every rank decodes all of them from the same
    bytes, so the result is identical everywhere. Transforming codecs send their
    quantizer's bytes (no map: there is no sum to share).

    Args:
        x, codec: as for :func:`allreduce`.
        comm, check: as in :class:`~geocomm.api.calls.Options`.

    Returns:
        An array of shape ``(size, *x.shape)``, x's kind and dtype.
    """
    with contextlib.ExitStack() as stack:
        options: Options = {"comm": comm, "check": check}
        arrays, call = _prepared(stack, "allgather", x, None, codec, "sum", options)
        run(call)
        return arrays.finish(output(call, arrays.x, None))


def _prepared(
    stack: contextlib.ExitStack,
    kind: str,
    x: Any,
    out: Any,
    codec: Any,
    op: str,
    options: Options,
) -> tuple[Operands, Call]:
    """The call's operands (entered on ``stack``) and its :class:`Call`: what this rank
    checks on its own. A call it refuses (TypeError, ValueError, or the KeyError of
    an unknown codec) it first refuses to its peers too
    (:func:`~geocomm.api.calls.refuse`), so that they raise rather than wait for it."""
    try:
        arrays = stack.enter_context(Operands(x, out))
        return arrays, prepare(kind, arrays.x, arrays.out, codec, op, options)
    except (LookupError, TypeError, ValueError):
        refuse(options)
        raise
