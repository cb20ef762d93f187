"""The on/off environment variables: one reading (geocomm._environ.switch) for all."""

from __future__ import annotations

import pytest

from geocomm._environ import OFF, ON, switch
from geocomm.adapters.torch.grads import check_policy
from geocomm.api.calls import check_enabled
from geocomm.comm import abort
from geocomm.engine import graphs


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
