"""GeoFP8's model-wide side budget and its cold start (docs/design.md, "GeoFP8").

:func:`geocomm.codecs.geo.policy.allocate` gives every key a rank from the
spectra the states track, under one cap on side bytes; the codec maps each
key with the rank it got, every rank alike, and the choice is part of the
state checksum. The cold start measures a basis from a key's first result.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_geometry import exact_sum, rel
from test_geometry import rank_inputs as spiked_inputs

from geocomm.codecs import get_codec
from geocomm.codecs.geo.policy import (
    STABLE_OVERLAP,
    MapShape,
    Spectrum,
    allocate,
    direction_bytes,
    next_period,
)
from geocomm.testing import simulate_allreduce


def spectrum(m: int, n: int, k: int, decay: float, total: float = 1.0) -> Spectrum:
    """A key whose energies fall by ``decay`` per direction, ``total`` its energy."""
    energies = tuple(total * (1 - decay) * decay**j for j in range(k))
    return Spectrum(MapShape(m, n, k), energies, total, m * n)


def spent(spectra: dict, ranks: dict, refresh: int) -> float:
    return sum(ranks[key] * direction_bytes(sp.dims, refresh) for key, sp in spectra.items())


def test_allocation_keeps_the_cap_and_prefers_steep_spectra():
    spectra = {
        "steep": spectrum(256, 256, 12, 0.5),
        "slow": spectrum(256, 256, 12, 0.95),
        "big": spectrum(1024, 1024, 12, 0.7, total=4.0),
    }
    payload = sum(sp.payload for sp in spectra.values())
    for budget in (0.01, 0.05, 0.2):
        ranks = allocate(spectra, budget, 0.0)
        # the greedy never takes a direction that would cross the cap
        assert spent(spectra, ranks, 1) <= budget * payload
        assert all(0 <= ranks[key] <= sp.dims.k for key, sp in spectra.items())
    # room for one 256-wide direction: the steep spectrum's first promises the most
    one = direction_bytes(spectra["steep"].dims, 1) / payload
    assert allocate(spectra, 1.5 * one, 0.0) == {"steep": 1, "slow": 0, "big": 0}
    ranks = allocate(spectra, 0.05, 0.0)
    # the steep key's directions fall by 2x each: past its first few the slow key's
    # (5% of its energy each, at the same cost) promise more, and get the bytes
    assert 1 <= ranks["steep"] < ranks["slow"]
    # no cap: every key gets its cap
    assert allocate(spectra, math.inf, 0.0) == {key: 12 for key in spectra}
    # a pure function of the spectra: the order keys arrive in does not matter
    assert allocate(dict(reversed(list(spectra.items()))), 0.05, 0.0) == ranks


def test_flat_spectra_stay_plain():
    flat = Spectrum(MapShape(256, 256, 12), (1.0 / 256,) * 12, 1.0, 256 * 256)
    # a top-12 share of 12/256 beats a flat spectrum's 12/256 by nothing
    assert allocate({"flat": flat}, math.inf, 0.2) == {"flat": 0}


def layered(m: int, n: int, decay: float, seed: int) -> np.ndarray:
    """A matrix with singular values decay**j (every direction present)."""
    rng = np.random.default_rng([seed, m, n])
    u = np.linalg.qr(rng.standard_normal((m, min(m, n))))[0]
    v = np.linalg.qr(rng.standard_normal((n, min(m, n))))[0]
    return ((u * decay ** np.arange(min(m, n))) @ v.T).astype(np.float32)


def rank_inputs(size: int, step: int) -> list[np.ndarray]:
    """Two keys' worth of inputs per rank: a steep key and a slowly decaying one."""
    base = {"steep": layered(128, 96, 0.6, 1), "slow": layered(128, 96, 0.9, 2)}
    noise = np.random.default_rng([step]).standard_normal((size, 128, 96)).astype(np.float32)
    return [{k: v + 0.01 * noise[r] for k, v in base.items()} for r in range(size)]


def test_ranks_choose_alike_and_the_choice_is_in_the_checksum():
    size = 2
    knobs = {"min_dim": 8, "min_numel": 0}
    tight = [get_codec("geofp8", side_budget=0.05, **knobs) for _ in range(size)]
    loose = [get_codec("geofp8", side_budget=math.inf, **knobs) for _ in range(size)]
    for step in range(4):
        xs = rank_inputs(size, step)
        for key in ("steep", "slow"):
            a = simulate_allreduce(tight, [x[key] for x in xs], key=key)
            b = simulate_allreduce(loose, [x[key] for x in xs], key=key)
            if step:  # after the cold start both map: each below plain fp8's error
                want = exact_sum([x[key] for x in xs])
                plain = simulate_allreduce([get_codec("fp8")] * size, [x[key] for x in xs])
                assert rel(b, want) < rel(plain, want)
                assert rel(a, want) <= rel(plain, want)
    assert tight[0].state_checksum() == tight[1].state_checksum()
    uses = {key: tight[0].state_info(key)["use"] for key in ("steep", "slow")}
    cap = tight[0].state_info("steep")["k"]
    assert all(loose[0].state_info(key)["use"] == cap for key in uses)
    assert sum(uses.values()) < 2 * cap  # the budget binds on these small keys
    # the same bases and spectra with another choice give another checksum
    other = get_codec("geofp8", side_budget=0.05, **knobs)
    data = tight[0].state_dict()
    other.load_state_dict(data)
    assert other.state_checksum() == tight[0].state_checksum()
    for key, st in data["keys"]:
        st["use"] += key == "steep"
    other.load_state_dict(data)
    assert other.state_checksum() != tight[0].state_checksum()


def test_cold_start_finds_the_top_directions_from_one_result():
    """Subspace iteration of p = k + 8 rows converges like (s_{p+1} / s_k)^(2 iters):
    here 0.8^(9 * 6) ~ 6e-6, so the first result's basis holds the top-k energy
    to within 1% of the SVD's (two plain power steps from k rows: 0.8^4 ~ 0.4)."""
    k = 8
    x = layered(256, 192, 0.8, 3)
    codec = get_codec("geofp8", k=k, min_dim=8, min_numel=0, side_budget=math.inf)
    simulate_allreduce([codec], [x], key="w")
    vt = codec.state_info("w")["vt"]
    got = float(np.sum((x.astype(np.float64) @ vt.T.astype(np.float64)) ** 2))
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    assert got >= 0.99 * float(np.sum(s[:k] ** 2))


def test_next_period_doubles_while_the_geometry_stands_and_drops_when_it_turns():
    assert next_period(1, STABLE_OVERLAP, 1, 8) == 2
    assert next_period(4, 0.99, 1, 8) == 8
    assert next_period(8, 1.0, 1, 8) == 8  # never beyond refresh_max
    assert next_period(8, STABLE_OVERLAP - 1e-3, 2, 8) == 2  # back to refresh


def refresh_calls(codec: object, inputs: list) -> list[int]:
    """The calls (1-based) after which the key's basis was refreshed."""
    calls = []
    for call, x in enumerate(inputs, 1):
        simulate_allreduce([codec], [x], key="w")
        if codec.state_info("w")["refreshed"] == call:
            calls.append(call)
    return calls


def test_the_refresh_period_adapts_to_how_fast_the_geometry_turns():
    """A fixed matrix keeps its basis (overlap ~ 1 at every refresh), so the
    period doubles from 1 to refresh_max = 8: refreshes at calls 1 (the cold
    start), 2, 4, 8, 16, 24. A matrix whose top directions are new at every
    call (random rank-4 signal over weak noise: a fresh basis shares ~4/96 of
    its span with the old one) turns at every refresh, so the period stays 1."""
    knobs = {"min_dim": 8, "min_numel": 0, "side_budget": math.inf, "k": 4}
    still = layered(128, 96, 0.6, 5)
    got = refresh_calls(get_codec("geofp8", **knobs), [still] * 24)
    assert got == [1, 2, 4, 8, 16, 24]
    rng = np.random.default_rng(7)
    turning = [
        (rng.standard_normal((128, 4)) @ rng.standard_normal((4, 96))).astype(np.float32)
        + 0.01 * rng.standard_normal((128, 96)).astype(np.float32)
        for _ in range(12)
    ]
    codec = get_codec("geofp8", **knobs)
    assert refresh_calls(codec, turning) == list(range(1, 13))
    assert codec.state_info("w")["period"] == 1
    # fixed periods stay fixed: refresh_max = refresh
    assert refresh_calls(get_codec("geofp8", refresh=4, refresh_max=4, **knobs), [still] * 12) == [
        1,
        5,
        9,
    ]


def test_the_period_is_state_every_rank_checks_and_a_checkpoint_keeps():
    knobs = {"min_dim": 8, "min_numel": 0, "side_budget": math.inf}
    codec = get_codec("geofp8", **knobs)
    still = layered(128, 96, 0.6, 5)
    for _ in range(5):
        simulate_allreduce([codec], [still], key="w")
    data = codec.state_dict()
    other = get_codec("geofp8", **knobs)
    other.load_state_dict(data)
    assert other.state_info("w")["period"] == codec.state_info("w")["period"] == 4
    assert other.state_checksum() == codec.state_checksum()
    for _, st in data["keys"]:
        st["period"] = 2
    other.load_state_dict(data)
    assert other.state_checksum() != codec.state_checksum()


def test_the_budget_charges_the_power_steps_and_the_re_measures_that_travel():
    """A mapped direction costs its m bfloat16 coefficients every call and its
    n-value power-step sum every period calls (the step sums over ranks in an
    all-reduce as in a reduce-scatter); a flat key's re-measure costs
    k (m + n) values a period only where it sums (a reduce-scatter: an
    all-reduce measures from the whole result on every rank)."""
    dims = MapShape(256, 1024, 8)
    assert direction_bytes(dims, 1) == 2 * (256 + 1024)
    assert direction_bytes(dims, 4) == 2 * (256 + 1024 / 4)
    payload = 10 * 256
    energies = (0.5, 0.2, 0.1, 0.05)
    every_call = {"w": Spectrum(dims, energies, 1.0, payload, period=1)}
    every_4th = {"w": Spectrum(dims, energies, 1.0, payload, period=4)}
    # room for three directions' coefficients: none once every call's step sum
    # counts, one when the step comes every 4th call (2 (256 + 256) bytes)
    room = 3 * 2 * 256 / payload
    assert allocate(every_call, room, 0.0) == {"w": 0}
    assert allocate(every_4th, room, 0.0) == {"w": 1}
    # a flat key (share 0.08, a flat spectrum's 8 / 256 + less than 0.2) stays plain,
    # and its re-measure takes the room only where it sums
    one = direction_bytes(dims, 4) / (2 * payload)
    for summed, want in ((False, 1), (True, 0)):
        flat = Spectrum(dims, (0.01,) * 8, 1.0, payload, period=4, summed=summed)
        assert allocate({**every_4th, "z": flat}, one, 0.2) == {"w": want, "z": 0}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transform", ["split", "whiten"])
def test_an_allreduce_sends_the_coefficients_and_the_power_steps(comm, transform):
    """Over MPI: a fresh key's first all-reduce (the cold start's three subspace
    iterations on the whole result, on every rank alone) sends exactly FP8's
    bytes; every later one FP8's plus the power step's sums (use n + 1 values)
    and the coefficients with their column energies ((m + 1) use), bfloat16
    all-gathers (2 bytes a value to each peer). The whitening sends nothing
    more: every rank measures its basis from the whole result alone. The state
    says whether its last basis update summed."""
    import geocomm
    from geocomm.testing import MeteredComm

    size, rank = comm.size, comm.rank
    metered = MeteredComm(comm)
    # steps every call
    geo = get_codec("geofp8", min_dim=8, min_numel=0, refresh_max=1, transform=transform)
    fp8 = get_codec("fp8")
    m, n = 96, 80
    for step in range(4):
        x = spiked_inputs(size, m, n, step, noise=0.05)[rank]
        metered.reset()
        geocomm.allreduce(x, codec=fp8, comm=metered, check=False)
        plain = metered.sent
        metered.reset()
        geocomm.allreduce(x, codec=geo, key="w", comm=metered, check=False)
        st = geo.state_info("w")
        use = st["use"]
        side = 0 if step == 0 else 2 * ((m + 1) * use + use * n + 1) * (size - 1)
        assert step == 0 or use > 0
        assert metered.sent == plain + side, step
        assert st["refreshed"] == step + 1 and st["summed"] is (step > 0)
        assert (st["wt"] is not None) is (transform == "whiten")
    rs = get_codec("geofp8", min_dim=8, min_numel=0)
    geocomm.reduce_scatter(spiked_inputs(size, m, n, 0)[rank], codec=rs, key="w", check=False)
    assert rs.state_info("w")["summed"] is True


@pytest.mark.mpi(min_size=2)
def test_ranks_is_a_reader_one_rank_may_call_anywhere(comm):
    """GeoCodec.ranks() on one rank, in the middle of a round of calls, changes no
    bit: a round's allocation is made by its first call, on every rank alike. Before,
    ranks() kept the allocation it made, from states where the round's later keys
    were not measured yet, and that rank alone planned the next round with it: the
    ranks' side channels differed and MPI failed (MPI_ERR_TRUNCATE)."""
    import geocomm

    shapes = {"a": (64, 96), "b": (96, 64), "c": (48, 80)}

    def run(read: bool) -> list[np.ndarray]:
        codec = get_codec("geofp8", min_dim=8, min_numel=0)
        results = []
        for step in range(4):
            for i, (key, (m, n)) in enumerate(shapes.items()):
                x = spiked_inputs(comm.size, m, n, 10 * step + i, noise=0.05)[comm.rank]
                results.append(geocomm.allreduce(x, codec=codec, key=key))
                if read and comm.rank == 0 and key == "b":
                    codec.ranks()
        return results

    for plain, read in zip(run(False), run(True), strict=True):
        np.testing.assert_array_equal(plain, read)
