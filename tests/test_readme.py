"""README and docs/ stay usable: their commands run, their links lead somewhere.

* Every relative link of README.md, CONTRIBUTING.md, tests/README.md and
  docs/*.md names a file that exists and, with ``#anchor``, a heading of it.
* Every command of README.md and docs/*.md (each line of a ``bash`` block, and
  inline code that starts with ``python``, ``bash`` or ``torchrun``) names files
  that exist and options its program knows: ``python -m geocomm.launch ...``
  and ``python perf/....py ...`` are run with ``--help`` and each option the
  command gives must be in the help; after ``--`` the command it launches is
  checked the same way. ``bash perf/run_main.sh ARGS`` passes ARGS to
  perf/main_job.py, which checks them. ``pip install '.[a,b]'`` names extras
  pyproject.toml defines.
* README's Python blocks run as they are in a single process (a world of one
  rank), except the example files shown verbatim (tests/adapters/test_examples.py
  runs those on two ranks).
* README's table of the two commands names tests/run.sh's stages in the order
  it runs them.

The commands themselves are not run: the two long ones are what CI runs.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "CONTRIBUTING.md", ROOT / "tests" / "README.md"]
#: scripts that hand their arguments to another program, which checks them
PASSES_ARGUMENTS = {"perf/run_main.sh": "perf/main_job.py"}
#: options whose value is a path the command writes (it need not exist yet)
WRITTEN = {"--out", "-o", "-J", "--output_file"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND_START = ("python ", "bash ", "torchrun ")


def without_code(text: str) -> str:
    """``text`` without its fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for title in re.findall(r"^#+\s+(.+)$", FENCE.sub("", path.read_text()), re.M):
        name, n = anchor(title), 0
        while (name if n == 0 else f"{name}-{n}") in found:
            n += 1
        found.add(name if n == 0 else f"{name}-{n}")
    return found


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", without_code(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("document", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    broken = []
    for link in relative_links(document):
        file, _, fragment = link.partition("#")
        target = (document.parent / file).resolve() if file else document
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT)}")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: no heading #{fragment} in {target.name}")
    assert not broken, f"{document.name}: {broken}"


def test_the_link_checker_finds_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title: here\n\n[ok](#a-title-here) [bad](#b) `[code](#c)`\n")
    assert relative_links(page) == ["#a-title-here", "#b"]
    assert anchors(page) == {"a-title-here"}


# ---------------------------------------------------------------------------
# commands


def command_lines(text: str) -> list[str]:
    """The commands of a document: each logical line of its bash blocks (comments and
    continuations resolved) and each inline code span that starts like a command."""
    lines = []
    for language, body in FENCE.findall(text):
        if language == "bash":
            joined = body.replace("\\\n", " ")
            lines += [line.split(" #")[0].strip() for line in joined.splitlines()]
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    lines += [s for s in spans if s.startswith(COMMAND_START) or re.match(r"[A-Z_]+=\S+ ", s)]
    return [line for line in lines if line and not line.startswith("#")]


def commands() -> list[tuple[str, str]]:
    return [(p.name, line) for p in DOCS for line in command_lines(p.read_text())]


def is_option(word: str) -> bool:
    return word.startswith("-") and not re.fullmatch(r"-[\d.]+", word) and word != "--"


def repository_path(word: str) -> bool:
    """Whether ``word`` names something under the repository root (tests/..., perf/...)."""
    first = word.split("/", 1)[0]
    return "/" in word and bool(first) and (ROOT / first).is_dir() and "*" not in word


def parse(words: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """(program, options, paths) of a command and of the commands it launches after
    ``--``. ``program``: "module:NAME", a script's path, "torchrun", "pip" or "" (no
    check of options); ``paths``: the positional words that name repository files."""
    while words and (words[0] == "env" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
        words = words[1:]  # env and VAR=value prefixes
    if not words:
        return []
    if "--" in words:
        at = words.index("--")
        return parse(words[:at]) + parse(words[at + 1 :])
    head, rest = words[0], words[1:]
    program = ""
    if head in ("python", "python3"):
        while rest and rest[0] in ("-P", "-u"):
            rest = rest[1:]
        if rest[:1] == ["-m"]:
            program, rest = f"module:{rest[1]}", rest[2:]
        elif rest:
            program, rest = rest[0], rest[1:]
    elif head == "bash" and rest:
        program, rest = PASSES_ARGUMENTS.get(rest[0], rest[0]), rest[1:]
    elif head in ("torchrun", "pip"):
        program = head
    options = [w.split("=")[0] for w in rest if is_option(w)]
    written = {i + 1 for i, w in enumerate(words) if w in WRITTEN}
    paths = [w for i, w in enumerate(words) if repository_path(w) and i not in written]
    return [(program, options, paths)]


@cache
def help_text(program: str) -> str:
    """``program --help`` (a module or a script run from the repository root)."""
    argv = {"torchrun": [str(Path(sys.executable).with_name("torchrun"))]}.get(program)
    if argv is None:
        is_module = program.startswith("module:")
        argv = [sys.executable, "-m", program[7:]] if is_module else [sys.executable, program]
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{program} --help failed: {done.stderr[-2000:]}"
    return done.stdout


def named(option: str, text: str) -> bool:
    """Whether ``text`` (a help) names ``option`` as a whole word."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def checked_by_help(program: str) -> bool:
    """Whether ``program``'s options are checked against its ``--help``: torchrun,
    geocomm's modules and the perf tools that exist (a missing one is reported)."""
    perf = program.startswith("perf/") and (ROOT / program).is_file()
    return perf or program == "torchrun" or program.startswith("module:geocomm")


def extras() -> set[str]:
    """The extras pyproject.toml's [project.optional-dependencies] defines."""
    table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    return set(re.findall(r"^([\w-]+)\s*=", table.split("\n[", 1)[0], re.M))


def problems_of(line: str) -> list[str]:
    found = []
    for program, options, paths in parse(shlex.split(line)):
        found += [f"{p} does not exist" for p in paths if not (ROOT / p).exists()]
        for script in (p for p in paths if p.endswith(".sh") and (ROOT / p).exists()):
            syntax = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True)
            found += [f"{script}: bash -n fails"] if syntax.returncode else []
        if checked_by_help(program):
            text = help_text(program)
            found += [f"{program} has no option {o}" for o in options if not named(o, text)]
    for listed in re.findall(r"'\.\[([\w,-]+)\]'", line):
        missing = sorted(set(listed.split(",")) - extras())
        found += [f"no extra {e!r} in pyproject.toml" for e in missing]
    return found


def test_every_documented_command_names_what_exists():
    found = commands()
    assert any("tests/run.sh" in line for _, line in found), "no command found in README"
    programs = {p for _, line in found for p, _, _ in parse(shlex.split(line))}
    with ThreadPoolExecutor(4) as pool:  # the --help runs, at once
        list(pool.map(help_text, sorted(p for p in programs if checked_by_help(p))))
    broken = {f"{doc}: {line}": problems_of(line) for doc, line in found}
    broken = {where: what for where, what in broken.items() if what}
    assert not broken, broken


def test_the_command_checker_finds_what_is_missing():
    assert problems_of("python perf/all_reduce_perf.py --codec fp8 -b 1K") == []
    assert problems_of("python perf/all_reduce_perf.py --no-such-flag") == [
        "perf/all_reduce_perf.py has no option --no-such-flag"
    ]
    assert problems_of("python -m geocomm.launch -n 2 -- python perf/missing.py") == [
        "perf/missing.py does not exist"
    ]
    assert problems_of("pip install '.[mpi,cuda99]'") == ["no extra 'cuda99' in pyproject.toml"]
    assert problems_of("python perf/gpu_check.py --out perf/out/new.json") == []


# ---------------------------------------------------------------------------
# README's Python blocks


def readme_snippets() -> list[str]:
    """README's Python blocks that are not example files (``# name.py`` first)."""
    python = [b for lang, b in FENCE.findall((ROOT / "README.md").read_text()) if lang == "python"]
    return [b for b in python if not re.match(r"# \w+\.py\b", b)]


def test_readme_has_snippets():
    assert len(readme_snippets()) >= 2


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_readme_snippet_runs(tmp_path, index):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippets()[index])
    argv = [sys.executable, "-P", str(script)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


#: tests/run.sh's stage headers and the words README's table of the two commands
#: uses for them, in the order run.sh runs them
TEST_STAGES = [
    ("lint and format", "lint and types"),
    ("single-process tests", "single-process tests"),
    ("MPI tests on", "MPI ranks"),
    ("GPU routes", "GPU routes"),
    ("soak", "soak"),
    ("fuzz", "fuzzer"),
    ("sanitizers", "sanitizer build"),
    ("torch window", "torch window"),
]


def test_readme_lists_the_test_stages_in_the_order_run_sh_runs_them():
    run = (ROOT / "tests" / "run.sh").read_text()
    headers = re.findall(r'^\s*stage "([^"]*)"', run, re.M)
    first = [next(i for i, h in enumerate(headers) if s in h) for s, _ in TEST_STAGES]
    assert first == sorted(first), f"TEST_STAGES is out of run.sh's order: {headers}"
    row = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `bash tests/run.sh`")
    )
    places = [row.find(word) for _, word in TEST_STAGES]
    assert -1 not in places, f"README's row misses a stage: {TEST_STAGES}"
    assert places == sorted(places), "README lists the test stages in another order"
