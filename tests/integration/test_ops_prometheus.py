"""Every dashboard panel and every rule returns data from a real Prometheus scraping a
running system: two router replicas (observe mode, Redis-shared residency, signed reports
pulled from the engines, priority hints sent) in front of two real reference-engine
processes that schedule by priority.

Prometheus (`/usr/bin/prometheus`) runs with the repository's rule files and a scrape
config derived from `deploy/prometheus/prometheus.yml` (same jobs and labels; targets
swapped for the loopback ports; 1 s scrape and evaluation). After a short multi-session
workload the test asks Prometheus's HTTP API for:

- every metric name referenced by a dashboard or rule, in `/api/v1/label/__name__/values`
  (a name nobody exports fails here, whatever the query does with it);
- every panel query (`$__rate_interval` -> 20s) and every recording rule: a non-empty
  result;
- every alert's signal: the expression `SIGNAL op THRESHOLD` asked as `SIGNAL op bool
  THRESHOLD` (one sample per series, whether or not it fires); alerts whose condition is
  a fault must not fire in this healthy run;
- `/api/v1/rules`: every rule loaded and evaluated without error; `/api/v1/targets`: all
  four targets up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from engines import EngineProcess, free_port
from redis_server import redis_server

from ramjet.app.server import RouterServer
from ramjet.config import PolicyConfig, parse_policy
from ramjet.fleet.signals import REPORTS_KEY
from ramjet.reports.keys import public_key_b64, write_keypair
from ramjet.residency.factory import ResidencyRuntime, build_residency

pytestmark = [pytest.mark.redis, pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
RATE_WINDOW = "20s"
ENGINE_IDS = ("e0", "e1")
# Alerts whose condition is a fault: in this healthy run their signal must be 0 everywhere.
MUST_NOT_FIRE = {
    "RamjetEngineEjected",
    "RamjetReportVerificationFailures",
    "RamjetRedisDegraded",
    "RamjetRedisBatchesDropped",
    "RamjetRedisCommandErrors",
    "RamjetRedisRejectedData",
    "RamjetHighErrorRate",
    "RamjetDecisionLogDropping",
    "RamjetReportPullSilent",
    "RamjetPriorityStarvation",
}
_COMPARISON = re.compile(
    r"^(?P<lhs>.+?)\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<thr>-?[0-9.]+(?:e-?\d+)?)$"
)
_NAME = re.compile(r"(?<![\w:\"'{=~])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left",
    "group_right", "rate", "increase", "irate", "histogram_quantile", "or", "and", "unless",
    "bool", "vector", "le", "offset",
}  # fmt: skip


# -- what the deploy folder asks of Prometheus ------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) for every target of every panel, `$__rate_interval` substituted."""
    out = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for t in panel["targets"]:
                expr = t["expr"].replace("$__rate_interval", RATE_WINDOW)
                out.append((f"{path.name}: {panel['title']} [{t['refId']}]", expr))
    return out


def rules() -> list[dict[str, Any]]:
    out = []
    for path in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend(group["rules"])
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression: identifiers outside label matchers
    and strings that are neither keywords/functions nor label names after by/on(...)."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_matchers = re.sub(r"\{[^}]*\}", "{}", no_strings)
    no_groupings = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", no_matchers
    )
    names = set()
    for m in _NAME.finditer(no_groupings):
        word = m.group(1)
        if word in _PROMQL_WORDS or re.fullmatch(r"\d.*", word):
            continue
        names.add(word)
    return names


def alert_signal(expr: str) -> tuple[str, str, float]:
    m = _COMPARISON.match(" ".join(expr.split()))
    assert m, f"alert expression is not `SIGNAL op THRESHOLD`: {expr}"
    return m["lhs"], m["op"], float(m["thr"])


# -- the running system ----------------------------------------------------------------------


@contextlib.contextmanager
def two_engines(keys_dir: Path) -> Iterator[dict[str, tuple[EngineProcess, Any]]]:
    """Two real engines, started in parallel (each takes seconds to import torch),
    signing their reports with keys made here and serving the lowest `priority` first
    (the priority dashboard's band, oldest-waiting and preemption series)."""
    procs: dict[str, tuple[EngineProcess, Any]] = {}
    for eid in ENGINE_IDS:
        priv, _pub, key = write_keypair(keys_dir, f"{eid}-k1")
        flags = {"window": 16, "profile": "skip", "log_level": "WARNING", "key": priv,
                 "key_id": f"{eid}-k1", "scheduling_policy": "priority"}  # fmt: skip
        cache = keys_dir.parent / eid
        cache.mkdir()
        procs[eid] = (EngineProcess(eid, free_port(), cache, flags), key)
    errors: list[BaseException] = []

    def start(p: EngineProcess) -> None:
        try:
            p.start(timeout=90)
        except BaseException as exc:  # reported below, after every engine is stopped
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(p,)) for p, _ in procs.values()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        yield procs
    finally:
        for p, _ in procs.values():
            p.stop()


def policy(engines: dict[str, tuple[EngineProcess, Any]], redis_url: str) -> PolicyConfig:
    return parse_policy(
        {
            "engines": [{"id": eid, "url": p.url} for eid, (p, _) in engines.items()],
            "mode": {"kind": "observe", "candidate_budget_s": 0.05},
            "incumbent": {"name": "prefix_affinity"},
            "candidate": {"name": "tier_aware"},
            "health": {"probe_interval_s": 0.5},
            "timeouts": {"drain_s": 2.0},
            "store": {"kind": "redis", "url": redis_url, "sync_interval_ms": 50},
            "reports": {"poll": {"wait_s": 1, "timeout_s": 3}},
            "priority": [
                {"name": "fleet", "engines": list(engines), "mode": "on", "convention": "reference"}
            ],
            "keys": {
                "engines": {
                    eid: [{"key_id": f"{eid}-k1", "public_key": public_key_b64(k.public_key())}]
                    for eid, (_, k) in engines.items()
                }
            },
        }
    )


class Replica:
    """One router as `ramjet serve` runs it, with Redis residency and signed reports on
    one registry (one /metrics); the server builds and mounts its report runtime."""

    def __init__(self, config: PolicyConfig) -> None:
        self.registry = CollectorRegistry()
        self.residency: ResidencyRuntime = build_residency(config, self.registry)
        self.server = RouterServer(config, registry=self.registry, residency=self.residency.tables)
        assert REPORTS_KEY in self.server.app, "the server mounts the report runtime"

    async def start(self) -> None:
        await self.residency.start()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(drain_s=0.5)
        await self.residency.stop()


@contextlib.asynccontextmanager
async def replicas(config: PolicyConfig, n: int = 2) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for _ in range(n):
            r = Replica(config)
            await r.start()
            started.append(r)
        yield started
    finally:
        for r in started:
            # a stop that hangs fails here, by name, instead of using up the test's timeout
            async with asyncio.timeout(20):
                await r.stop()


def prometheus_config(
    tmp: Path, routers: list[str], engines: dict[str, tuple[EngineProcess, Any]]
) -> Path:
    """deploy/prometheus/prometheus.yml with loopback targets, 1 s intervals and the
    repository's rule files by absolute path; jobs, paths and labels as deployed."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in cfg["rule_files"]]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    router_job = jobs.pop("ramjet-router")
    router_job.pop("dns_sd_configs")
    router_job["static_configs"] = [{"targets": routers}]
    engine_job = jobs.pop("ramjet-engine")
    assert not jobs, f"unexpected scrape jobs {sorted(jobs)}"
    by_label = {sc["labels"]["engine"]: sc for sc in engine_job["static_configs"]}
    assert sorted(by_label) == sorted(engines), "deploy config must label every engine"
    for eid, (p, _) in engines.items():
        by_label[eid]["targets"] = [f"127.0.0.1:{p.port}"]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def prometheus(config: Path, tmp: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=log,
    )  # fmt: skip
    log.close()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


async def api(s: aiohttp.ClientSession, base: str, path: str, **params: str) -> Any:
    async with s.get(base + path, params=params) as resp:
        body = await resp.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]


async def query(s: aiohttp.ClientSession, base: str, expr: str) -> list[dict[str, Any]]:
    data = await api(s, base, "/api/v1/query", query=expr)
    assert data["resultType"] == "vector", expr
    return list(data["result"])


# -- the workload ----------------------------------------------------------------------------

SYSTEM = "You are the coding agent. Repository map: " + "src/module_x.py defines Y; " * 30


def turn(session: int, k: int) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for i in range(k + 1):
        messages.append({"role": "user", "content": f"session {session} step {i}: run tests"})
        if i < k:
            messages.append({"role": "assistant", "content": f"ok {i}"})
    return {"model": "mini-v4", "messages": messages, "max_tokens": 3, "stream": k % 2 == 1}


async def workload(urls: list[str], sessions: int = 3, turns: int = 3) -> list[int]:
    """Multi-turn sessions sharing a system prompt, each turn through the next replica."""
    statuses: list[int] = []
    failures: list[str] = []

    async def run(s: aiohttp.ClientSession, session: int) -> None:
        for k in range(turns):
            url = urls[(session + k) % len(urls)] + "/v1/chat/completions"
            async with s.post(url, json=turn(session, k)) as resp:
                body = await resp.read()
                statuses.append(resp.status)
                if resp.status != 200:
                    failures.append(f"{resp.status} {body[:300]!r}")

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await asyncio.gather(*(run(s, i) for i in range(sessions)))
    assert not failures, failures
    return statuses


# -- the test --------------------------------------------------------------------------------


def test_every_dashboard_query_and_rule_names_real_metrics() -> None:
    """Static half: every panel has a description, every alert a runbook in
    docs/operations.md, and the name extractor sees what the queries name."""
    ops = (REPO / "docs" / "operations.md").read_text().lower()
    for where, expr in dashboard_queries():
        assert metric_names(expr), f"{where}: no metric in {expr}"
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            assert panel.get("description", "").strip(), f"{path.name}: {panel['title']}"
    for rule in rules():
        if "alert" in rule:
            ann = rule["annotations"]
            assert ann["summary"] and ann["description"], rule["alert"]
            anchor = ann["runbook_url"].split("#", 1)
            assert anchor[0] == "docs/operations.md", rule["alert"]
            assert f"### {rule['alert'].lower()}" in ops, f"no runbook section {rule['alert']}"
            alert_signal(rule["expr"])
    assert metric_names(
        'sum by (engine) (rate(ramjet_x_total{a="b:c"}[1m])) / ignoring (source) group_left '
        "sum(ramjet:y:rate5m) or vector(0)"
    ) == {"ramjet_x_total", "ramjet:y:rate5m"}


async def test_prometheus_answers_every_panel_and_rule(tmp_path: Path) -> None:
    t0 = time.monotonic()
    keys_dir = tmp_path / "keys"
    with redis_server() as redis, two_engines(keys_dir) as engines:
        config = policy(engines, redis.url)
        async with replicas(config) as reps:
            urls = [r.server.url for r in reps]
            prom_cfg = prometheus_config(
                tmp_path, [u.removeprefix("http://") for u in urls], engines
            )
            with prometheus(prom_cfg, tmp_path) as prom:
                statuses = await workload(urls)
                assert statuses and all(s == 200 for s in statuses), statuses
                async with aiohttp.ClientSession() as s:
                    await check_prometheus(s, prom, tmp_path)
    print(f"\nops prometheus test: {time.monotonic() - t0:.1f}s")


async def check_prometheus(s: aiohttp.ClientSession, prom: str, tmp: Path) -> None:
    board = dashboard_queries()
    all_rules = rules()
    recorded = {r["record"] for r in all_rules if "record" in r}
    exprs = [*(e for _, e in board), *(r["expr"] for r in all_rules)]
    wanted = set().union(*(metric_names(e) for e in exprs))

    # Wait for the scrapes and rule evaluations to cover the workload (bounded): every
    # name a query reads, and every series a recording rule writes (a rule whose
    # expression selects nothing writes none, even where no panel reads it yet).
    deadline = time.monotonic() + 30
    names: set[str] = set()
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, AssertionError):
            names = set(await api(s, prom, "/api/v1/label/__name__/values"))
            if not (wanted | recorded) - names:
                break
        await asyncio.sleep(0.5)
    log = (tmp / "prometheus.log").read_text(errors="replace")[-3000:]
    missing = sorted((wanted - recorded) - names)
    assert not missing, f"metrics named but never scraped: {missing}\n{log}"
    unwritten = sorted(recorded - names)
    assert not unwritten, f"recording rules that wrote no series: {unwritten}\n{log}"

    targets = (await api(s, prom, "/api/v1/targets"))["activeTargets"]
    assert len(targets) == 4 and all(t["health"] == "up" for t in targets), targets

    # A rate() needs two samples of a series inside its window: a series born in the last
    # scrape has one. Poll until every panel answers (bounded), then judge.
    pending = list(board) + [
        (f"record {r['record']}: {r['expr']}", r["record"]) for r in all_rules if "record" in r
    ]
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        pending = [(w, e) for w, e in pending if not await query(s, prom, e)]
        if pending:
            await asyncio.sleep(1.0)
    empty = [where if where.startswith("record ") else f"{where}: {e}" for where, e in pending]
    for rule in all_rules:
        if "alert" in rule:
            lhs, op, thr = alert_signal(rule["expr"])
            result = await query(s, prom, f"({lhs}) {op} bool {thr}")
            if not result:
                empty.append(f"alert {rule['alert']}: {lhs}")
            elif rule["alert"] in MUST_NOT_FIRE:
                firing = [r["metric"] for r in result if float(r["value"][1]) != 0]
                assert not firing, f"{rule['alert']} fires in a healthy run: {firing}"
    assert not empty, "queries without data:\n" + "\n".join(empty)

    # The priority panels show priority scheduling, not FCFS: the routers sent hints, and
    # the engines banded their queue waits by them.
    sent = await query(s, prom, 'sum(ramjet_priority_hints_total{outcome="sent"})')
    assert sent and float(sent[0]["value"][1]) > 0, sent
    waits = await query(s, prom, "sum by (band) (engine_queue_wait_by_band_seconds_count)")
    bands = {r["metric"]["band"] for r in waits}
    assert bands and "fcfs" not in bands, bands

    groups = (await api(s, prom, "/api/v1/rules"))["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    rule_names = {r.get("record") or r.get("alert") for r in all_rules}
    assert rule_names == set(loaded), rule_names ^ set(loaded)
    bad = {n: r.get("lastError") for n, r in loaded.items() if r["health"] != "ok"}
    assert not bad, bad
