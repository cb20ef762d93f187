"""The native codec's threads and vector loops change no byte.

gc_codec_threads splits a call on whole blocks (superblocks, groups) and
gc_codec_simd picks the AVX-512 loops or the portable ones: every
combination must write the bytes of one portable thread, on inputs with
every kind of block (non-finite values, zeros, tiny and huge amaxes, fp32
subnormals) and on lengths that end inside a block. The thread count comes
from GEOCOMM_CODEC_THREADS, else OMP_NUM_THREADS, else 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from geocomm.codecs import reference as ref
from geocomm.kernels import native

pytestmark = pytest.mark.skipif(not native.available, reason="native core not built")

CASES = [
    ("e4m3", 128),
    ("e5m2", 128),
    ("e4m3", 256),
    ("e5m2", 0),
    ("nvfp4", 0),
    ("bf16", 0),
    ("mxfp8_e4m3", 0),
    ("mxfp8_e5m2", 0),
    ("mxfp4", 0),
]
#: large enough for three threads (a thread gets at least 2^19 values), not a whole block
N = 3 * (1 << 19) + 4096 + 777


def varied(n: int, seed: int) -> np.ndarray:
    """Normal values with blocks of zeros, tiny and huge values, subnormals, inf and NaN."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[1000:1200] = 0.0
    x[5000:5300] *= np.float32(1e-35)
    x[9000:9100] = rng.integers(-(2**22), 2**22, 100).astype(np.int32).view(np.float32)
    x[20000:20500] *= np.float32(1e30)
    x[rng.integers(0, n, 40)] = np.inf
    x[rng.integers(0, n, 40)] = -np.inf
    x[rng.integers(0, n, 40)] = np.nan
    x[n - 50 :] *= np.float32(3e-3)
    return x


@pytest.fixture
def restore():
    level, count = native.simd(), native.threads()
    yield
    native.set_simd(level)
    native.set_threads(count)


def encode(fmt: str, x: np.ndarray, block: int, flags: int = 0) -> np.ndarray:
    wire = np.empty(native.wire_size(fmt, x.size, block), np.uint8)
    native.encode(fmt, x, block, wire, flags=flags, seed=5, rounding_stream=6, offset=7)
    return wire


def decode(fmt: str, wire: np.ndarray, block: int, n: int, acc: np.ndarray | None) -> np.ndarray:
    out = np.zeros(n, np.float32) if acc is None else acc.copy()
    native.decode(fmt, wire, block, out, accumulate=acc is not None)
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, any NaN matching any NaN."""
    nan = np.isnan(a)
    return bool(
        np.array_equal(nan, np.isnan(b))
        and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])
    )


@pytest.mark.parametrize("fmt,block", CASES)
def test_threads_and_simd_same_bytes(fmt, block, restore):
    x = varied(N, 11)
    garbage = np.random.default_rng(12).integers(
        0, 256, native.wire_size(fmt, N, block), dtype=np.uint8
    )
    acc = np.random.default_rng(13).standard_normal(N).astype(np.float32)
    flag_sets = [0, native.STOCHASTIC] + ([native.RCEIL] if fmt.startswith("mx") else [])
    native.set_simd("portable")
    native.set_threads(1)
    wires = [encode(fmt, x, block, f) for f in flag_sets]
    outs = [decode(fmt, w, block, N, a) for w in (wires[0], garbage) for a in (None, acc)]
    for level in ("portable", "auto"):
        for count in (1, 2, 3):
            native.set_simd(level)
            native.set_threads(count)
            for f, want in zip(flag_sets, wires, strict=True):
                assert np.array_equal(encode(fmt, x, block, f), want), (level, count, f)
            got = [decode(fmt, w, block, N, a) for w in (wires[0], garbage) for a in (None, acc)]
            for g, want in zip(got, outs, strict=True):
                assert same(g, want), (level, count)


@pytest.mark.parametrize("fmt,block", CASES)
@pytest.mark.parametrize("n", [1, 15, 16, 33, 4095, 4096, 4097, 70001])
def test_vector_loops_match_reference(fmt, block, n, restore):
    native.set_simd("auto")
    x = varied(max(n, 30000), n)[:n]
    wire = encode(fmt, x, block)
    assert np.array_equal(wire, ref.encode(fmt, x, block))
    with np.errstate(invalid="ignore"):
        want = ref.decode(fmt, wire, n, block)
    assert same(decode(fmt, wire, block, n, None), want)


def test_unaligned_output_streams_the_same_values(restore):
    """A large decode writes whole cache lines around the cache; out need not start on one."""
    native.set_simd("auto")
    n = (3 << 20) + 5
    x = varied(n, 3)
    wire = encode("e4m3", x, 128)
    want = ref.decode("e4m3", wire, n, 128)
    buf = np.zeros(n + 16, np.float32)
    for skip in (0, 1, 3, 9):
        out = buf[skip : skip + n]
        native.decode("e4m3", wire, 128, out)
        assert same(out, want), skip


def decode_onto(fmt: str, wire: np.ndarray, block: int, base: np.ndarray, out: np.ndarray):
    native.decode_onto(fmt, wire, block, base, out)
    return out


@pytest.mark.parametrize("fmt,block", CASES)
def test_decode_onto_is_a_copy_then_an_accumulating_decode(fmt, block, restore):
    """out = base + decode(wire) in one pass: the bits of copying base into out and
    decoding with accumulate (each value is one fp32 addition), on every path (the
    vector loop's L1 tiles and streamed sink, the copy-and-accumulate tiles), thread
    split, alignment of out, wires from real inputs and arbitrary bytes, and base
    being out itself (the accumulating decode)."""
    n = N + 3  # not a whole vector: the vector loop's scalar tail
    x = varied(n, 21)
    garbage = np.random.default_rng(22).integers(
        0, 256, native.wire_size(fmt, n, block), dtype=np.uint8
    )
    rng = np.random.default_rng(23)
    buf = rng.standard_normal(n + 16).astype(np.float32)
    space = np.empty(n + 16, np.float32)
    native.set_simd("portable")
    native.set_threads(1)
    wires = [encode(fmt, x, block), garbage]
    for level in ("portable", "auto"):
        for count in (1, 3):
            native.set_simd(level)
            native.set_threads(count)
            for wire in wires:
                for skip in (0, 5):
                    base = buf[skip + 1 : skip + 1 + n]  # never where out starts
                    want = decode(fmt, wire, block, n, base)
                    got = decode_onto(fmt, wire, block, base, space[skip : skip + n])
                    assert same(got, want), (level, count, skip)
                    inplace = base.copy()
                    assert same(decode_onto(fmt, wire, block, inplace, inplace), want)


def test_decode_onto_refuses_a_base_that_overlaps_out():
    wire = encode("e4m3", np.ones(64, np.float32), 0)
    buf = np.zeros(70, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        native.decode_onto("e4m3", wire, 0, buf[1:65], buf[:64])
    with pytest.raises(ValueError, match="holds 63 values"):
        native.decode_onto("e4m3", wire, 0, buf[:63], np.zeros(64, np.float32))
    with pytest.raises(TypeError, match="base"):
        native.decode_onto("e4m3", wire, 0, buf[:128:2], np.zeros(64, np.float32))


def test_thread_count_from_environment():
    assert native.threads_from_env({}) == 1
    assert native.threads_from_env({"OMP_NUM_THREADS": "3"}) == 3
    assert native.threads_from_env({"OMP_NUM_THREADS": "4,2"}) == 4
    assert native.threads_from_env({"OMP_NUM_THREADS": "x"}) == 1
    assert native.threads_from_env({"OMP_NUM_THREADS": "3", "GEOCOMM_CODEC_THREADS": "2"}) == 2
    with pytest.raises(ValueError):
        native.threads_from_env({"GEOCOMM_CODEC_THREADS": "0"})
    env = {k: v for k, v in os.environ.items() if k not in native.THREAD_VARIABLES}
    code = "from geocomm.kernels import native; print(native.threads())"
    # beyond the C core's GC_MAX_THREADS, clamped before C's int (import raised)
    assert native.threads_from_env({"OMP_NUM_THREADS": "99999999999"}) == native.MAX_THREADS
    header = (Path(__file__).parents[2] / "native" / "geocomm.h").read_text()
    assert f"#define GC_MAX_THREADS {native.MAX_THREADS}\n" in header
    for extra, want in (
        ({}, "1"),
        ({"OMP_NUM_THREADS": "2"}, "2"),
        ({"OMP_NUM_THREADS": "2", "GEOCOMM_CODEC_THREADS": "5"}, "5"),
        ({"GEOCOMM_CODEC_THREADS": "2147483648"}, str(native.MAX_THREADS)),
    ):
        got = subprocess.run(
            [sys.executable, "-P", "-c", code],
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert got == want, extra


def test_bad_settings_raise(restore):
    assert native.set_threads(2**40) == native.MAX_THREADS  # clamped, not OverflowError
    with pytest.raises(ValueError):
        native.set_threads(0)
    with pytest.raises(ValueError):
        native.set_simd("avx9")
    assert native.set_simd("portable") == "portable"
    assert native.set_simd("auto") in native.SIMD_LEVELS
