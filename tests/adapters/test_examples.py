"""The examples in tests/examples/, run as the documentation shows them, on 2 CPU ranks.

README shows the first example (``first_allreduce.py``) and docs/torch.md the
training examples (``train_*.py``), each verbatim (checked here), so what a
user copies is what runs. The first example runs with README's own two
commands (``geocomm.launch`` and ``torchrun``); each rank's printed sum must be
the bits the oracle gives for two ranks, its error within the collective's
derived bound, and its lines those README shows. The training examples run
under mpirun (geocomm.launch) and under torchrun, and every rank must end with
the same parameters (each prints a digest of them).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import geocomm
from geocomm.codecs.bounds import allreduce_bound
from geocomm.testing import simulate_allreduce

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "examples"
NAMES = sorted(p.name for p in EXAMPLES.glob("train_*.py"))
FIRST = "first_allreduce.py"
TIMEOUT_S = 120
#: where each example is shown verbatim
SHOWN_IN = {FIRST: ROOT / "README.md", **{name: ROOT / "docs" / "torch.md" for name in NAMES}}


def shown_examples(document: Path) -> dict[str, str]:
    """The Python blocks of ``document`` that start with ``# <name>.py``, by name."""
    blocks = re.findall(r"```python\n(# (\w+\.py)\b.*?)```", document.read_text(), re.S)
    return {name: body for body, name in blocks}


@pytest.mark.parametrize("name", sorted(SHOWN_IN))
def test_the_docs_show_every_example_verbatim(name):
    document = SHOWN_IN[name]
    shown = shown_examples(document)
    assert name in shown, f"{document.name} does not show {name}"
    assert shown[name] == (EXAMPLES / name).read_text(), f"{document.name}'s {name} differs"


def test_every_example_is_shown():
    shown = set(shown_examples(ROOT / "README.md")) | set(shown_examples(ROOT / "docs/torch.md"))
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(shown)


def run_job(argv: list[str], cwd: Path, timeout: float) -> str:
    """stdout and stderr of ``argv``, which must succeed; run outside the MPI job the test
    may run inside (its variables dropped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


# ---------------------------------------------------------------------------
# the first example


def readme_section(title: str) -> str:
    """README's text from the heading ``## title`` to the next ``## `` heading."""
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def first_example_commands() -> list[str]:
    """The command lines of README's first bash block in "A first example"."""
    block = re.search(r"```bash\n(.*?)```", readme_section("A first example"), re.S)
    assert block, "README's first example has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def as_run_here(command: str) -> list[str]:
    """``command`` with ``python`` this interpreter and ``torchrun`` the one beside it."""
    here = {"python": sys.executable, "torchrun": str(Path(sys.executable).with_name("torchrun"))}
    return [here.get(word, word) for word in shlex.split(command)]


def first_example_expected() -> tuple[str, float]:
    """(digest of the sum, bound on its relative error) on two ranks: the oracle's bits
    for the example's inputs and the derived bound of the fp8 all-reduce."""
    xs = [np.random.default_rng(r).standard_normal(1 << 20, dtype=np.float32) for r in (0, 1)]
    codecs = [geocomm.get_codec("fp8") for _ in xs]
    total = np.ascontiguousarray(simulate_allreduce(codecs, xs))
    exact = xs[0].astype(np.float64) + xs[1]
    # the bound holds per element, so its norm bounds the error's norm
    bound = np.linalg.norm(allreduce_bound(xs, codecs[0])) / np.linalg.norm(exact)
    return hashlib.sha256(total).hexdigest()[:16], float(bound)


def test_readme_starts_the_first_example_with_both_launchers():
    commands = first_example_commands()
    assert [shlex.split(c)[0] for c in commands] == ["python", "torchrun"]
    assert all(f"tests/examples/{FIRST}" in c for c in commands)


@pytest.mark.parametrize("launcher", ["geocomm.launch", "torchrun"])
def test_first_example_sums_over_two_ranks(launcher):
    command = next(c for c in first_example_commands() if launcher in c.split()[:3])
    output = run_job(as_run_here(command), ROOT, TIMEOUT_S)
    line = re.compile(r"rank (\d+) of (\d+): relative error ([0-9.]+), sum ([0-9a-f]{16})")
    matches = sorted(line.finditer(output), key=lambda m: m.group(0))
    printed = [m.group(0) for m in matches]
    found = [m.groups() for m in matches]
    assert [(rank, size) for rank, size, _, _ in found] == [("0", "2"), ("1", "2")], output
    digest, bound = first_example_expected()
    assert {d for _, _, _, d in found} == {digest}, "the ranks' sums differ from the oracle's"
    assert all(float(error) <= bound for _, _, error, _ in found), (found, bound)
    shown = re.search(r"```text\n(.*?)```", readme_section("A first example"), re.S)
    assert shown and sorted(shown.group(1).splitlines()) == printed, "README shows other lines"


# ---------------------------------------------------------------------------
# the training examples


def _launch(name: str, launcher: str) -> list[str]:
    script = str(EXAMPLES / name)
    if launcher == "mpirun":
        launch = [sys.executable, "-m", "geocomm.launch", "-n", "2", "--timeout", str(TIMEOUT_S)]
        return [*launch, "--", sys.executable, "-P", script]
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
    output = run_job(_launch(name, launcher), tmp_path, TIMEOUT_S + 30)
    # non-greedy: two ranks' lines can land on one line of the shared pipe
    digests = dict(re.findall(r"rank (\d+): [^\n]*?parameters ([0-9a-f]{16})", output))
    assert sorted(digests) == ["0", "1"], output[-3000:]
    assert digests["0"] == digests["1"]
    if " compressed " in output:  # the hook or the backend really compressed
        counts = [int(n) for n in re.findall(r"(\d+) compressed ", output)]
        assert len(counts) == 2 and min(counts) > 0
