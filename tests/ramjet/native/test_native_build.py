"""The compiled hot modules (ramjet/native.py, scripts/build_native.py) never run stale.

A small package is compiled with the real build script (mypyc) into a build folder
beside it, and each case runs in a fresh interpreter, since the finder is per process:
the build is loaded when every source matches it; an edited, added or removed source,
the env switch, no build, a build for another interpreter or another mypyc, an extension
file changed since the build, or a manifest that binds a module to another name or path
all give pure Python, and the edited code is what runs. Then the repository itself: `ramjet native` says what the
checkout runs, and under `make test` (RAMJET_NATIVE_EXPECT=compiled) every listed module
must have come from the build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

TOY_INIT = """\
from pathlib import Path

from ramjet.native import install

STATUS = install(Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "build")
"""

TOY_CORE = """\
from dataclasses import dataclass


@dataclass
class Point:
    x: int
    y: int

    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)


def answer() -> int:
    return 41 + 1
"""

TOY_USER = """\
from toy.core import Point, answer


def total(n: int) -> int:
    return sum(Point(i, -i).norm1() for i in range(n)) + answer()
"""

PROBE = """\
import json, sys
import toy, toy.core, toy.user
print(json.dumps({
    "state": toy.STATUS.state,
    "reason": toy.STATUS.reason,
    "changed": list(toy.STATUS.changed),
    "loaded": toy.STATUS.loaded(),
    "files": {m: sys.modules[m].__file__ for m in ("toy.core", "toy.user")},
    "answer": toy.core.answer(),
    "total": toy.user.total(10),
}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAMJET_NATIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _probe(tree: Path, **env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tree,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    result["stderr"] = out.stderr
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-module package compiled by scripts/build_native.py: tree/toy, tree/build."""
    tree = tmp_path_factory.mktemp("native") / "tree"
    (tree / "toy").mkdir(parents=True)
    (tree / "toy" / "__init__.py").write_text(TOY_INIT)
    (tree / "toy" / "core.py").write_text(TOY_CORE)
    (tree / "toy" / "user.py").write_text(TOY_USER)
    # mypy's config, as the repository's pyproject.toml is for ramjet (ramjet.native,
    # imported by toy/__init__.py, is not compiled and has no py.typed)
    (tree / "pyproject.toml").write_text("[tool.mypy]\nignore_missing_imports = true\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "build_native.py"),
            "--package",
            str(tree / "toy"),
            "--modules",
            "toy.core,toy.user",
            "--out",
            str(tree / "build"),
            "--group",
            "toy_native",
            "--jobs",
            "1",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list((tree / "toy").rglob("*.so")), "the build wrote into the source tree"
    return tree


@pytest.fixture
def tree(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built tree, free to edit."""
    dst = tmp_path / "tree"
    shutil.copytree(built, dst)
    return dst


def test_a_current_build_is_what_runs(tree: Path) -> None:
    r = _probe(tree)
    assert r["state"] == "compiled", r["reason"]
    assert r["loaded"] == ["toy.core", "toy.user"]
    files = r["files"]
    assert isinstance(files, dict)
    for name in ("toy.core", "toy.user"):
        f = Path(files[name])
        assert f.is_relative_to(tree / "build") and f.name.endswith(".so"), f
    assert (r["answer"], r["total"]) == (42, 2 * sum(range(10)) + 42)


def test_an_edited_source_runs_from_source_with_the_whole_build_off(tree: Path) -> None:
    core = tree / "toy" / "core.py"
    core.write_text(core.read_text().replace("41 + 1", "41 + 2"))
    r = _probe(tree)
    assert r["state"] == "stale"
    assert r["changed"] == ["toy/core.py"]
    assert "toy/core.py" in str(r["reason"])
    assert r["loaded"] == []  # toy.user too: its compiled code calls core's directly
    files = r["files"]
    assert isinstance(files, dict)
    assert files == {"toy.core": str(core), "toy.user": str(tree / "toy" / "user.py")}
    assert (r["answer"], r["total"]) == (43, 2 * sum(range(10)) + 43)  # the edit runs


def test_an_added_or_removed_source_makes_the_build_stale(tree: Path) -> None:
    (tree / "toy" / "extra.py").write_text("X = 1\n")
    r = _probe(tree)
    assert (r["state"], r["changed"], r["loaded"]) == ("stale", ["toy/extra.py"], [])
    (tree / "toy" / "extra.py").unlink()
    assert _probe(tree)["state"] == "compiled"
    manifest = tree / "build" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["sources"]["toy/gone.py"] = "0" * 64  # a file the build had and the tree lost
    manifest.write_text(json.dumps(m))
    r = _probe(tree)
    assert (r["state"], r["changed"], r["loaded"]) == ("stale", ["toy/gone.py"], [])


def test_the_env_switch_forces_pure_python(tree: Path) -> None:
    r = _probe(tree, RAMJET_NATIVE="0")
    assert (r["state"], r["loaded"], r["answer"]) == ("off", [], 42)
    assert _probe(tree, RAMJET_NATIVE="1")["state"] == "compiled"


def test_no_build_or_a_foreign_build_runs_pure_python(tree: Path) -> None:
    manifest = tree / "build" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, ext_suffix=".cpython-399-other.so")))
    r = _probe(tree)
    assert (r["state"], r["loaded"]) == ("invalid", [])
    assert "cpython-399" in str(r["reason"])
    manifest.write_text("{not json")
    assert _probe(tree)["state"] == "invalid"
    shutil.rmtree(tree / "build")
    r = _probe(tree)
    assert (r["state"], r["loaded"], r["total"]) == ("absent", [], 2 * sum(range(10)) + 42)


def test_a_build_missing_an_extension_file_is_not_used(tree: Path) -> None:
    so = next((tree / "build" / "toy").glob("user*.so"))
    so.unlink()
    r = _probe(tree)
    assert (r["state"], r["loaded"]) == ("invalid", [])


def _edit_manifest(tree: Path, **fields: object) -> dict[str, object]:
    manifest = tree / "build" / "manifest.json"
    m: dict[str, object] = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, **fields)))
    return m


def test_a_build_by_another_mypyc_is_stale(tree: Path) -> None:
    m = _edit_manifest(tree, mypyc="0.0.1")
    assert m["mypyc"] and m["tool"] == f"mypyc {m['mypyc']}"
    r = _probe(tree)
    assert (r["state"], r["loaded"], r["answer"]) == ("stale", [], 42)
    assert "built by mypyc 0.0.1, not " + str(m["mypyc"]) in str(r["reason"])


def test_the_build_script_rebuilds_only_what_the_loader_would_not_load(tree: Path) -> None:
    """`--if-stale` (make native): a current build is kept as it is; a removed source
    (which make's timestamps miss) or another mypyc rebuilds."""

    def build() -> str:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_native.py"), "--if-stale",
             "--package", str(tree / "toy"), "--modules", "toy.core,toy.user",
             "--out", str(tree / "build"), "--group", "toy_native", "--jobs", "1"],
            env=_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    manifest = tree / "build" / "manifest.json"
    before = manifest.read_text()
    assert "is current" in build()
    assert manifest.read_text() == before
    m = json.loads(before)
    m["sources"]["toy/gone.py"] = "0" * 64  # a file the build had and the tree lost
    manifest.write_text(json.dumps(m))
    out = build()
    assert "rebuilding" in out and "toy/gone.py" in out
    assert "toy/gone.py" not in json.loads(manifest.read_text())["sources"]
    assert _probe(tree)["state"] == "compiled"
    _edit_manifest(tree, mypyc="0.0.1")
    assert "built by mypyc 0.0.1" in build()
    assert _probe(tree)["state"] == "compiled"


def test_an_extension_file_changed_since_the_build_is_not_loaded(tree: Path) -> None:
    so = next((tree / "build" / "toy").glob("core*.so"))
    so.write_bytes(so.read_bytes() + b"\0")
    r = _probe(tree)
    assert (r["state"], r["loaded"], r["answer"]) == ("invalid", [], 42)
    assert f"{so}: sha256 differs from" in str(r["reason"])
    assert f"native: pure Python (invalid: {so}: sha256 differs" in str(r["stderr"])  # logged


def test_each_module_is_bound_to_its_own_name_and_path(tree: Path) -> None:
    """The manifest names what the finder loads: a module it maps to another module's
    file, a path outside the build, a name outside the package, or a second shared
    library is refused, and everything runs from source."""
    m = _edit_manifest(tree)
    files = m["files"]
    assert isinstance(files, dict)
    core, user = files["toy.core"], files["toy.user"]
    for bad, why in [
        (dict(files, **{"toy.core": user}), f"toy.core points at {user!r}"),
        (dict(files, **{"toy.core": "../" + core}), "toy.core points at '../"),
        (dict(files, json="json" + core[len("toy/core") :]), "json is not under toy"),
        (dict(files, **{"toy..core": core}), "'toy..core' is not a module name"),
        (dict(files, other__mypyc="x.so"), "not one shared library (__mypyc) but 2"),
    ]:
        _edit_manifest(tree, files=bad)
        r = _probe(tree)
        assert (r["state"], r["loaded"], r["answer"]) == ("invalid", [], 42), bad
        assert why in str(r["reason"]), (why, r["reason"])
    good = {k: m[k] for k in ("files", "sha256", "modules")}
    for key, bad_value in [("files", ["x"]), ("sha256", {"a": 1}), ("modules", "toy.core")]:
        _edit_manifest(tree, **{**good, key: bad_value})
        r = _probe(tree)  # a well-formed JSON of the wrong shape: refused, not a traceback
        assert (r["state"], r["loaded"], r["answer"]) == ("invalid", [], 42), key
        assert f"{key} is not a" in str(r["reason"]), r["reason"]
    _edit_manifest(tree, **{**good, "modules": ["toy.core"]})
    assert "its modules and files differ" in str(_probe(tree)["reason"])
    _edit_manifest(tree, files=files, modules=["toy.core", "toy.user"])
    assert _probe(tree)["state"] == "compiled"


def _run_python(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_only_the_router_entry_points_install_the_build() -> None:
    """`import ramjet` (the engine, the simulator, a script) puts no finder on
    `sys.meta_path`; `ramjet serve` checks the build and installs it, before it imports
    anything else of ramjet."""
    alone = _run_python(
        "import json, sys\n"
        "import ramjet, ramjet.keys.prefix, engine_stub.reporting, simulations.probes\n"
        "from ramjet import native\n"
        "print(json.dumps({'finders': [type(f).__name__ for f in sys.meta_path],\n"
        "                  'status': native.STATUS is None, 'file': ramjet.keys.prefix.__file__}))\n"
    )
    assert "_Finder" not in alone["finders"] and alone["status"] is True
    assert str(alone["file"]).endswith("ramjet/keys/prefix.py")
    serve = _run_python(
        "import json, sys\n"
        "from ramjet import cli, native\n"
        "rc = cli.main(['serve', '--policy', '/nonexistent/policy.yaml'])\n"
        "print(json.dumps({'rc': rc, 'state': native.STATUS and native.STATUS.state,\n"
        "                  'finders': [type(f).__name__ for f in sys.meta_path]}))\n"
    )
    assert serve["rc"] == 2  # the policy file is missing: the build was checked before
    from ramjet import native

    state = native.check_build(ROOT / "ramjet", ROOT / "build" / "native", native.COMPILED)[0]
    assert serve["state"] == state.state
    assert ("_Finder" in serve["finders"]) is (state.state == "compiled")


def test_the_repository_reports_what_it_runs() -> None:
    """`ramjet native` on this checkout; under `make test` the build must be current and
    every listed module compiled (RAMJET_NATIVE_EXPECT=compiled, set by the Makefile)."""
    from ramjet import native

    same = {"RAMJET_NATIVE": os.environ[native.ENV]} if native.ENV in os.environ else {}
    proc = subprocess.run(
        [sys.executable, "-m", "ramjet", "native"],
        cwd=ROOT,
        env=_env(**same),
        capture_output=True,
        text=True,
        timeout=60,
    )
    st = native.install_ramjet()
    if os.environ.get("RAMJET_NATIVE_EXPECT") == "compiled":
        assert st.state == "compiled", st.line()
    if st.state == "compiled":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith(f"native: {len(native.COMPILED)} modules compiled")
        assert lines[1:] == [f"  {m}: compiled" for m in native.COMPILED]
        import ramjet.app.router  # this process too (the one the whole suite runs in)

        assert "ramjet.app.router" in st.loaded()
        assert Path(str(ramjet.app.router.__file__)).is_relative_to(st.build_dir)
    else:
        assert proc.returncode == 0
        assert proc.stdout.strip() == st.line()
        assert proc.stdout.startswith("native: pure Python (")
        assert st.loaded() == []
    off = subprocess.run(
        [sys.executable, "-m", "ramjet", "native"],
        cwd=ROOT,
        env=_env(RAMJET_NATIVE="0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert off.stdout.strip() == "native: pure Python (off: RAMJET_NATIVE=0)"
