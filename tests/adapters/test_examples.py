"""README's training examples (tests/examples/), run as written on 2 CPU ranks.

README shows each file verbatim (checked here), so what a user copies is what
runs: under mpirun (geocomm.launch) and under torchrun, every rank must end
with the same parameters (each example prints a digest of them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "examples"
NAMES = sorted(p.name for p in EXAMPLES.glob("train_*.py"))
TIMEOUT_S = 120


def test_readme_shows_every_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    shown = {name: body for body, name in re.findall(r"```python\n(# (train_\w+\.py)\b.*?)```",
                                                     readme, re.S)}  # fmt: skip
    assert sorted(shown) == NAMES
    for name in NAMES:
        assert shown[name] == (EXAMPLES / name).read_text(), f"README's {name} differs"


def _launch(name: str, launcher: str) -> list[str]:
    script = str(EXAMPLES / name)
    if launcher == "mpirun":
        return [sys.executable, "-m", "geocomm.launch", "-n", "2", "--timeout", str(TIMEOUT_S),
                "--", sys.executable, "-P", script]  # fmt: skip
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", "--nproc-per-node", "2", script]


#: examples that set up torch.distributed from torchrun's variables alone
TORCHRUN_ONLY = {"train_hf.py"}


@pytest.mark.parametrize(
    ("name", "launcher"),
    [(name, "mpirun") for name in NAMES if name not in TORCHRUN_ONLY]
    + [(name, "torchrun") for name in ("train_ddp.py", "train_lightning.py", "train_hf.py")],
)
def test_example_trains_with_the_same_parameters_on_every_rank(tmp_path, name, launcher):
    needs = {"train_lightning.py": "lightning", "train_hf.py": "transformers"}.get(name)
    if needs:
        pytest.importorskip(needs, reason="the frameworks extra (tests/run.sh installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    done = subprocess.run(_launch(name, launcher), cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S + 30)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    # non-greedy: two ranks' lines can land on one line of the shared pipe
    digests = dict(re.findall(r"rank (\d+): [^\n]*?parameters ([0-9a-f]{16})", output))
    assert sorted(digests) == ["0", "1"], output[-3000:]
    assert digests["0"] == digests["1"]
    if " compressed " in output:  # the hook or the backend really compressed
        counts = [int(n) for n in re.findall(r"(\d+) compressed ", output)]
        assert len(counts) == 2 and min(counts) > 0
