"""GPU check of the MX kernels, stochastic rounding and the fp8 launch plan.

    python -P tests/jobs/gpu_formats_check.py

For every format (fp8 E4M3/E5M2 with team, tile and huge blocks, NVFP4,
BF16, MXFP8 E4M3/E5M2, MXFP4 with floor and rceil), rounding to nearest and
stochastically (several seeds, streams, offsets), and lengths from 0 up to
~1M, the CuPy kernels must write the native C core's wire bytes and decode
(and decode onto) its values bit for bit (NaN payloads exempt: only NaN
positions must agree). Complements perf/gpu_check.py, which covers the
original formats with rounding to nearest. Exit status: 0 all equal, 1 a
mismatch, 2 no CuPy/GPU.
"""

from __future__ import annotations

import sys

import numpy as np

from geocomm.kernels import cuda, native

F32 = np.float32
LENGTHS = (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 4097, (1 << 20) + 3)


def inputs(n: int, rng: np.random.Generator) -> np.ndarray:
    """Wide dynamic range per 32-value block, with specials and fp32 extremes."""
    x = rng.standard_normal(n) * np.exp2(np.repeat(rng.integers(-140, 120, -(-n // 32)), 32)[:n])
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.3e38, 1e-45, 448.0, 465.0, 6.0]
    k = min(n, len(edges))
    x[rng.choice(n, k, replace=False)] = edges[:k]
    return x.astype(F32)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(b)
    return bool(
        np.array_equal(np.isnan(a), nan)
        and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])
    )


def check(cp, name: str, fmt: int, block: int, x: np.ndarray, options: dict) -> list[str]:
    n = x.size
    wire = np.empty(native.wire_size(fmt, n, block), np.uint8)
    native.encode(fmt, x, block, wire, **options)
    x_dev = cp.asarray(x)
    wire_dev = cp.full(wire.size, 0xAB, cp.uint8)
    cuda.encode(fmt, x_dev, block, wire_dev, **options)
    problems = []
    if not np.array_equal(cp.asnumpy(wire_dev), wire):
        problems.append(f"{name} n={n} {options}: encode bytes differ")
    out = np.empty(n, F32)
    native.decode(fmt, wire, block, out)
    out_dev = cp.empty(n, cp.float32)
    cuda.decode(fmt, cp.asarray(wire), block, out_dev)
    if not same_values(cp.asnumpy(out_dev), out):
        problems.append(f"{name} n={n}: decode differs")
    onto = np.linspace(-1, 1, n, dtype=F32)
    acc, acc_dev = onto.copy(), cp.asarray(onto)
    native.decode(fmt, wire, block, acc, accumulate=True)
    cuda.decode(fmt, cp.asarray(wire), block, acc_dev, accumulate=True)
    if not same_values(cp.asnumpy(acc_dev), acc):
        problems.append(f"{name} n={n}: decode+accumulate differs")
    return problems


def main() -> int:
    if not cuda.available:
        print("gpu_formats_check: no CuPy or no GPU", file=sys.stderr)
        return 2
    cp = cuda.require()
    rng = np.random.default_rng(20261129)
    cases = [
        (f"{name} b{b}", native.FORMATS[name], b)
        for name in ("e4m3", "e5m2")
        for b in (0, 1, 16, 128, 3000, 2**30, 2**48)
    ]
    cases += [
        (name, native.FORMATS[name], 0)
        for name in ("nvfp4", "bf16", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")
    ]
    keys = [
        {"seed": 0, "rounding_stream": 0, "offset": 0},
        {"seed": 2**64 - 1, "rounding_stream": 12345, "offset": 2**64 - 7},
        {"seed": 7, "rounding_stream": 3, "offset": 10**9},
    ]
    problems, runs = [], 0
    for name, fmt, block in cases:
        rules = (0, native.RCEIL) if fmt in native.MX_FORMATS else (0,)
        for n in LENGTHS:
            x = inputs(n, rng)
            for rule in rules:
                problems += check(cp, name, fmt, block, x, {"flags": rule})
                for key in keys:
                    problems += check(
                        cp, name, fmt, block, x, {"flags": rule | native.STOCHASTIC, **key}
                    )
                runs += 1 + len(keys)
    for line in problems[:50]:
        print(line)
    print(f"gpu_formats_check: {runs} encodes, {len(problems)} mismatches")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
