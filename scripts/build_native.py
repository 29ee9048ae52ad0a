"""Compile ramjet's hot modules (`ramjet.native.COMPILED`) with mypyc into build/native/.

    .venv/bin/python scripts/build_native.py [--out build/native] [--jobs 2] [--if-stale]

`make native` runs it (and `make test`, `make run`, `make bench` depend on that). The
source tree is never written to: the package's `.py` files are copied to
`build/native-staging/`, hashed as copied, compiled there (mypy type-checks them with
the project's own config, then gcc builds one shared library and a small extension per
module), and the extension files go to a fresh `<out>.new/` with `manifest.json` written
last (the sources' hashes, the mypyc version, each extension file's sha256), which then
replaces `<out>` by rename. `ramjet/native.py` loads the build only while every source
still hashes as the manifest says, under the same mypyc, each extension file intact.
`--if-stale` (what `make native` runs, every time) builds only when the loader would not
load the build: so a removed source, another mypyc or an edited file rebuilds, and a
current build costs one hashing pass (make's timestamps miss a deleted file). A failed build leaves the previous
build as it was (still checked by hash) and exits non-zero with the compiler's output.
Needs a C compiler and the Python headers (scripts/system_deps.sh native installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ["RAMJET_NATIVE"] = "0"  # this process reads the list and hashes; loads no build
sys.path.insert(0, str(ROOT))
from ramjet.native import (  # noqa: E402
    COMPILED,
    FORMAT,
    LIB_SUFFIX,
    MANIFEST,
    check_build,
    file_sha256,
    module_file,
    mypyc_version,
    source_hashes,
)

GROUP = "mypyc_ramjet"  # the shared library: mypyc_ramjet__mypyc<EXT_SUFFIX>

SETUP = """\
import sys
from mypyc.build import mypycify
from setuptools import setup

paths = sys.argv[1:]
setup(
    name="ramjet-native",
    ext_modules=mypycify(paths, opt_level="3", group_name={group!r}),
    script_args=["build_ext", "--inplace", "-j", {jobs!r}],
)
"""


def stage(package: Path, staging: Path) -> dict[str, str]:
    """Copy the package's .py files (and the pyproject.toml beside it, mypy's config) to
    `staging`; return their hashes as copied (what the manifest records)."""
    if staging.exists():
        shutil.rmtree(staging)
    for src in sorted(package.rglob("*.py")):
        dst = staging / src.relative_to(package.parent)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    if (package.parent / "pyproject.toml").is_file():
        shutil.copyfile(package.parent / "pyproject.toml", staging / "pyproject.toml")
    return source_hashes(staging / package.name)


def build(package: Path, modules: Sequence[str], out: Path, *, jobs: str, group: str) -> int:
    """Compile `modules` of the package at `package` into `out` (see the module doc)."""
    staging = out.parent / (out.name + "-staging")
    t0 = time.monotonic()
    hashes = stage(package, staging)
    paths = [m.replace(".", "/") + ".py" for m in modules]
    (staging / "setup_native.py").write_text(SETUP.format(group=group, jobs=jobs))
    env = dict(os.environ, MYPY_CACHE_DIR=str(out.parent / (out.name + "-mypy-cache")))
    env.pop("RAMJET_NATIVE", None)
    print(f"build_native: mypyc on {len(paths)} modules in {staging} ...", flush=True)
    proc = subprocess.run(
        [sys.executable, "setup_native.py", *paths],
        cwd=staging,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        print(proc.stdout[-20000:], file=sys.stderr)
        print(
            f"build_native: mypyc failed (exit {proc.returncode}); {out} unchanged", file=sys.stderr
        )
        return 1

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    files = {m: module_file(m, suffix) for m in modules}
    files[group + LIB_SUFFIX] = module_file(group + LIB_SUFFIX, suffix)
    new = out.parent / (out.name + ".new")
    if new.exists():
        shutil.rmtree(new)
    for rel in files.values():
        src = staging / rel
        if not src.is_file():
            print(f"build_native: mypyc did not produce {src}", file=sys.stderr)
            return 1
        (new / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, new / rel)
    manifest = {
        "format": FORMAT,
        "tool": f"mypyc {mypyc_version()}",
        "mypyc": mypyc_version(),
        "sha256": {rel: file_sha256(new / rel) for rel in files.values()},
        "ext_suffix": suffix,
        "modules": list(modules),
        "files": files,
        "sources": hashes,
    }
    (new / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    new.rename(out)
    shutil.rmtree(staging)
    print(f"build_native: {len(modules)} modules -> {out} in {time.monotonic() - t0:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "native")
    ap.add_argument("--jobs", default=str(min(4, os.cpu_count() or 1)))
    # another package (the loader's tests build a small one): its directory and modules
    ap.add_argument("--package", type=Path, default=ROOT / "ramjet")
    ap.add_argument("--modules", help="comma-separated (default: ramjet.native.COMPILED)")
    ap.add_argument("--group", default=GROUP)
    ap.add_argument("--if-stale", action="store_true", help="build only when not current")
    args = ap.parse_args()
    modules = args.modules.split(",") if args.modules else list(COMPILED)
    if args.if_stale:
        st, _ = check_build(args.package.resolve(), args.out.resolve(), modules)
        if st.state == "compiled" and list(st.modules) == modules:
            print(f"build_native: {args.out} is current ({len(modules)} modules)")
            return 0
        print(f"build_native: rebuilding: {st.line()}", flush=True)
    return build(
        args.package.resolve(), modules, args.out.resolve(), jobs=args.jobs, group=args.group
    )


if __name__ == "__main__":
    raise SystemExit(main())
