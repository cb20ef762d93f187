"""Renamed public names keep their old ones (CONTRIBUTING.md, "Names"; geocomm issue 25).

Every old keyword still works, gives the bits of the new one, and warns with a
DeprecationWarning that names the new one; passing both is a TypeError.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

import geocomm
from geocomm import collectives, cuda, native
from geocomm.codecs import get_codec, reference
from geocomm.deprecation import DeprecatedOption, renamed_keywords
from geocomm.testing import loopback

ROOT = pathlib.Path(__file__).resolve().parent.parent
X = np.random.default_rng(25).standard_normal(3 * 4096 + 17).astype(np.float32)


def test_renamed_keywords_warns_names_the_new_one_and_refuses_both():
    @renamed_keywords(old="new")
    def f(*, new=0):
        return new

    with pytest.warns(DeprecationWarning, match="use new="):
        assert f(old=3) == 3
    with pytest.raises(TypeError, match="both old= and new="):
        f(old=1, new=2)


@pytest.mark.parametrize(
    "collective",
    [geocomm.allreduce, geocomm.reduce_scatter, collectives.allreduce, collectives.reduce_scatter],
)
def test_chunk_elems_is_stage_size(collective):
    want = collective(X.copy(), codec="fp8", comm=loopback(1)[0], check=False, stage_size=4096)
    with pytest.warns(DeprecationWarning, match="stage_size="):
        got = collective(X.copy(), codec="fp8", comm=loopback(1)[0], check=False, chunk_elems=4096)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_default_chunk_elems_is_default_stage_size():
    with pytest.warns(DeprecationWarning, match="DEFAULT_STAGE_SIZE"):
        assert collectives.DEFAULT_CHUNK_ELEMS == collectives.DEFAULT_STAGE_SIZE


def test_torch_adapters_accept_chunk_elems():
    torch = pytest.importorskip("torch")
    from geocomm.adapters import torch_fsdp
    from geocomm.adapters.torch import GeocommHookState, GradReducer

    with pytest.warns(DeprecationWarning, match="stage_size="):
        assert GradReducer("fp8", loopback(1)[0], chunk_elems=8192).stage_size == 8192
    with pytest.warns(DeprecationWarning, match="stage_size="):
        state = GeocommHookState(
            torch.nn.Linear(4, 4), comm=loopback(1)[0], check=False, chunk_elems=4096
        )
    assert state.reducer.stage_size == 4096
    assert torch_fsdp.compress_fsdp.__renamed_keywords__ == {"chunk_elems": "stage_size"}


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "bf16"])
def test_encode_wire_stream_is_rounding_stream(name):
    codec = get_codec(name, rounding="stochastic", seed=7)
    want = np.zeros(codec.wire_size(X.size), np.uint8)
    codec.encode_wire(X, want, rounding_stream=5, offset=3)
    got = np.zeros_like(want)
    with pytest.warns(DeprecationWarning, match="rounding_stream="):
        codec.encode_wire(X, got, stream=5, offset=3)
    assert np.array_equal(got, want)
    other = np.zeros_like(want)
    codec.encode_wire(X, other, rounding_stream=6, offset=3)
    assert not np.array_equal(other, want)  # the keyword reached the rounding


def test_native_and_reference_encode_old_stream_keywords():
    block, flags = 128, native.STOCHASTIC
    want = np.zeros(native.wire_size("e4m3", X.size, block), np.uint8)
    native.encode("e4m3", X, block, want, flags=flags, seed=9, rounding_stream=4)
    got = np.zeros_like(want)
    with pytest.warns(DeprecationWarning, match="rounding_stream="):
        native.encode("e4m3", X, block, got, flags=flags, seed=9, rng_stream=4)
    assert np.array_equal(got, want)
    with pytest.warns(DeprecationWarning, match="rounding_stream="):
        old = reference.encode("e4m3", X, block, rounding="stochastic", seed=9, stream=4)
    assert np.array_equal(old, want)
    assert cuda.encode.__renamed_keywords__ == {"rng_stream": "rounding_stream"}


def test_fp8_plan_is_fp8_launch():
    with pytest.warns(DeprecationWarning, match="fp8_launch"):
        assert cuda.fp8_plan(10_000, 128) == cuda.fp8_launch(10_000, 128)
    with pytest.warns(DeprecationWarning, match="Fp8Launch"):
        assert cuda.Fp8Plan is cuda.Fp8Launch


def test_error_feedback_transform_is_mapping_codec():
    codec = get_codec("geofp8", error_feedback=True)
    assert codec.mapping_codec is codec.inner
    with pytest.warns(DeprecationWarning, match="mapping_codec"):
        assert codec.transform is codec.mapping_codec
    assert get_codec("fp8", error_feedback=True).mapping_codec is None


def test_perf_option_chunk_is_stage_size(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "perf"))
    spec = importlib.util.spec_from_file_location("_driver", ROOT / "perf" / "_driver.py")
    driver = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_driver", driver)
    spec.loader.exec_module(driver)
    assert driver.parse_args("all_reduce_perf", ["--stage-size", "8192"]).stage_size == 8192
    with pytest.warns(DeprecationWarning, match="--stage-size"):
        assert driver.parse_args("all_reduce_perf", ["--chunk", "8192"]).stage_size == 8192


def test_deprecated_option_is_hidden():
    p = argparse.ArgumentParser()
    p.add_argument("--new", type=int)
    p.add_argument("--old", dest="new", type=int, action=DeprecatedOption, help=argparse.SUPPRESS)
    assert "--old" not in p.format_help()
    with pytest.warns(DeprecationWarning, match="use --new"):
        assert p.parse_args(["--old", "2"]).new == 2
