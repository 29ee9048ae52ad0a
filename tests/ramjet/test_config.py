"""Policy file loading: defaults, the shipped files, and errors that name field paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from ramjet.cli import main
from ramjet.config import PolicyFileError, field_path, load_policy, parse_policy

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "engines": [
        {"id": "e0", "url": "http://127.0.0.1:8101"},
        {"id": "e1", "url": "http://127.0.0.1:8102"},
    ],
    "incumbent": {"name": "prefix_affinity"},
}


def _with(**changes: object) -> dict[str, object]:
    return {**BASE, **changes}


def _problems(data: object) -> dict[str, str]:
    with pytest.raises(PolicyFileError) as info:
        parse_policy(data, "t.yaml")
    return dict(info.value.problems)


def test_defaults_are_filled_in() -> None:
    cfg = parse_policy(BASE)
    assert cfg.mode.kind == "observe"
    assert cfg.residency.global_ttl_s == 72 * 3600
    assert cfg.residency.swa_ttl_s == 300
    assert cfg.retry.budget_ratio == 0.2 and cfg.retry.min_retries == 3
    assert cfg.engines[1].url == "http://127.0.0.1:8102"


def test_mode_shorthand_and_canary_share() -> None:
    cfg = parse_policy(
        _with(mode={"kind": "canary", "share": 0.25}, candidate={"name": "round_robin"})
    )
    assert cfg.mode.kind == "canary" and cfg.mode.share == 0.25
    assert parse_policy(_with(mode="observe")).mode.kind == "observe"


@pytest.mark.parametrize(
    ("data", "path"),
    [
        (
            _with(engines=[{"id": "e0", "url": "http://a:1"}, {"id": "e1", "urll": "http://b:2"}]),
            "engines[1].urll",
        ),
        (
            _with(engines=[{"id": "e0", "url": "http://a:1"}, {"id": "e1", "url": "ftp://b"}]),
            "engines[1].url",
        ),
        (_with(engines=[{"id": "e0", "url": "http://a:1/v1"}]), "engines[0].url"),
        (_with(engines=[]), "engines"),
        (
            _with(engines=[{"id": "e0", "url": "http://a:1"}, {"id": "e0", "url": "http://b:1"}]),
            "engines",
        ),
        (_with(timeouts={"idle_s": 0}), "timeouts.idle_s"),
        (_with(timeouts={"idel_s": 3}), "timeouts.idel_s"),
        (_with(mode={"kind": "canary", "share": 1.5}), "mode.share"),
        (_with(mode={"kind": "sometimes"}), "mode.kind"),
        (_with(retry={"budget_ratio": "lots"}), "retry.budget_ratio"),
        (_with(limits={"max_body_bytes": -1}), "limits.max_body_bytes"),
        (_with(health={"probe_path": "health"}), "health.probe_path"),
        (_with(residency={"swa_ttl_s": 0}), "residency.swa_ttl_s"),
        (_with(incumbent={"name": "x", "parms": {}}), "incumbent.parms"),
        (_with(surprise=1), "surprise"),
    ],
)
def test_errors_name_the_field_path(data: dict[str, object], path: str) -> None:
    assert path in _problems(data)


def test_canary_without_candidate_is_refused() -> None:
    problems = _problems(_with(mode="enforce"))
    assert any("candidate" in m for m in problems.values())


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    assert "" in _problems([1, 2])
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [\n")
    with pytest.raises(PolicyFileError, match="not valid YAML"):
        load_policy(bad)
    with pytest.raises(PolicyFileError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")


def test_field_path_rendering() -> None:
    assert field_path(("engines", 1, "url")) == "engines[1].url"
    assert field_path(("timeouts", "idle_s")) == "timeouts.idle_s"


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "policies").glob("*.yaml")))
def test_shipped_policy_files_check(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(ROOT / "policies" / name)]) == 0
    out = capsys.readouterr().out
    assert "engines:" in out and "incumbent:" in out


def test_policy_check_exit_2_with_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "engines:\n  - id: e0\n    url: http://a:1\nincumbent:\n  name: prefix_affinity\n  params: {nope: 1}\n"
    )
    assert main(["policy", "check", str(f)]) == 2
    assert "incumbent.params.nope" in capsys.readouterr().err
    f.write_text(
        "engines:\n  - id: e0\n    url: http://a:1\n    modles: [m]\nincumbent: {name: round_robin}\n"
    )
    assert main(["policy", "check", str(f)]) == 2
    assert "engines[0].modles" in capsys.readouterr().err
