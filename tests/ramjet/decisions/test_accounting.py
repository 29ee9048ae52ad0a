"""Accounting: agreement pair, TTFT and cached-token prediction error, estimated gain,
realized tokens, and the mean-wait EWMA, all with an injected clock."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ramjet.decisions.accounting import Accounting, MeanWait
from ramjet.decisions.record import DecisionRecord
from ramjet.policy.base import Decision
from ramjet.proxy.exchange import Attempt
from ramjet.types import EngineId

E0, E1 = EngineId("e0"), EngineId("e1")


def tail(queue_ms: float, cached: int = 700) -> bytes:
    pw = {
        "hbm_tokens": cached,
        "host_tokens": 0,
        "ssd_tokens": 0,
        "swa_tokens": 0,
        "replayed_tokens": 16,
        "prefilled_tokens": 100,
        "queue_ms": queue_ms,
        "restore_ms": 0.0,
        "prefill_ms": 100.0,
        "epoch": 1,
    }
    return json.dumps({"choices": [], "usage": {"prompt_work": pw}}).encode()


def record(
    *,
    mode: str = "observe",
    inc: str = "e0",
    cand: str | None = "e1",
    engine: str = "e0",
    queue_ms: float = 50.0,
    status: int = 200,
    stream: bool = True,
    ttft: float = 0.3,
) -> DecisionRecord:
    comps = {E0: {"ttft_s": 0.4, "resume_tokens": 800.0}, E1: {"ttft_s": 0.1, "resume_tokens": 0.0}}
    c = None if cand is None else Decision(EngineId(cand), "tier_aware", comps)
    i = Decision(EngineId(inc), "round_robin")
    return DecisionRecord(
        request_id="r",
        time_unix=0.0,
        model="m",
        session=None,
        prompt_tokens=900,
        stream=stream,
        mode=mode,
        live_role="incumbent",
        live=i,
        incumbent=i,
        candidate=c,
        candidate_error=None,
        candidate_s=0.0,
        engine=EngineId(engine),
        status=status,
        attempts=(Attempt(EngineId(engine), status),),
        ttft_s=ttft,
        duration_s=0.5,
        end="ok",
        response_tail=tail(queue_ms),
    )


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_agreement_gain_and_errors_by_mode() -> None:
    reg = CollectorRegistry()
    now = [0.0]
    acc = Accounting(reg, clock=lambda: now[0])
    acc.on_decision(record(inc="e0", cand="e1"))  # disagree: gain 0.4 - 0.1
    acc.on_decision(record(inc="e1", cand="e1", engine="e1"))  # agree, gain 0
    acc.on_decision(record(mode="enforce", inc="e1", cand="e0"))  # gain 0.1 - 0.4 < 0
    assert value(reg, "ramjet_policy_compared_total", mode="observe") == 2
    assert value(reg, "ramjet_policy_agreed_total", mode="observe") == 1
    assert value(reg, "ramjet_policy_compared_total", mode="enforce") == 1
    assert value(reg, "ramjet_policy_agreed_total", mode="enforce") == 0
    assert value(reg, "ramjet_candidate_gain_seconds_total", mode="observe") == pytest.approx(0.3)
    assert value(reg, "ramjet_candidate_loss_seconds_total", mode="enforce") == pytest.approx(0.3)
    assert value(reg, "ramjet_candidate_gain_estimate_seconds_count", mode="observe") == 2

    # TTFT error on the answering engine: e0 predicted 0.4, realized 0.3 (stream: router)
    # errors +0.1 (e0) and -0.2 (e1): one in (0.05, 0.1], one in (-0.25, -0.1]
    def err_le(le: str) -> float:
        return value(reg, "ramjet_ttft_prediction_error_seconds_bucket", mode="observe", le=le)

    assert err_le("-0.25") == 0 and err_le("-0.1") == 1 and err_le("0.05") == 1
    assert err_le("0.25") == 2
    mae = value(reg, "ramjet_ttft_prediction_abs_error_seconds_sum", mode="observe")
    assert mae == pytest.approx(0.1 + 0.2)

    def rel_le(le: str) -> float:
        return value(
            reg, "ramjet_ttft_prediction_relative_error_ratio_bucket", mode="observe", le=le
        )

    # relative: -2/3 in (-1, -0.5], +1/3 in (0.25, 0.5]
    assert rel_le("-1.0") == 0 and rel_le("-0.5") == 1 and rel_le("0.25") == 1
    assert rel_le("0.5") == 2

    # cached tokens: e0 predicted 800 resume tokens, realized 700 cached (+100); e1: -700
    def tok_le(le: str) -> float:
        return value(
            reg, "ramjet_cached_tokens_prediction_error_tokens_bucket", mode="observe", le=le
        )

    assert tok_le("-1024.0") == 0 and tok_le("-256.0") == 1 and tok_le("64.0") == 1
    assert tok_le("256.0") == 2
    assert value(reg, "ramjet_realized_prompt_tokens_total", engine="e0", source="hbm") == 1400


def test_non_stream_ttft_uses_the_engine_account() -> None:
    reg = CollectorRegistry()
    acc = Accounting(reg, clock=lambda: 0.0)
    acc.on_decision(record(stream=False, ttft=5.0, queue_ms=50.0))
    # engine TTFT = (50 + 0 + 100) ms; predicted on e0 = 0.4
    err = value(reg, "ramjet_ttft_prediction_abs_error_seconds_sum", mode="observe")
    assert err == pytest.approx(0.4 - 0.15)


def test_no_candidate_no_comparison_and_errors_not_measured() -> None:
    reg = CollectorRegistry()
    acc = Accounting(reg, clock=lambda: 0.0)
    acc.on_decision(record(cand=None))
    acc.on_decision(record(status=503))
    assert value(reg, "ramjet_policy_compared_total", mode="observe") == 0
    assert value(reg, "ramjet_ttft_prediction_error_seconds_count", mode="observe") == 0
    bad = record()
    object.__setattr__(bad, "response_tail", b"{}")
    acc.on_decision(bad)
    assert value(reg, "ramjet_realized_usage_missing_total", engine="e0") == 1


def test_mean_wait_is_a_time_weighted_ewma() -> None:
    w = MeanWait(tau_s=2.0)
    w.add(0.0, 1.0)
    assert w.mean() == 1.0  # the first sample sets it
    w.add(2.0, 0.0)
    assert w.mean() == pytest.approx(math.exp(-1.0))
    for k in range(200):
        w.add(2.0 + 0.1 * k, 0.25)
    assert w.mean() == pytest.approx(0.25, abs=1e-3)
    with pytest.raises(ValueError):
        MeanWait(0.0)


def test_accounting_feeds_mean_wait_and_downstream(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    now = [0.0]
    seen: list[Any] = []

    class Sink:
        def on_decision(self, r: DecisionRecord) -> None:
            seen.append(r)

    acc = Accounting(
        reg, clock=lambda: now[0], downstream=Sink(), log_path=str(tmp_path / "d.jsonl")
    )
    acc.on_decision(record(queue_ms=200.0))
    assert acc.mean_wait_s() == pytest.approx(0.2)
    now[0] = 100.0  # long after: the next sample dominates
    acc.on_decision(record(queue_ms=10.0))
    assert acc.mean_wait_s() == pytest.approx(0.01, abs=1e-4)
    assert value(reg, "ramjet_mean_wait_seconds") == pytest.approx(acc.mean_wait_s())
    assert len(seen) == 2
    acc.close()
    assert value(reg, "ramjet_decision_log_lines_total") == 2
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert [json.loads(line)["realized"]["queue_ms"] for line in lines] == [200.0, 10.0]
