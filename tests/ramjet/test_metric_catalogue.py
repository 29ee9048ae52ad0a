"""The metric catalogue (`ramjet.metric_catalogue`) is the one list: what the code
registers, what the dashboards and recording rules query, and the docs table all agree
with it."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from ramjet import metric_catalogue as mc
from ramjet.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
DIRECT = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}
LOOP = ("loop_counter", "loop_histogram")  # ramjet.metrics: the request path's families
BY_NAME = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "family": "gauge"}
BY_NAME |= {"loop_counter": "counter", "loop_histogram": "histogram"}


def _calls() -> tuple[
    list[tuple[str, str, str, str, tuple[str, ...] | None, str | None]], list[str]
]:
    """Every registration in ramjet/: (module, how, name, kind, labels, help); `how` is
    "catalogue" for `counter(r, name)`-style calls, "direct" for prometheus_client's
    constructors with a constant `ramjet_` name (their labels and help as written)."""
    found = []
    bad = []
    for path in sorted((ROOT / "ramjet").rglob("*.py")):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            fn = node.func.id
            args = node.args
            if fn in ("counter", "gauge", "histogram", *LOOP) and len(args) == 2:
                name_node = args[1]
            elif fn == "family" and args:
                name_node = args[0]
            elif fn in DIRECT or fn.endswith("MetricFamily"):
                name_node = args[0] if args else None
            else:
                continue
            if not (isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)):
                registers = any(kw.arg == "registry" for kw in node.keywords)
                if fn in DIRECT and registers and mod != "ramjet.metric_catalogue":
                    bad.append(f"{mod}:{node.lineno}: {fn} with a name that is not a constant")
                continue
            name = name_node.value
            if not name.startswith("ramjet_"):
                continue
            if fn in BY_NAME:
                found.append((mod, "catalogue", name, BY_NAME[fn], None, None))
                continue
            kind = DIRECT.get(fn, "gauge" if fn == "GaugeMetricFamily" else fn)
            help_ = ast.literal_eval(args[1]) if len(args) > 1 else None
            labels = tuple(ast.literal_eval(args[2])) if len(args) > 2 else ()
            for kw in node.keywords:
                if kw.arg in ("labelnames", "labels"):
                    labels = tuple(ast.literal_eval(kw.value))
            found.append((mod, "direct", name, kind, labels, help_))
    return found, bad


CALLS, NON_CONSTANT = _calls()


def test_the_walk_finds_registrations() -> None:
    names = {c[2] for c in CALLS}
    assert {
        "ramjet_requests_total",
        "ramjet_reports_rejected_total",
        "ramjet_residency_entries",
    } <= names
    assert not NON_CONSTANT, NON_CONSTANT


def test_every_registration_is_its_catalogue_entry() -> None:
    bad = []
    for mod, how, name, kind, labels, help_ in CALLS:
        m = mc.BY_NAME.get(name)
        if m is None:
            bad.append(f"{mod}: {name} is not in the catalogue")
            continue
        if m.kind != kind:
            bad.append(f"{mod}: {name} registered as {kind}, catalogued as {m.kind}")
        if m.source != mod:
            bad.append(f"{mod}: {name} is catalogued as registered by {m.source}")
        if how == "direct" and (labels != m.labels or help_ != m.help):
            bad.append(f"{mod}: {name} labels/help differ from the catalogue: {labels} {help_!r}")
    assert not bad, "\n".join(bad)


def test_every_entry_is_registered_once() -> None:
    registered = [c[2] for c in CALLS]
    missing = sorted(m.name for m in mc.CATALOGUE if m.name not in registered)
    twice = sorted({n for n in registered if registered.count(n) > 1})
    assert not missing, f"catalogued but registered nowhere: {missing}"
    assert not twice, f"registered in more than one place: {twice}"


def test_router_metrics_are_made_from_the_catalogue() -> None:
    reg = CollectorRegistry()
    RouterMetrics(reg)
    got = {}
    for collector in list(reg._collector_to_names):
        for fam in collector.describe():
            got[fam.name] = (fam.type, fam.documentation)
    mine = [m for m in mc.CATALOGUE if m.source == "ramjet.metrics"]
    assert len(mine) >= 16
    for m in mine:
        base = m.name.removesuffix("_total") if m.kind == "counter" else m.name
        assert got[base] == (m.kind, m.help), m.name
    assert len(got) == len(mine)


def test_docs_table_is_the_catalogue() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert mc.render_doc(doc) == doc, "run python -m ramjet.metric_catalogue docs/metrics.md"
    rows = [line for line in doc.splitlines() if line.startswith("| `ramjet_")]
    assert len(rows) == len(mc.CATALOGUE)


def test_docs_mention_only_catalogued_series() -> None:
    # a name counts as a metric when its first word after ramjet_ is a catalogued
    # subsystem (ramjet_reports_..., ramjet_redis_...); ramjet_observe, a benchmark row, is not
    subsystems = {m.name.split("_")[1] for m in mc.CATALOGUE}
    bad = []
    for path in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for series in re.findall(r"(?<![\w:])ramjet_[a-z0-9_]*[a-z0-9](?![\w:])", line):
                if series.split("_")[1] in subsystems and mc.series_metric(series) is None:
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {series}")
    assert not bad, "series named in the docs but not in the catalogue:\n" + "\n".join(bad)


def _dashboard_queries() -> list[tuple[str, str]]:
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import generate_dashboards
    finally:
        sys.path.pop(0)
    return generate_dashboards.queries()


def _rule_queries() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "deploy" / "prometheus").rglob("*.yml")):
        data = yaml.safe_load(path.read_text()) or {}
        for group in data.get("groups", []) if isinstance(data, dict) else []:
            for rule in group.get("rules", []):
                where = f"{path.name}/{rule.get('record') or rule.get('alert')}"
                out.append((where, str(rule["expr"])))
    return out


def test_dashboards_and_rules_query_catalogued_series() -> None:
    queries = _dashboard_queries() + _rule_queries()
    assert len(queries) > 20
    assert not mc.check_queries(queries)


def test_check_queries_refuses_unknown_series() -> None:
    bad = mc.check_queries(
        [
            ("a", "sum(rate(ramjet_requests_total[5m]))"),
            ("b", "rate(ramjet_no_such_total[5m])"),
            ("c", "histogram_quantile(0.9, rate(ramjet_requests_total_bucket[5m]))"),
            ("d", "histogram_quantile(0.9, rate(ramjet_ttft_seconds_bucket[5m]))"),
        ]
    )
    assert [b.split(":")[0] for b in bad] == ["b", "c"]


def test_catalogue_rules_refuse_bad_entries() -> None:
    ok = mc.Metric("ramjet_x_total", mc.COUNTER, "", (), "ramjet.x", "x")
    mc._check([ok])
    for bad, msg in [
        (mc.Metric("ramjet_x", mc.COUNTER, "", (), "ramjet.x", "x"), "_total"),
        (mc.Metric("ramjet_x_total", mc.GAUGE, "", (), "ramjet.x", "x"), "_total"),
        (mc.Metric("ramjet_wait_ms", mc.GAUGE, "seconds", (), "ramjet.x", "x"), "unit"),
        (mc.Metric("other_x", mc.GAUGE, "", (), "ramjet.x", "x"), "ramjet_"),
        (mc.Metric("ramjet_x", mc.GAUGE, "", (), "ramjet.x", "x", buckets=(1.0,)), "buckets"),
    ]:
        with pytest.raises(ValueError, match=msg):
            mc._check([bad])
    with pytest.raises(ValueError, match="twice"):
        mc._check([ok, ok])


def test_lookup_by_name_and_kind() -> None:
    reg = CollectorRegistry()
    c = mc.counter(reg, "ramjet_retries_total")
    c.labels(reason="status_5xx").inc()
    assert reg.get_sample_value("ramjet_retries_total", {"reason": "status_5xx"}) == 1.0
    with pytest.raises(KeyError, match="add its entry"):
        mc.counter(reg, "ramjet_not_catalogued_total")
    with pytest.raises(TypeError, match="not a gauge"):
        mc.gauge(reg, "ramjet_ejections_total")
    with pytest.raises(TypeError, match="scrape"):
        mc.gauge(reg, "ramjet_residency_entries")
