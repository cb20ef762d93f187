"""geocomm's import graph (docs/design.md, "Architecture"): imports go one way.

Every module of geocomm/ is parsed with ``ast`` (nothing is imported); each
``import geocomm...`` and ``from geocomm... import ...``, relative ones and
those inside functions included, is an edge. The test fails on

* an import that runs upward through the layers (:data:`LAYERS`: kernels, then
  codecs and transports, which know nothing of each other, the engine, the API,
  the adapters),
* a cycle (reported as the chain of modules),
* a private name (leading underscore, not a dunder) imported from another
  module, unless the module is listed in :data:`PRIVATE_MODULES` with a reason,
* production code importing ``geocomm.testing`` (tests and studies may);

and the same private-name rule holds for perf/ (the tools and studies use only
public names). :func:`test_checker_finds_a_planted_cycle` shows the checker
failing on a small planted package.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Private modules another module may import, with the reason.
PRIVATE_MODULES = {
    "geocomm._native": "the cffi extension the build writes; geocomm.kernels.native uses it",
    "geocomm._environ": "the on/off environment variables, read alike by every layer",
}
#: The layers, bottom first: a module imports from its own layer or those below it.
#: Layers of one rank (a tuple) stand side by side and import nothing of each other.
LAYERS: list[tuple[str, ...]] = [
    ("geocomm._native", "geocomm._environ"),
    ("geocomm.kernels",),
    ("geocomm.codecs",),
    ("geocomm.comm",),
    ("geocomm.engine",),
    ("geocomm.api",),
    ("geocomm.testing", "geocomm.adapters"),
    ("geocomm", "geocomm.launch"),
]
#: Pairs of layers that must not import each other although the order allows one way.
APART = [("geocomm.codecs", "geocomm.comm")]
#: Modules that may import geocomm.testing (none in production code).
TESTING = "geocomm.testing"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module of a (possibly relative) ``from`` import."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(
    path: pathlib.Path, module: str, known: set[str], prefix: str
) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of every import of ``prefix`` in
    ``path``; ``from pkg import mod`` names the module ``pkg.mod`` when it is one."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == prefix or alias.name.startswith(prefix + "."):
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            if not (target == prefix or target.startswith(prefix + ".")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.append((sub, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(module: str) -> bool:
    return any(_private(part) for part in module.split("."))


def check_package(
    root: pathlib.Path, package: str, private_modules: dict[str, str], production: bool = True
) -> list[str]:
    """Every problem of the package ``root/package`` (an empty list: none)."""
    files = sorted((root / package).rglob("*.py"))
    names = {module_name(f, root): f for f in files}
    known = set(names)
    graph: dict[str, set[str]] = {m: set() for m in names}
    problems = []
    for module, path in names.items():
        for target, name, line in imports_of(path, module, known, package):
            where = f"{path.relative_to(root)}:{line}"
            if target != module:
                graph[module].add(target)
            if (
                production
                and (target == TESTING or target.startswith(TESTING + "."))
                and not (module == TESTING or module.startswith(TESTING + "."))
            ):
                problems.append(f"{where}: production code imports {target}")
            if (
                target != module
                and _private_module(target)
                and target not in private_modules
                and not target.startswith(module + ".")
            ):
                problems.append(f"{where}: imports the private module {target}")
            if name is not None and _private(name) and target != module:
                problems.append(f"{where}: imports the private name {target}.{name}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph, known)]
    return problems


def cycles(graph: dict[str, set[str]], known: set[str]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a
    module importing itself), as a closed chain of modules."""
    # a module's import also imports its packages: follow edges to known modules only
    edges = {m: sorted(t for t in targets if t in known) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        members = set(component)
        if len(component) == 1 and component[0] not in edges[component[0]]:
            continue
        start = min(component)
        chain, seen = [start], {start}
        while True:  # walk inside the component until a module repeats
            nxt = next(w for w in edges[chain[-1]] if w in members)
            chain.append(nxt)
            if nxt in seen:
                found.append(chain[chain.index(nxt) :])
                break
            seen.add(nxt)
    return found


def layer_of(module: str) -> tuple[int, str]:
    """(rank in :data:`LAYERS`, the layer's name) of a module of geocomm."""
    best = (-1, "")
    for rank, names in enumerate(LAYERS):
        for name in names:
            inside = module == name or module.startswith(name + ".")
            if inside and len(name) > len(best[1]):
                best = (rank, name)
    return best


def layer_problems(root: pathlib.Path, package: str = "geocomm") -> list[str]:
    """Every import that runs upward through :data:`LAYERS` or across an :data:`APART`
    pair or between two layers of one rank."""
    problems = []
    files = sorted((root / package).rglob("*.py"))
    names = {module_name(f, root): f for f in files}
    for module, path in names.items():
        rank, layer = layer_of(module)
        for target, _, line in imports_of(path, module, set(names), package):
            if target == package and module != package:
                problems.append(f"{path.relative_to(root)}:{line}: imports the package root")
                continue
            target_rank, target_layer = layer_of(target)
            apart = {layer, target_layer} in [set(p) for p in APART]
            side = target_rank == rank and target_layer != layer
            if target_rank > rank or apart or side:
                problems.append(
                    f"{path.relative_to(root)}:{line}: {layer} imports {target} ({target_layer})"
                )
    return problems


def test_layers_import_downward():
    """Each module imports from its own layer or the layers below (docs/design.md,
    "Architecture"); the checker itself fails on a planted upward import."""
    assert all(layer_of(module_name(f, ROOT))[0] >= 0 for f in (ROOT / "geocomm").rglob("*.py"))
    problems = layer_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_layer_checker_finds_an_upward_import(tmp_path):
    root = _plant(
        tmp_path,
        {
            "geocomm/__init__.py": "",
            "geocomm/codecs/__init__.py": "",
            "geocomm/codecs/auto.py": "from geocomm.engine import costs\n",  # upward
            "geocomm/comm/base.py": "from geocomm.codecs import auto\n",  # across
            "geocomm/engine/__init__.py": "",
            "geocomm/engine/costs.py": "from geocomm.codecs import auto\n",  # downward
        },
    )
    assert layer_problems(root) == [
        "geocomm/codecs/auto.py:1: geocomm.codecs imports geocomm.engine.costs (geocomm.engine)",
        "geocomm/comm/base.py:1: geocomm.comm imports geocomm.codecs.auto (geocomm.codecs)",
    ]


def test_geocomm_imports_go_one_way():
    problems = check_package(ROOT, "geocomm", PRIVATE_MODULES)
    assert not problems, "\n".join(problems)


def test_codec_roles_stand_apart():
    """The contract imports nothing of geocomm and frames no registry (docs/design.md,
    module table): a codec author reads ``base.py`` alone."""
    path = ROOT / "geocomm" / "codecs"
    contract = imports_of(path / "base.py", "geocomm.codecs.base", set(), "geocomm")
    assert contract == []
    frames = {
        t for t, _, _ in imports_of(path / "frames.py", "geocomm.codecs.frames", set(), "geocomm")
    }
    assert frames <= {"geocomm.codecs.base"}, frames


def test_perf_imports_only_public_geocomm_names():
    problems = []
    for path in sorted((ROOT / "perf").rglob("*.py")):
        module = module_name(path, ROOT)
        for target, name, line in imports_of(path, module, set(), "geocomm"):
            where = f"{path.relative_to(ROOT)}:{line}"
            if _private_module(target):
                problems.append(f"{where}: imports the private module {target}")
            if name is not None and _private(name):
                problems.append(f"{where}: imports the private name {target}.{name}")
    assert not problems, "\n".join(problems)


def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_checker_finds_a_planted_cycle(tmp_path):
    root = _plant(
        tmp_path,
        {
            "geocomm/__init__.py": "",
            "geocomm/a.py": "from geocomm.b import f\n",
            "geocomm/b.py": "def f():\n    from . import c\n",  # relative, inside a function
            "geocomm/c.py": "import geocomm.a\n",
            "geocomm/d.py": "from geocomm.a import f\n",  # imports the cycle, is not in it
        },
    )
    problems = check_package(root, "geocomm", {})
    assert problems == ["import cycle: geocomm.a -> geocomm.b -> geocomm.c -> geocomm.a"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("from geocomm.b import _hidden\n", "imports the private name geocomm.b._hidden"),
        ("from geocomm import _secret\n", "imports the private module geocomm._secret"),
        ("def f():\n    from geocomm.testing import helper\n", "production code imports"),
        ("from geocomm.b import __version__\n", None),  # dunders are public
    ],
)
def test_checker_finds_private_and_testing_imports(tmp_path, text, expected):
    root = _plant(
        tmp_path,
        {
            "geocomm/__init__.py": "",
            "geocomm/b.py": "_hidden = __version__ = 1\n",
            "geocomm/_secret.py": "",
            "geocomm/testing.py": "helper = 1\n",
            "geocomm/a.py": text,
        },
    )
    problems = check_package(root, "geocomm", {})
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems
