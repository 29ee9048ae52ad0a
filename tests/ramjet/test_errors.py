"""Every public exception of `ramjet/` is under `RamjetError` and drawn in its tree, and
keeps the built-in base it had before the tree (so old `except` clauses still match)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import ramjet
from ramjet import errors
from ramjet.errors import ConfigError, ProxyError, RamjetError, ReportError


def public_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(ramjet.__path__, "ramjet."):
        if info.name == "ramjet.__main__":
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == mod.__name__
                and not name.startswith("_")
            ):
                found[f"{mod.__name__}.{name}"] = obj
    return found


FOUND = public_exceptions()

KEPT_BASES = {  # by class name: a class may move between modules
    "PolicyFileError": ValueError,
    "ReloadError": ValueError,
    "PolicyConfigError": ValueError,
    "TokenizerFileError": ValueError,
    "KeyError_": ValueError,
    "PromptError": ValueError,
    "EnvelopeError": ValueError,
    "BodyError": ValueError,
    "BatchError": ValueError,
    "UpstreamConnectError": OSError,
    "UpstreamClosed": OSError,
    "WireError": ValueError,
}


BY_CLASS = {name.rpartition(".")[2]: cls for name, cls in FOUND.items()}


def test_the_walk_finds_the_exceptions() -> None:
    assert set(KEPT_BASES) <= set(BY_CLASS)
    assert len(FOUND) >= 21  # 17 of the modules, 4 of the tree


@pytest.mark.parametrize("name", sorted(FOUND))
def test_under_the_root_and_drawn(name: str) -> None:
    cls = FOUND[name]
    assert issubclass(cls, RamjetError), f"{name} is not under RamjetError"
    assert cls.__name__ in (errors.__doc__ or ""), f"{name} is not drawn in ramjet/errors.py"


@pytest.mark.parametrize(("name", "base"), sorted(KEPT_BASES.items()))
def test_old_base_kept(name: str, base: type[BaseException]) -> None:
    assert issubclass(BY_CLASS[name], base)


def test_groups() -> None:
    # by class name: the proxy's exceptions may move between its modules
    upstream, connect = BY_CLASS["UpstreamError"], BY_CLASS["UpstreamConnectError"]
    too_large = BY_CLASS["ResponseTooLarge"]

    assert issubclass(BY_CLASS["PolicyFileError"], ConfigError)
    assert issubclass(BY_CLASS["EnvelopeError"], ReportError)
    assert issubclass(too_large, ReportError) and not issubclass(too_large, ValueError)
    assert issubclass(upstream, ProxyError) and issubclass(connect, ProxyError)
    # the groups are new; they add no built-in base an old `except` could now catch
    assert not issubclass(connect, upstream)
    for group in (ConfigError, ReportError, ProxyError):
        assert group.__mro__[1:] == (RamjetError, Exception, BaseException, object)
