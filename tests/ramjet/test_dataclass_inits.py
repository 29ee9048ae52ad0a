"""The request path's dataclasses with a hand-written `__init__` (`init=False`: mypyc
compiles a written-out one, never the generated one; docs/native.md) take exactly
their fields, in field order, with the fields' defaults (a `default_factory` field:
None, for a fresh one), set every field, and keep what the decorator gave them (frozen
stays frozen; eq, repr and replace() work)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from typing import Any

import pytest

import ramjet
from ramjet import native


def _written_out() -> list[type[Any]]:
    out = []
    for info in pkgutil.walk_packages(ramjet.__path__, "ramjet."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and obj.__module__ == mod.__name__
                and dataclasses.is_dataclass(obj)
                and "__init__" in vars(obj)
                and not obj.__dataclass_params__.init  # type: ignore[attr-defined]
            ):
                out.append(obj)
    return out


CLASSES = _written_out()


def test_the_request_path_classes_are_found() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"EngineView", "RequestView", "Decision", "EngineEstimate", "ParsedRequest"} <= names


def _check_takes_the_fields(cls: type[Any]) -> None:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        if f.default is not dataclasses.MISSING:
            assert p.default is not inspect.Parameter.empty and p.default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name
        else:
            assert p.default is inspect.Parameter.empty, f.name


def _check_sets_every_field(cls: type[Any]) -> None:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    args = {f.name: object() for f in fields}  # distinct sentinels in, the same objects out
    obj = cls(**args)
    for name, value in args.items():
        assert getattr(obj, name) is value, name
    assert repr(obj).startswith(cls.__name__ + "(")
    assert obj == dataclasses.replace(obj)
    if cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, fields[0].name, 1)
    for f in fields:  # a default_factory field left out gets a fresh value of its kind
        if f.default_factory is not dataclasses.MISSING:
            given = {k: v for k, v in args.items() if k != f.name}
            a, b = cls(**given), cls(**given)
            made = f.default_factory()
            assert type(getattr(a, f.name)) is type(made), f.name
            assert getattr(a, f.name) is not getattr(b, f.name), f.name


def test_each_written_init_takes_and_sets_its_fields() -> None:
    """In pure Python: a compiled `__init__` shows no signature and checks its arguments'
    types (sentinels of no field's type are the point). The suite runs on the build: then
    in a child process with `RAMJET_NATIVE=0`."""
    if native.install_ramjet().state != "compiled":
        for cls in CLASSES:
            _check_takes_the_fields(cls)
            _check_sets_every_field(cls)
        return
    env = {k: v for k, v in os.environ.items() if k != "RAMJET_NATIVE_EXPECT"}
    env["RAMJET_NATIVE"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "takes_and_sets"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]
