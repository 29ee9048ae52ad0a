"""Modes and accounting through a real router in front of fault-controllable upstreams:
observe-mode live decisions equal an incumbent-only run on the same seeded workload (also
with a raising or slow candidate), canary keeps each session on one policy, the engine's
usage is read from the response without changing a byte, the decision log and metrics
fill in, and mode reloads live (admin endpoint; SIGHUP on a real `ramjet serve`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import yaml
from aiohttp import web
from fake_upstream import FakeUpstream
from router_rig import Records, router_config

from ramjet.app.server import RouterServer
from ramjet.decisions.log import read_log
from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView
from ramjet.residency.tables import ResidencyTables

SYSTEM = "You are a careful agent. " * 20


def workload(seed: int, sessions: int = 6, turns: int = 4) -> list[dict[str, Any]]:
    """Seeded multi-turn chats: sessions interleaved at random, each turn extends its
    conversation (so prefixes repeat across turns)."""
    rng = random.Random(seed)
    convs: dict[str, list[dict[str, str]]] = {
        f"s{i}": [{"role": "system", "content": f"task {i}: " + SYSTEM}] for i in range(sessions)
    }
    order = [s for s in convs for _ in range(turns)]
    rng.shuffle(order)
    out = []
    for s in order:
        msgs = convs[s]
        msgs.append({"role": "user", "content": f"step {len(msgs)} " + "x" * rng.randint(5, 300)})
        out.append({"model": "m", "messages": list(msgs), "user": s, "stream": rng.random() < 0.5})
        msgs.append({"role": "assistant", "content": "ok " * rng.randint(1, 20)})
    return out


async def send_all(url: str, bodies: Sequence[dict[str, Any]]) -> list[str]:
    engines = []
    async with aiohttp.ClientSession() as s:
        for i, b in enumerate(bodies):
            async with s.post(
                url + "/v1/chat/completions", json=b, headers={"X-Request-Id": f"req-{i}"}
            ) as r:
                await r.read()
                assert r.status == 200
                engines.append(r.headers["X-Ramjet-Engine"])
    return engines


class Raising:
    name = "raising"

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        raise RuntimeError("scorer bug")


class Slow:
    name = "slow"

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        time.sleep(0.02)  # over the 5 ms budget
        return Decision(engine=engines[-1].id, policy=self.name)


async def run(
    upstreams: list[FakeUpstream],
    bodies: list[dict[str, Any]],
    replace_candidate: Any = None,
    **over: Any,
) -> tuple[list[str], Records, RouterServer]:
    cfg = router_config([u.url for u in upstreams], incumbent={"name": "prefix_affinity"}, **over)
    sink = Records()
    server = RouterServer(cfg, sink=sink, residency=ResidencyTables())
    await server.start()
    try:
        if replace_candidate is not None:
            server.router.modes.candidate = replace_candidate
        return await send_all(server.url, bodies), sink, server
    finally:
        await server.stop(drain_s=0.2)


async def test_observe_decisions_equal_incumbent_only(upstreams: list[FakeUpstream]) -> None:
    bodies = workload(seed=7)
    alone, _, _ = await run(upstreams, bodies)
    assert len(set(alone)) == 2  # the workload does spread over both engines
    observed, sink, server = await run(
        upstreams,
        bodies,
        mode={"kind": "observe", "candidate_budget_s": 1.0},  # a loaded CI box is slow
        candidate={"name": "tier_aware"},
    )
    assert observed == alone
    assert all(r.candidate is not None and r.live_role == "incumbent" for r in sink.records)
    reg = server.router.metrics.registry
    assert reg.get_sample_value("ramjet_policy_compared_total", {"mode": "observe"}) == len(bodies)
    for bad, kind in ((Raising(), "raised"), (Slow(), "slow")):
        got, sink, server = await run(
            upstreams, bodies, bad, mode="observe", candidate={"name": "tier_aware"}
        )
        assert got == alone, kind
        errs = [r.candidate_error or "" for r in sink.records]
        assert all(e.startswith(kind) or e == "skipped" for e in errs), errs
        reg = server.router.metrics.registry
        labels = {"role": "candidate", "kind": kind}
        assert (reg.get_sample_value("ramjet_policy_errors_total", labels) or 0) >= 1


class Witness:
    """Wraps a policy; at each pick records what the router had already done: per engine,
    the in-flight requests in the view it was given and in the router's fleet now (the
    forward raises the latter before it writes to the engine), and the request's blocks
    pending on each engine in its view and in a fresh view of the router's tables (the
    forward holds them pending there)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.server: RouterServer | None = None
        self.seen: list[dict[str, tuple[int, int, int, int]]] = []

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        assert self.server is not None
        router = self.server.router
        seen = {}
        for e in engines:
            fresh = router.residency.view(e.id).global_match(
                request.block_keys, request.block_tokens
            )
            given = e.residency.global_match(request.block_keys, request.block_tokens)
            seen[e.id] = (
                e.load.inflight_requests,
                router.fleet.get(e.id).inflight_requests,
                given.pending,
                fresh.pending,
            )
        self.seen.append(seen)
        return cast(Decision, self.inner.pick(request, engines, fleet))


@pytest.mark.parametrize("mode", ["observe", "enforce"])
async def test_the_accounting_only_pick_runs_after_the_forward_on_the_views_before_it(
    upstreams: list[FakeUpstream], mode: str
) -> None:
    """Observe's candidate and enforce's incumbent pick once the request is on its way
    (the router's fleet already counts it in flight, its blocks are pending on the live
    engine), on the views as they were when the live pick was made (nothing in flight,
    nothing pending: one request at a time, each session's first turn), and land in
    the records as before."""
    bodies = workload(seed=5, sessions=6, turns=1)
    cfg = router_config(
        [u.url for u in upstreams],
        incumbent={"name": "prefix_affinity"},
        candidate={"name": "tier_aware"},
        mode={"kind": mode, "candidate_budget_s": 1.0},
    )
    sink = Records()
    server = RouterServer(cfg, sink=sink, residency=ResidencyTables())
    await server.start()
    try:
        modes = server.router.modes
        role = "candidate" if mode == "observe" else "incumbent"
        witness = Witness(getattr(modes, role))
        witness.server = server
        setattr(modes, role, witness)
        await send_all(server.url, bodies)
        # the packing term's ρ got each request's predicted work on its live engine: in
        # observe from the deferred candidate's figures (the incumbent records none)
        rates = server.router.work_rates.rates(server.router.clock())
    finally:
        await server.stop(drain_s=0.2)
    assert {r.live.engine for r in sink.records} == {e for e, v in rates.items() if v > 0}
    assert len(witness.seen) == len(bodies) == len(sink.records)
    for seen, rec in zip(witness.seen, sink.records, strict=True):
        live = rec.live.engine
        for eid, (view_inflight, now_inflight, given_pending, fresh_pending) in seen.items():
            assert view_inflight == 0 and given_pending == 0, (eid, seen)
            # after the forward began: only the live engine holds it in flight and pending
            assert now_inflight == (1 if eid == live else 0), (eid, seen)
            assert (fresh_pending > 0) == (eid == live), (eid, seen)
        shadow = rec.candidate if mode == "observe" else rec.incumbent
        assert shadow is not None and rec.candidate_error is None
        assert shadow.policy == ("tier_aware" if mode == "observe" else "prefix_affinity")


async def test_canary_keeps_each_session_on_one_policy(upstreams: list[FakeUpstream]) -> None:
    bodies = workload(seed=3, sessions=16, turns=3)
    _, sink, _ = await run(
        upstreams, bodies, mode={"kind": "canary", "share": 0.5}, candidate={"name": "tier_aware"}
    )
    roles: dict[str | None, set[str]] = {}
    for r in sink.records:
        roles.setdefault(r.session, set()).add(r.live_role)
    assert all(len(v) == 1 for v in roles.values()), roles
    assert {next(iter(v)) for v in roles.values()} == {"incumbent", "candidate"}


USAGE = {
    "prompt_tokens": 900,
    "completion_tokens": 2,
    "prompt_work": {
        "hbm_tokens": 768, "host_tokens": 0, "ssd_tokens": 0, "swa_tokens": 5,
        "replayed_tokens": 16, "prefilled_tokens": 127, "queue_ms": 40.0,
        "restore_ms": 1.0, "prefill_ms": 9.0, "epoch": 1,
    },
}  # fmt: skip


class UsageUpstream:
    """An upstream that answers like the reference engine: usage with prompt_work in the
    body, or in the final SSE chunk before [DONE], with many chunks before it."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            data = json.dumps({"choices": [{"message": {"content": "a" * 40000}}], "usage": USAGE})
            self.sent.append(data.encode())
            return web.Response(body=data.encode(), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        out = []
        for _ in range(300):  # ~30 KB of chunks before the usage: the tail must suffice
            out.append(
                b"data: "
                + json.dumps({"choices": [{"delta": {"content": "t" * 80}}]}).encode()
                + b"\n\n"
            )
        out.append(b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        for chunk in out:
            await resp.write(chunk)
        self.sent.append(b"".join(out))
        await resp.write_eof()
        return resp


async def test_usage_read_from_the_tail_bytes_untouched_and_logged(tmp_path: Path) -> None:
    up = UsageUpstream()
    await up.start()
    log_path = tmp_path / "decisions.jsonl"
    cfg = router_config(
        [up.url],
        candidate={"name": "tier_aware"},
        logging={"decisions_path": str(log_path)},
    )
    server = RouterServer(cfg)
    await server.start()
    try:
        got = []
        async with aiohttp.ClientSession() as s:
            for i, stream in enumerate((False, True)):
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": stream,
                }
                async with s.post(
                    server.url + "/v1/chat/completions",
                    json=body,
                    headers={"X-Request-Id": f"u{i}"},
                ) as r:
                    got.append(await r.read())
        assert got == up.sent  # byte-exact, both forms
        reg = server.router.metrics.registry
        hbm = reg.get_sample_value(
            "ramjet_realized_prompt_tokens_total", {"engine": "e0", "source": "hbm"}
        )
        assert hbm == 2 * 768
        # W: the non-stream answer's queue_ms from its usage; the stream's first byte was
        # seen by the router, which measures that request's wait itself (accounting)
        waits = {
            src: reg.get_sample_value("ramjet_mean_wait_samples_total", {"source": src})
            for src in ("engine", "router")
        }
        assert waits == {"engine": 1.0, "router": 1.0}, waits
    finally:
        await server.stop(drain_s=0.2)
        if up.runner is not None:
            await up.runner.cleanup()
    lines = read_log(log_path)
    assert [e["id"] for e in lines] == ["u0", "u1"]
    assert all(e["realized"]["cached_tokens"] == 773 for e in lines)
    assert lines[0]["ttft_source"] == "engine" and lines[1]["ttft_source"] == "router"
    assert "e0" in lines[0]["predicted"] and lines[0]["candidate"]["policy"] == "tier_aware"


def _policy_file(path: Path, urls: list[str], mode: str, token: str | None = "s3cret") -> None:
    data: dict[str, Any] = {
        "engines": [{"id": f"e{i}", "url": u} for i, u in enumerate(urls)],
        "incumbent": {"name": "round_robin"},
        "candidate": {"name": "tier_aware", "params": {"externality_scale": 1.0}},
        "mode": mode,
    }
    if token:
        data["admin"] = {"token": token}
    path.write_text(yaml.safe_dump(data))


async def test_admin_reload_swaps_mode_and_refuses_bad_files(
    upstreams: list[FakeUpstream], tmp_path: Path
) -> None:
    urls = [u.url for u in upstreams]
    pf = tmp_path / "policy.yaml"
    _policy_file(pf, urls, "observe")
    from ramjet.config import load_policy

    server = RouterServer(load_policy(pf), policy_path=str(pf))
    await server.start()
    try:
        async with aiohttp.ClientSession() as s:

            async def reload(token: str | None) -> tuple[int, Any]:
                h = {"Authorization": f"Bearer {token}"} if token else {}
                async with s.post(server.url + "/admin/reload", headers=h) as r:
                    return r.status, await r.json()

            assert (await reload(None))[0] == 401
            assert (await reload("wrong"))[0] == 401
            _policy_file(pf, urls, "enforce")
            status, body = await reload("s3cret")
            assert status == 200 and body["mode"] == "enforce" and body["changed"] == ["mode"]
            assert server.router.modes.mode.kind == "enforce"
            inc_before = server.router.modes.incumbent
            pf.write_text("engines: [}")  # broken YAML: refused, nothing changes
            status, body = await reload("s3cret")
            assert status == 400 and "not valid YAML" in body["error"]["message"]
            assert server.router.modes.mode.kind == "enforce"
            assert server.router.modes.incumbent is inc_before
            _policy_file(pf, urls, "canary")  # canary share 0 is valid; bad params are not
            data = yaml.safe_load(pf.read_text())
            data["candidate"]["params"] = {"externality_scale": -1}
            pf.write_text(yaml.safe_dump(data))
            status, body = await reload("s3cret")
            assert status == 400 and "externality_scale" in body["error"]["message"]
            assert server.router.modes.mode.kind == "enforce"
    finally:
        await server.stop(drain_s=0.2)


async def test_admin_reload_off_without_token(upstreams: list[FakeUpstream]) -> None:
    server = RouterServer(router_config([u.url for u in upstreams]))
    await server.start()
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(server.url + "/admin/reload", headers={"Authorization": "Bearer x"}) as r,
        ):
            assert r.status == 403
    finally:
        await server.stop(drain_s=0.2)


def _free_port() -> int:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return int(so.getsockname()[1])


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_sighup_reloads_a_running_router(
    upstreams: list[FakeUpstream], tmp_path: Path
) -> None:
    urls = [u.url for u in upstreams]
    pf = tmp_path / "policy.yaml"
    _policy_file(pf, urls, "observe", token=None)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ramjet", "serve", "--policy", str(pf), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                await _metric(url, "ramjet_policy_reloads_total")
                break
            except aiohttp.ClientError:
                assert time.monotonic() < deadline and proc.poll() is None
                await asyncio.sleep(0.1)
        _policy_file(pf, urls, "enforce", token=None)
        os.kill(proc.pid, signal.SIGHUP)
        ok = 'ramjet_policy_reloads_total{result="ok"}'
        while await _metric(url, ok) < 1:
            assert time.monotonic() < deadline and proc.poll() is None
            await asyncio.sleep(0.05)
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            ) as r,
        ):
            assert r.status == 200
        assert (
            await _metric(
                url, 'ramjet_decisions_total{engine="e0",policy="tier_aware",role="live"}'
            )
            + await _metric(
                url, 'ramjet_decisions_total{engine="e1",policy="tier_aware",role="live"}'
            )
            == 1
        )
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def test_enforce_tier_aware_spreads_sequential_cold_requests(
    upstreams: list[FakeUpstream],
) -> None:
    """Issue 19: one request at a time on idle engines, each a new session with its own
    prompt: every engine ties, and the ties must rotate (20 of 20 went to the first)."""
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": f"cold {i} " + "y" * 300}]}
        for i in range(20)
    ]
    engines, sink, _ = await run(
        upstreams, bodies, mode={"kind": "enforce"}, candidate={"name": "tier_aware"}
    )
    assert all(r.live_role == "candidate" for r in sink.records)
    counts = {e: engines.count(e) for e in ("e0", "e1")}
    assert min(counts.values()) >= 8, counts
