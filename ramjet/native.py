"""Compiled hot modules: loaded only when built from exactly the source beside them.

`scripts/build_native.py` (`make native`; `make test`, `make run` and `make bench` run it
first) compiles the modules in `COMPILED` with mypyc into `build/native/`, outside the
source tree, and writes `build/native/manifest.json` last: the sha256 of every `.py`
file of the package as it was compiled, and the extension file of each module.

`ramjet/__init__.py` calls `install()` before any other ramjet module is imported. It
puts a `sys.meta_path` finder in front that loads a listed module from its extension
file, and only when the build is current: every `.py` file of the package hashes as the
manifest says (none edited, added or removed) and the build is for this interpreter.
Otherwise nothing is installed and every module runs from its source. The check is over
the whole package, not module by module: mypyc binds compiled modules to each other
(a compiled caller calls the compiled callee's code directly) and compiles each against
the types of the modules it imports, so one edited file makes the whole build stale.

- `RAMJET_NATIVE=0` forces pure Python (no finder; the build is not even read).
- `ramjet native` prints the state and which modules run compiled; `ramjet
  serve` logs the same line at start.
- A checkout without a build runs pure Python, as does one whose build is stale.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ENV = "RAMJET_NATIVE"
MANIFEST = "manifest.json"
FORMAT = 1

# The request path, as profiled (docs/performance.md, "Compiled hot modules"), and what
# it calls per request (the fleet's state and signals, the residency view and tables).
# A class on it is written for mypyc: a dataclass made per request has a written-out
# `__init__` (`init=False`; the generated one stays interpreted), and a series the loop
# alone updates is a `ramjet.metrics` loop family. Left
# interpreted, since mypyc cannot compile them as they are written: the modules that
# define pydantic models (policy/profile, and policy/params: the policies' parameter
# models, moved out of tier_aware and baselines so that their pick code compiles),
# policy/base (a runtime-checkable Protocol; the views and Decision it exports are
# defined in policy/views, compiled) and proxy/transport (exceptions that subclass
# OSError). A compiled class that interpreted code subclasses says so:
# `@mypyc_attr(allow_interpreted_subclasses=True)` (Accounting, DecisionLog,
# FleetEstimators: tests subclass them; TierAware: simulations/probes.py does).
COMPILED: tuple[str, ...] = (
    "ramjet.types",
    "ramjet.metrics",
    "ramjet.policy.baselines",
    "ramjet.policy.candidates",
    "ramjet.policy.cost",
    "ramjet.policy.fleet_stats",
    "ramjet.policy.priority_key",
    "ramjet.policy.session_load",
    "ramjet.policy.tier_aware",
    "ramjet.policy.views",
    "ramjet.fleet.engines",
    "ramjet.fleet.signals",
    "ramjet.fleet.views",
    "ramjet.keys.prefix",
    "ramjet.residency.index",
    "ramjet.residency.pending",
    "ramjet.residency.source",
    "ramjet.residency.store",
    "ramjet.residency.tables",
    "ramjet.request.admission",
    "ramjet.request.framing",
    "ramjet.request.parse",
    "ramjet.proxy.deadlines",
    "ramjet.proxy.exchange",
    "ramjet.proxy.forward",
    "ramjet.proxy.headers",
    "ramjet.proxy.http1",
    "ramjet.proxy.stream",
    "ramjet.decisions.accounting",
    "ramjet.decisions.log",
    "ramjet.decisions.prompt_work",
    "ramjet.decisions.record",
    "ramjet.app.fast_server",
    "ramjet.app.modes",
    "ramjet.app.router",
)


def source_hashes(package_dir: Path) -> dict[str, str]:
    """sha256 of every `.py` file under `package_dir`, by path relative to its parent
    (`ramjet/app/router.py`)."""
    root = package_dir.parent
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(package_dir.rglob("*.py"))
    }


@dataclass
class NativeStatus:
    """What `install` found. `state`: `compiled` (finder installed), `off` (the env
    switch), `absent` (no build), `stale` (a source differs from the build's), `invalid`
    (a manifest that cannot be used)."""

    state: str
    reason: str
    build_dir: Path
    modules: tuple[str, ...] = ()
    changed: tuple[str, ...] = field(default=())

    def loaded(self) -> list[str]:
        """The listed modules imported so far from their extension file."""
        out = []
        for name in self.modules:
            mod = sys.modules.get(name)
            f = getattr(mod, "__file__", None) or ""
            if f.startswith(str(self.build_dir)) and not f.endswith(".py"):
                out.append(name)
        return out

    def line(self) -> str:
        if self.state == "compiled":
            return f"native: {len(self.modules)} modules compiled (mypyc, {self.build_dir})"
        return f"native: pure Python ({self.state}: {self.reason})"


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the listed modules (and the build's shared library) in the build."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        f = self.files.get(fullname)
        if f is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(f))
        return importlib.util.spec_from_file_location(fullname, f, loader=loader)


def _check(package_dir: Path, build_dir: Path) -> tuple[NativeStatus, dict[str, Path]]:
    def status(state: str, reason: str, changed: Sequence[str] = ()) -> NativeStatus:
        return NativeStatus(state, reason, build_dir, changed=tuple(changed))

    if os.environ.get(ENV, "1").strip() == "0":
        return status("off", f"{ENV}=0"), {}
    path = build_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return status("absent", f"no {path} (make native builds it)"), {}
    except (OSError, ValueError) as exc:
        return status("invalid", f"{path}: {exc}"), {}
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return status("invalid", f"{path}: not a format-{FORMAT} manifest"), {}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if manifest.get("ext_suffix") != suffix:
        return status("invalid", f"built for {manifest.get('ext_suffix')}, not {suffix}"), {}
    built: dict[str, str] = manifest.get("sources", {})
    now = source_hashes(package_dir)
    changed = sorted(k for k in built.keys() | now.keys() if built.get(k) != now.get(k))
    if changed:
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        return status("stale", f"changed since the build: {shown} (make native)", changed), {}
    files = {name: build_dir / rel for name, rel in manifest.get("files", {}).items()}
    missing = sorted(str(p) for p in files.values() if not p.is_file())
    if missing or not files:
        return status("invalid", f"missing extension files: {missing[:3]}"), {}
    modules = tuple(m for m in manifest.get("modules", []) if m in files)
    return NativeStatus("compiled", "", build_dir, modules), files


def install(package_dir: Path, build_dir: Path) -> NativeStatus:
    """Check the build of the package at `package_dir` and, when it is current, put its
    finder first on `sys.meta_path`. Call before any listed module is imported."""
    st, files = _check(package_dir, build_dir)
    if st.state == "compiled":
        sys.meta_path.insert(0, _Finder(files))
    return st


_PACKAGE = Path(__file__).resolve().parent
STATUS: NativeStatus | None = None


def install_ramjet() -> NativeStatus:
    """`install` for this package and its `build/native/` (once per process)."""
    global STATUS
    if STATUS is None:
        STATUS = install(_PACKAGE, _PACKAGE.parent / "build" / "native")
    return STATUS


def describe() -> tuple[str, int]:
    """`ramjet native`'s text and exit status: the state, then each listed module and
    whether it runs compiled (1 when the build is current but a module did not load
    from it)."""
    st = install_ramjet()
    lines = [st.line()]
    if st.state != "compiled":
        return lines[0], 0
    for name in st.modules:
        importlib.import_module(name)
    loaded = set(st.loaded())
    lines += [f"  {name}: {'compiled' if name in loaded else 'source'}" for name in st.modules]
    return "\n".join(lines), 0 if loaded == set(st.modules) else 1
