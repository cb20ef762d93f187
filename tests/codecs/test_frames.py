"""The public codec API and the self-describing frame.

Covers: the registry (ids, configs, equality), encode/decode over dtypes and
shapes, golden frames committed under tests/codecs/golden (a wire-format change
fails here), rejection of malformed frames with ValueError only (targeted
cases plus hypothesis fuzzing), and a clear error when the native core is
missing.

The frame layout is restated here independently of geocomm.codecs.base, so
a layout change is caught twice: little-endian header
``magic(4) version(u8) dtype(u8) ndim(u8) reserved(u8) config_len(u32)
body_len(u64)``, then ndim u64 dims, the config as compact sorted JSON, the
wire body, and a CRC32 of everything before it.

Every test runs on every MPI rank alike and writes only under tmp_path.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geocomm
from geocomm.codecs import bounds
from geocomm.codecs import reference as ref
from geocomm.kernels import native

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
HEAD = struct.Struct("<4sBBBBIQ")
CRC = struct.Struct("<I")
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4}
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64]
SHAPES = [(), (0,), (1,), (7,), (3, 5, 7)]
CONFIGS = [
    {"id": "none"},
    {"id": "bf16"},
    {"id": "fp8", "fmt": "e4m3", "block": 128},
    {"id": "fp8", "fmt": "e4m3", "block": 0},
    {"id": "fp8", "fmt": "e5m2", "block": 16},
    {"id": "nvfp4"},
    {"id": "mxfp8", "fmt": "e4m3", "scale_rule": "floor"},
    {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
    {"id": "mxfp4", "scale_rule": "floor"},
    {"id": "fp8", "fmt": "e4m3", "block": 16, "rounding": "stochastic", "seed": 5},
    {"id": "mxfp4", "scale_rule": "rceil", "rounding": "stochastic", "seed": 0},
]
CONFIG_IDS = ["-".join(str(v) for v in c.values()) for c in CONFIGS]
# hypothesis: no example database (ranks under mpiexec would share it), bounded work
FUZZ = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def sample(shape: tuple[int, ...], dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal(shape) * 4, dtype)  # an array also for shape ()


# ---- frame layout, written out independently -------------------------------


def split_frame(frame) -> dict:
    """The fields of a frame, read with this file's own idea of the layout."""
    data = bytes(frame)
    magic, version, dtype, ndim, reserved, config_len, body_len = HEAD.unpack_from(data)
    shape = struct.unpack_from(f"<{ndim}Q", data, HEAD.size)
    start = HEAD.size + 8 * ndim
    return {
        "magic": magic,
        "version": version,
        "dtype": dtype,
        "ndim": ndim,
        "reserved": reserved,
        "shape": shape,
        "config": data[start : start + config_len],
        "body": data[start + config_len : start + config_len + body_len],
        "crc": data[start + config_len + body_len :],
    }


def build_frame(fields: dict, **changes) -> bytes:
    """A frame from fields (as split_frame gives them) with a freshly computed CRC.

    ``config_len``/``body_len``/``ndim`` follow the actual parts unless given
    explicitly, so single header fields can be falsified on their own.
    """
    f = {**fields, **changes}
    ndim = changes.get("ndim", len(f["shape"]))
    head = HEAD.pack(
        f["magic"],
        f["version"],
        f["dtype"],
        ndim,
        f["reserved"],
        changes.get("config_len", len(f["config"])),
        changes.get("body_len", len(f["body"])),
    )
    data = head + struct.pack(f"<{len(f['shape'])}Q", *f["shape"]) + f["config"] + f["body"]
    return data + CRC.pack(zlib.crc32(data))


def reference_body(config: dict, x: np.ndarray) -> bytes:
    """The wire body of x for config by the NumPy reference (frames use stream 0, offset 0)."""
    if config["id"] == "none":
        return x.astype("<f4").tobytes()
    fmt = {"fp8": config.get("fmt"), "mxfp8": f"mxfp8_{config.get('fmt')}"}.get(
        config["id"], config["id"]
    )
    options = {k: config[k] for k in ("rounding", "seed", "scale_rule") if k in config}
    return ref.encode(fmt, x, config.get("block", 0), **options).tobytes()


def decode_or_reject(data):
    """geocomm.decode(data) must return an array or raise ValueError, nothing else."""
    try:
        result = geocomm.decode(data)
    except ValueError:
        return None
    assert isinstance(result, np.ndarray)
    return result


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_frame_layout(config):
    x = sample((3, 50), np.float32)
    frame = geocomm.get_codec(config).encode(x)
    assert isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 1
    f = split_frame(frame)
    assert (f["magic"], f["version"], f["dtype"], f["reserved"]) == (b"GEOC", 1, 1, 0)
    assert f["shape"] == (3, 50)
    assert f["config"] == json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    assert f["crc"] == CRC.pack(zlib.crc32(bytes(frame[: -CRC.size])))
    assert f["body"] == reference_body(config, x)
    assert build_frame(f) == frame.tobytes()


# ---- registry and configs --------------------------------------------------


def test_get_codec_by_id_params_config_and_instance():
    codec = geocomm.get_codec("fp8", fmt="e5m2", block=0)
    assert codec.get_config() == {"id": "fp8", "fmt": "e5m2", "block": 0}
    assert geocomm.get_codec({"id": "fp8", "fmt": "e5m2", "block": 0}) == codec
    assert geocomm.get_codec({"id": "fp8"}, fmt="e5m2", block=0) == codec
    assert geocomm.get_codec(codec) is codec
    assert geocomm.get_codec("fp8").get_config() == {"id": "fp8", "fmt": "e4m3", "block": 128}
    assert geocomm.get_codec(None) == geocomm.get_codec("none")
    assert {"none", "bf16", "fp8", "nvfp4", "mxfp8", "mxfp4"} <= set(geocomm.registered_ids())


def test_rounding_and_scale_rule_defaults_and_configs():
    # nearest rounding (the default) adds nothing to a config, so every config
    # and frame written before stochastic rounding existed stays valid
    for codec_id in ("bf16", "fp8", "nvfp4"):
        plain = geocomm.get_codec(codec_id)
        assert "rounding" not in plain.get_config() and "seed" not in plain.get_config()
        assert geocomm.get_codec(codec_id, rounding="nearest") == plain
        sr = geocomm.get_codec(codec_id, rounding="stochastic", seed=9)
        assert sr.get_config() == {**plain.get_config(), "rounding": "stochastic", "seed": 9}
        assert sr != plain and sr != geocomm.get_codec(codec_id, rounding="stochastic")
    # MX: the OCP floor rule by default, rceil with stochastic rounding (which needs it)
    assert geocomm.get_codec("mxfp8").get_config() == {
        "id": "mxfp8",
        "fmt": "e4m3",
        "scale_rule": "floor",
    }
    assert geocomm.get_codec("mxfp4", rounding="stochastic").get_config() == {
        "id": "mxfp4",
        "scale_rule": "rceil",
        "rounding": "stochastic",
        "seed": 0,
    }
    assert geocomm.get_codec("mxfp4", scale_rule="rceil").get_config() == {
        "id": "mxfp4",
        "scale_rule": "rceil",
    }


@pytest.mark.parametrize(
    ("codec_id", "params"),
    [
        ("fp8", {"rounding": "up"}),
        ("fp8", {"rounding": None}),
        ("bf16", {"seed": -1}),
        ("nvfp4", {"seed": 2**64}),
        ("fp8", {"seed": 1.5}),
        ("fp8", {"seed": True}),
        ("mxfp8", {"fmt": "e2m1"}),
        ("mxfp8", {"scale_rule": "ceil"}),
        ("mxfp4", {"scale_rule": "floor", "rounding": "stochastic"}),
    ],
)
def test_bad_rounding_and_mx_params_are_value_error(codec_id, params):
    with pytest.raises(ValueError):
        geocomm.get_codec(codec_id, **params)


@pytest.mark.parametrize("codec_id", ["none", "bf16", "fp8", "nvfp4", "mxfp8", "mxfp4", "auto"])
def test_encode_wire_takes_stream_and_offset(codec_id):
    # every codec accepts them; nearest rounding (and "none") ignores them
    codec = geocomm.get_codec(codec_id)
    x = sample((100,), np.float32)
    a, b = (np.empty(codec.wire_size(100), np.uint8) for _ in range(2))
    codec.encode_wire(x, a)
    codec.encode_wire(x, b, rounding_stream=2**64 - 1, offset=12345)
    assert np.array_equal(a, b)
    if codec_id not in ("none", "auto"):
        with pytest.raises(ValueError):
            codec.encode_wire(x, b, rounding_stream=-1)
        with pytest.raises(ValueError):
            codec.encode_wire(x, b, offset=2**64)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_config_json_round_trip_defines_equality(config):
    codec = geocomm.get_codec(config)
    again = geocomm.get_codec(json.loads(json.dumps(codec.get_config())))
    assert again == codec and hash(again) == hash(codec)
    assert again.get_config() == config
    others = [geocomm.get_codec(c) for c in CONFIGS if c != config]
    assert all(other != codec for other in others)
    assert codec != config  # a config dict is not a codec


@pytest.mark.parametrize(
    "config",
    [*CONFIGS, {"id": "geofp8"}, {"id": "fp8", "error_feedback": True}, {"id": "auto"}],
    ids=[*CONFIG_IDS, "geofp8", "ef", "auto"],
)
def test_a_codec_is_fixed_once_made(config):
    """Setting or deleting any public attribute of a made codec raises, so its hash and
    what the collectives derived from it (plans and graphs kept by the instance) stay
    right; its private working state stays its own to change."""
    codec = geocomm.get_codec(config)
    before, public = codec.get_config(), [n for n in vars(codec) if not n.startswith("_")]
    for name in public:
        with pytest.raises(AttributeError, match=f"{name} cannot change"):
            setattr(codec, name, getattr(codec, name))
        with pytest.raises(AttributeError, match=f"{name} cannot be deleted"):
            delattr(codec, name)
    with pytest.raises(AttributeError, match="rounding cannot change"):
        codec.rounding = "stochastic"  # nor can a class default be shadowed
    codec._scratch = 1
    assert codec.get_config() == before and codec == geocomm.get_codec(before)


def test_what_a_frame_cannot_hold_is_refused_when_encoding():
    """decode refuses frames of more than 32 dimensions; encode wrote them."""
    codec = geocomm.get_codec("fp8")
    codec.encode(np.ones((1,) * 32, np.float32))
    with pytest.raises(ValueError, match="at most 32 dimensions"):
        codec.encode(np.ones((1,) * 33, np.float32))


def test_an_unaligned_array_encodes_like_an_aligned_one():
    """The C core reads floats where they lie: the wire API refuses an array at an odd
    address (undefined behaviour in C), the frame API copies it."""
    codec = geocomm.get_codec("fp8")
    x = sample((1000,), np.float32)
    odd = np.frombuffer(np.zeros(4 * 1000 + 1, np.uint8).data, np.float32, 1000, 1)
    odd[...] = x
    assert not odd.flags.aligned
    assert np.array_equal(codec.encode(odd), codec.encode(x))
    with pytest.raises(ValueError, match="not aligned"):
        codec.encode_wire(odd, np.empty(codec.wire_size(1000), np.uint8))


@pytest.mark.parametrize("codec_id", ["none", "bf16", "fp8", "nvfp4", "mxfp8", "mxfp4"])
def test_wire_sizes_of_any_count_are_exact_or_refused(codec_id):
    """Counts are integers up to 2^56, where every size fits 64 bits (ceil_div wrapped
    near 2^64: bf16's size of 2^63 values was 0); others raise."""
    codec = geocomm.get_codec(codec_id)
    n = 2**56
    per_value = {"none": 4, "bf16": 2, "fp8": 1 + 4 / 128, "nvfp4": 0.5 + 1 / 16 + 4 / 4096}
    per_value |= {"mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32}
    assert codec.wire_size(n) == int(n * per_value[codec_id])
    for bad, error in ((2**56 + 1, ValueError), (-1, ValueError), (1.5, TypeError)):
        with pytest.raises(error):
            codec.wire_size(bad)
    with pytest.raises(TypeError):
        codec.wire_size(True)


def test_auto_takes_its_codec_by_keyword_and_switches_to_stateless_codecs_only():
    """get_codec("auto", codec=...) is auto's documented keyword (it collided with
    get_codec's own first parameter). A stateful codec behind auto (error feedback,
    GeoFP8) would keep its state out of checkpoints and cross-rank checks, and error
    feedback around auto compressed every call: both are refused, as is a bool
    crossover."""
    auto = geocomm.get_codec("auto", codec="nvfp4", crossover_bytes=1024)
    assert auto.get_config()["codec"] == {"id": "nvfp4"}
    for inner in ({"id": "fp8", "error_feedback": True}, "geofp8"):
        with pytest.raises(ValueError, match="stateless"):
            geocomm.get_codec("auto", codec=inner)
    with pytest.raises(ValueError, match="error feedback wraps"):
        geocomm.get_codec("auto", error_feedback=True)
    with pytest.raises(ValueError, match="crossover_bytes"):
        geocomm.get_codec("auto", crossover_bytes=True)


def test_a_seed_goes_with_stochastic_rounding_only():
    """Nearest rounding's config has no seed: one given was kept on the codec but lost
    in its config (equal to the seedless codec, and gone once made from the config)."""
    with pytest.raises(ValueError, match="stochastic"):
        geocomm.get_codec("fp8", seed=5)
    assert geocomm.get_codec("fp8", rounding="stochastic", seed=5).get_config()["seed"] == 5
    assert geocomm.get_codec("geofp8", seed=5).get_config()["seed"] == 5  # GeoFP8's own


def test_unknown_id_is_key_error():
    with pytest.raises(KeyError, match="nosuch"):
        geocomm.get_codec("nosuch")
    with pytest.raises(KeyError):
        geocomm.get_codec({"id": "nosuch"})


@pytest.mark.parametrize(
    "params",
    [
        {"fmt": "e3m4"},
        {"fmt": "E4M3"},
        {"fmt": None},
        {"block": -1},
        {"block": 1.5},
        {"block": "128"},
        {"block": True},
        {"block": None},
        {"block": 2**70},
    ],
)
def test_bad_fp8_params_are_value_error(params):
    with pytest.raises(ValueError):
        geocomm.get_codec("fp8", **params)


def test_unknown_param_and_mismatched_id():
    with pytest.raises(TypeError):  # like any Python call with an unexpected keyword
        geocomm.get_codec("nvfp4", block=16)
    with pytest.raises(ValueError, match="does not match"):
        geocomm.codecs.FP8Codec.from_config({"id": "nvfp4"})
    with pytest.raises(TypeError, match="'id' is a codec id string"):
        geocomm.get_codec({"id": ["fp8"]})


# ---- encode / decode over dtypes and shapes ---------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_keeps_dtype_and_shape(config, dtype, shape):
    codec = geocomm.get_codec(config)
    x = sample(shape, dtype)
    frame = codec.encode(x)
    y = codec.decode(frame)
    assert y.dtype == np.dtype(dtype) and y.shape == shape
    assert geocomm.decode(frame).shape == shape
    # the codec sees x as float32: "none" gives those values back, "bf16" their
    # bfloat16 rounding; the quantizing codecs stay within their derived error
    # bounds (geocomm.codecs.bounds), plus the cast of the result to dtype
    # (at most 2^-8 relative, bfloat16's half ulp)
    x32 = x.astype(np.float32)
    if config["id"] == "none":
        np.testing.assert_array_equal(y, x32.astype(dtype))
    elif config["id"] == "bf16":
        np.testing.assert_array_equal(
            y, x32.astype(ml_dtypes.bfloat16).astype(np.float32).astype(dtype)
        )
    else:
        bound = bounds.single_bound(x32.ravel(), codec).reshape(shape)
        err = np.abs(y.astype(np.float64) - x32)
        assert np.all(err <= bound * (1 + 2.0**-8) + 2.0**-8 * np.abs(x32))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_decode_into_out(config, dtype):
    codec = geocomm.get_codec(config)
    x = sample((3, 5, 7), np.float32, seed=1)
    frame = codec.encode(x)
    out = np.full((3, 5, 7), 99, dtype)
    assert codec.decode(frame, out=out) is out
    np.testing.assert_array_equal(out, codec.decode(frame).astype(dtype))


def test_decode_into_bad_out():
    codec = geocomm.get_codec("fp8")
    frame = codec.encode(sample((4, 4), np.float32))
    with pytest.raises(ValueError, match="shape"):
        codec.decode(frame, out=np.empty(16, np.float32))
    readonly = np.empty((4, 4), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        codec.decode(frame, out=readonly)
    with pytest.raises(TypeError, match="int32"):
        codec.decode(frame, out=np.empty((4, 4), np.int32))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
    "bad",
    [np.arange(6, dtype=np.int32), np.ones(3, np.complex64), [1.0, 2.0], np.ones(3, bool)],
    ids=["int32", "complex64", "list", "bool"],
)
def test_encode_rejects_non_float(config, bad):
    with pytest.raises(TypeError):
        geocomm.get_codec(config).encode(bad)


def test_encode_accepts_non_contiguous():
    x = sample((8, 9), np.float32)[::2, ::3]
    codec = geocomm.get_codec("fp8", block=4)
    np.testing.assert_array_equal(
        codec.decode(codec.encode(x)), codec.decode(codec.encode(np.ascontiguousarray(x)))
    )


def test_decode_rejects_frame_of_another_codec():
    frame = geocomm.get_codec("fp8", fmt="e4m3", block=128).encode(sample((300,), np.float32))
    for other in (
        {"id": "fp8", "fmt": "e5m2", "block": 128},
        {"id": "fp8", "fmt": "e4m3", "block": 64},
        {"id": "nvfp4"},
        {"id": "none"},
    ):
        with pytest.raises(ValueError, match="written by"):
            geocomm.get_codec(other).decode(frame)
    # an e5m2 config on an e4m3 body has the right length: a valid frame, but
    # not one the e4m3 codec accepts
    relabelled = build_frame(split_frame(frame), config=b'{"block":128,"fmt":"e5m2","id":"fp8"}')
    assert geocomm.decode(relabelled).shape == (300,)
    with pytest.raises(ValueError, match="written by"):
        geocomm.get_codec("fp8").decode(relabelled)


# ---- golden frames ---------------------------------------------------------


def load_golden_cases() -> dict:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


GOLDEN_CASES = load_golden_cases()


def first_difference(a: bytes, b: bytes) -> str:
    common = min(len(a), len(b))
    u, v = np.frombuffer(a[:common], np.uint8), np.frombuffer(b[:common], np.uint8)
    diff = np.flatnonzero(u != v)
    if diff.size:
        return f"first difference at byte {diff[0]}: {a[diff[0]]:#04x} != {b[diff[0]]:#04x}"
    return f"lengths {len(a)} != {len(b)}"


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_frame_is_reproduced_byte_for_byte(name):
    config, dtype, shape = GOLDEN_CASES[name]
    x = np.load(GOLDEN / f"{name}.npy")
    assert x.dtype == np.dtype(dtype) and x.shape == shape
    golden = (GOLDEN / f"{name}.bin").read_bytes()
    frame = geocomm.get_codec(config).encode(x).tobytes()
    assert frame == golden, (
        f"the wire format of {config} changed ({first_difference(frame, golden)}); if this is "
        "deliberate, bump FRAME_VERSION and rerun tests/codecs/golden/make_golden.py"
    )


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_frame_decodes(name):
    config, dtype, shape = GOLDEN_CASES[name]
    golden = (GOLDEN / f"{name}.bin").read_bytes()
    expected = np.load(GOLDEN / f"{name}.decoded.npy")
    for y in (geocomm.decode(golden), geocomm.get_codec(config).decode(golden)):
        assert y.dtype == np.dtype(dtype) and y.shape == shape
        np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
        np.testing.assert_array_equal(y, expected)
        assert np.array_equal(np.signbit(y), np.signbit(expected))


# ---- malformed frames ------------------------------------------------------


@pytest.fixture(scope="module")
def small_frame() -> bytes:
    codec = geocomm.get_codec("fp8", fmt="e4m3", block=4)
    return codec.encode(sample((2, 5), np.float32)).tobytes()


def test_every_truncation_and_extension_is_rejected(small_frame):
    for length in range(len(small_frame)):
        with pytest.raises(ValueError):
            geocomm.decode(small_frame[:length])
    with pytest.raises(ValueError):
        geocomm.decode(small_frame + b"\0")


def test_every_single_bit_flip_is_rejected(small_frame):
    data = bytearray(small_frame)
    for bit in range(8 * len(data)):
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ValueError):
            geocomm.decode(bytes(data))
        data[bit // 8] ^= 1 << (bit % 8)
    assert geocomm.decode(bytes(data)).shape == (2, 5)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"magic": b"GEOD"}, "magic"),
        ({"magic": b"\0\0\0\0"}, "magic"),
        ({"version": 0}, "version"),
        ({"version": 2}, "version"),
        ({"dtype": 0}, "dtype"),
        ({"dtype": 5}, "dtype"),
        ({"dtype": 255}, "dtype"),
        ({"ndim": 33}, "dimensions"),
        ({"ndim": 255}, "dimensions"),
        ({"ndim": 3}, "length"),  # one dim more than the frame holds
        ({"ndim": 1}, "length"),
        ({"config_len": 0}, "length"),
        ({"body_len": 0}, "length"),
        ({"shape": (2, 6)}, "body"),
        ({"shape": (2, 5, 1, 0)}, "body"),
        ({"shape": (2**40, 2**40)}, "holds more"),
        ({"shape": (2**64 - 1,)}, "holds more"),
        ({"shape": (0, 2**64 - 1)}, "holds more"),  # no values, but no array has that dim
        ({"reserved": 1}, "reserved"),
        ({"body": b""}, "body"),
        ({"body": b"\0" * 200}, "body"),
        ({"config": b'{"id":"fp8","fmt":"e4m3","block":4}x'}, "JSON"),
        ({"config": b"{not json}"}, "JSON"),
        ({"config": b"\xff\xfe\xfd"}, "JSON"),
        ({"config": b""}, "JSON"),
        ({"config": b"[1, 2]"}, "object"),
        ({"config": b'{"id": 4}'}, "object"),
        ({"config": b'{"fmt": "e4m3"}'}, "object"),
        ({"config": b'{"id": "nosuch"}'}, "unusable"),
        ({"config": b'{"id": "fp8", "fmt": "e9m9", "block": 4}'}, "unusable"),
        ({"config": b'{"id": "fp8", "fmt": "e4m3", "block": 4, "x": 1}'}, "unusable"),
        (
            {"config": b'{"id": "fp8", "fmt": "e4m3", "block": 100000000000000000000000}'},
            "unusable",
        ),
        ({"config": b'{"id": "fp8", "fmt": "e4m3", "block": 1e400}'}, "unusable"),
        ({"config": b'{"id": "none", "x": 1}'}, "unusable"),
        ({"config": b'{"id": "bf16"}'}, "body"),  # a fine codec, but the body has fp8 size
        ({"config": b"[" * 100_000}, "JSON"),  # nesting deeper than the JSON parser recurses
    ],
)
def test_malformed_header_is_rejected(small_frame, changes, match):
    frame = build_frame(split_frame(small_frame), **changes)  # CRC recomputed: checks behind it
    with pytest.raises(ValueError, match=match):
        geocomm.decode(frame)
    with pytest.raises(ValueError):
        geocomm.get_codec("fp8", fmt="e4m3", block=4).decode(frame)


@pytest.mark.parametrize(
    ("config", "scale"),
    [
        ({"id": "fp8", "fmt": "e4m3", "block": 4}, np.nan),
        ({"id": "fp8", "fmt": "e5m2", "block": 0}, -1.0),
        ({"id": "fp8", "fmt": "e4m3", "block": 4}, np.inf),
        ({"id": "nvfp4"}, np.nan),
        ({"id": "nvfp4"}, -0.5),
        ({"id": "geofp8", "min_dim": 2, "min_numel": 0}, np.nan),
    ],
)
def test_a_scale_no_encoder_writes_is_rejected(config, scale):
    """fp32 scales are amax / FMAX of finite values: a NaN, infinite or negative one in
    a frame whose CRC was made again decoded to NaNs or flipped signs; it is refused."""
    codec = geocomm.get_codec(config)
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    fields = split_frame(codec.encode(x))
    body = bytearray(fields["body"])
    start = 0 if config["id"] != "geofp8" else len(body) - codec.quantizer.wire_size(x.size)
    body[start : start + 4] = np.float32(scale).tobytes()
    with pytest.raises(ValueError, match="scale no encoder writes"):
        geocomm.decode(build_frame(fields, body=bytes(body)))


@pytest.mark.parametrize(
    ("config", "offset", "code"),
    [
        ({"id": "nvfp4"}, 4, 0x80),  # the block scales follow the one superblock scale
        ({"id": "nvfp4"}, 4, 0xFF),
        ({"id": "mxfp8"}, 0, 0xFF),
        ({"id": "mxfp8", "fmt": "e5m2"}, 1, 0xFF),
    ],
)
def test_a_scale_code_no_encoder_writes_is_rejected(config, offset, code):
    """An NVFP4 block scale is an E4M3 code of amax / 6 (or NaN, 0x7f): never negative;
    an MXFP8 E8M0 scale is at most 254 - EMAX (a non-finite value keeps its own code),
    never 0xff. Made by hand, a negative block scale decoded to flipped signs and 0xff
    to NaNs; both are refused."""
    codec = geocomm.get_codec(config)
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    fields = split_frame(codec.encode(x))
    body = bytearray(fields["body"])
    body[offset] = code
    with pytest.raises(ValueError, match="scale no encoder writes"):
        geocomm.decode(build_frame(fields, body=bytes(body)))


def test_wrong_crc_is_rejected(small_frame):
    fields = split_frame(small_frame)
    body = bytearray(fields["body"])
    body[-1] ^= 0x10
    tampered = build_frame(fields)[: -CRC.size - len(body)] + bytes(body) + fields["crc"]
    with pytest.raises(ValueError, match="checksum"):
        geocomm.decode(tampered)


@pytest.mark.parametrize("buf", [None, 12345, "GEOC", [1, 2, 3], b"", np.zeros(3, np.float32)])
def test_non_frames_are_rejected(buf):
    with pytest.raises(ValueError):
        geocomm.decode(buf)


def test_frame_may_be_any_buffer(small_frame):
    expected = geocomm.decode(small_frame)
    for buf in (
        bytearray(small_frame),
        memoryview(small_frame),
        np.frombuffer(small_frame, np.uint8),
    ):
        np.testing.assert_array_equal(geocomm.decode(buf), expected)


# ---- fuzzing: ValueError or an array, never anything else ------------------

VALID_FRAMES = [
    geocomm.get_codec(c).encode(sample(shape, dt, seed=i)).tobytes()
    for i, (c, shape, dt) in enumerate(
        [
            (CONFIGS[0], (3,), np.float32),
            (CONFIGS[1], (2, 3), np.float16),
            (CONFIGS[2], (5,), np.float64),
            (CONFIGS[3], (), np.float32),
            (CONFIGS[4], (17,), ml_dtypes.bfloat16),
            (CONFIGS[5], (3, 7), np.float32),
            (CONFIGS[5], (0,), np.float32),
            (CONFIGS[6], (40,), np.float32),
            (CONFIGS[8], (33,), np.float16),
            (CONFIGS[9], (5, 5), np.float32),
        ]
    )
]
CONFIG_TEXTS = [json.dumps(c, sort_keys=True, separators=(",", ":")).encode() for c in CONFIGS] + [
    b"",
    b"{}",
    b"null",
    b'{"id":null}',
    b'{"id":"fp8","block":-5}',
    b'{"id":"fp8","block":0.0}',
    b'{"id":"fp8","fmt":"e5m2","block":18446744073709551616}',
    b'{"id":"nvfp4","id":"none"}',
    b'{"id":"fp8","fmt":["e4m3"]}',
    b'{"id":"fp8","fmt":{"a":1}}',
    b"[" * 3000,
    b'"' * 7,
    b'{"id":"' + b"x" * 300 + b'"}',
    b'{"id":"none"}\x00',
    b'{"id":"bf16","\xc3\x28":1}',
]


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(data):
    decode_or_reject(data)
    decode_or_reject(b"GEOC\x01" + data)  # past the magic and version checks


@FUZZ
@given(
    frame=st.sampled_from(VALID_FRAMES),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["set", "insert", "delete", "truncate"]),
            st.integers(0, 10**6),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=6,
    ),
    reseal=st.booleans(),
)
def test_fuzz_mutated_frames(frame, edits, reseal):
    data = bytearray(frame[: -CRC.size] if reseal else frame)
    for op, where, value in edits:
        i = where % (len(data) + 1)
        if op == "set" and i < len(data):
            data[i] = value
        elif op == "insert":
            data.insert(i, value)
        elif op == "delete" and i < len(data):
            del data[i]
        elif op == "truncate":
            del data[i:]
    if reseal:  # a valid CRC lets the mutation reach the checks behind it
        data += CRC.pack(zlib.crc32(bytes(data)))
    decode_or_reject(bytes(data))


@FUZZ
@given(
    magic=st.sampled_from([b"GEOC", b"GEOD"]),
    version=st.sampled_from([1, 1, 1, 0, 2]),
    dtype=st.integers(0, 6),
    shape=st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1)), max_size=5),
    config=st.sampled_from(CONFIG_TEXTS),
    body=st.binary(max_size=600),
    body_len=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_fuzz_structured_headers(magic, version, dtype, shape, config, body, body_len):
    fields = {
        "magic": magic,
        "version": version,
        "dtype": dtype,
        "reserved": 0,
        "shape": tuple(shape),
        "config": config,
        "body": body,
    }
    extra = {} if body_len is None else {"body_len": body_len}
    result = decode_or_reject(build_frame(fields, **extra))
    if result is not None:
        assert result.shape == tuple(shape)


# ---- missing native core ---------------------------------------------------

WITHOUT_NATIVE = """
    import numpy as np
    import geocomm
    from geocomm.kernels.native import NativeBuildMissing

    assert geocomm.native_available is False, "the block did not take"
    x = np.ones(5, np.float32)
    plain = geocomm.get_codec("none")
    assert (plain.decode(plain.encode(x)) == x).all(), "the plain codec needs no C code"
    codec = geocomm.get_codec("fp8")  # configuring needs no C code either
    try:
        codec.encode(x)
    except NativeBuildMissing as exc:
        assert isinstance(exc, ImportError)
        print("MESSAGE", exc)
    else:
        raise SystemExit("encode worked without the native core")
"""


def test_missing_native_core_fails_only_when_encoding(without_native):
    proc = without_native(WITHOUT_NATIVE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    message = proc.stdout.split("MESSAGE", 1)[1]
    assert "pip install" in message and "geocomm._native" in message


def test_native_core_is_available_here():
    assert geocomm.native_available and native.available
