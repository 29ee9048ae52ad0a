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
from ramjet.decisions.log import parse_realized
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


class _OldAccounting:
    """`_measure` as it was before the per-mode children (commit 6d46593): the reference
    the rendered metrics are compared against, step by step (which series exist after each
    record, every bucket). Its engine-side part (usage, waits, realized tokens) is today's
    code unchanged, copied so the method stays whole. A deliberate change to `_measure`'s
    series changes this reference with it. It wraps an `Accounting` (its metrics, label
    cache, waits and clock) and stands in for its `on_decision`: the compiled class is not
    subclassed."""

    def __init__(self, registry: CollectorRegistry, clock: Any) -> None:
        self.acc = Accounting(registry, clock=clock)
        self.metrics, self._of, self.waits = self.acc.metrics, self.acc._of, self.acc.waits
        self.clock = clock

    def on_decision(self, record: DecisionRecord) -> None:  # Accounting's, with no log
        realized = parse_realized(record.response_tail) if record.engine is not None else None
        self._measure(record, realized)

    def _measure(self, record: DecisionRecord, realized: Any) -> None:
        from ramjet.decisions.log import predicted_for, realized_ttft

        m, mode = self.metrics, record.mode
        inc, cand = record.incumbent, record.candidate
        if inc is not None and cand is not None and record.status and record.status < 500:
            self._of(m.compared, mode).inc()
            self._of(m.gain_total, mode)
            self._of(m.loss_total, mode)
            agreed = self._of(m.agreed, mode)
            if inc.engine == cand.engine:
                agreed.inc()
            on_inc = predicted_for(cand, inc.engine, "ttft_s")
            on_cand = predicted_for(cand, cand.engine, "ttft_s")
            if on_inc is not None and on_cand is not None:
                gain = on_inc - on_cand
                m.gain.labels(mode).observe(gain)
                if gain > 0:
                    self._of(m.gain_total, mode).inc(gain)
                elif gain < 0:
                    self._of(m.loss_total, mode).inc(-gain)
        if record.engine is None or record.status >= 400:
            return
        if realized is None:
            self._of(m.usage_missing, record.engine).inc()
        else:
            self.waits.add(self.clock(), realized.queue_ms / 1e3)
            m.mean_wait.set(self.waits.mean())
            self._of(m.wait_samples, "engine").inc()
            for source, n in (
                ("hbm", realized.hbm_tokens),
                ("host", realized.host_tokens),
                ("ssd", realized.ssd_tokens),
                ("swa", realized.swa_tokens),
                ("replayed", realized.replayed_tokens),
                ("prefilled", realized.prefilled_tokens),
            ):
                if n:
                    self._of(m.realized_tokens, record.engine, source).inc(n)
        predicted = predicted_for(cand, record.engine, "ttft_s")
        real, _ = realized_ttft(record, realized)
        if predicted is not None and real is not None:
            m.ttft_error.labels(mode).observe(predicted - real)
            m.ttft_abs_error.labels(mode).observe(abs(predicted - real))
            m.ttft_predicted.labels(mode).observe(predicted)
            m.ttft_realized.labels(mode).observe(real)
            if real > 0:
                m.ttft_relative_error.labels(mode).observe((predicted - real) / real)
                m.ttft_abs_relative.labels(mode).observe(abs(predicted - real) / real)
        resume = predicted_for(cand, record.engine, "resume_tokens")
        if resume is not None and realized is not None:
            m.cached_error.labels(mode).observe(resume - realized.cached_tokens)
            self._of(m.cached_predicted, mode).inc(max(resume, 0))
            self._of(m.cached_realized, mode).inc(realized.cached_tokens)


def test_metrics_render_the_same_as_before_the_per_mode_children() -> None:
    """The same 600 varied records (three modes, with and without a candidate, agreeing or
    not, 2xx/4xx/5xx, stream or not, usage missing, a zero TTFT, no resume prediction)
    through today's accounting and the old one: /metrics is byte-identical after each (but
    for the series' creation times)."""
    import dataclasses
    import random

    from prometheus_client import generate_latest

    def rendered(reg: CollectorRegistry) -> bytes:  # less `_created`: wall-clock stamps
        lines = generate_latest(reg).splitlines(keepends=True)
        return b"".join(ln for ln in lines if b"_created{" not in ln and b"_created " not in ln)

    rng = random.Random(19)
    new_reg, old_reg = CollectorRegistry(), CollectorRegistry()
    t = [0.0]
    new = Accounting(new_reg, clock=lambda: t[0])
    old = _OldAccounting(old_reg, clock=lambda: t[0])
    series = 0
    for i in range(600):
        t[0] += rng.uniform(0.0, 2.0)
        r = record(
            mode=rng.choice(["observe", "canary", "enforce"]),
            inc=rng.choice(["e0", "e1"]),
            cand=rng.choice(["e0", "e1", None]),
            engine=rng.choice(["e0", "e1"]),
            queue_ms=rng.uniform(0.0, 200.0),
            status=rng.choice([200, 200, 200, 429, 503]),
            stream=rng.random() < 0.5,
            ttft=rng.choice([0.0, rng.uniform(0.0, 1.0)]),
        )
        if i % 7 == 0:
            r = dataclasses.replace(r, response_tail=b"")  # no usage: usage_missing
        if i % 11 == 0 and r.candidate is not None:  # no resume_tokens, no ttft_s for e0
            comps = {E0: {"cost_s": 0.2}, E1: {"ttft_s": 0.3}}
            r = dataclasses.replace(r, candidate=Decision(r.candidate.engine, "x", comps))
        new.on_decision(r)
        old.on_decision(r)
        got, want = rendered(new_reg), rendered(old_reg)
        assert got == want, i
        series = got.count(b"\n")
    assert series > 200  # the sequence reached every group of series
    assert value(new_reg, "ramjet_policy_compared_total", mode="canary") > 0
    assert value(new_reg, "ramjet_ttft_prediction_relative_error_ratio_count", mode="enforce")


def _with_features(r: DecisionRecord, engine: EngineId, x: list[float]) -> DecisionRecord:
    import dataclasses

    names = ("x_prefill_s", "x_context_s", "x_resume_s", "x_wait_s", "x_packing_s")
    comps = {engine: {"ttft_s": sum(x), "resume_tokens": 0.0, **dict(zip(names, x, strict=True))}}
    assert r.candidate is not None
    return dataclasses.replace(r, candidate=Decision(engine, "tier_aware", comps))


def test_an_engine_without_queue_times_gets_its_wait_from_the_router() -> None:
    """vLLM sends no `prompt_work`: the wait W is the realized TTFT less the calibrated
    service, so the externality λ·W is live in front of it; the calibration learns from
    every realized TTFT and shows its weights."""
    import dataclasses

    from ramjet.policy.calibration import Calibrations

    reg, now = CollectorRegistry(), [0.0]
    acc = Accounting(reg, clock=lambda: now[0], calibration=Calibrations())
    for i in range(30):
        now[0] = i * 0.5
        r = record(mode="enforce", cand="e0", engine="e0", ttft=0.9)
        r = _with_features(r, E0, [0.4, 0.0, 0.0, 0.2, 0.0])
        r = dataclasses.replace(r, response_tail=b"")
        acc.on_decision(r)
    assert value(reg, "ramjet_realized_usage_missing_total", engine="e0") == 30
    assert value(reg, "ramjet_mean_wait_samples_total", source="router") == 30
    assert value(reg, "ramjet_mean_wait_samples_total", source="engine") == 0
    assert acc.mean_wait_s() > 0.05  # 0.9 s realized against 0.4 s of predicted prefill
    assert value(reg, "ramjet_ttft_calibration_samples_total", engine="e0") == 30
    w = value(reg, "ramjet_ttft_calibration_weight", engine="e0", term="prefill")
    assert w > 1.0  # it took 0.9 s where the profile said 0.6 s


def test_a_stream_measures_w_at_the_router_and_a_non_stream_takes_the_engines() -> None:
    """A stream's wait is what the router saw (realized first byte less the calibrated
    service: the engine's queue_ms misses the time before its scheduler saw the request);
    a non-stream request has no router first byte, so the engine's queue_ms is W."""
    import dataclasses

    from ramjet.policy.calibration import Calibrations

    reg = CollectorRegistry()
    acc = Accounting(reg, clock=lambda: 0.0, calibration=Calibrations())
    acc.on_decision(_with_features(record(queue_ms=80.0, ttft=0.3), E0, [0.1, 0, 0, 0, 0]))
    assert value(reg, "ramjet_mean_wait_samples_total", source="router") == 1
    assert value(reg, "ramjet_mean_wait_samples_total", source="engine") == 0
    assert acc.mean_wait_s() > 0.1  # 0.3 s realized against ~0.1 s of service
    reg = CollectorRegistry()
    acc = Accounting(reg, clock=lambda: 0.0, calibration=Calibrations())
    r = _with_features(record(queue_ms=80.0), E0, [0.1, 0.0, 0.0, 0.0, 0.0])
    acc.on_decision(dataclasses.replace(r, stream=False, ttft_s=None))
    assert acc.mean_wait_s() == pytest.approx(0.08)
    assert value(reg, "ramjet_mean_wait_samples_total", source="router") == 0
    assert value(reg, "ramjet_mean_wait_samples_total", source="engine") == 1
