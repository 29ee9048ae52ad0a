"""`--variant NAME=JSON`: an extra tier_aware row for ablations, validated up front."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ramjet.policy.base import RoutingPolicy
from ramjet.policy.tier_aware import TierAware
from simulations import __main__ as cli
from simulations.lineup import resolve, variant
from simulations.preset import engine_spec

TRACE = (
    Path(__file__).resolve().parents[3] / "shared/data/traces/agent/miniswe_interleaved_b64.jsonl"
)


def test_variant_builds_tier_aware_with_its_params_under_its_name() -> None:
    ent = variant('tier_aware:x0.5={"externality_scale": 0.5, "per_job_prefill": false}')
    policy = ent.make(0)
    assert isinstance(policy, TierAware)
    assert policy.name == ent.name == "tier_aware:x0.5"
    assert policy.params.externality_scale == 0.5
    assert policy.params.per_job_prefill is False


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_equals", "NAME=JSON"),
        ('={"externality_scale": 1}', "NAME=JSON"),
        ('tier_aware={"externality_scale": 1}', "taken"),
        ('oracle:mine={"externality_scale": 1}', "taken"),
        ("v={not json", "not JSON"),
        ("v=[1, 2]", "JSON object"),
        ('v={"externality_scale": -1}', "externality_scale"),
        ('v={"no_such_param": 1}', "no_such_param"),
    ],
)
def test_bad_variants_are_refused_with_the_reason(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        variant(spec)


def test_cli_refuses_a_bad_variant_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["run", "--trace", str(TRACE), "--policies", "round_robin", "--variant", "v={"]
    assert cli.main([*argv, "--out", str(out), "--quiet", "--no-plot"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert not out.exists()


def test_cli_runs_a_variant_as_its_own_row(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["run", "--trace", str(TRACE), "--policies", "tier_aware", "--sessions", "8"]
    argv += ["--load", "0.4", "--variant", 'v:x0={"externality_scale": 0}']
    assert cli.main([*argv, "--out", str(out), "--quiet", "--no-plot"]) == 0
    rows = (out / "results.csv").read_text().splitlines()
    assert sum(r.startswith("v:x0,") for r in rows) == 1
    assert sum(r.startswith("tier_aware,") for r in rows) == 1


@pytest.mark.parametrize(
    ("scheduler", "per_job"),
    [("fcfs", True), ("priority", True), ("vllm-fcfs", False), ("vllm-priority", False)],
)
def test_tier_aware_is_configured_for_the_engines_it_routes_to(
    scheduler: str, per_job: bool
) -> None:
    """In front of vLLM's model (prompts packed into a step) tier_aware runs with
    `per_job_prefill: false`, and everywhere with the engines' chunk as `chunk_tokens`,
    as policies/vllm_pair.yaml configures it; the oracle too."""
    spec = engine_spec(scheduler=scheduler, chunk_tokens=2048)
    for name in ("tier_aware", "oracle:tier_aware"):
        [ent] = resolve(name)
        policy = ent.on(spec).make(0)
        assert isinstance(policy, TierAware)
        assert policy.params.per_job_prefill is per_job
        assert policy.params.chunk_tokens == 2048
        assert policy.name == name
        made = ent.make(0)  # the entrant itself is unchanged
        assert isinstance(made, TierAware)
        assert (made.params.per_job_prefill, made.params.chunk_tokens) == (True, 8192)


def test_an_ablation_keeps_the_engine_parameters_it_sets() -> None:
    ent = variant(
        'tier_aware:perjob={"per_job_prefill": true, "chunk_tokens": 512, "externality_scale": 0.5}'
    )
    policy = ent.on(engine_spec(scheduler="vllm-fcfs", chunk_tokens=2048)).make(0)
    assert isinstance(policy, TierAware)
    assert policy.params.per_job_prefill is True
    assert policy.params.chunk_tokens == 512
    assert policy.params.externality_scale == 0.5


def test_other_entrants_are_left_as_made() -> None:
    [peer] = resolve("smg_cache_aware:exact")
    spec = engine_spec(scheduler="vllm-priority", chunk_tokens=2048)
    assert type(peer.on(spec).make(0)) is type(peer.make(0))


def test_the_cli_configures_tier_aware_for_its_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`simulations run --scheduler vllm-fcfs --chunk-tokens N`: the policy that routes is
    configured as `Entrant.on` says, not left at the reference engine's defaults."""
    seen: list[tuple[str, bool, int]] = []
    real = cli.RunSetup.simulation

    def spy(self: cli.RunSetup, policy: RoutingPolicy, *args: Any, **kwargs: Any) -> Any:
        if isinstance(policy, TierAware):
            seen.append((policy.name, policy.params.per_job_prefill, policy.params.chunk_tokens))
        return real(self, policy, *args, **kwargs)

    monkeypatch.setattr(cli.RunSetup, "simulation", spy)
    argv = ["run", "--trace", str(TRACE), "--policies", "tier_aware", "--sessions", "8"]
    argv += ["--load", "0.4", "--scheduler", "vllm-fcfs", "--chunk-tokens", "4096"]
    assert cli.main([*argv, "--out", str(tmp_path / "out"), "--quiet", "--no-plot"]) == 0
    assert ("tier_aware", False, 4096) in seen
    assert {(p, c) for _, p, c in seen} == {(False, 4096)}
