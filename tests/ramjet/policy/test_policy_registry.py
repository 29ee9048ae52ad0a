"""The policy registry: names to factories, parameters validated over defaults."""

from __future__ import annotations

import pytest
from policy_fakes import engine, request

from ramjet.policy.base import FleetStats, RoutingPolicy
from ramjet.policy.baselines import PrefixAffinity
from ramjet.policy.registry import PolicyConfigError, available_policies, create_policy


def test_every_registered_policy_builds_with_defaults_and_picks() -> None:
    names = available_policies()
    assert {"round_robin", "least_loaded", "session_hash", "prefix_affinity"} <= set(names)
    for name in names:
        policy = create_policy(name, {})
        assert isinstance(policy, RoutingPolicy)
        assert policy.name == name
        assert policy.pick(request(), [engine("a"), engine("b")], FleetStats()).engine in {"a", "b"}


def test_params_override_defaults() -> None:
    policy = create_policy("prefix_affinity", {"rel_factor": 2.0})
    assert isinstance(policy, PrefixAffinity)
    assert policy.params.rel_factor == 2.0
    assert policy.params.abs_margin_tokens == 32768


@pytest.mark.parametrize(
    ("name", "params", "path", "fragment"),
    [
        ("prefix_affinity", {"rel_factr": 2}, "params.rel_factr", "Extra inputs"),
        ("prefix_affinity", {"rel_factor": "big"}, "params.rel_factor", "number"),
        ("prefix_affinity", {"rel_factor": 0.5}, "params.rel_factor", "greater than or equal"),
        ("session_hash", {"fallback": "random"}, "params.fallback", "least_loaded"),
        ("least_loaded", {"request_weight_tokens": -1}, "params.request_weight_tokens", "greater"),
        ("no_such_policy", {}, "name", "unknown policy"),
    ],
)
def test_bad_config_names_the_field(
    name: str, params: dict[str, object], path: str, fragment: str
) -> None:
    with pytest.raises(PolicyConfigError) as info:
        create_policy(name, params)
    assert info.value.path == path
    assert fragment in str(info.value)


def test_error_path_is_prefixed_with_where_params_sit() -> None:
    with pytest.raises(PolicyConfigError) as info:
        create_policy("prefix_affinity", {"bogus": 1}, path="incumbent.params")
    assert info.value.path == "incumbent.params.bogus"
    with pytest.raises(PolicyConfigError) as info:
        create_policy("nope", {}, path="incumbent.params")
    assert info.value.path == "incumbent.name"


def test_params_must_be_a_mapping() -> None:
    with pytest.raises(PolicyConfigError) as info:
        create_policy("round_robin", [1, 2])  # type: ignore[arg-type]
    assert info.value.path == "params"
