"""perf/gpu_check.py's shared parts: the size profiles, the inputs and the comparisons.

Imports NumPy only (geocomm and CuPy are imported by the sections when they
run), so ``gpu_check.py --twin`` can still put the CuPy twin first on
``sys.path`` after importing this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

F32 = np.float32
#: team kernel up to TEAM_MAX = 1024 values per block, tile kernel above;
#: tiles of TILE = 4096 values, so blocks > 4096 span several tiles
FP8_BLOCKS = (0, 1, 16, 31, 32, 33, 128, 1000, 1024, 1025, 3000, 4096, 4097, 3 * 4096 + 5, 50_000)
ODD_SIZES = (
    0,
    1,
    2,
    15,
    16,
    17,
    31,
    33,
    127,
    129,
    1000,
    1023,
    1024,
    1025,
    4095,
    4097,
    8193,
    12_299,
)
#: inputs up to this size are also compared with the (slow) NumPy reference
REFERENCE_MAX_N = 70_000
EDGES = np.array(
    [
        0.0,
        -0.0,
        448.0,
        -448.0,
        464.0,
        465.0,
        -465.0,
        480.0,
        57344.0,
        61440.0,
        -61441.0,
        6.0,
        5.0,
        0.25,
        1e-45,
        -3e-39,
        1e-40,
        2.0**-100,
        2.0**-126,
        2.0**-149,
        3.4e38,
        -3.4e38,
        np.inf,
        -np.inf,
        np.nan,
        -np.nan,
    ],
    F32,
)


@dataclass(frozen=True)
class Sizes:
    """The sizes of one profile (gpu_check.py's docstring lists both)."""

    wide: int  # bytes: the wide-range input
    edges: int  # bytes: edge values (also the batched kernels' source)
    bits: int  # bytes: random bit patterns
    tiny: int  # bytes: subnormal values with all-zero blocks
    big: int  # bytes: the big input (0: none)
    collective_n: int  # collectives: values per rank
    stage_size: int  # collectives: pipeline stage (values), so many stages
    lockstep_n: int  # collectives: values per loopback rank
    geo_shape: tuple[int, int]  # geofp8: the matrix of each all-reduce
    geo_steps: int  # geofp8: all-reduces in the sequence (basis refreshed every 4)
    timing_mib: tuple[float, ...]  # timing: MiB of fp32 per timed call
    timing_calls: int  # timing: calls per measurement


PROFILES = {
    # a real GPU: what the sections have always used
    "gpu": Sizes(
        wide=1_000_003,
        edges=65_537,
        bits=262_147,
        tiny=100_003,
        big=5_000_017,
        collective_n=100_003,
        stage_size=4096,
        lockstep_n=60_007,
        geo_shape=(2048, 4096),
        geo_steps=6,
        timing_mib=(64, 256),
        timing_calls=10,
    ),
    # the CPU twin of CuPy (tests/twin): the same formats, blocks, walks and ragged
    # sizes; fewer values where only the count was large
    "twin": Sizes(
        wide=200_003,
        edges=65_537,
        bits=65_539,
        tiny=30_011,
        big=500_009,
        collective_n=60_013,
        stage_size=4096,
        lockstep_n=20_011,
        geo_shape=(512, 1024),
        geo_steps=6,
        timing_mib=(1,),
        timing_calls=2,
    ),
}


# ---------------------------------------------------------------------------
# inputs


def wide(rng: np.random.Generator, n: int, lo: int = -60, hi: int = 60) -> np.ndarray:
    """Random signs and mantissas over 2^lo .. 2^hi."""
    mant = rng.uniform(1.0, 2.0, n)
    sign = rng.choice([-1.0, 1.0], n)
    return (sign * mant * np.exp2(rng.integers(lo, hi, n))).astype(F32)


def cases(
    rng: np.random.Generator, sizes: Sizes = PROFILES["gpu"], big: int | None = None
) -> list[tuple[str, np.ndarray]]:
    """(name, float32 input) for the bytes section; ``big``: the big input's size
    (default the profile's; 0: none)."""
    big = sizes.big if big is None else big
    out = [("wide", wide(rng, sizes.wide))]
    scale = rng.choice(np.array([1.0, 2.0**-20, 2.0**-130], F32), sizes.edges)
    out.append(("edges", (rng.choice(EDGES, sizes.edges) * scale).astype(F32)))
    out.append(
        ("bits", rng.integers(0, 2**32, sizes.bits, dtype=np.uint64).astype(np.uint32).view(F32))
    )
    tiny = wide(rng, sizes.tiny, -149, -120)
    tiny[(np.arange(tiny.size) // 40) % 3 == 0] = 0.0  # all-zero blocks among subnormal ones
    out.append(("tiny", tiny))
    out += [(f"n={n}", wide(rng, n)) for n in ODD_SIZES]
    if big:
        out.append(("big", wide(rng, big, -20, 20)))
    return out


def configs() -> list[tuple[str, int]]:
    return [(f, b) for f in ("e4m3", "e5m2") for b in FP8_BLOCKS] + [("nvfp4", 0), ("bf16", 0)]


def gradient(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Gradient-like float32 values: a rank-4 signal plus noise (anisotropic, as
    GeoFP8 expects), scaled to typical gradient magnitudes."""
    m = shape[0]
    n = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    signal = rng.standard_normal((m, 4)) @ rng.standard_normal((4, n)) * 3.0
    return ((signal + rng.standard_normal((m, n))) * 1e-3).astype(F32).reshape(shape)


# ---------------------------------------------------------------------------
# comparisons


def byte_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Byte equality of two uint8 arrays."""
    if a.shape != b.shape:
        return {"equal": False, "why": f"shapes {a.shape} != {b.shape}"}
    bad = np.flatnonzero(a != b)
    return {
        "equal": bad.size == 0,
        "mismatches": int(bad.size),
        **(
            {"first": int(bad[0]), "got": int(a.flat[bad[0]]), "want": int(b.flat[bad[0]])}
            if bad.size
            else {}
        ),
    }


def value_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Bit equality of two float arrays of one dtype (float32, float16 or
    ml_dtypes bfloat16), any NaN equal to any NaN (GPU arithmetic returns the
    canonical NaN, the C core may keep a payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal": False, "why": f"{a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"}
    uint = np.dtype(f"u{a.dtype.itemsize}")
    wa, wb = a.astype(F32).ravel(), b.astype(F32).ravel()  # exact for all three dtypes
    both_nan = np.isnan(wa) & np.isnan(wb)
    bad = np.flatnonzero((a.view(uint).ravel() != b.view(uint).ravel()) & ~both_nan)
    return {
        "equal": bad.size == 0,
        "mismatches": int(bad.size),
        **(
            {"first": int(bad[0]), "got": float(wa[bad[0]]), "want": float(wb[bad[0]])}
            if bad.size
            else {}
        ),
    }


def all_equal(row: dict[str, Any]) -> bool:
    """Every comparison in ``row`` (values that are dicts with "equal") holds."""
    diffs = [v for v in row.values() if isinstance(v, dict) and "equal" in v]
    return bool(diffs) and all(d["equal"] for d in diffs)


def digest(a: np.ndarray | None) -> str | None:
    """A checksum of a host array's bits, NaN payloads made canonical (what the
    ranks compare to show they hold the same result); None stays None."""
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        nan = np.isnan(a.astype(F32))
        if nan.any():
            a = a.copy()
            a[nan] = np.nan
    return hashlib.sha256(a.dtype.name.encode() + str(a.shape).encode() + a.tobytes()).hexdigest()[
        :16
    ]


def after_current(cp: Any, stream: Any) -> None:
    """Order ``stream`` after the work queued on the current stream (the
    copies that filled its inputs): a non-blocking stream does not wait for
    the legacy default stream by itself."""
    if stream is not None:
        stream.wait_event(cp.cuda.get_current_stream().record())
