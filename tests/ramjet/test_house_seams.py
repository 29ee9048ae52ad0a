"""The seams of the router's house, read from the source (ast; nothing is imported), in
the style of tests/ramjet/test_import_graph.py:

1. Seams, not type checks: no `isinstance`/`issubclass` in `ramjet/proxy/`,
   `ramjet/transport/` or `ramjet/app/` over a server, request, response or transport class (ours, aiohttp's or
   asyncio's). The relay and the servers go through `ClientExchange` / `ClientResponse`
   (`ramjet.request.client`) and `EngineResponse` / `EngineTransport`
   (`ramjet.transport.base`) instead.
2. One composition root: `Router.__init__` builds nothing. It calls nothing imported
   from `ramjet`, and reads its parameters only to keep them whole (`self.x = x`):
   every part is built by `ramjet.app.wiring.build`.
3. Nothing is set on the router or its mode runner from outside: no module but their
   own assigns to an attribute of a `router` or a `modes` (a reload builds a new mode
   runner and the router swaps it in itself, `Router.reconfigure`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.ramjet.test_import_graph import FILES, ROOT, type_checks_over

SEAM_DIRS = ("ramjet/proxy/", "ramjet/transport/", "ramjet/app/")

SEEDS = frozenset(
    {
        # the seams and their implementations
        "ClientExchange",
        "ClientResponse",
        "FastRequest",
        "FastResponse",
        "AiohttpExchange",
        "AiohttpResponse",
        "EngineResponse",
        "EngineTransport",
        "UpstreamResponse",
        "MemoryResponse",
        "EnginePool",
        "MemoryTransport",
        # the servers and their connections
        "FastServer",
        "FastProtocol",
        "Connection",
        # aiohttp's and asyncio's
        "Request",
        "BaseRequest",
        "StreamResponse",
        "Response",
        "FileResponse",
        "Server",
        "RequestHandler",
        "AppRunner",
        "BaseRunner",
        "ClientSession",
        "Transport",
        "BaseTransport",
        "Protocol",
        "BaseProtocol",
    }
)
"""Server, request, response and transport classes by name; every class of `ramjet/`
that derives from one of them is added (`serving_classes`)."""


def _base_names(node: ast.ClassDef) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for b in node.bases
        for n in ast.walk(b)
        if isinstance(n, ast.Name | ast.Attribute)
    }


def serving_classes(files: dict[str, Path]) -> set[str]:
    """`SEEDS` and every class of `files` deriving from one of them (transitively)."""
    classes = [
        node
        for path in files.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    names = set(SEEDS)
    grew = True
    while grew:
        grew = False
        for c in classes:
            if c.name not in names and _base_names(c) & names:
                names.add(c.name)
                grew = True
    return names


def _in_seam_dirs(files: dict[str, Path]) -> dict[str, Path]:
    return {m: p for m, p in files.items() if p.relative_to(ROOT).as_posix().startswith(SEAM_DIRS)}


def test_no_type_checks_over_servers_requests_responses_or_transports() -> None:
    names = serving_classes(FILES)
    # the finder sees our own classes and those derived from aiohttp's (a finder that
    # finds none would pass anything)
    assert {"FastRequest", "UpstreamResponse", "FastProtocol"} <= names
    assert {"_Server", "_Handler", "_Runner"} <= names  # ramjet.app.server's subclasses
    scope = _in_seam_dirs(FILES)
    assert "ramjet.proxy.stream" in scope and "ramjet.app.fast_server" in scope
    bad = type_checks_over(scope, names)
    assert not bad, "go through the seam (ClientExchange, EngineResponse) instead:\n" + (
        "\n".join(bad)
    )


# -- Router.__init__ builds nothing -----------------------------------------------------


def _ramjet_imports(tree: ast.Module) -> set[str]:
    """Names a module binds by importing from `ramjet`."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ramjet"):
            out.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.startswith("ramjet")
            )
    return out


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def init_builds(source: str, cls: str = "Router") -> list[str]:
    """What `cls.__init__` in `source` does besides keeping its parameters: calls to names
    imported from ramjet, and parameters read other than as `self.x = <parameter>`."""
    tree = ast.parse(source)
    imported = _ramjet_imports(tree)
    init = next(
        n
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.name == cls
        for n in c.body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    a = init.args
    params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self"}
    kept: set[int] = set()  # ids of the Name nodes that are a whole kept parameter
    for node in ast.walk(init):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Name):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
                for t in targets
            ):
                kept.add(id(node.value))
    bad = []
    for node in ast.walk(init):
        if isinstance(node, ast.Call) and _root_name(node.func) in imported:
            bad.append(f"  line {node.lineno}: calls {ast.unparse(node.func)}")
        elif isinstance(node, ast.Name) and node.id in params and id(node) not in kept:
            bad.append(f"  line {node.lineno}: reads {node.id} ({ast.unparse(node)} used)")
    for d in a.defaults + [d for d in a.kw_defaults if d is not None]:
        for node in ast.walk(d):
            if isinstance(node, ast.Call) and _root_name(node.func) in imported:
                bad.append(f"  line {node.lineno}: default builds {ast.unparse(node.func)}")
    return bad


def test_router_init_builds_nothing() -> None:
    source = (ROOT / "ramjet/app/router.py").read_text()
    bad = init_builds(source)
    assert not bad, (
        "Router.__init__ must only keep the parts ramjet.app.wiring.build made:\n" + "\n".join(bad)
    )


def test_a_part_built_in_init_is_found() -> None:
    source = (
        "from ramjet.proxy.forward import Proxy\n"
        "import time\n"
        "class Router:\n"
        "    def __init__(self, config, *, metrics=None, fleet, clock=time.monotonic):\n"
        "        self.config = config\n"
        "        self.clock = clock\n"
        "        self.fleet = fleet\n"
        "        self.metrics = metrics or RouterMetrics()\n"
        "        self.proxy = Proxy(config, fleet)\n"
        "        self.limit = config.limits.max\n"
        "        self.ids = set()\n"
    )
    bad = init_builds(source)
    lines = sorted({b.split(":")[0].strip() for b in bad})
    # line 8: `metrics or ...`; line 9: Proxy(...) and its two parameters; line 10
    assert lines == ["line 10", "line 8", "line 9"], bad
    assert any("calls Proxy" in b for b in bad)


# -- nothing set on the router or its mode runner from outside --------------------------

OWNERS = {"router": "ramjet/app/router.py", "modes": "ramjet/app/modes.py"}


def outside_writes(files: dict[str, Path]) -> list[str]:
    """Assignments to `<...>.router.<attr>`, `router.<attr>`, `<...>.modes.<attr>` or
    `modes.<attr>` outside the module that defines the object."""
    bad = []
    for path in files.values():
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if not isinstance(el, ast.Attribute):
                        continue
                    owner = el.value
                    name = (
                        owner.id
                        if isinstance(owner, ast.Name)
                        else owner.attr
                        if isinstance(owner, ast.Attribute)
                        else None
                    )
                    if name in OWNERS and rel != OWNERS[name]:
                        bad.append(f"  {rel}:{node.lineno}: sets {ast.unparse(el)}")
    return bad


def test_nothing_is_set_on_the_router_or_its_mode_runner_from_outside() -> None:
    bad = outside_writes(FILES)
    assert not bad, "build it in ramjet.app.wiring, or swap it in with a method:\n" + "\n".join(bad)


def test_an_outside_write_is_found(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text(
        "def f(router, server):\n"
        "    router.config = 1\n"
        "    m = router.modes\n"
        "    m.mode, server.router.modes.incumbent = 2, 3\n"
        "    server.fast = 4\n"
    )
    bad = outside_writes({"m": p})
    assert [b.split(":")[1] for b in bad] == ["2", "4"], bad
