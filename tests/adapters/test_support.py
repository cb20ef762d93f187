"""The torch window (geocomm/adapters/torch/support.py) is the one CI runs and the docs
name: its two ends are what tests/run_torch_window.sh installs, and what README.md and
docs/torch.md state, so widening it in one place and not the others fails here."""

from __future__ import annotations

import re
from pathlib import Path

from geocomm.adapters.torch import support

ROOT = Path(__file__).resolve().parents[2]


def _release(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def test_the_window_script_runs_both_ends_of_the_supported_window():
    script = (ROOT / "tests" / "run_torch_window.sh").read_text()
    versions = re.search(r'VERSIONS=\$\{GEOCOMM_TORCH_WINDOW:-"([^"]+)"\}', script)
    assert versions, "no default VERSIONS in run_torch_window.sh"
    releases = [".".join(v.split(".")[:2]) for v in versions.group(1).split()]
    assert releases == [_release(support.OLDEST), _release(support.NEWEST)], releases


def test_the_docs_state_the_window():
    window = f"{_release(support.OLDEST)} to {_release(support.NEWEST)}"
    assert f"torch {window}" in (ROOT / "docs" / "torch.md").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.search(rf"{_release(support.OLDEST)} \(.*?\) to {_release(support.NEWEST)}", readme)
