"""The C core computes in IEEE 754's default mode whatever mode the caller set.

A process may flush subnormals (flush-to-zero and denormals-are-zero:
``torch.set_flush_denormal(True)``, or a library linked with -ffast-math);
the GPU kernels never do (nvrtc's -ftz=false), so the C core's bytes would
differ from theirs and from codecs/reference.py. Every entry point of
native/geocomm.h runs its body in the default mode and restores the
caller's (native/gc_internal.h). Each case here computes once in the default
mode, then again with flushing on, and compares bits; inputs are subnormal or
have subnormal results, so a flushed computation changes them. After each
call the caller's mode must still flush.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

import geocomm
from geocomm.kernels import native

torch = pytest.importorskip("torch")
TINY = np.float32(2.0**-128)  # a subnormal float32 (bfloat16 keeps most of its multiples)


@contextlib.contextmanager
def flushing() -> Iterator[None]:
    """Flush-to-zero and denormals-are-zero on this thread for the body."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals (no SSE3 / FZ)")
    try:
        yield
        # the caller's mode is back: subnormal arithmetic still flushes
        assert np.float32(TINY) * np.float32(1.5) == 0, "the C core left the caller's mode"
    finally:
        torch.set_flush_denormal(False)


def subnormal_gradient(n: int = 8192) -> np.ndarray:
    """Subnormal values, but for the last 512 (normal, of blocks of their own)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * TINY).astype(np.float32)
    x[-512:] *= 2.0**20
    return x


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


CONFIGS = [
    {"id": "fp8"},
    {"id": "fp8", "fmt": "e5m2", "block": 32},
    {"id": "fp8", "rounding": "stochastic"},
    {"id": "nvfp4"},
    {"id": "mxfp8"},
    {"id": "mxfp4"},
    {"id": "bf16"},
]


@pytest.mark.parametrize("simd", sorted(set(native.SIMD_LEVELS) & {"portable", "avx512"}))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_codecs_give_the_default_modes_bits_under_flushing(config, simd):
    previous = native.simd()
    if native.set_simd(simd) != simd:
        native.set_simd(previous)
        pytest.skip(f"this CPU has no {simd} loops")
    try:
        codec = geocomm.get_codec(config)
        x = subnormal_gradient()
        wire = codec.encode(x)
        values = codec.decode(wire)
        with flushing():
            assert np.array_equal(bits(codec.encode(x)), bits(wire))
            assert np.array_equal(bits(codec.decode(wire)), bits(values))
    finally:
        native.set_simd(previous)
    assert np.count_nonzero(values) > values.size // 2  # most subnormals were kept


def test_fp8_accumulate_keeps_subnormal_sums_under_flushing():
    x = subnormal_gradient()
    wire = np.empty(native.wire_size("e4m3", x.size, 128), np.uint8)
    native.encode("e4m3", x, 128, wire)
    want = subnormal_gradient()[::-1].copy()
    native.decode("e4m3", wire, 128, want, accumulate=True)
    got = subnormal_gradient()[::-1].copy()
    onto = np.empty_like(got)
    with flushing():
        native.decode_onto("e4m3", wire, 128, got, onto)
        native.decode("e4m3", wire, 128, got, accumulate=True)
    assert np.array_equal(bits(got), bits(want))
    assert np.array_equal(bits(onto), bits(want))


def test_geometry_gives_the_default_modes_bits_under_flushing():
    """GeoFP8's kernels: the power step's (projection, accumulation, residual, sum of
    squares, orthonormalization) and the map fused with fp8 (encode, decode)."""
    m, n, k = 64, 128, 4
    x = subnormal_gradient(m * n)
    rng = np.random.default_rng(1)
    coef = rng.standard_normal((m, k)).astype(np.float32)  # normal: coef vt is not tiny
    vt = (rng.standard_normal((k, n)) * TINY).astype(np.float32)  # tiny: x - coef vt is
    packed = native.geo_pack(vt)
    start = rng.standard_normal((k, n)).astype(np.float32)
    wire = np.empty(native.wire_size("e4m3", x.size, 128), np.uint8)
    outcomes = []
    for mode in (contextlib.nullcontext, flushing):
        with mode():
            rows = start.copy()
            native.geo_orthonormalize(rows, seed=3)
            projected, _ = native.geo_project(x, 0, n, rows)
            acc = np.zeros((k, n), np.float32)
            native.geo_accumulate(x, 0, n, coef, acc)
            residual = np.empty_like(x)
            native.geo_residual(x, n, rows, residual)
            expanded = np.empty_like(x)
            native.geo_expand(x, 0, n, coef, vt, -1.0, expanded, packed)
            native.geo_encode("e4m3", x, 0, n, coef, vt, packed, 128, wire)
            decoded = np.empty_like(x)
            native.geo_decode("e4m3", wire, 0, n, coef, vt, packed, 128, decoded)
            sumsq = np.float64(native.geo_sumsq(x))
            outcomes.append([rows, projected, acc, residual, expanded, wire.copy(), decoded,
                             sumsq])  # fmt: skip
    for default, flushed in zip(*outcomes, strict=True):
        assert np.array_equal(bits(default), bits(flushed))
    assert outcomes[0][-1] > 0  # the subnormals' squares were summed, not flushed
    assert np.count_nonzero(outcomes[0][2]) == acc.size  # subnormal sums kept


def test_a_caller_trapping_invalid_operations_gets_no_signal():
    """A process that traps floating-point exceptions (glibc's feenableexcept) got
    SIGFPE from the core's inf - inf in an accumulating decode (the core assumes no
    traps: -fno-trapping-math). The default mode masks them; the caller's traps are
    back afterwards."""
    import ctypes
    import ctypes.util
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("FE_INVALID's value is x86's here")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    if not hasattr(libm, "feenableexcept"):
        pytest.skip("no feenableexcept (not glibc)")
    fe_invalid = 0x01  # x86
    x = np.full(4096, np.inf, np.float32)
    wire = np.empty(native.wire_size("bf16", x.size), np.uint8)
    native.encode("bf16", x, 0, wire)
    out = np.full_like(x, -np.inf)
    libm.feenableexcept(fe_invalid)
    try:
        native.decode("bf16", wire, 0, out, accumulate=True)  # inf + -inf in every lane
        trapping = libm.fegetexcept() & fe_invalid
    finally:
        libm.fedisableexcept(fe_invalid)
    assert trapping, "the caller's trap was not given back"
    assert (out.view(np.uint32) == 0x7FFFFFFF).all()


def test_the_threads_a_call_starts_compute_in_the_default_mode_too():
    """A call of 2^21 values runs on several threads (native.set_threads), which take
    the mode the calling thread set before starting them."""
    previous = native.threads()
    native.set_threads(4)
    try:
        x = subnormal_gradient(1 << 21)
        wire = np.empty(native.wire_size("e4m3", x.size, 128), np.uint8)
        native.encode("e4m3", x, 128, wire)
        flushed = np.empty_like(wire)
        with flushing():
            native.encode("e4m3", x, 128, flushed)
    finally:
        native.set_threads(previous)
    assert np.array_equal(flushed, wire)
