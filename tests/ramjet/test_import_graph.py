"""The shape of `ramjet/`'s imports, read from the source (ast; nothing is imported).

Three rules (docs/architecture.md, "Dependency rules"):

1. No circle: the module graph of `ramjet/` is acyclic. Every import counts, including
   those under `if TYPE_CHECKING:` and those inside functions: a circle hidden behind a
   lazy import is still one concept split over two modules.
2. Stages: each module belongs to a stage of the request's path (`STAGES`, lowest
   first) and imports only from its own stage or lower ones. The config stage
   (`ramjet/config.py` and every `ramjet/<pkg>/config.py`) sits right above the
   identifiers, so loading a policy file loads no runtime module.
3. `ramjet/` imports neither torch nor triton, nor the reference engine, the kernels or
   the simulator (those import `ramjet`, never the reverse).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ramjet"

STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("identifiers", ("ramjet", "ramjet.types", "ramjet.errors")),
    ("config", ("ramjet.config", "ramjet.*.config")),
    ("base", ("ramjet.metrics", "ramjet.metric_catalogue", "ramjet.runtime")),
    ("transport", ("ramjet.transport",)),
    ("policy", ("ramjet.policy",)),
    ("keys/request", ("ramjet.keys", "ramjet.request")),
    ("fleet/residency/reports", ("ramjet.fleet", "ramjet.residency", "ramjet.reports")),
    ("proxy/sidecar", ("ramjet.proxy", "ramjet.sidecar")),
    ("decisions", ("ramjet.decisions",)),
    ("app", ("ramjet.app",)),
    ("commands/cli", ("ramjet.commands", "ramjet.cli", "ramjet.__main__")),
)
"""Stage order, lowest first. A pattern names a module or package (the package's
modules included); `ramjet.*.config` is the `config` module of any package. The most
specific pattern wins."""

FORBIDDEN_TOP = frozenset({"torch", "triton", "engine_stub", "kernels", "simulations"})


def module_files(pkg: Path = PKG) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = list(p.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) for every import in the file, relative ones resolved; for
    `from a import b` both `a` and `a.b` (b may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for a in node.names:
                yield f"{mod}.{a.name}", node.lineno


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {ramjet module it imports: first line}."""

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        deps: dict[str, int] = {}
        for name, line in imported_names(mod, path):
            if name == "ramjet" or name.startswith("ramjet."):
                target = resolve(name)
                if target is not None and target != mod and not mod.startswith(target + "."):
                    deps.setdefault(target, line)
        graph[mod] = deps
    return graph


def stage_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (specificity, stage)
    for i, (_, patterns) in enumerate(STAGES):
        for pat in patterns:
            if "*" in pat:
                head, _, tail = pat.partition("*")
                hit = module.startswith(head) and module.endswith(tail)
                spec = len(pat) + 100  # a named module beats its package
            else:
                hit = module == pat or module.startswith(pat + ".")
                spec = len(pat) + (100 if module == pat else 0)
            if hit and (best is None or spec > best[0]):
                best = (spec, i)
    if best is None:
        raise AssertionError(f"{module} is in no stage: add it to STAGES")
    return best[1]


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


FILES = module_files()
GRAPH = import_graph(FILES)


def test_the_graph_is_read() -> None:
    # the walker sees the router's real imports (a walker that reads nothing passes all)
    assert "ramjet.proxy.forward" in GRAPH["ramjet.app.router"]
    assert "ramjet.types" in GRAPH["ramjet.keys.prefix"]


def test_no_circle() -> None:
    found = cycles(GRAPH)
    text = ["  " + " -> ".join(_circle(GRAPH, comp)) for comp in found]
    assert not found, "import circles in ramjet/:\n" + "\n".join(text)


def _circle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """The shortest circle through comp[0] (BFS back to it)."""
    members = set(comp)
    start = comp[0]
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    for v in queue:
        for w in graph[v]:
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])  # type: ignore[arg-type]
                return [*reversed(path), start]
            if w in members and w not in parent:
                parent[w] = v
                queue.append(w)
    return comp


def test_every_module_has_a_stage() -> None:
    for mod in FILES:
        stage_of(mod)


def test_no_import_from_a_higher_stage() -> None:
    bad = []
    for mod, deps in sorted(GRAPH.items()):
        s = stage_of(mod)
        for dep, line in sorted(deps.items()):
            d = stage_of(dep)
            if d > s:
                bad.append(
                    f"  {FILES[mod].relative_to(ROOT)}:{line}: {mod} ({STAGES[s][0]}) "
                    f"imports {dep} ({STAGES[d][0]})"
                )
    assert not bad, "imports from a higher stage:\n" + "\n".join(bad)


def test_no_torch_triton_engine_kernels_or_simulator() -> None:
    bad = []
    for mod, path in FILES.items():
        for name, line in imported_names(mod, path):
            if name.split(".")[0] in FORBIDDEN_TOP:
                bad.append(f"  {path.relative_to(ROOT)}:{line}: imports {name}")
    assert not bad, "ramjet/ must not import these:\n" + "\n".join(sorted(set(bad)))


def test_loading_the_config_loads_no_runtime_module() -> None:
    # the static rule above, checked once by really importing: a policy file's tree
    # loads identifiers and config modules only (not the parser, not the Redis link)
    code = "import sys, ramjet.config; print('\\n'.join(m for m in sys.modules if m.startswith('ramjet')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    config_stage = next(i for i, (name, _) in enumerate(STAGES) if name == "config")
    # a package whose __init__ imports nothing is a namespace, loaded with its config
    namespaces = {m for m, p in FILES.items() if p.name == "__init__.py" and not GRAPH[m]}
    above = sorted(m for m in out if stage_of(m) > config_stage and m not in namespaces)
    assert "ramjet.config" in out
    assert not above, f"importing ramjet.config loads {above}"


# -- the rules themselves fail on what they must catch ----------------------------------


def _write(tmp: Path, files: dict[str, str]) -> dict[str, dict[str, int]]:
    for rel, text in files.items():
        p = tmp / "ramjet" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return import_graph(module_files(tmp / "ramjet"))


def test_a_circle_is_found(tmp_path: Path) -> None:
    g = _write(
        tmp_path,
        {
            "__init__.py": "",
            "app/__init__.py": "",
            "app/router.py": "from ramjet.fleet import views\n",
            "fleet/__init__.py": "",
            "fleet/views.py": "from .signals import x\n",
            "fleet/signals.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ramjet.app.router import Router\n"
            ),
        },
    )
    found = cycles(g)
    assert found == [["ramjet.app.router", "ramjet.fleet.signals", "ramjet.fleet.views"]]
    assert _circle(g, found[0])[0] == _circle(g, found[0])[-1]


@pytest.mark.parametrize(
    ("module", "stage"),
    [
        ("ramjet.config", "config"),
        ("ramjet.keys.config", "config"),
        ("ramjet.keys.pools", "keys/request"),
        ("ramjet.residency.redis_link", "fleet/residency/reports"),
        ("ramjet.app.wiring", "app"),
        ("ramjet", "identifiers"),
    ],
)
def test_stage_names(module: str, stage: str) -> None:
    assert STAGES[stage_of(module)][0] == stage


def test_unknown_module_has_no_stage() -> None:
    with pytest.raises(AssertionError, match="in no stage"):
        stage_of("ramjet_other.x")


# -- capabilities, not type checks ------------------------------------------------------

CONTRACTS = (
    "ResidencyStore",
    "ExactStager",
    "SharedStore",
    "ResidencySource",
    "ResidencyView",
    "RoutingPolicy",
    "EngineSignals",
)
"""Protocols whose implementations are told apart by what the protocol says they can do
(e.g. `ResidencyStore.stage_exact`, `.shared()`), never by `isinstance`."""


def _classes(files: dict[str, Path]) -> dict[str, set[str]]:
    """class name -> its method names, over every module."""
    out: dict[str, set[str]] = {}
    for path in files.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {
                    n.name
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not n.name.startswith("__")
                }
                out.setdefault(node.name, set()).update(methods)
    return out


def contract_types(files: dict[str, Path]) -> set[str]:
    """The contracts and every class implementing one (all its methods, structurally)."""
    classes = _classes(files)
    names = set(CONTRACTS)
    for contract in CONTRACTS:
        needed = classes.get(contract)
        assert needed, f"contract {contract} not found in ramjet/"
        names.update(c for c, methods in classes.items() if needed <= methods)
    return names


def type_checks_over(files: dict[str, Path], names: set[str]) -> list[str]:
    """`isinstance`/`issubclass` calls whose class argument names one of `names`."""
    bad = []
    for path in files.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                continue
            used = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, ast.Name | ast.Attribute)
            }
            hit = sorted(used & names)
            if hit:
                bad.append(f"  {path}:{node.lineno}: {node.func.id} over {', '.join(hit)}")
    return bad


def test_no_type_checks_over_stores_sources_policies_or_signals() -> None:
    names = contract_types(FILES)
    # the implementations are found (a finder that finds none would pass anything)
    assert {"MemoryStore", "RedisStore", "ResidencyTables", "NoResidency"} <= names
    assert {"NoSignals", "ReportSignals", "TierAware", "RoundRobin"} <= names
    bad = type_checks_over(FILES, names)
    assert not bad, "ask the protocol for the capability instead:\n" + "\n".join(bad)


def test_a_type_check_over_a_store_is_found(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text(
        "def f(store, x):\n"
        "    if isinstance(store, (MemoryStore, int)):\n        return 1\n"
        "    return isinstance(x, str) or isinstance(store, store_mod.RedisStore)\n"
    )
    bad = type_checks_over({"m": p}, {"MemoryStore", "RedisStore"})
    assert [b.rsplit(":", 1)[0].rsplit(":", 1)[1] for b in bad] == ["2", "4"]
