"""The maps a GeoFP8 plan applies: the split map, the split with whitening, and
the Hadamard rotation.

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

Whitening (after the split, on the residual R_i): with r orthonormal rows
U^T (orthogonal to V^T) and scales d_j in (0, 1], this rank quantizes
Z_i = R_i + (R_i U) diag(d - 1) U^T, the residual with its j-th input-side
direction scaled by d_j; every rank inverts the quantized sum Y with
Y + (Y U) diag(1/d - 1) U^T, which gives back sum_i R_i exactly up to fp32
rounding and multiplies the quantization error along u_j by 1 / d_j. Strong
directions (d_j small) get less of an error that, after an elementwise
quantizer, spreads over every direction alike. The inverse needs whole rows,
so only rows that lie inside one shard are whitened.

Hadamard: a randomized Walsh-Hadamard rotation of every row that lies
entirely inside one shard (so the owner of a reduce-scatter shard can undo
it); for n not a power of two, p = 2**floor(log2 n) and two rotations of size
p act on columns [0, p) and then [n - p, n). Orthogonal, no state.

``bounds`` are the collective's N + 1 shard offsets relative to the tensor's
first value (clipped to the tensor).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from geocomm.codecs.formats import Split, split_format
from geocomm.codecs.geo import kernels
from geocomm.codecs.geo.policy import MapShape, whiten_scale


def shard_rows(dims: MapShape, bounds: Sequence[int]) -> list[tuple[int, int]]:
    """Runs [r0, r1) of the rows that lie entirely inside one shard, in order
    (adjacent runs merged)."""
    n, runs = dims.n, list[tuple[int, int]]()
    for start, end in itertools.pairwise(bounds):
        r0, r1 = -(-max(int(start), 0) // n), min(int(end) // n, dims.m)
        if r1 <= r0:
            continue
        if runs and runs[-1][1] == r0:
            runs[-1] = (runs[-1][0], r1)
        else:
            runs.append((r0, r1))
    return runs


def rows_within(runs: list[tuple[int, int]], lo: int, length: int, n: int) -> list[tuple[int, int]]:
    """The parts of ``runs`` whose rows lie entirely inside [lo, lo + length)."""
    first, end = -(-lo // n), (lo + length) // n
    return [(max(a, first), min(b, end)) for a, b in runs if min(b, end) > max(a, first)]


def side_shape(dims: MapShape, steps: bool) -> tuple[int, int]:
    """The shape of a split's side: a row of coefficients per matrix row, and with a
    step one more, the energy of each column."""
    return (dims.m + steps, dims.k)


def _side(
    x: Any, dims: MapShape, vt: Any, pending: Any, out: Any = None, scratch: Any = None
) -> Any:
    """The split's side of the flat values x (into ``out``, of :func:`side_shape`, when
    given; ``scratch``: the projection's): their coefficients rounded to bfloat16, then
    :func:`_with_energies`."""
    coef = kernels.project(x, 0, dims.n, vt, None if out is None else out[: dims.m], scratch)
    return _with_energies(kernels.round_bf16(coef), pending, out)


def _with_energies(coef: Any, pending: Any, out: Any = None) -> Any:
    """The side from the rounded coefficients (``out[:m]`` when ``out`` is given): after
    a step one more row, the energy of each column (what the state records once it is
    summed)."""
    if pending is None:
        return coef if out is None else out
    xp = array_namespace(coef)
    energies = kernels.round_bf16(xp.reshape(kernels.row_sumsq_f32(coef.T), (1, -1)))
    if out is None:
        return xp.concat([coef, energies], axis=0)
    out[coef.shape[0] :, :] = energies
    return out


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
        self.settled = not steps  # the codec's step sets it once the basis is final
        self.side: Any = None
        self.pending: Any = None  # after a step: (basis, the step's verdict, basis hash)
        self._packed: Any = None

    @property
    def refreshes(self) -> bool:
        """Whether the codec's refresh runs after the call: after a step, whose verdict
        says whether the key's state takes the new basis."""
        return self.pending is not None

    def stepped(self, vt: Any, verdict: Any, digest: Any) -> None:
        """The step's result: ``vt`` (the key's tracked rows, the mapped ones first)
        maps from now on; the state takes it after the call, as ``verdict`` (an array
        of the codec's) says, with ``digest``, its
        :func:`~geocomm.codecs.geo.kernels.basis_hash`. Call before :meth:`begin`."""
        self.vt, self.pending = vt[: self.map_shape.k, :], (vt, verdict, digest)

    def resume(self, pending: Any) -> None:
        """Take :attr:`pending` of an earlier call's plan of the same key, basis and step,
        whose work a CUDA graph replays for this call: the arrays the graph's step
        writes (instead of the codec's ``step`` rounds)."""
        self.settled = True
        self.stepped(*pending)

    @property
    def inputs(self) -> tuple[Any, ...]:
        """The arrays the map reads besides the values and the sides: the basis (a CUDA
        graph of the call names their addresses, and reads what they hold then; a step
        reads the key's whole basis, of which this is the first rows)."""
        return (self.vt,)

    @property
    def side_shape(self) -> tuple[int, int]:
        """The shape :meth:`begin` gives :attr:`side` (known before the step rounds)."""
        return side_shape(self.map_shape, self.steps)

    @property
    def scratch_size(self) -> int:
        """The float32 values of scratch :meth:`begin` uses (the projection's chunk sums:
        :func:`~geocomm.codecs.geo.kernels.project_scratch_size`)."""
        dims = self.map_shape
        return kernels.project_scratch_size(dims.m, dims.n, dims.k)

    def begin(self, x: Any, side: Any = None, scratch: Any = None) -> None:
        """A = X V, rounded to bfloat16, for this rank's flat values x: sets :attr:`side`
        (written into ``side``, of :attr:`side_shape`, when given; ``scratch``: at least
        :attr:`scratch_size` float32 values, or None to allocate them).

        Non-finite values of x do not enter A (they stay at their positions).
        """
        self.side = _side(x, self.map_shape, self.vt, self.pending, side, scratch)
        self._packed = kernels.pack(self.vt)  # every piece expands with it

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
        coef = kernels.residual(x, self.map_shape.n, self.vt, out)
        self.side = _with_energies(coef, self.pending)

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        """values += (sum_i A_i) V^T over the range starting at ``lo``, in place."""
        n = self.map_shape.n
        r0 = lo // n
        coef = side_sum[r0 : r0 + kernels.rows(lo, values.shape[0], n), :]
        kernels.expand(values, lo, n, coef, self.vt, 1.0, values, self._packed)

    def split(self, lo: int, length: int, coef: Any) -> Split:
        """The split over [lo, lo + length) with the rows of ``coef`` that the range
        touches (:attr:`side` on the way out, the summed side on the way back)."""
        n = self.map_shape.n
        r0 = lo // n
        return Split(lo, n, coef[r0 : r0 + kernels.rows(lo, length, n), :], self.vt, self._packed)

    def _split(self, lo: int, length: int, coef: Any) -> Split | None:
        """:meth:`split` for the C core's split calls (None on CuPy: no packed basis)."""
        return None if self._packed is None else self.split(lo, length, coef)

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


class WhitenPlan:
    """This call's split and whitening of one tensor (module docstring): whole
    tensors, not ranges (the whitening's inverse needs whole rows).

    ``dims.k`` split rows ``vt`` (0: whitening alone), ``steps`` and ``state`` as
    :class:`SplitPlan`'s; ``values``: this rank's flat input, whose coefficients
    make :attr:`side` when it is first read (after the step rounds, which may
    replace :attr:`vt`); ``whitening``: the state's measured basis, its energies
    and bulk (None: none measured yet, nothing is whitened); ``rows``: how many
    directions to whiten; ``basis_rows``: the rows of the basis the refresh
    measures; ``alpha``: the exponent; ``seed``: the orthonormalization's.
    The whitened directions are the
    measured basis's rows with the mapped ones taken out, the ``rows`` of them
    whose energy (under the state's model: the measured energies along the
    basis, the bulk's elsewhere) is largest. ``refreshes`` always: the state
    then measures the basis again from the result; ``remeasure``: a flat key's
    split basis is measured again too.
    """

    ranged = False
    refreshes = True

    def __init__(
        self,
        dims: MapShape,
        vt: Any,
        steps: bool,
        state: Any,
        values: Any,
        whitening: tuple[Any, tuple[float, ...], float] | None,
        rows: int,
        basis_rows: int,
        alpha: float,
        seed: int,
        bounds: Sequence[int],
        remeasure: bool = False,
    ):
        self.map_shape, self.vt, self.steps, self.state = dims, vt, steps, state
        self.settled = not steps  # the codec's step sets it once the basis is final
        self.pending: Any = None
        self.remeasure = remeasure
        self._values, self._whitening, self._rows = values, whitening, rows
        self.basis_rows = basis_rows
        self._alpha, self._seed = alpha, seed
        self._runs = shard_rows(dims, bounds)
        self._side: Any = None
        self._bases: Any = None  # (U^T, forward rows, inverse rows), or () for none

    def stepped(self, vt: Any, verdict: Any, digest: Any) -> None:
        """As :meth:`SplitPlan.stepped` (before :attr:`side` is read)."""
        self.vt, self.pending = vt[: self.map_shape.k, :], (vt, verdict, digest)

    @property
    def side(self) -> Any:
        """A = X V rounded to bfloat16 (with the energies row after a step), None
        when nothing is split; computed when first read."""
        if self.map_shape.k == 0:
            return None
        if not self.settled:
            raise RuntimeError("a plan's side was read before its step rounds ended")
        if self._side is None:
            self._side = _side(self._values, self.map_shape, self.vt, self.pending)
        return self._side

    def whitened(self) -> Any:
        """(U^T, (d - 1) U^T, (1 / d - 1) U^T) of this call, each (r, n), or None when
        no direction is scaled."""
        if self._bases is None:
            self._bases = self._whitening_bases() or ()
        return self._bases or None

    def _whitening_bases(self) -> Any:
        if self._whitening is None:
            return None
        wt, energies, bulk = self._whitening
        k, n = self.map_shape.k, self.map_shape.n
        xp = array_namespace(wt)
        rest = wt
        if k:  # the measured rows with the mapped ones taken out (Gram-Schmidt, mapped first)
            rest = kernels.orthonormalize(xp.concat([self.vt, wt], axis=0), self._seed)[k:]
        # each row's energy under the model: e_j along the measured rows, the bulk elsewhere
        # (correctly rounded sums, not a BLAS: every rank gets the same bits)
        c = kernels.host_copy(kernels.project(xp.reshape(rest, (-1,)), 0, n, wt)).tolist()
        model = [
            math.fsum(x * x * e for x, e in zip(row, energies, strict=True))
            + bulk * max(1.0 - math.fsum(x * x for x in row), 0.0)
            for row in c
        ]
        best = sorted(range(len(model)), key=lambda i: -model[i])[: self._rows]
        scales = {i: whiten_scale(model[i], bulk, self._alpha) for i in best}
        keep = [i for i in best if scales[i] < 1.0]
        if not keep:
            return None
        u = kernels.host_copy(rest)[keep]
        d = np.array([scales[i] for i in keep], np.float64)[:, None]
        fwd = (u * (d - 1.0)).astype(np.float32)
        inv = (u * (1.0 / d - 1.0)).astype(np.float32)
        return xp.asarray(np.ascontiguousarray(u)), xp.asarray(fwd), xp.asarray(inv)

    def forward(self, x: Any, out: Any) -> None:
        """out = X - A V^T, then its whitened rows scaled (``out`` may be ``x``)."""
        n, m = self.map_shape.n, self.map_shape.m
        side = self.side  # from x before out (which may be x) is written
        if side is not None:
            kernels.expand(x, 0, n, side[:m, :], self.vt, -1.0, out)
        elif out is not x:
            out[...] = x
        bases = self.whitened()
        if bases is None:
            return
        u, fwd, _ = bases
        for r0, r1 in self._runs:
            part = out[r0 * n : r1 * n]
            kernels.expand(part, 0, n, kernels.project(part, 0, n, u), fwd, 1.0, part)

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        """The whitened rows inside [lo, lo + values.size) scaled back, then
        (sum_i A_i) V^T added over the range, in place."""
        n = self.map_shape.n
        bases = self.whitened()
        if bases is not None:
            u, _, inv = bases
            for r0, r1 in rows_within(self._runs, lo, values.shape[0], n):
                part = values[r0 * n - lo : r1 * n - lo]
                kernels.expand(part, 0, n, kernels.project(part, 0, n, u), inv, 1.0, part)
        if side_sum is not None and values.shape[0]:
            r0 = lo // n
            coef = side_sum[r0 : r0 + kernels.rows(lo, values.shape[0], n), :]
            kernels.expand(values, lo, n, coef, self.vt, 1.0, values)


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
        self._runs = shard_rows(dims, bounds)

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
            cols = _rotate_rows(cols, p, scale)
            block[:, start : start + p] = cols * s if inverse else cols

    def _apply(self, values: Any, lo: int, inverse: bool) -> Any:
        xp = array_namespace(values)
        n = self.map_shape.n
        for r0, r1 in rows_within(self._runs, lo, values.shape[0], n):
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


def _rotate_rows(cols: Any, p: int, scale: Any) -> Any:
    """The normalized Walsh-Hadamard rotation of every row of ``cols`` (r, p):
    ``_fwht(cols) * scale``, except that a row whose largest |value| passes
    FLT_MAX / p (where a butterfly's sum of p values could overflow) has 1 / sqrt(p)
    applied as 2^-h before the butterflies (exact for values that large: a power of
    two) and 2^h / sqrt(p) after, so its sums stay within sqrt(p) times its largest
    value. Chosen per row from the row's own values, on the device without a host
    round trip (a CUDA graph may hold it)."""
    xp = array_namespace(cols)
    h = p.bit_length() // 2  # ceil(log2(p) / 2)
    amax = xp.max(xp.abs(cols), axis=1, keepdims=True) if cols.shape[0] else cols[:, :1]
    large = amax > np.float32(np.finfo(np.float32).max / p)
    one = xp.asarray(1.0, dtype=xp.float32)
    pre = xp.where(large, xp.asarray(2.0**-h, dtype=xp.float32), one)
    post = xp.where(large, xp.asarray(2.0**h / math.sqrt(p), dtype=xp.float32), scale)
    return _fwht(cols * pre) * post


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
