"""Compressed reduce-scatter sweep, nccl-tests style (each rank checks its shard).

    python -m geocomm.launch -n 2 -- python perf/reduce_scatter_perf.py -b 8 -e 128M -f 2
"""

import sys

import numpy as np
from _driver import Collective, main

import geocomm
from geocomm.codecs import bounds
from geocomm.pipeline import shard_bounds


def _shard(values, rank, size):
    offsets = shard_bounds(values.shape[-1], size)
    return values[..., offsets[rank]: offsets[rank + 1]]


def _expected(total, rank, size, op):
    shard = _shard(total, rank, size)
    return shard / size if op == "avg" else shard


def _bound(xs, codec, rank, size, op):
    if codec.lossless:
        b = 2 * size * bounds.FP32_UNIT * np.sum([np.abs(x) for x in xs], axis=0)
    else:
        b = bounds.reduce_scatter_bound(xs, codec)
    b = _shard(b, rank, size)
    return b / size + 2.0**-23 * b if op == "avg" else b


def _norm_bound(xs, codec, rank, size, op):
    """The whole buffer's error bound also bounds this rank's shard of it."""
    b = bounds.transformed_bound(xs, codec, gather=False)
    return b / size + 2.0**-23 * b if op == "avg" else b


REDUCE_SCATTER = Collective(
    name="reduce_scatter",
    run=lambda x, codec, op, chunk, comm: geocomm.reduce_scatter(
        x, codec=codec, op=op, chunk_elems=chunk, comm=comm),
    bus_factor=lambda n: (n - 1) / n,
    expected=_expected,
    bound=_bound,
    norm_bound=_norm_bound,
    gather=False,
)

if __name__ == "__main__":
    sys.exit(main(REDUCE_SCATTER))
