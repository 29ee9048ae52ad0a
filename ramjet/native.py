"""Compiled hot modules: loaded only when built from exactly the source beside them.

`scripts/build_native.py` (`make native`; `make test`, `make run` and `make bench` run it
first) compiles the modules in `COMPILED` with mypyc into `build/native/`, outside the
source tree, and writes `build/native/manifest.json` last: the sha256 of every `.py`
file of the package as it was compiled, the mypyc version, and the extension file of
each module with its own sha256.

Only the router process installs the build: `ramjet serve` (and `ramjet native`, which
reports on it) call `install_ramjet()` from `ramjet.cli` before any other ramjet module is
imported; `ramjet stack` starts its router as `ramjet serve`. The test suite installs it
too (tests/conftest.py), since it runs the router in process. `import ramjet` alone (the
reference engine, the simulator, a script) installs nothing and runs from source.
`install` puts a `sys.meta_path` finder in front that loads a listed module from its
extension file, and only when the build is current and intact:

- every `.py` file of the package hashes as the manifest says (none edited, added or
  removed), the build is for this interpreter and for the mypyc installed now;
- each module is bound to its own name: a name under the package (and, for ramjet, one
  of `COMPILED`) whose file is exactly `<name with / for .><EXT_SUFFIX>` in the build,
  plus the one shared library `<group>__mypyc<EXT_SUFFIX>`;
- every extension file hashes as the manifest says (a mismatch is logged as a warning).

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
import logging
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType

ENV = "RAMJET_NATIVE"
MANIFEST = "manifest.json"
FORMAT = 2  # 2: mypyc version and sha256 of each extension file
LIB_SUFFIX = "__mypyc"  # the shared library of a group: <group>__mypyc<EXT_SUFFIX>

log = logging.getLogger("ramjet.native")

# The request path, as profiled (docs/native.md), and what
# it calls per request (the fleet's state and signals, the residency view and tables).
# A class on it is written for mypyc: a dataclass made per request has a written-out
# `__init__` (`init=False`; the generated one stays interpreted), and a series the loop
# alone updates is a `ramjet.metrics` loop family. Left
# interpreted, since mypyc cannot compile them as they are written: the modules that
# define pydantic models (policy/profile, and policy/params: the policies' parameter
# models, moved out of tier_aware and baselines so that their pick code compiles),
# policy/base (a runtime-checkable Protocol; the views and Decision it exports are
# defined in policy/views, compiled) and transport/base (exceptions that subclass
# OSError). No compiled class is subclassed by interpreted code (tests and
# simulations/probes.py wrap one instead), so none carries a compiler attribute.
COMPILED: tuple[str, ...] = (
    "ramjet.types",
    "ramjet.metrics",
    "ramjet.transport.http1",
    "ramjet.policy.baselines",
    "ramjet.policy.candidates",
    "ramjet.policy.cost",
    "ramjet.policy.curve",
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


def file_sha256(path: Path) -> str:
    """sha256 of one file, read in 1 MiB pieces (an extension file is a few MB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return h.hexdigest()


def mypyc_version() -> str | None:
    """The installed mypyc (the `mypy` distribution), without importing it; None when
    it is not installed."""
    try:
        return metadata.version("mypy")
    except metadata.PackageNotFoundError:
        return None


def module_file(name: str, suffix: str) -> str:
    """The one path, relative to the build, where module `name` may lie."""
    return name.replace(".", "/") + suffix


@dataclass
class NativeStatus:
    """What `install` found. `state`: `compiled` (finder installed), `off` (the env
    switch), `absent` (no build), `stale` (a source differs from the build's, or another
    mypyc), `invalid` (a manifest or an extension file that cannot be used),
    `unused` (this process did not install the build: only `ramjet serve` does)."""

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


def _str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _unbound(
    package: str, files: dict[str, str], suffix: str, allowed: Sequence[str] | None
) -> str | None:
    """Why the manifest's `files` do not bind each module to its own name under
    `package` (and to one of `allowed` when given) and its own path, with exactly one
    shared library; None when they do."""
    libs = [n for n in files if "." not in n and n.endswith(LIB_SUFFIX)]
    if len(libs) != 1:
        return f"not one shared library ({LIB_SUFFIX}) but {len(libs)}"
    for name, rel in sorted(files.items()):
        parts = name.split(".")
        if not all(p.isidentifier() for p in parts):
            return f"{name!r} is not a module name"
        if name not in libs and parts[0] != package:
            return f"{name} is not under {package}"
        if name not in libs and allowed is not None and name not in allowed:
            return f"{name} is not a compiled module of {package}"
        if rel != module_file(name, suffix):
            return f"{name} points at {rel!r}, not {module_file(name, suffix)!r}"
    return None


def _check(
    package_dir: Path, build_dir: Path, allowed: Sequence[str] | None = None
) -> tuple[NativeStatus, dict[str, Path]]:
    if os.environ.get(ENV, "1").strip() == "0":
        return NativeStatus("off", f"{ENV}=0", build_dir), {}
    return check_build(package_dir, build_dir, allowed)


def check_build(
    package_dir: Path, build_dir: Path, allowed: Sequence[str] | None = None
) -> tuple[NativeStatus, dict[str, Path]]:
    """The build's state whatever the env switch says (`_check`; the build script asks
    it whether to rebuild), and the extension file of each name when it is usable."""

    def status(state: str, reason: str, changed: Sequence[str] = ()) -> NativeStatus:
        return NativeStatus(state, reason, build_dir, changed=tuple(changed))

    path = build_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return status("absent", f"no {path} (make native builds it)"), {}
    except (OSError, ValueError) as exc:
        return status("invalid", f"{path}: {exc}"), {}
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return status("invalid", f"{path}: not a format-{FORMAT} manifest (make native)"), {}
    for key in ("sources", "files", "sha256"):
        if not _str_map(manifest.get(key)):
            return status("invalid", f"{path}: {key} is not a map of strings"), {}
    modules_listed = manifest.get("modules")
    if not isinstance(modules_listed, list) or not all(isinstance(m, str) for m in modules_listed):
        return status("invalid", f"{path}: modules is not a list of names"), {}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if manifest.get("ext_suffix") != suffix:
        return status("invalid", f"built for {manifest.get('ext_suffix')}, not {suffix}"), {}
    mypyc = mypyc_version()
    if manifest.get("mypyc") != mypyc:
        return status(
            "stale", f"built by mypyc {manifest.get('mypyc')}, not {mypyc} (make native)"
        ), {}
    built: dict[str, str] = manifest["sources"]
    now = source_hashes(package_dir)
    changed = sorted(k for k in built.keys() | now.keys() if built.get(k) != now.get(k))
    if changed:
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        return status("stale", f"changed since the build: {shown} (make native)", changed), {}
    rels: dict[str, str] = manifest["files"]
    why = _unbound(package_dir.name, rels, suffix, allowed)
    if why is not None:
        return status("invalid", f"{path}: {why}"), {}
    files = {name: build_dir / rel for name, rel in rels.items()}
    missing = sorted(str(p) for p in files.values() if not p.is_file())
    if missing:
        return status("invalid", f"missing extension files: {missing[:3]}"), {}
    sums: dict[str, str] = manifest["sha256"]
    for rel in sorted(rels.values()):
        if sums.get(rel) != file_sha256(build_dir / rel):
            return status("invalid", f"{build_dir / rel}: sha256 differs from {path}"), {}
    modules = tuple(m for m in modules_listed if m in files)
    if set(modules) != {n for n in files if "." in n}:
        return status("invalid", f"{path}: its modules and files differ"), {}
    return NativeStatus("compiled", "", build_dir, modules), files


def install(
    package_dir: Path, build_dir: Path, allowed: Sequence[str] | None = None
) -> NativeStatus:
    """Check the build of the package at `package_dir` and, when it is current and
    intact, put its finder first on `sys.meta_path`. Call before any listed module is
    imported. A build that cannot be used is logged (a warning) with its reason."""
    st, files = _check(package_dir, build_dir, allowed)
    if st.state == "compiled":
        sys.meta_path.insert(0, _Finder(files))
    elif st.state == "invalid":
        log.warning("%s", st.line())
    return st


_PACKAGE = Path(__file__).resolve().parent
STATUS: NativeStatus | None = None


def install_ramjet() -> NativeStatus:
    """`install` for this package and its `build/native/` (once per process). Only the
    router's entry points call it (`ramjet serve`, `ramjet native`: ramjet/cli.py), and
    the test suite."""
    global STATUS
    if STATUS is None:
        STATUS = install(_PACKAGE, _PACKAGE.parent / "build" / "native", COMPILED)
    return STATUS


def current() -> NativeStatus:
    """What this process runs, without installing anything (too late to, once ramjet
    modules are imported)."""
    if STATUS is not None:
        return STATUS
    return NativeStatus(
        "unused", "this process did not install the build (ramjet serve does)", _PACKAGE
    )


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
