"""The design document is cited by its headings, and perf/ shows only the public API.

Code cites docs/design.md by heading: ``docs/design.md, "The collective"``
(the quote may follow on the next comment line). A renamed or removed
heading would leave readers with a dead reference, so this test fails
instead. The founding brief outside the repository is never cited.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SOURCES = [
    p
    for pattern in (
        "geocomm/**/*.py",
        "native/*.[ch]",
        "native/*.cu",
        "perf/**/*.py",
        "tests/**/*.py",
        "bindings/*.py",
    )
    for p in ROOT.glob(pattern)
    if p.name != "test_docs.py"
]
# "docs/design.md, " then a quoted heading, possibly after a line break and comment marks
CITATION = re.compile(r'docs/design\.md,\s*(?:[#*/]+\s*)?"([^"]+)"')


def headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", DESIGN.read_text(), re.M)}


def test_every_citation_names_a_heading():
    known = headings()
    cited = {}
    for path in SOURCES:
        for match in CITATION.finditer(path.read_text()):
            cited.setdefault(match.group(1), []).append(path.relative_to(ROOT))
    assert cited, "no citation found: the pattern no longer matches the code's style"
    missing = {title: where for title, where in cited.items() if title not in known}
    assert not missing, f"citations of headings that docs/design.md lacks: {missing}"


def test_the_founding_brief_is_not_cited():
    stale = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        if re.search(r"DESIGN section|shared/DESIGN", p.read_text())
    ]
    assert not stale, f"cite docs/design.md by heading instead: {stale}"


def test_perf_uses_only_public_geocomm_modules():
    # perf/ is what users run and copy from: it may import geocomm's public modules
    # (geocomm.testing included), never a private one, so it shows the real API
    private = re.compile(
        r"(?:from|import)\s+geocomm(?:\.\w+)*\.(_\w+)|"
        r"from\s+geocomm(?:\.\w+)*\s+import\s+[^\n]*\b(_\w+)"
    )
    found = {
        str(p.relative_to(ROOT)): m.group(0)
        for p in ROOT.glob("perf/**/*.py")
        for m in private.finditer(p.read_text())
    }
    assert not found, f"perf files importing private geocomm modules: {found}"
