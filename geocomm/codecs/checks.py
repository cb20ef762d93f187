"""Checks a codec author runs on their codec (docs/design.md, "Formats").

What numcodecs' ``tests/common.py`` is to its codecs: functions that raise
``AssertionError`` with a message when a codec breaks the contract of
:class:`~geocomm.codecs.base.Codec`, for the built-in codecs and third-party
ones alike (register yours first, or pass the instance)::

    from geocomm.codecs import checks

    checks.check_roundtrip(codec, x, bound=lambda x: 2.0**-3 * np.abs(x) + 1e-6)
    checks.check_config(codec)
    checks.check_golden_frame(codec, x, "tests/golden/mycodec.bin")

* :func:`check_roundtrip`: the wire API and the frame API give back every
  finite value within a stated bound (exactly for lossless codecs), keep
  shapes and dtypes, and accumulate in place or onto a base;
* :func:`check_config`: ``get_codec(codec.get_config())`` builds an equal
  codec that writes the same bytes, and the config is JSON;
* :func:`check_golden_frame`: the frame of an input is the same bytes as one
  written before (creating the file the first time, when asked to).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from geocomm.codecs.base import Codec
from geocomm.codecs.frames import parse_frame
from geocomm.codecs.registry import frame_body_size, get_codec


def host_array(values: Any) -> np.ndarray:
    """A host (NumPy) view or copy of a NumPy, CuPy or DLPack array."""
    if hasattr(values, "get") and not isinstance(values, np.ndarray):
        result: np.ndarray = values.get()
        return result
    return values if isinstance(values, np.ndarray) else np.from_dlpack(values)


def roundtrip(codec: Codec, values: Any) -> np.ndarray:
    """decode(encode(values)) through the codec's wire format (flat float32, host)."""
    flat = np.ascontiguousarray(host_array(values), np.float32).reshape(-1)
    wire = np.empty(codec.wire_size(flat.size), np.uint8)
    codec.encode_wire(flat, wire)
    out = np.empty(flat.size, np.float32)
    codec.decode_wire(wire, out)
    return out


Bound = Callable[[np.ndarray], np.ndarray]


def check_roundtrip(codec: Codec, values: np.ndarray, bound: Bound | float | None = None) -> None:
    """Assert that ``codec`` gives back ``values`` within ``bound``.

    ``bound``: the largest error allowed per value, as a function of the float32
    values or a number (None: 0, which lossless codecs must meet). Checked for the
    wire API (flat float32), ``accumulate=True`` (decoding adds onto ``out``),
    ``decode_wire_onto`` (onto a base, into another array) and the frame API
    (``decode(encode(x))`` has x's shape and dtype, and the same values as the
    wire API's). Non-finite inputs are not checked against the bound."""
    x = np.asarray(values)
    flat = np.ascontiguousarray(x, np.float32).reshape(-1)
    allowed = (
        np.zeros_like(flat)
        if bound is None
        else np.broadcast_to(
            np.asarray(bound(flat) if callable(bound) else bound, np.float64), flat.shape
        )
    )
    size = codec.wire_size(flat.size)
    assert isinstance(size, int) and size >= 0, f"wire_size({flat.size}) = {size!r}"
    decoded = roundtrip(codec, flat)
    finite = np.isfinite(flat)
    error = np.abs(decoded[finite].astype(np.float64) - flat[finite])
    worst = error - allowed[finite]
    assert not np.any(worst > 0), (
        f"{codec.get_config()}: value {flat[finite][np.argmax(worst)]!r} came back as "
        f"{decoded[finite][np.argmax(worst)]!r}, off by more than the bound "
        f"({float(np.max(worst))} beyond it)"
    )
    wire = np.empty(size, np.uint8)
    codec.encode_wire(flat, wire)
    base = np.linspace(-1, 1, flat.size, dtype=np.float32)
    acc = base.copy()
    codec.decode_wire(wire, acc, accumulate=True)
    np.testing.assert_array_equal(
        acc, base + decoded, err_msg=f"{codec.get_config()}: accumulate=True"
    )
    onto = np.empty_like(base)
    codec.decode_wire_onto(wire, base, onto)
    np.testing.assert_array_equal(
        onto, base + decoded, err_msg=f"{codec.get_config()}: decode_wire_onto"
    )
    frame = codec.encode(x)
    back = codec.decode(frame)
    assert back.shape == x.shape and back.dtype == x.dtype, (
        f"{codec.get_config()}: a frame of {x.dtype}{list(x.shape)} decoded as "
        f"{back.dtype}{list(back.shape)}"
    )
    np.testing.assert_array_equal(
        np.asarray(back, np.float32).reshape(-1),
        decoded.astype(x.dtype).astype(np.float32),
        err_msg=f"{codec.get_config()}: the frame and the wire API disagree",
    )


def check_config(codec: Codec, values: np.ndarray | None = None) -> None:
    """Assert that ``codec``'s config is JSON and rebuilds it through the registry: an
    equal codec (``==``, same hash) that writes the same frame of ``values`` and reads
    ``codec``'s frames (``geocomm.codecs.decode`` included)."""
    config = codec.get_config()
    assert isinstance(config, dict) and isinstance(config.get("id"), str), (
        f"get_config() must be a dict with a string 'id', got {config!r}"
    )
    text = json.dumps(config, sort_keys=True)
    rebuilt = get_codec(json.loads(text))
    assert type(rebuilt) is type(codec), f"{config} rebuilds a {type(rebuilt).__name__}"
    assert rebuilt == codec and hash(rebuilt) == hash(codec), (
        f"{config} rebuilds a codec that is not equal: {rebuilt.get_config()}"
    )
    assert rebuilt.get_config() == config, (
        f"the config does not survive a round trip: {config} -> {rebuilt.get_config()}"
    )
    x = (
        np.linspace(-3, 3, 257, dtype=np.float32).reshape(1, 257)
        if values is None
        else np.asarray(values)
    )
    frame = codec.encode(x)
    assert bytes(rebuilt.encode(x)) == bytes(frame), f"{config}: the rebuilt codec's frame differs"
    info = parse_frame(frame, frame_body_size)
    assert info.config == config and info.shape == x.shape and info.dtype == x.dtype
    np.testing.assert_array_equal(rebuilt.decode(frame), codec.decode(frame))


def check_golden_frame(
    codec: Codec, values: np.ndarray, path: str | pathlib.Path, create: bool = False
) -> None:
    """Assert that the frame of ``values`` is byte for byte the one stored at ``path``
    (a wire-format change fails loudly). ``create``: write it when the file is missing
    (commit it; never rewrite one to make a test pass)."""
    path = pathlib.Path(path)
    frame = bytes(codec.encode(np.asarray(values)))
    if not path.exists():
        assert create, f"no golden frame at {path} (pass create=True once to write it)"
        path.write_bytes(frame)
        return
    golden = path.read_bytes()
    if frame != golden:
        at = next(
            (i for i, (a, b) in enumerate(zip(frame, golden, strict=False)) if a != b),
            min(len(frame), len(golden)),
        )
        raise AssertionError(
            f"the frame of {codec.get_config()} differs from {path} from byte {at} on "
            f"({len(frame)} bytes now, {len(golden)} stored)"
        )
    np.testing.assert_array_equal(codec.decode(golden), codec.decode(frame))
