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

KEPT_BASES = {
    "ramjet.config.PolicyFileError": ValueError,
    "ramjet.app.reload.ReloadError": ValueError,
    "ramjet.policy.registry.PolicyConfigError": ValueError,
    "ramjet.keys.tokens.TokenizerFileError": ValueError,
    "ramjet.reports.keys.KeyError_": ValueError,
    "ramjet.keys.prefix.PromptError": ValueError,
    "ramjet.reports.envelope.EnvelopeError": ValueError,
    "ramjet.reports.bodies.BodyError": ValueError,
    "ramjet.reports.transport.BatchError": ValueError,
    "ramjet.proxy.http1.UpstreamConnectError": OSError,
    "ramjet.proxy.http1.UpstreamClosed": OSError,
    "ramjet.sidecar.wire.WireError": ValueError,
}


def test_the_walk_finds_the_exceptions() -> None:
    assert set(KEPT_BASES) <= set(FOUND)
    assert len(FOUND) >= 21  # 17 of the modules, 4 of the tree


@pytest.mark.parametrize("name", sorted(FOUND))
def test_under_the_root_and_drawn(name: str) -> None:
    cls = FOUND[name]
    assert issubclass(cls, RamjetError), f"{name} is not under RamjetError"
    assert cls.__name__ in (errors.__doc__ or ""), f"{name} is not drawn in ramjet/errors.py"


@pytest.mark.parametrize(("name", "base"), sorted(KEPT_BASES.items()))
def test_old_base_kept(name: str, base: type[BaseException]) -> None:
    assert issubclass(FOUND[name], base)


def test_groups() -> None:
    from ramjet.proxy.exchange import UpstreamError
    from ramjet.proxy.http1 import UpstreamConnectError
    from ramjet.reports.ingest import ResponseTooLarge

    assert issubclass(FOUND["ramjet.config.PolicyFileError"], ConfigError)
    assert issubclass(FOUND["ramjet.reports.envelope.EnvelopeError"], ReportError)
    assert issubclass(ResponseTooLarge, ReportError) and not issubclass(
        ResponseTooLarge, ValueError
    )
    assert issubclass(UpstreamError, ProxyError) and issubclass(UpstreamConnectError, ProxyError)
    # the groups are new; they add no built-in base an old `except` could now catch
    assert not issubclass(UpstreamConnectError, UpstreamError)
    for group in (ConfigError, ReportError, ProxyError):
        assert group.__mro__[1:] == (RamjetError, Exception, BaseException, object)
