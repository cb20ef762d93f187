"""The GeoFP8 codecs: a quantizer behind a geometry map with per-key state.

:class:`GeoCodec` is a :class:`~geocomm.codecs.base.TransformingCodec`: the
collective asks it for this call's :meth:`plan` of each tensor, runs the
:meth:`step` rounds of the plans whose basis takes a power step on this
call's gradients (each round one small exact sum the collective performs),
moves the mapped values through the quantizer and the plan's side
contribution through an exact sum, inverts, and then runs the
:meth:`refresh` rounds that hand a step's basis to the key's state or
measure a basis from the result. The codec never talks to a communicator.
docs/design.md, "GeoFP8", has the maths; :mod:`~geocomm.codecs.geo.policy`
the per-tensor choices.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from array_api_compat import array_namespace, is_cupy_array

from geocomm.codecs.base import Codec, TransformingCodec, WireOf
from geocomm.codecs.formats import FP8Codec, NVFP4Codec
from geocomm.codecs.frames import FramedCodec
from geocomm.codecs.geo import kernels, policy
from geocomm.codecs.geo.maps import HadamardPlan, SplitPlan, WhitenPlan
from geocomm.codecs.geo.policy import (
    ALPHAS,
    DEFAULTS,
    DEVICES,
    TRANSFORMS,
    MapShape,
    anisotropic,
    whiten_rows,
)
from geocomm.codecs.geo.state import KeyState

#: Subspace iterations on a key's first result, from a fixed-seed random basis
#: of OVERSAMPLE more rows than the key tracks (the extra rows soak up the
#: directions just below the kept ones, so the kept ones converge faster).
COLD_ITERS = 3
OVERSAMPLE = 8

#: A refresh round: yields this rank's partial sums, receives their exact sum.
Rounds = Generator[Any, Any, None]


class _MeasurePlan:
    """No map this call, but a refresh from its result (a key's first call, or
    one left plain for a flat spectrum and due for a re-measure); ``whiten``:
    rows of a whitening basis the first call measures too (0: none)."""

    side = None
    refreshes = True
    steps = False
    ranged = True

    def __init__(self, dims: MapShape, state: KeyState, whiten: int = 0):
        self.map_shape, self.state, self.whiten = dims, state, whiten

    scratch_size = 0

    def begin(self, x: Any, side: Any = None, scratch: Any = None) -> None:
        return None

    def forward_range(self, values: Any, lo: int, out: Any) -> None:
        if out is not values:
            out[...] = values

    def forward(self, x: Any, out: Any) -> None:
        self.forward_range(x, 0, out)

    def inverse(self, values: Any, lo: int, side_sum: Any) -> None:
        return None

    def encode_range(
        self, values: Any, lo: int, codec: Any, wire: Any, rounding_stream: int, offset: int
    ) -> bool:
        codec.encode_wire(values, wire, rounding_stream=rounding_stream, offset=offset)
        return True  # the values as they are: no copy

    def decode_range(self, wire: Any, codec: Any, out: Any, lo: int, side_sum: Any) -> bool:
        codec.decode_wire(wire, out)
        return True

    def split(self, lo: int, length: int, coef: Any) -> None:
        return None  # no map to run inside the kernels


class GeoCodec(WireOf, FramedCodec, TransformingCodec):
    """A quantizer preceded by a geometry map (see the module docstring).

    Knobs (:data:`~geocomm.codecs.geo.policy.DEFAULTS`): ``transform``
    (auto | split | whiten | hadamard | none), ``k`` (largest rank), ``budget``
    (multiply-adds per value and call of the split), ``refresh``/``refresh_max``
    (shortest and longest period between basis updates; a key's period adapts
    in between), ``max_side`` (side channel over payload),
    ``min_dim``/``min_numel`` (smallest mapped matrix), ``min_share``
    (anisotropy needed), ``side_budget`` (model-wide side bytes over payload),
    ``whiten`` (directions whitened) and ``alpha`` (their exponent), ``device``
    (auto | cpu | gpu: the kind ``transform="auto"`` picks for), ``seed``.
    """

    #: knobs listed in get_config (subclasses may expose fewer)
    _fields: ClassVar[tuple[str, ...]] = tuple(DEFAULTS)
    #: coefficients, step and refresh sums are rounded to bfloat16 (kernels.round_bf16)
    side_format: ClassVar[str] = "bf16"

    def __init__(self, quantizer: Codec, **knobs: Any):
        unknown = set(knobs) - set(DEFAULTS)
        if unknown:
            raise TypeError(
                f"unknown GeoFP8 parameters {sorted(unknown)}; known: {sorted(DEFAULTS)}"
            )
        config = {**DEFAULTS, **knobs}
        if config["transform"] not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {config['transform']!r}")
        if config["device"] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {config['device']!r}")
        if config["alpha"] not in ALPHAS or isinstance(config["alpha"], bool):
            raise ValueError(f"alpha must be one of {ALPHAS}, got {config['alpha']!r}")
        self.quantizer = self.wire_codec = quantizer  # the bytes are the quantizer's
        self.transform, self.device = config["transform"], config["device"]
        self.whiten = _check_int("whiten", config["whiten"], 0)
        self.alpha = float(config["alpha"])
        self.k = _check_int("k", config["k"], 1)
        self.refresh_period = _check_int("refresh", config["refresh"], 1)
        self.refresh_max = _check_int("refresh_max", config["refresh_max"], self.refresh_period)
        self.min_dim = _check_int("min_dim", config["min_dim"], 1)
        self.min_numel = _check_int("min_numel", config["min_numel"], 0)
        self.seed = _check_int("seed", config["seed"], 0)
        self.budget = _check_float("budget", config["budget"], 0.0, math.inf)
        self.max_side = _check_float("max_side", config["max_side"], 0.0, math.inf)
        self.min_share = _check_float("min_share", config["min_share"], 0.0, 1.0)
        self.side_budget = _check_float("side_budget", config["side_budget"], 0.0, math.inf)
        self._state: dict[Any, KeyState] = {}
        self._ranks: tuple[int, dict[Any, int]] = (-1, {})  # (state version, allocation)
        self._version = 0  # bumps whenever a key's spectrum or the set of keys changes
        self._planned: set[Any] = set()  # keys planned in this round of calls
        self._map_shapes: dict[tuple[tuple[int, ...], bool], MapShape | None] = {}
        # basis updates whose outcomes are still on their way to the host, in call
        # order: the key's state, the copies of the call (the update's are those at
        # the slice) and the commit that takes them (:meth:`_later`, :meth:`flush`)
        self._unsettled: list[tuple[KeyState, kernels.LaterCopy, slice, Callable[..., None]]] = []
        # this call's updates, their copies not yet queued (:meth:`flush` does)
        self._queued: list[tuple[KeyState, Callable[..., None], tuple[Any, ...]]] = []

    # ---- configuration --------------------------------------------------------
    def _knobs(self) -> dict[str, Any]:
        return {
            "transform": self.transform,
            "k": self.k,
            "budget": self.budget,
            "refresh": self.refresh_period,
            "refresh_max": self.refresh_max,
            "max_side": self.max_side,
            "min_dim": self.min_dim,
            "min_numel": self.min_numel,
            "min_share": self.min_share,
            "side_budget": self.side_budget,
            "whiten": self.whiten,
            "alpha": self.alpha,
            "device": self.device,
            "seed": self.seed,
        }

    def get_config(self) -> dict[str, Any]:
        """The quantizer's parameters, then the geometry's (one ``seed`` serves both:
        the quantizer's stochastic rounding and the geometry's random starts)."""
        quantizer = self.quantizer.get_config()
        quantizer.pop("id")
        knobs = self._knobs()
        return {"id": self.codec_id, **quantizer, **{f: knobs[f] for f in self._fields}}

    # ---- the map of one call -----------------------------------------------------
    def map_shape(self, shape: Sequence[int], framed: bool = False) -> MapShape | None:
        """The map of a tensor of ``shape`` (None: plain quantization); worked out once
        per shape (the knobs never change)."""
        known = (tuple(shape), framed)
        if known not in self._map_shapes:
            payload = self.quantizer.wire_size(math.prod(shape))
            self._map_shapes[known] = policy.map_shape(shape, self._knobs(), payload, framed)
        return self._map_shapes[known]

    def geometry(self, device_arrays: bool) -> str:
        """The geometry this codec applies to host arrays (``device_arrays`` False)
        or to a GPU's (True): ``transform``, with ``auto`` resolved by ``device``
        (:data:`~geocomm.codecs.geo.policy.DEVICE_GEOMETRY`)."""
        device = self.device
        if device == "auto":
            device = "gpu" if device_arrays else "cpu"
        return policy.geometry(self.transform, device)

    def plan(self, x: Any, shape: Sequence[int], key: Any, bounds: Sequence[int]) -> Any:
        """This call's plan for the flat float32 values ``x`` of a tensor of ``shape``.

        ``key`` names the tensor (None: its shape does); ``bounds`` are the
        collective's N + 1 shard offsets relative to the tensor's first value.
        Local: decides from shape, config, the kind of ``x`` and the key's
        state only, so every rank decides alike. None means plain
        quantization and no state.
        """
        dims = self.map_shape(shape)
        if dims is None:
            return None
        geometry = self.geometry(is_cupy_array(x))
        if geometry == "hadamard":
            return HadamardPlan(dims, self.seed, bounds)
        key = ("shape", tuple(shape)) if key is None else key
        st = self._state_for(key, dims)
        if self._unsettled:
            self._settle(st)
        st.calls += 1
        whiten = whiten_rows(dims, self.whiten) if geometry == "whiten" else (0, 0)
        if st.vt is None:  # the first result measures the basis (the cold start)
            return _MeasurePlan(dims, st, whiten[1])
        due = st.calls - st.refreshed >= st.period
        st.use = self._rank_of(key)
        if whiten[0]:
            return self._whiten_plan(x, dims, st, due, whiten, bounds)
        if st.use < 0:  # flat when the round's allocation was made: re-measured
            st.use = 0
            return _MeasurePlan(dims, st) if due else None
        if st.use == 0:
            return None
        use = MapShape(dims.m, dims.n, st.use)
        return SplitPlan(use, st.vt[: st.use, :], steps=due, state=st)

    def _whiten_plan(
        self,
        x: Any,
        dims: MapShape,
        st: KeyState,
        due: bool,
        whiten: tuple[int, int],
        bounds: Sequence[int],
    ) -> WhitenPlan:
        """The split (the key's rank under the allocation, possibly 0) and the
        whitening of the state's measured basis; a flat key is plain in the split
        and re-measured when due, as a split key is."""
        remeasure = st.use < 0 and due
        st.use = max(st.use, 0)
        return WhitenPlan(
            MapShape(dims.m, dims.n, st.use),
            st.vt[: st.use, :],
            steps=due and st.use > 0,
            state=st,
            values=x,
            whitening=(st.wt, st.wenergies, st.wbulk) if st.wt is not None else None,
            rows=whiten[0],
            basis_rows=whiten[1],
            alpha=self.alpha,
            seed=self.seed,
            bounds=bounds,
            remeasure=remeasure,
        )

    def _rank_of(self, key: Any) -> int:
        """The key's rank under the allocation of this round of calls. A round starts
        when a key comes back (the next training step's first tensor): every key's
        state then takes the updates still on their way (:meth:`_settle`), and the
        allocation is made again if they changed it. So every call of one step spends
        from one allocation and the step keeps the cap, and no call of a round waits
        for what another call of the round found."""
        if key in self._planned or self._ranks[0] < 0:
            self._settle()
            self._planned.clear()
            if self._ranks[0] != self._version:
                self._ranks = (-1, {})
        self._planned.add(key)
        return self._allocation().get(key, 0)

    def _flat(self, st: KeyState) -> bool:
        """Whether the key's tracked share beats a flat spectrum by less than min_share."""
        return st.share is not None and not anisotropic(st.share, st.map_shape, self.min_share)

    def ranks(self) -> dict[Any, int]:
        """The rank the model-wide budget gives each measured key in this round
        of calls (:func:`~geocomm.codecs.geo.policy.allocate`; -1: flat, plain
        and re-measured); a pure function of the keys' states, so equal on
        ranks whose states are. A reader: it never fixes a round's allocation
        (only a round's first call does, on every rank alike), so one rank may
        call it anywhere."""
        self._settle()
        if self._ranks[0] >= 0:
            return dict(self._ranks[1])
        return self._allocate()

    def _allocation(self) -> dict[Any, int]:
        """The allocation of this round of calls, made at its first call."""
        if self._ranks[0] < 0:
            self._ranks = (self._version, self._allocate())
        return self._ranks[1]

    def _allocate(self) -> dict[Any, int]:
        """:meth:`ranks` from the states as they are."""
        spectra = {
            key: policy.Spectrum(
                st.map_shape,
                st.energies,
                st.total,
                self.quantizer.wire_size(st.map_shape.m * st.map_shape.n),
                st.period,
                st.summed,
            )
            for key, st in self._state.items()
            if st.energies
        }
        allocation = policy.allocate(spectra, self.side_budget, self.min_share)
        for key, st in self._state.items():
            if st.energies and self._flat(st):
                allocation[key] = -1
        return allocation

    def step(self, plan: Any, x: Any) -> Rounds:
        """The round that turns ``plan``'s basis one power step towards this call's
        gradients before they are mapped (a plan with ``steps``).

        ``x``: this rank's flat values of the tensor. Yields this rank's
        X_i^T X_i V (k, n) for the plan's k mapped rows V and its energy
        ||X_i||^2; is sent their exact sum over ranks, whose orthonormal rows
        become the plan's basis (the tracked rows the plan does not map are
        carried along). The key's state takes the new basis after the call
        (:meth:`refresh`; committed when the state is next read), with the
        energy the ranks' values have along each new direction (the plan's side
        sums it). Where the energy is not finite or zero the state does not
        take it. Everything runs in ``x``'s namespace: on a GPU the step never
        waits for the device."""
        st, dims = plan.state, plan.map_shape
        if st.vt is None:
            raise RuntimeError("a plan steps from a measured basis, and this key has none")
        # from the state's basis, not the plan's: a step run again (eagerly, after a
        # failed capture of the call) starts where the first did
        coef = kernels.project(x, 0, dims.n, st.vt[: dims.k, :])
        total = yield _accumulation(x, 0, coef, dims)
        plan.settled = True  # the basis is final from here on (a plan's side may be read)
        plan.stepped(*_power_step(total, st.vt, dims.k, self.seed))

    def refresh(self, plan: Any, shard: Any, lo: int, side_sum: Any, alone: bool = False) -> Rounds:
        """The rounds that update the key of ``plan`` after the call: a measuring
        plan's (its first call, or a flat key's re-measure) from this call's result,
        a stepped split plan's from its summed side (no rounds).

        ``shard``: this rank's flat range [lo, lo + shard.size) of the summed
        result in the tensor's own coordinates (before any averaging);
        ``side_sum``: the plan's summed side (None for a measuring plan). Each round yields
        this rank's partial sums and receives their exact sum over ranks;
        ``alone``: every rank holds the whole result and measures from it,
        each round's yield is its own total (an all-reduce: no bytes, which
        the budget then does not charge). The state changes only when the sums
        are finite and the result is not all zero.
        """
        if isinstance(plan, WhitenPlan):
            if plan.pending is not None:
                self._commit_step(plan, side_sum)
            if plan.remeasure:
                yield from self.measure(plan.state, shard, lo, summed=not alone)
            if alone:  # the whitening's basis from the whole result (no bytes)
                yield from self._measure_whitening(plan.state, shard, lo, plan.basis_rows)
            return
        if isinstance(plan, SplitPlan):  # a stepped plan: its side summed the energies
            self._commit_step(plan, side_sum)
            return
        whiten = plan.whiten if alone else 0  # a reduce-scatter measures no whitening
        yield from self.measure(plan.state, shard, lo, summed=not alone, whiten=whiten)

    def _commit_step(self, plan: SplitPlan | WhitenPlan, side_sum: Any) -> None:
        """The key's state after a power step (unless its energy was non-finite or
        zero): the plan's new basis, the energy along each mapped direction (the
        side sum's last row: every rank's values), the tracked rows it does not
        map carried along with their energies scaled to the new whole energy, and
        the period the overlap of the new basis with the old one gives. The step's
        outcome and the energies travel to the host behind the call
        (:class:`~geocomm.codecs.geo.kernels.LaterCopy`), so the call never waits
        for them: the state takes them when it is next read (:meth:`_settle`)."""
        st, k, (vt, verdict, digest) = plan.state, plan.map_shape.k, plan.pending

        def commit(energies: np.ndarray, outcome: np.ndarray, hashed: np.ndarray) -> None:
            kept, whole, overlap = _outcome(outcome, k)
            mapped = [float(e) for e in energies]
            if not kept or not all(map(math.isfinite, mapped)):
                return
            period = policy.next_period(st.period, overlap, self.refresh_period, self.refresh_max)
            stale = whole / st.total if st.total > 0 else 0.0
            carried = [e * stale for e in st.energies[k:]]
            st.commit(vt, (*mapped, *carried), whole, period, summed=True, digest=int(hashed[0]))
            self._version += 1

        self._later(st, commit, side_sum[plan.map_shape.m, :], verdict, digest)

    def _later(self, st: KeyState, commit: Callable[..., None], *arrays: Any) -> None:
        """Hand ``commit``, an update of ``st``, the host copies of ``arrays`` when the
        state is next read; the copies leave with the call's others (:meth:`flush`)."""
        self._queued.append((st, commit, arrays))

    def flush(self) -> None:
        """Queue the host copies of every update this call's rounds left, behind one
        event (:class:`~geocomm.codecs.geo.kernels.LaterCopy`: the call goes on at
        once; the collective calls this after the refresh rounds)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        copy = kernels.LaterCopy(*(a for _, _, arrays in queued for a in arrays))
        at = 0
        for st, commit, arrays in queued:
            self._unsettled.append((st, copy, slice(at, at + len(arrays)), commit))
            at += len(arrays)

    def _settle(self, st: KeyState | None = None) -> None:
        """Run the updates whose outcomes were on their way (:meth:`_later`), in call
        order: every one, or with ``st`` those up to ``st``'s last, so that the host
        waits only for the calls the reader needs (the device runs them in order).
        Every reader of a key's state calls this first; readers decide at the same
        calls on every rank, so every rank's state takes the same updates."""
        self.flush()  # a driver of the rounds other than the collective may not have
        pending = self._unsettled
        done = len(pending)
        if st is not None:
            done = max((i + 1 for i, (owner, *_) in enumerate(pending) if owner is st), default=0)
        if not done:
            return
        self._unsettled = pending[done:]
        for _, copies, taken, commit in pending[:done]:
            commit(*copies.result()[taken])

    def measure(
        self, st: KeyState, shard: Any, lo: int, summed: bool = False, whiten: int = 0
    ) -> Rounds:
        """Subspace iterations on the result from the key's basis (one), or from a
        fixed-seed random one (COLD_ITERS, OVERSAMPLE more rows, the top k kept).
        ``whiten``: a cold measure keeps that many rows as the whitening basis too
        (the split's are its first k). The key has no update pending here: its plan
        measured, so it did not step, and the call's plan settled the earlier ones."""
        cap = st.map_shape
        xp = array_namespace(shard)
        cold = st.vt is None
        kept = max(cap.k, whiten) if cold else cap.k
        rows = min(kept + OVERSAMPLE, min(cap.m, cap.n)) if cold else cap.k
        start = self._random_rows(xp, rows, cap.n) if cold else st.vt
        total, coef = yield from self._iterate(shard, lo, cap, start, COLD_ITERS if cold else 1)
        w = xp.reshape(total[: rows * cap.n], (rows, cap.n))
        basis = kernels.orthonormalize(w[:kept, :], self.seed)  # row i: rows <= i only
        vt = basis[: cap.k, :]
        compared = st.use or cap.k  # the rows whose overlap with the old basis sets the period
        verdict = _verdict(total, vt[:compared, :], None if cold else st.vt)

        def commit(column_energies: np.ndarray, outcome: np.ndarray, host: np.ndarray) -> None:
            ok, energy, overlap = _outcome(outcome, compared)
            energies = [float(e) for e in column_energies[:kept]]
            if not ok or not all(map(math.isfinite, energies)):
                return
            period = self.refresh_period
            if not cold:
                period = policy.next_period(
                    st.period, overlap, self.refresh_period, self.refresh_max
                )
            digest = int(kernels.basis_hash(host[: cap.k])[0])
            st.commit(vt, tuple(energies[: cap.k]), energy, period, summed, digest=digest)
            if whiten and cold:  # its own memory: later steps overwrite the split basis's
                wt = xp.asarray(basis[:whiten, :], copy=True)
                _commit_whitening(st, wt, host[:whiten], energies[:whiten], energy)
            self._version += 1

        self._later(st, commit, kernels.row_sumsq(coef.T), verdict, basis)

    def _random_rows(self, xp: Any, rows: int, n: int) -> Any:
        """A cold start's basis: ``rows`` orthonormal rows drawn from the seed (the
        orthonormalization fills zero rows with them)."""
        return kernels.orthonormalize(xp.zeros((rows, n), dtype=xp.float32), self.seed)

    def _measure_whitening(self, st: KeyState, shard: Any, lo: int, rows: int) -> Rounds:
        """The whitening basis of ``rows`` rows: one subspace iteration on the
        result from the state's (COLD_ITERS from a fixed-seed random one, with
        OVERSAMPLE more rows, when it has none of that size). The allocation does
        not read it: the version stays."""
        self._settle()
        cap = st.map_shape
        xp = array_namespace(shard)
        cold = st.wt is None or st.wt.shape[0] != rows
        count = min(rows + OVERSAMPLE, min(cap.m, cap.n)) if cold else rows
        start = self._random_rows(xp, count, cap.n) if cold else st.wt
        total, coef = yield from self._iterate(shard, lo, cap, start, COLD_ITERS if cold else 1)
        energies, energy = kernels.column_sumsq(coef)[:rows], float(total[-1])
        if not (math.isfinite(energy) and all(map(math.isfinite, energies)) and energy > 0):
            return
        w = xp.reshape(total[: count * cap.n], (count, cap.n))[:rows, :]
        if bool(xp.all(xp.isfinite(w))):
            wt = kernels.orthonormalize(w, self.seed)
            _commit_whitening(st, wt, kernels.host_copy(wt), energies, energy)

    def _iterate(
        self, shard: Any, lo: int, cap: MapShape, vt: Any, iters: int
    ) -> Generator[Any, Any, tuple[Any, Any]]:
        """``iters`` subspace iterations on the result from the rows of ``vt``; each
        yields this rank's projection, then its accumulation (exact sums over the
        ranks, or its own totals alone). Returns the last iteration's summed
        accumulation (W (rows, n) flat, then ||S||^2) and the coefficients it
        accumulated, in the shard's namespace."""
        xp = array_namespace(shard)
        dims = MapShape(cap.m, cap.n, vt.shape[0])
        for it in range(iters):
            coef = xp.reshape(
                (yield xp.reshape(_projection(shard, lo, vt, dims), (-1,))), (cap.m, dims.k)
            )
            total = yield _accumulation(shard, lo, coef, dims)
            if it + 1 < iters:
                w = xp.reshape(total[: dims.k * dims.n], (dims.k, dims.n))
                vt = kernels.orthonormalize(w, self.seed)
        return total, coef

    # ---- state --------------------------------------------------------------------
    def _state_for(self, key: Any, dims: MapShape) -> KeyState:
        st = self._state.get(key)
        if st is None or st.map_shape != dims:
            st = self._state[key] = KeyState(dims, period=self.refresh_period)
            self._version += 1
        return st

    def state_checksum(self, key: Any = None) -> int:
        """CRC32 of one key's state (0 if it has none), or with key None of
        every key's, in key order; equal on ranks that agree."""
        if key is not None:
            st = self._state.get(key)
            if st is None:
                return 0
            if self._unsettled:
                self._settle(st)
            return st.crc
        self._settle()
        crc = 0
        for k in sorted(self._state, key=repr):
            crc = zlib.crc32(repr(k).encode() + self._state[k].crc.to_bytes(4, "little"), crc)
        return crc

    def _forget(self) -> None:
        self._unsettled.clear()
        self._queued.clear()
        self._state.clear()
        self._version += 1
        self._ranks = (-1, {})
        self._planned.clear()

    def state_info(self, key: Any) -> dict[str, Any] | None:
        """A copy of the state of ``key`` (None if it has none): ``shape``, ``k``,
        ``calls``, ``refreshed``, ``share``, ``energies``, ``total``, ``use``,
        ``period`` and the basis ``vt`` (NumPy)."""
        self._settle()
        st = self._state.get(key)
        return None if st is None else st.to_dict()

    def state_dict(self) -> dict[str, Any]:
        """Every key's state as NumPy arrays and plain values (for checkpoints)."""
        self._settle()
        return {
            "version": 1,
            "config": self.get_config(),
            "keys": [(k, st.to_dict()) for k, st in self._state.items()],
        }

    def load_state_dict(self, data: dict[str, Any], xp: Any = np) -> None:
        """Restore :meth:`state_dict` output; the basis goes to namespace ``xp``. All of
        it is checked before anything changes: a state this codec cannot take raises
        (TypeError for no dict, else ValueError) and leaves the codec as it was."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a GeoFP8 state is a dict, got {type(data).__name__}")
        if data.get("version") != 1:
            raise ValueError(f"unknown GeoFP8 state version {data.get('version')!r}")
        if data.get("config") != self.get_config():
            raise ValueError(
                f"state was saved by {data.get('config')}, this codec is {self.get_config()}"
            )
        try:
            state = {_key(k): KeyState.from_dict(v, xp) for k, v in data["keys"]}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed GeoFP8 state: {error!r}") from None
        self._unsettled.clear()
        self._state = state
        self._version += 1
        self._ranks = (-1, {})
        self._planned.clear()

    # ---- standalone frames ----------------------------------------------------------
    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        from geocomm.codecs.geo import frames

        return frames.body_size(self, shape)

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        from geocomm.codecs.geo import frames

        frames.encode_body(self, x, body)

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        from geocomm.codecs.geo import frames

        frames.decode_body(self, body, out)


def _commit_whitening(
    st: KeyState, wt: Any, host: np.ndarray, energies: Sequence[float], energy: float
) -> None:
    """The state's whitening basis ``wt`` (``host``: its NumPy copy), its energies and
    the bulk's mean energy per direction: what the result's energy ``energy`` leaves
    outside them, spread over the other min(m, n) - rows directions."""
    cap = st.map_shape
    rest = max(energy - sum(energies), 0.0)
    bulk = rest / max(min(cap.m, cap.n) - len(energies), 1)
    st.commit_whitening(wt, tuple(energies), bulk, host=host)


def _key(k: Any) -> Any:
    """Keys come back from JSON-like containers as lists: tuples again."""
    return tuple(_key(v) for v in k) if isinstance(k, list) else k


def _shard_rows(shard: Any, lo: int, dims: MapShape) -> slice:
    """The rows of the (m, n) matrix that this rank's shard [lo, lo + shard.size) touches."""
    r0 = lo // dims.n
    return slice(r0, r0 + kernels.rows(lo, shard.shape[0], dims.n))


def _projection(shard: Any, lo: int, vt: Any, dims: MapShape) -> Any:
    """This rank's part of S V (m, k): its shard's rows, zeros elsewhere; bfloat16
    values, as the side channel carries them."""
    xp = array_namespace(shard, vt)
    part = xp.zeros((dims.m, dims.k), dtype=xp.float32)
    if shard.shape[0]:
        part[_shard_rows(shard, lo, dims), :] = kernels.project(shard, lo, dims.n, vt)
    return kernels.round_bf16(part)


def _accumulation(shard: Any, lo: int, coef: Any, dims: MapShape) -> Any:
    """This rank's part of coef^T S (k, n) and of ||S||^2, flat: k n + 1 values,
    rounded to bfloat16 (they only steer the basis and the budget)."""
    xp = array_namespace(shard, coef)
    acc = xp.zeros((dims.k, dims.n), dtype=xp.float32)
    if shard.shape[0]:
        kernels.accumulate(shard, lo, dims.n, coef[_shard_rows(shard, lo, dims), :], acc)
    energy = kernels.row_sumsq_f32(xp.reshape(shard, (1, -1)))
    return kernels.round_bf16(xp.concat([xp.reshape(acc, (-1,)), energy]))


def _power_step(total: Any, old: Any, k: int, seed: int) -> tuple[Any, Any, Any]:
    """(basis, verdict, digest) of a power step from the summed accumulation ``total``
    (W of the k mapped rows, then the energy) of a key whose basis is ``old`` (cap, n):
    the orthonormal rows of W with old's unmapped rows carried along, the
    :func:`_verdict` that says whether the state takes them and the basis's
    :func:`~geocomm.codecs.geo.kernels.basis_hash` (what the state's checksum holds of
    it: the basis itself never comes to the host); in ``total``'s namespace. The call
    maps with the basis either way: any orthonormal basis maps exactly, and the
    orthonormalization reads non-finite sums as 0."""
    xp = array_namespace(total, old)
    cap, n = old.shape
    w = xp.reshape(total[: k * n], (k, n))
    rows = w if k == cap else xp.concat([w, old[k:, :]], axis=0)
    basis = kernels.orthonormalize(rows, seed)
    return basis, _verdict(total, basis[:k, :], old), kernels.basis_hash(basis)


def _verdict(total: Any, new: Any, old: Any) -> Any:
    """What decides a basis update, in the arrays' namespace (:func:`_outcome` reads
    it): float64 [E, S]. E is the energy, the last value of the summed accumulation
    ``total``: a non-finite or zero energy says nothing about the geometry. S is the
    squared overlap of ``new``'s rows with ``old``'s span, ||new old^T||_F^2
    (fixed-order kernels: every rank gets the same bits; 0 without ``old``)."""
    xp = array_namespace(total, new)
    overlap = xp.zeros((1,), dtype=xp.float64)
    if old is not None:
        coef = kernels.project(xp.reshape(new, (-1,)), 0, new.shape[1], old)
        overlap = kernels.row_sumsq(xp.reshape(coef, (1, -1)))
    return xp.concat([xp.astype(total[-1:], xp.float64), overlap])


def _outcome(verdict: np.ndarray, rows: int) -> tuple[bool, float, float]:
    """(ok, energy, overlap) from a :func:`_verdict` on the host: ok when the energy is
    finite and positive; the overlap as the mean share of each of the ``rows``
    compared rows that lies in the old span, in [0, 1]."""
    energy = float(verdict[0])
    return math.isfinite(energy) and energy > 0, energy, float(verdict[1]) / float(rows)


def _check_int(name: str, value: Any, low: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_float(name: str, value: Any, low: float, high: float) -> float:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value!r}")
    result: float = value
    return result


class GeoFP8Codec(GeoCodec):
    """GeoFP8: geometry map + ``FP8Codec(fmt, block, rounding, seed)``."""

    codec_id: ClassVar[str] = "geofp8"

    def __init__(
        self,
        fmt: str = "e4m3",
        block: int = 128,
        rounding: str = "nearest",
        seed: int = DEFAULTS["seed"],
        **knobs: Any,
    ):
        stochastic_seed = seed if rounding == "stochastic" else 0
        super().__init__(FP8Codec(fmt, block, rounding, stochastic_seed), seed=seed, **knobs)


class GeoNVFP4Codec(GeoCodec):
    """Geometry map + ``NVFP4Codec(rounding, seed)``."""

    codec_id: ClassVar[str] = "geonvfp4"

    def __init__(self, rounding: str = "nearest", seed: int = DEFAULTS["seed"], **knobs: Any):
        stochastic_seed = seed if rounding == "stochastic" else 0
        super().__init__(NVFP4Codec(rounding, stochastic_seed), seed=seed, **knobs)


class HadamardCodec(GeoCodec):
    """The random-rotation baseline: randomized Hadamard rows + ``FP8Codec(fmt, block)``."""

    codec_id: ClassVar[str] = "hadamard"
    _fields: ClassVar[tuple[str, ...]] = ("seed", "min_dim", "min_numel")

    def __init__(
        self,
        fmt: str = "e4m3",
        block: int = 128,
        seed: int = 0,
        min_dim: int = DEFAULTS["min_dim"],
        min_numel: int = DEFAULTS["min_numel"],
    ):
        super().__init__(
            FP8Codec(fmt, block),
            transform="hadamard",
            seed=seed,
            min_dim=min_dim,
            min_numel=min_numel,
        )
