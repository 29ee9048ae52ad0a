"""`ramjet.metrics`' loop families against prometheus_client: the same updates give the
same exposition text (every sample but the `_created` timestamps), the same errors, and
the same duplicate-registration refusal."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ramjet.metric_catalogue import counter, histogram
from ramjet.metrics import loop_counter, loop_histogram

COUNTERS = ("ramjet_requests_total", "ramjet_policy_compared_total")
HISTOGRAMS = (
    "ramjet_ttft_seconds",  # buckets without +Inf (added)
    "ramjet_ttft_predicted_seconds",  # buckets ending in +Inf
    "ramjet_ttft_prediction_error_seconds",  # negative buckets: no _sum
    "ramjet_cached_tokens_prediction_error_tokens",
)
_CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.M)


def _text(reg: CollectorRegistry) -> tuple[str, list[str]]:
    """The exposition with `_created` values masked, and the `_created` series names."""
    text = generate_latest(reg).decode()
    return _CREATED.sub(r"\1 T", text), _CREATED.findall(text)


def _values(rng: random.Random) -> Iterator[float]:
    edge = [0.0, -0.0, 0.001, 0.0025, 1e-9, 59.9, 60.0, 300.0, 301.0, -0.001, -10.0, 1e9]
    yield from edge
    yield from (math.inf, -math.inf, math.nan)
    for _ in range(300):
        yield rng.choice([rng.uniform(-12, 12), rng.expovariate(3.0), rng.choice(edge)])


@pytest.fixture(params=[True, False], ids=["created", "no-created"])
def created(request: pytest.FixtureRequest) -> Iterator[bool]:
    if not request.param:
        prometheus_client.disable_created_metrics()
    try:
        yield bool(request.param)
    finally:
        prometheus_client.enable_created_metrics()


def test_the_same_updates_expose_the_same_text(created: bool) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    rng = random.Random(5)
    for name in COUNTERS:
        a, b = loop_counter(ours, name), counter(theirs, name)
        n = len(a.labelnames)
        for _ in range(200):
            values = tuple(rng.choice(["e0", "e1", "x y", 'q"\\']) for _ in range(n))
            amount = rng.choice([1.0, 0.0, 2.5, 1e-7, 3])
            a.labels(*values).inc(amount)
            b.labels(*values).inc(amount)
        kw = dict(zip(a.labelnames, ["k"] * n, strict=True))
        a.labels(**kw).inc()
        b.labels(**kw).inc()
    for name in HISTOGRAMS:
        h, g = loop_histogram(ours, name), histogram(theirs, name)
        for v in _values(rng):
            label = rng.choice(["observe", "enforce"])
            h.labels(label).observe(v)
            g.labels(label).observe(v)
    mine, mine_created = _text(ours)
    want, want_created = _text(theirs)
    assert mine == want
    assert mine_created == want_created
    assert bool(mine_created) == created


def test_an_unlabelled_family_and_a_fresh_series() -> None:
    reg = CollectorRegistry()
    c = loop_counter(reg, "ramjet_requests_total")
    c.labels("e0", "200", "p")  # a series exists from its first labels(), as there
    labels = {"engine": "e0", "status": "200", "policy": "p"}
    assert reg.get_sample_value("ramjet_requests_total", labels) == 0.0
    with pytest.raises(ValueError, match="has labels"):
        c.inc()


def test_bad_updates_fail_as_prometheus_client_fails() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a, b = loop_counter(ours, "ramjet_requests_total"), counter(theirs, "ramjet_requests_total")
    h = loop_histogram(ours, "ramjet_ttft_seconds")
    for fam in (a, b):
        with pytest.raises(ValueError):
            fam.labels("e0", "200", "p").inc(-1)
        with pytest.raises(ValueError):
            fam.labels("e0", "200")
        with pytest.raises(ValueError):
            fam.labels("e0", "200", "p", "x")
        with pytest.raises(ValueError):
            fam.labels(engine="e0", status="200")
        with pytest.raises(ValueError):
            fam.labels("e0", engine="e0", status="200", policy="p")
    with pytest.raises(ValueError):
        h.labels()
    assert _text(ours)[0].count("ramjet_requests_total{") == 1  # the one good series
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        loop_counter(ours, "ramjet_requests_total")
    with pytest.raises(TypeError, match="not a histogram"):
        loop_histogram(CollectorRegistry(), "ramjet_requests_total")
