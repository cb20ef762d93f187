"""The maps a GeoFP8 plan applies: the split map and the Hadamard rotation.

Both are linear and the same on every rank, so the sum over ranks commutes
with them (docs/design.md, "GeoFP8"). Flat arrays are the row-major values of
the tensor's (m, n) view; ranges are [lo, lo + values.size) of those values.

Split, with the orthonormal (k, n) basis V^T of the key's state: this rank's
coefficients A_i = X_i V (m x k) travel exactly on the side channel; what is
quantized is the residual X_i - A_i V^T, whose energy no longer holds the
dominant directions; the reduced result is Y + (sum_i A_i) V^T. The map never
needs to be inverted numerically: what is subtracted is added back, so any
rounding of A_i cancels except for the two fp32 roundings of the
subtraction and the addition.

Hadamard: a randomized Walsh-Hadamard rotation of every row that lies
entirely inside one shard (so the owner of a reduce-scatter shard can undo
it); for n not a power of two, p = 2**floor(log2 n) and two rotations of size
p act on columns [0, p) and then [n - p, n). Orthogonal, no state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from geocomm.codecs.geo import kernels
from geocomm.codecs.geo.policy import Layout


class SplitPlan:
    """This call's split map of one tensor.

    ``side``: this rank's coefficients A_i (m, k), the contribution to the
    exact side sum; ``refreshes``: whether the key's basis is updated from
    this call's result; ``state``: the key's state (the codec's, opaque here).
    """

    def __init__(self, lay: Layout, vt: Any, refreshes: bool, state: Any = None):
        self.layout, self.vt, self.refreshes, self.state = lay, vt, refreshes, state
        self.side: Any = None

    def forward(self, x: Any, out: Any) -> None:
        """out = X - A V^T for this rank's flat values x; sets :attr:`side` to A.

        ``out`` may be ``x``. Non-finite values of x are kept at their
        positions and do not enter A.
        """
        self.side = kernels.residual(x, self.layout.n, self.vt, out)

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        """values += (sum_i A_i) V^T over the range starting at ``lo``, in place."""
        n = self.layout.n
        r0 = lo // n
        coef = side_sum[r0 : r0 + kernels.rows(lo, values.shape[0], n), :]
        kernels.expand(values, lo, n, coef, self.vt, 1.0, values)


class HadamardPlan:
    """The randomized Hadamard rotation of the rows that lie inside one shard.

    ``bounds``: the N + 1 flat shard offsets of the collective.
    """

    side = None
    refreshes = False

    def __init__(self, lay: Layout, seed: int, bounds: Sequence[int]):
        self.layout = lay
        n = lay.n
        self.p = 1 << (n.bit_length() - 1)
        rng = np.random.default_rng([seed, n, 0x4841])
        count = 1 if self.p == n else 2
        self._signs = [rng.choice(np.array([-1.0, 1.0], np.float32), self.p)
                       for _ in range(count)]
        self.bounds = [int(b) for b in bounds]

    def _rows(self, lo: int, hi: int) -> tuple[int, int]:
        """[r0, r1): the rows inside [lo, hi) that also lie inside one shard."""
        n = self.layout.n
        r0, r1 = -(-lo // n), hi // n
        rows = [r for r in range(r0, r1) if self._inside_shard(r * n, (r + 1) * n)]
        return (rows[0], rows[-1] + 1) if rows else (0, 0)

    def _inside_shard(self, a: int, b: int) -> bool:
        return any(s <= a and b <= e for s, e in zip(self.bounds[:-1], self.bounds[1:],
                                                       strict=True))

    def _rotate(self, block: Any, inverse: bool) -> Any:
        xp = array_namespace(block)
        n, p = self.layout.n, self.p
        parts = list(zip((0, n - p), self._signs, strict=False))
        scale = 1.0 / math.sqrt(p)
        for start, signs in (reversed(parts) if inverse else parts):
            s = xp.asarray(signs)
            cols = block[:, start : start + p]
            rotated = (_fwht(cols) * scale * s) if inverse else _fwht(cols * s) * scale
            block = xp.concat([block[:, :start], xp.astype(rotated, xp.float32),
                               block[:, start + p :]], axis=1)
        return block

    def _apply(self, values: Any, lo: int, inverse: bool) -> Any:
        xp = array_namespace(values)
        n = self.layout.n
        r0, r1 = self._rows(lo, lo + values.shape[0])
        if r1 <= r0:
            return values
        a, b = r0 * n - lo, r1 * n - lo
        block = self._rotate(xp.reshape(values[a:b], (r1 - r0, n)), inverse)
        return xp.concat([values[:a], xp.reshape(block, (-1,)), values[b:]])

    def forward(self, x: Any, out: Any) -> None:
        out[...] = self._apply(x, 0, False)

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        values[...] = self._apply(values, lo, True)


def _fwht(x: Any) -> Any:
    """Unnormalized Sylvester Walsh-Hadamard transform of every row (length 2**j)."""
    xp = array_namespace(x)
    r, p = x.shape
    y, h = x, 1
    while h < p:
        y = xp.reshape(y, (r, p // (2 * h), 2, h))
        y = xp.stack((y[:, :, 0, :] + y[:, :, 1, :], y[:, :, 0, :] - y[:, :, 1, :]), axis=2)
        h *= 2
    return xp.reshape(y, (r, p))
