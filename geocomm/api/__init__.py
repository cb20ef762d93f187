"""The API layer: what callers see (docs/design.md, "Architecture").

* :mod:`~geocomm.api.collectives`: ``allreduce``, ``reduce_scatter``, ``allgather``;
* :mod:`~geocomm.api.calls`: the arguments checked and described as one call for the
  engine (:class:`~geocomm.engine.call.Call`), the default communicator, codecs by id;
* :mod:`~geocomm.api.arrays`: every array kind in (DLPack, torch, CuPy, JAX) and out.
"""

from geocomm.api.arrays import as_array
from geocomm.api.calls import Options, get_comm, init, resolve_codec
from geocomm.api.collectives import allgather, allreduce, reduce_scatter

__all__ = [
    "Options",
    "allgather",
    "allreduce",
    "as_array",
    "get_comm",
    "init",
    "reduce_scatter",
    "resolve_codec",
]
