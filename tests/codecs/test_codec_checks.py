"""geocomm.codecs.checks, the checks a codec author runs, on two built-in codecs
(docs/design.md, "Formats"), and that they catch a broken codec."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import geocomm
from geocomm.codecs import checks
from geocomm.codecs.formats import BF16Codec
from geocomm.codecs.registry import registered_ids

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"


def values(n: int = 1000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp2(rng.integers(-6, 6, n))).astype(np.float32)


@pytest.mark.parametrize(
    ("config", "bound", "golden"),
    [
        # bf16 keeps 8 significant bits, rounded to nearest: half an ulp
        ({"id": "bf16"}, lambda x: np.abs(x) * 2.0**-8, "bf16"),
        # fp8 e4m3, one scale per 128 values: 3 mantissa bits relative to the block's amax
        (
            {"id": "fp8", "fmt": "e4m3", "block": 128},
            lambda x: np.repeat(
                [np.abs(b).max() * 2.0**-3 for b in np.array_split(x, -(-x.size // 128))],
                [len(b) for b in np.array_split(x, -(-x.size // 128))],
            ),
            "fp8_e4m3_b128",
        ),
    ],
)
def test_builtin_codecs_pass_the_checks(config, bound, golden):
    codec = geocomm.get_codec(config)
    x = values(128 * 8)
    checks.check_roundtrip(codec, x, bound)
    checks.check_roundtrip(codec, x.reshape(8, 128).astype(np.float16), bound)
    checks.check_config(codec)
    checks.check_golden_frame(codec, np.load(GOLDEN / f"{golden}.npy"), GOLDEN / f"{golden}.bin")


def test_lossless_codec_passes_with_no_bound():
    checks.check_roundtrip(geocomm.get_codec("none"), values())


def test_checks_catch_a_broken_codec(tmp_path):
    class Sloppy(BF16Codec):
        codec_id = "sloppy-bf16"  # not registered: its config does not rebuild it

        def decode_wire(self, wire, out, accumulate=False):
            super().decode_wire(wire, out, accumulate)
            out[:1] += 1.0

    codec = Sloppy()
    with pytest.raises(AssertionError, match="off by more than the bound"):
        checks.check_roundtrip(codec, values(), lambda x: np.abs(x) * 2.0**-8)
    with pytest.raises(KeyError, match="sloppy-bf16"):
        checks.check_config(codec)

    class LostBase(BF16Codec):  # its one-pass decode forgets the base
        codec_id = "lost-base-bf16"

        def decode_wire_onto(self, wire, base, out):
            self.decode_wire(wire, out)

    with pytest.raises(AssertionError, match="decode_wire_onto"):
        checks.check_roundtrip(LostBase(), values(), lambda x: np.abs(x) * 2.0**-8)
    x = values(64)
    path = tmp_path / "bf16.bin"
    with pytest.raises(AssertionError, match="no golden frame"):
        checks.check_golden_frame(BF16Codec(), x, path)
    checks.check_golden_frame(BF16Codec(), x, path, create=True)
    checks.check_golden_frame(BF16Codec(), x, path)
    with pytest.raises(AssertionError, match="differs"):
        checks.check_golden_frame(BF16Codec(), x + 1, path)


@pytest.mark.parametrize("codec_id", registered_ids())
def test_every_codec_decodes_onto_a_base_as_it_accumulates(codec_id):
    """decode_wire_onto(wire, base, out) is a copy of base into out and an accumulating
    decode, to the bit, for every registered codec (the host pipeline adds a peer's
    piece to its own that way); with base being out it is the accumulating decode."""
    codec = geocomm.get_codec(codec_id)
    x, base = values(5000, seed=1), values(5000, seed=2)
    wire = np.empty(codec.wire_size(x.size), np.uint8)
    codec.encode_wire(x, wire)
    want = base.copy()
    codec.decode_wire(wire, want, accumulate=True)
    out = np.empty_like(base)
    codec.decode_wire_onto(wire, base, out)
    assert out.tobytes() == want.tobytes()
    codec.decode_wire_onto(wire, base, base)
    assert base.tobytes() == want.tobytes()
