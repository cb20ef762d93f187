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
    # NVFP4 blocks whose decoded scale is 0 (docs/design.md, "Formats"): inputs below
    "nvfp4_zero_scale": ({"id": "nvfp4"}, "float32", (7, 32)),
    "nvfp4_zero_scale_sr": (
        {"id": "nvfp4", "rounding": "stochastic", "seed": 5},
        "float32",
        (7, 32),
    ),
    "nvfp4_zero_superscale": ({"id": "nvfp4"}, "float32", (3, 16)),
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


def zero_scale_input(seed: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """NVFP4 blocks of scale code 0 among ordinary ones, in one superblock of amax
    3.4e38: 16-value blocks of values near 1e37 (non-zero scale codes), then block 1
    (small values and zeros of both signs beside values above 2^64, for which the
    old (x * 2^64) * 0 was NaN), block 2 (values 1e20 to 1e30 of both signs), block
    3 (negative zeros), block 4 (values near 1 of both signs) and blocks 5 and 6 on
    either side of the scale code 0 / 1 threshold (block amax 2^-10 and 2^-9 of the
    superblock's over 448)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(int(np.prod(shape))) * 1e37
    blocks = x.reshape(-1, 16)
    x[0] = 3.4e38
    blocks[1] = [1e25, -465, 57344, -1e21, -0.0, 1.0, -1e30, 0.0] * 2
    blocks[2] = rng.choice([-1, 1], 16) * 10.0 ** rng.uniform(20, 30, 16)
    blocks[3] = -0.0
    blocks[4] = rng.uniform(-2, 2, 16)
    for j, k in ((5, -10), (6, -9)):
        blocks[j] = rng.uniform(-1, 1, 16) * 3.4e38 * 2.0**k / 448
        blocks[j, 0] = 3.4e38 * 2.0**k / 448
    return x.astype(dtype).reshape(shape)


def zero_superscale_input(seed: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A superblock of fp32 subnormals of both signs (amax 2^-146), whose fp32
    superblock scale amax / 2688 is 0, and negative zeros."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = rng.choice([-1, 1], n) * rng.integers(0, 9, n) * 2.0**-149
    x[rng.choice(n, 4, replace=False)] = -0.0
    return x.astype(dtype).reshape(shape)


#: cases whose input is not make_input's
INPUTS = {
    "nvfp4_zero_scale": zero_scale_input,
    "nvfp4_zero_scale_sr": zero_scale_input,
    "nvfp4_zero_superscale": zero_superscale_input,
}


def main(names: list[str]) -> None:
    from geocomm import get_codec

    unknown = set(names) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {sorted(CASES)}")
    for seed, (name, (config, dtype, shape)) in enumerate(CASES.items()):
        if name not in names and (names or (HERE / f"{name}.bin").exists()):
            continue
        x = INPUTS.get(name, make_input)(seed, dtype, shape)
        frame = get_codec(config).encode(x)
        np.save(HERE / f"{name}.npy", x)
        (HERE / f"{name}.bin").write_bytes(frame.tobytes())
        np.save(HERE / f"{name}.decoded.npy", get_codec(config).decode(frame))
        print(f"{name}: {x.dtype}{list(x.shape)} -> {frame.size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
