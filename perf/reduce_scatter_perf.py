"""Compressed reduce-scatter sweep, nccl-tests style (each rank checks its shard).

python -m geocomm.launch -n 2 -- python perf/reduce_scatter_perf.py -b 8 -e 128M -f 2
"""

import sys

import numpy as np
from _driver import Collective, main

import geocomm
from geocomm.codecs import bounds
from geocomm.engine.layout import shard_bounds


def _span(count, rank, size):
    offsets = shard_bounds(count, size)
    return int(offsets[rank]), int(offsets[rank + 1])


def _bound(xs, codec, size, op, amaxes, a_prime):
    """Element bound on slices ``xs`` of the inputs (whole-tensor ``amaxes``); with
    ``a_prime`` the all-reduce's (on nodes of unequal size a node-aware reduce-scatter
    returns the node-aware all-reduce's shard, quantized twice)."""
    if codec.lossless:
        b = 2 * size * bounds.FP32_UNIT * np.sum([np.abs(x) for x in xs], axis=0)
    elif a_prime is not None:
        b = bounds.allreduce_bound(xs, codec, amaxes, a_prime)
    else:
        b = bounds.reduce_scatter_bound(xs, codec, amaxes)
    return b / size + 2.0**-23 * b if op == "avg" else b


def _norm_bound(xs, codec, rank, size, op, twice):
    """The whole buffer's error bound also bounds this rank's shard of it."""
    b = bounds.transformed_bound(xs, codec, gather=twice)
    return b / size + 2.0**-23 * b if op == "avg" else b


REDUCE_SCATTER = Collective(
    name="reduce_scatter",
    run=lambda x, codec, op, stage_size, comm: geocomm.reduce_scatter(
        x, codec=codec, op=op, stage_size=stage_size, comm=comm
    ),
    bus_factor=lambda n: (n - 1) / n,
    span=_span,
    bound=_bound,
    norm_bound=_norm_bound,
    gather=False,
)

if __name__ == "__main__":
    sys.exit(main(REDUCE_SCATTER))
