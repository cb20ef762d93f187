"""The maps a GeoFP8 plan applies: the split map and the Hadamard rotation.

Both are linear and the same on every rank, so the sum over ranks commutes
with them (docs/design.md, "GeoFP8"). Flat arrays are the row-major values of
the tensor's (m, n) view; ranges are [lo, lo + values.size) of those values.

Split, with the orthonormal (k, n) basis V^T of the key's state: this rank's
coefficients A_i = X_i V (m x k), rounded to bfloat16, travel exactly on the
side channel (2 bytes each); what is quantized is the residual X_i - A_i V^T,
whose energy no longer holds the dominant directions; the reduced result is
Y + (sum_i A_i) V^T. The map never needs to be inverted numerically: what is
subtracted is added back, so any rounding of A_i (bfloat16's included)
cancels except for the two fp32 roundings of the subtraction and the
addition; bfloat16 only leaves A_i's rounding error, 2^-9 of it at most, in
the quantized residual.

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

from geocomm.codecs.formats import Split, split_format
from geocomm.codecs.geo import kernels
from geocomm.codecs.geo.policy import MapShape


class SplitPlan:
    """This call's split map of one tensor.

    ``side``: this rank's coefficients A_i (m, k), bfloat16 values in float32,
    the contribution to the exact side sum (after a step, with a last row of
    their column energies); ``steps``: whether the basis takes
    a power step towards this call's gradients before the map (the codec's
    ``step`` rounds, which replace :attr:`vt`); ``state``: the key's state
    (the codec's, opaque here). ``refreshes`` once a step found a new basis:
    the codec's ``refresh`` then hands it to the state (no rounds).
    ``ranged``: the map works on any flat range once :meth:`begin` has run,
    so the collective maps each piece just before it travels.
    """

    ranged = True

    def __init__(self, dims: MapShape, vt: Any, steps: bool, state: Any = None):
        self.map_shape, self.vt, self.steps, self.state = dims, vt, steps, state
        self.side: Any = None
        self.pending: Any = None  # after a step: (basis, energy, period) for the state
        self._packed: Any = None

    @property
    def refreshes(self) -> bool:
        """Whether the key's state takes a new basis after the call (a step found one)."""
        return self.pending is not None

    def stepped(self, vt: Any, energy: float, period: int) -> None:
        """The step's result: ``vt`` (the key's tracked rows, the mapped ones first)
        maps from now on; the state takes it after the call with the summed
        ``energy`` and ``period``. Call before :meth:`begin`."""
        self.vt, self.pending = vt[: self.map_shape.k, :], (vt, energy, period)

    def begin(self, x: Any) -> None:
        """A = X V, rounded to bfloat16, for this rank's flat values x: sets :attr:`side`.

        Non-finite values of x do not enter A (they stay at their positions).
        """
        self._set_side(kernels.project(x, 0, self.map_shape.n, self.vt))
        self._packed = kernels.pack(self.vt)  # every piece expands with it

    def _set_side(self, coef: Any) -> None:
        """side = coef rounded to bfloat16; after a step one more row follows: the
        energy of each column (what the state records once it is summed)."""
        coef = kernels.round_bf16(coef)
        if self.pending is not None:
            xp = array_namespace(coef)
            energies = xp.asarray([kernels.column_sumsq(coef)])
            coef = xp.concat([coef, kernels.round_bf16(xp.astype(energies, xp.float32))], axis=0)
        self.side = coef

    def forward_range(self, values: Any, lo: int, out: Any) -> None:
        """out = X - A V^T over the range ``values`` starting at ``lo`` (after begin)."""
        n = self.map_shape.n
        r0 = lo // n
        coef = self.side[r0 : r0 + kernels.rows(lo, values.shape[0], n), :]
        kernels.expand(values, lo, n, coef, self.vt, -1.0, out, self._packed)

    def forward(self, x: Any, out: Any) -> None:
        """begin and forward_range over the whole tensor, in one pass (same bits).

        ``out`` may be ``x``.
        """
        self._set_side(kernels.residual(x, self.map_shape.n, self.vt, out))

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        """values += (sum_i A_i) V^T over the range starting at ``lo``, in place."""
        n = self.map_shape.n
        r0 = lo // n
        coef = side_sum[r0 : r0 + kernels.rows(lo, values.shape[0], n), :]
        kernels.expand(values, lo, n, coef, self.vt, 1.0, values, self._packed)

    def _split(self, lo: int, length: int, coef: Any) -> Split | None:
        """The split over [lo, lo + length) with the rows of ``coef`` (None on CuPy:
        no packed basis, no split calls)."""
        if self._packed is None:
            return None
        n = self.map_shape.n
        r0 = lo // n
        return Split(lo, n, coef[r0 : r0 + kernels.rows(lo, length, n), :], self.vt, self._packed)

    def encode_range(
        self, values: Any, lo: int, codec: Any, wire: Any, rounding_stream: int, offset: int
    ) -> bool:
        """``codec.encode_wire`` of :meth:`forward_range`'s values in one pass, without
        storing them (the same bytes); False, doing nothing, where ``codec`` has no
        split calls (not a native format, or CuPy arrays)."""
        fmt, split = split_format(codec), self._split(lo, values.shape[0], self.side)
        if fmt is None or split is None:
            return False
        fmt.encode_split_wire(values, split, wire, rounding_stream=rounding_stream, offset=offset)
        return True

    def decode_range(self, wire: Any, codec: Any, out: Any, lo: int, side_sum: Any) -> bool:
        """``codec.decode_wire`` into ``out``, then :meth:`inverse`, in one pass (the
        same values); False, doing nothing, as :meth:`encode_range`."""
        fmt, split = split_format(codec), self._split(lo, out.shape[0], side_sum)
        if fmt is None or split is None:
            return False
        fmt.decode_split_wire(wire, split, out)
        return True


class HadamardPlan:
    """The randomized Hadamard rotation of the rows that lie inside one shard.

    ``bounds``: the N + 1 flat shard offsets of the collective.
    """

    side = None
    refreshes = steps = False
    ranged = False  # a row is rotated as a whole

    def __init__(self, dims: MapShape, seed: int, bounds: Sequence[int]):
        self.map_shape = dims
        n = dims.n
        self.p = 1 << (n.bit_length() - 1)
        rng = np.random.default_rng([seed, n, 0x4841])
        count = 1 if self.p == n else 2
        self._signs = [rng.choice(np.array([-1.0, 1.0], np.float32), self.p) for _ in range(count)]
        self.bounds = [int(b) for b in bounds]

    def _rows(self, lo: int, hi: int) -> tuple[int, int]:
        """[r0, r1): the rows inside [lo, hi) that also lie inside one shard."""
        n = self.map_shape.n
        r0, r1 = -(-lo // n), hi // n
        rows = [r for r in range(r0, r1) if self._inside_shard(r * n, (r + 1) * n)]
        return (rows[0], rows[-1] + 1) if rows else (0, 0)

    def _inside_shard(self, a: int, b: int) -> bool:
        return any(
            s <= a and b <= e for s, e in zip(self.bounds[:-1], self.bounds[1:], strict=True)
        )

    def _rotate(self, block: Any, inverse: bool) -> None:
        """Rotate the rows of ``block`` (r, n) in place."""
        xp = array_namespace(block)
        n, p = self.map_shape.n, self.p
        parts = list(zip((0, n - p), self._signs, strict=False))
        scale = xp.asarray(1.0 / math.sqrt(p), dtype=xp.float32)
        for start, signs in reversed(parts) if inverse else parts:
            s = xp.asarray(signs)
            cols = block[:, start : start + p]
            if not inverse:
                cols = cols * s
            cols = _fwht(cols) * scale
            block[:, start : start + p] = cols * s if inverse else cols

    def _apply(self, values: Any, lo: int, inverse: bool) -> Any:
        xp = array_namespace(values)
        n = self.map_shape.n
        r0, r1 = self._rows(lo, lo + values.shape[0])
        if r1 <= r0:
            return values
        a, b = r0 * n - lo, r1 * n - lo
        block = xp.reshape(values[a:b], (r1 - r0, n))
        self._rotate(block, inverse)
        values[a:b] = xp.reshape(block, (-1,))
        return values

    def forward(self, x: Any, out: Any) -> None:
        if out is not x:
            out[...] = x
        self._apply(out, 0, False)

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        self._apply(values, lo, True)


def _fwht(x: Any) -> Any:
    """Unnormalized Sylvester Walsh-Hadamard transform of every row (length 2**j):
    log2(p) butterfly levels, each a sum and a difference of half-blocks."""
    xp = array_namespace(x)
    r, p = x.shape
    y, h = xp.reshape(x, (r, p)), p // 2
    while h >= 1:
        y = xp.reshape(y, (r, p // (2 * h), 2, h))
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = xp.concat([a + b, a - b], axis=2)
        h //= 2
    return xp.reshape(y, (r, p))
