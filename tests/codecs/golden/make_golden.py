"""Write the golden frames that tests/codecs/test_frames.py compares against.

Run from anywhere: ``python tests/codecs/golden/make_golden.py [NAME ...]``. For
each named case (without names: each case that has no ``.bin`` yet, so adding
a case never rewrites the existing ones) it writes, next to this script,
``<name>.npy`` (the input), ``<name>.bin`` (the frame
``get_codec(config).encode(input)``) and ``<name>.decoded.npy`` (what decoding
that frame gives). The test re-encodes the input and demands the same bytes,
so any change of the frame layout, the wire bodies, the rounding or the
stochastic rounding's random bits fails loudly. Regenerate only for a
deliberate format change, and bump ``FRAME_VERSION`` with it.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

# name: (codec config, input dtype, input shape); the dtypes exercise the
# frame's dtype codes, the odd shapes partial FP8 and NVFP4 blocks.
CASES: dict[str, tuple[dict, str, tuple[int, ...]]] = {
    "none": ({"id": "none"}, "float32", (3, 41)),
    "bf16": ({"id": "bf16"}, "float16", (130,)),
    "fp8_e4m3_b128": ({"id": "fp8", "fmt": "e4m3", "block": 128}, "float32", (5, 67)),
    "fp8_e5m2_b0": ({"id": "fp8", "fmt": "e5m2", "block": 0}, "float64", (2, 3, 29)),
    "nvfp4": ({"id": "nvfp4"}, "float32", (7, 21)),
    "mxfp8_e4m3": ({"id": "mxfp8", "fmt": "e4m3", "scale_rule": "floor"}, "float32", (3, 45)),
    "mxfp8_e5m2_rceil": ({"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"}, "float16", (70,)),
    "mxfp4": ({"id": "mxfp4", "scale_rule": "floor"}, "float32", (5, 27)),
    # stochastic rounding: these pin the random bits (seed, stream 0, offset 0) as well
    "fp8_e4m3_b128_sr": (
        {"id": "fp8", "fmt": "e4m3", "block": 128, "rounding": "stochastic", "seed": 42},
        "float32",
        (5, 67),
    ),
    "nvfp4_sr": ({"id": "nvfp4", "rounding": "stochastic", "seed": 7}, "float32", (7, 21)),
    "bf16_sr": ({"id": "bf16", "rounding": "stochastic", "seed": 2**64 - 1}, "float32", (130,)),
    "mxfp4_sr": (
        {"id": "mxfp4", "scale_rule": "rceil", "rounding": "stochastic", "seed": 3},
        "float32",
        (5, 27),
    ),
}


def make_input(seed: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Gaussians over 16 binades plus fixed edge values (+-0, tiny, 448, inf, NaN)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = rng.standard_normal(n) * np.exp2(rng.integers(-8, 8, n))
    edges = [0.0, -0.0, 1e-40, 448.0, -464.0, 2.0**-9, np.inf, np.nan]
    positions = rng.choice(n, len(edges), replace=False)
    x[positions] = edges
    return x.astype(dtype).reshape(shape)


def main(names: list[str]) -> None:
    from geocomm import get_codec

    unknown = set(names) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {sorted(CASES)}")
    for seed, (name, (config, dtype, shape)) in enumerate(CASES.items()):
        if name not in names and (names or (HERE / f"{name}.bin").exists()):
            continue
        x = make_input(seed, dtype, shape)
        frame = get_codec(config).encode(x)
        np.save(HERE / f"{name}.npy", x)
        (HERE / f"{name}.bin").write_bytes(frame.tobytes())
        np.save(HERE / f"{name}.decoded.npy", get_codec(config).decode(frame))
        print(f"{name}: {x.dtype}{list(x.shape)} -> {frame.size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
