"""Policy names, as written in a policy file, mapped to factories.

Each entry pairs a frozen pydantic parameter model (`extra="forbid"`, defaults for every
field) with a factory that builds the policy from validated parameters. `create_policy`
validates the YAML mapping over the defaults; an unknown name, an unknown key or a wrong
type raises `PolicyConfigError` whose message and `.path` name the offending field
(e.g. `incumbent.params.rel_factor`), and nothing is built.

Adding a policy: write its `Params` model (in `ramjet.policy.params`, which stays
interpreted: pydantic and mypyc do not mix) and its module (a class with `name` and
`pick`), then add one `_Entry` to `_ENTRIES`. Keep names snake_case and stable: they are the API
of policy files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ramjet.errors import ConfigError
from ramjet.policy import baselines, tier_aware
from ramjet.policy.base import RoutingPolicy


class PolicyConfigError(ConfigError, ValueError):
    """A policy name or its parameters are invalid. `path` names the field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True, slots=True)
class _Entry:
    params: type[BaseModel]
    build: Callable[[Any, str], RoutingPolicy]
    summary: str


_ENTRIES: dict[str, _Entry] = {
    "round_robin": _Entry(
        baselines.RoundRobinParams,
        lambda p, n: baselines.RoundRobin(p, name=n),
        "each eligible engine in turn",
    ),
    "least_loaded": _Entry(
        baselines.LeastLoadedParams,
        lambda p, n: baselines.LeastLoaded(p, name=n),
        "fewest in-flight requests and outstanding prompt tokens",
    ),
    "session_hash": _Entry(
        baselines.SessionHashParams,
        lambda p, n: baselines.SessionHash(p, name=n),
        "consistent (rendezvous) hash of the session id",
    ),
    "prefix_affinity": _Entry(
        baselines.PrefixAffinityParams,
        lambda p, n: baselines.PrefixAffinity(p, name=n),
        "incumbent: longest resident prefix, bounded by load",
    ),
    "tier_aware": _Entry(
        tier_aware.TierAwareParams,
        lambda p, n: tier_aware.TierAware(p, name=n),
        "candidate: least predicted TTFT plus the externality of wasted work",
    ),
}


def available_policies() -> dict[str, str]:
    """Registered policy names and a one-line summary of each, sorted by name."""
    return {name: _ENTRIES[name].summary for name in sorted(_ENTRIES)}


def params_model(name: str, *, path: str = "policy") -> type[BaseModel]:
    """The parameter model of a policy (for documentation and `policy check`)."""
    entry = _ENTRIES.get(name)
    if entry is None:
        known = ", ".join(sorted(_ENTRIES))
        raise PolicyConfigError(path, f"unknown policy {name!r}; expected one of {known}")
    return entry.params


def validate_params(
    name: str, params: Mapping[str, Any] | None, *, path: str = "params"
) -> BaseModel:
    """Parameters validated over the policy's defaults; raises `PolicyConfigError`."""
    model = params_model(name, path=path.rsplit(".", 1)[0] + ".name" if "." in path else "name")
    if params is not None and not isinstance(params, Mapping):
        raise PolicyConfigError(path, f"expected a mapping, got {type(params).__name__}")
    try:
        return model.model_validate(dict(params or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(part) for part in err["loc"])
        raise PolicyConfigError(f"{path}.{loc}" if loc else path, err["msg"]) from None


def create_policy(
    name: str, params: Mapping[str, Any] | None = None, *, path: str = "params"
) -> RoutingPolicy:
    """Build the named policy from YAML parameters validated over its defaults.

    `path` is where `params` sits in the policy file (e.g. `candidate.params`), used in
    error messages. Raises `PolicyConfigError`; never returns a half-built policy.
    """
    validated = validate_params(name, params, path=path)
    return _ENTRIES[name].build(validated, name)
