"""The environment variables: one reading of the on/off ones (geocomm._environ.switch)
for all, and every other one refused by name when its value makes no sense."""

from __future__ import annotations

import math

import pytest

from geocomm._environ import OFF, ON, switch
from geocomm.adapters.torch.backend.config import env_config
from geocomm.adapters.torch.grads import check_policy
from geocomm.api.calls import check_enabled, requested_topology
from geocomm.comm import abort
from geocomm.comm.base import timeout_seconds
from geocomm.engine import costs, graphs


@pytest.mark.parametrize("text", [*ON, *OFF, " On ", "FALSE", "Yes"])
def test_every_spelling_reads_alike_everywhere(monkeypatch, text):
    """Each variable's reader takes the same spellings (it once took "off" in one
    place and not another)."""
    on = text.strip().lower() in ON
    for name in ("GEOCOMM_CHECK", "GEOCOMM_GRAPHS", "GEOCOMM_ABORT_ON_ERROR"):
        monkeypatch.setenv(name, text)
        assert switch(name) is on
    assert check_enabled(None) is on
    assert check_policy(None) == ("always" if on else "never")
    assert graphs.enabled() is on
    assert abort.enabled() is on


@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_is_the_default(monkeypatch, text):
    if text is None:
        monkeypatch.delenv("GEOCOMM_CHECK", raising=False)
    else:
        monkeypatch.setenv("GEOCOMM_CHECK", text)
    assert switch("GEOCOMM_CHECK") is None
    assert check_enabled(None) is True and check_policy(None) == "first"


def test_anything_else_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("GEOCOMM_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="GEOCOMM_GRAPHS='maybe'"):
        graphs.enabled()


@pytest.mark.parametrize("name", ["GEOCOMM_INTRA_GBPS", "GEOCOMM_INTER_GBPS"])
@pytest.mark.parametrize("text", ["fast", "0", "-1", "nan", "inf"])
def test_link_speeds_must_be_positive_numbers(name, text):
    """They divide byte counts in the cost model: 0 raised ZeroDivisionError, -1 was
    taken, and "fast" failed without naming the variable."""
    with pytest.raises(ValueError, match=f"{name}={text!r}"):
        costs.links("mpi", {name: text})
    assert costs.links("mpi", {name: " 2.5 "}) != costs.links("mpi", {})


@pytest.mark.parametrize(("text", "seconds"), [("", 300.0), ("0", math.inf), (" 12.5 ", 12.5)])
def test_timeout_reads_seconds_and_0_for_none(monkeypatch, text, seconds):
    monkeypatch.setenv("GEOCOMM_TIMEOUT", text)
    assert timeout_seconds() == seconds


@pytest.mark.parametrize("text", ["-1", "nan", "soon"])
def test_a_timeout_that_is_no_time_is_refused(monkeypatch, text):
    """-1 and nan were taken as "no timeout": a hang then waited for ever."""
    monkeypatch.setenv("GEOCOMM_TIMEOUT", text)
    with pytest.raises(ValueError, match="GEOCOMM_TIMEOUT"):
        timeout_seconds()


def test_topology_from_the_environment_takes_any_case_and_names_itself(monkeypatch):
    monkeypatch.setenv("GEOCOMM_TOPOLOGY", " NODE ")
    assert requested_topology(None) == "node"
    assert requested_topology("flat") == "flat"  # the argument wins
    monkeypatch.setenv("GEOCOMM_TOPOLOGY", "bogus")
    with pytest.raises(ValueError, match="GEOCOMM_TOPOLOGY='bogus'"):
        requested_topology(None)


def test_backend_variables_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("GEOCOMM_CODEC", '{"id": "fp8"')
    with pytest.raises(ValueError, match="GEOCOMM_CODEC"):
        env_config()
    monkeypatch.setenv("GEOCOMM_CODEC", '{"id": "nvfp4"}')
    monkeypatch.setenv("GEOCOMM_MIN_NUMEL", "abc")
    with pytest.raises(ValueError, match="GEOCOMM_MIN_NUMEL='abc'"):
        env_config()
    monkeypatch.setenv("GEOCOMM_MIN_NUMEL", "300")
    assert env_config() == {"codec": {"id": "nvfp4"}, "min_numel": 300}
