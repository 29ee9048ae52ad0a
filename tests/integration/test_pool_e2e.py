"""Issue 30 end to end: two reference-engine processes sharing a host pool of global KV
and a pool of SWA states (`--pool-dir`, `--swa-pool-dir`), each pool reported by its own
`ramjet pool-reporter` process signing with the pool's key, and the router (`ramjet
serve`, enforce with `tier_aware`, the pools declared under `fabric.pools`), all real
processes on loopback.

A session's first turn runs on one engine, which writes its blocks and its SWA state
through to the pools. That engine then stops, so the router moves the session's next
turn to the other engine, which has never seen it. The second engine restores the
whole prefix from the pools: `prompt_work` shows the blocks as pool tokens, the SWA
state resumed at the first prompt's end (no replay), and only the new turn prefilled;
the router's decision priced the move as a pull from the pool (its signed reports
reached the router) and its realized work carries the pool tokens.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from pool_fleet import pool_fleet

from kvpool import Pool

pytestmark = pytest.mark.timeout(180)

POOL_BYTES = 8 << 20
SWA_POOL_BYTES = 4 << 20
BLOCK = 256


def _accepted(router: str, who: str) -> float:
    """Reports of `who` the router accepted (its metrics)."""
    with urllib.request.urlopen(router + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("ramjet_reports_accepted_total{") and f'engine="{who}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _chat(router: str, msgs: list[dict[str, Any]], rid: str) -> tuple[str, dict[str, Any], str]:
    req = urllib.request.Request(
        router + "/v1/chat/completions",
        data=json.dumps({"model": "mini-v4", "messages": msgs, "max_tokens": 3}).encode(),
        headers={"Content-Type": "application/json", "X-Session-Id": "s1", "X-Request-Id": rid},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        engine = resp.headers.get("x-ramjet-engine")
        body = json.loads(resp.read())
    return engine, body["usage"], body["choices"][0]["message"]["content"]


def _record(path: Path, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["id"] == rid:
                    return rec  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"no decision line for {rid}")


def test_a_moved_session_restores_its_prefix_and_swa_state_from_the_pools(tmp_path: Path) -> None:
    fast_probe = {"health": {"probe_interval_s": 0.2, "consecutive_failures": 1}}
    with pool_fleet(
        tmp_path,
        engine_flags={"max_gen": 4},
        policy=fast_probe,
        pool_bytes=POOL_BYTES,
        swa_pool_bytes=SWA_POOL_BYTES,
    ) as f:
        assert f.router_url is not None and f.kv_dir is not None and f.swa_dir is not None
        router = f.router_url
        msgs = [
            {"role": "system", "content": "[pool] You are a careful coding agent. " * 16},
            {"role": "user", "content": "read main.py"},
        ]
        first, u1, answer = _chat(router, msgs, "turn-1")
        n1 = u1["prompt_tokens"]
        assert first in ("e0", "e1") and u1["prompt_work"]["prefilled_tokens"] == n1
        other = "e1" if first == "e0" else "e0"
        # the first engine wrote its blocks and its SWA state through to the pools
        kv, swa = Pool(f.kv_dir, POOL_BYTES), Pool(f.swa_dir, SWA_POOL_BYTES)
        deadline = time.monotonic() + 10
        while len(kv.held_keys()) < n1 // BLOCK or not swa.held_keys():
            assert time.monotonic() < deadline, "the pools never got the session's state"
            time.sleep(0.05)
        # ... and the pools' own signed reports reached the router since
        seen = {p: _accepted(router, p) for p in ("host0", "swa0")}
        deadline = time.monotonic() + 15
        while any(_accepted(router, p) < seen[p] + 2 for p in seen):
            assert time.monotonic() < deadline, "the pools' reports do not reach the router"
            time.sleep(0.1)
        f.engines[first].stop()  # the session must move
        time.sleep(1.0)  # the router's probe ejects it
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
        moved, u2, _ = _chat(router, msgs, "turn-2")
        assert moved == other
        w = u2["prompt_work"]
        n2 = u2["prompt_tokens"]
        blocks = n1 // BLOCK * BLOCK
        # the prefix came from the pool, the SWA state too (resumed at turn 1's end)
        assert w["pool_tokens"] == blocks
        assert w["hbm_tokens"] == w["host_tokens"] == w["ssd_tokens"] == 0
        assert w["pool_swa_tokens"] == n1 and w["swa_tokens"] == n1 - blocks
        assert w["replayed_tokens"] == 0  # no replay
        assert w["prefilled_tokens"] == n2 - n1  # only the new turn
        assert u2["prompt_tokens_details"]["cached_tokens"] == n1
        assert w["pools"]["host0"]["tokens"] == blocks and w["pools"]["host0"]["bytes"] > 0
        assert w["pools"]["swa0"]["tokens"] == n1 and w["pools"]["swa0"]["bytes"] > 0
        assert 0 < w["pool_io_ms"] <= w["restore_io_ms"] <= w["restore_ms"]
        # the router priced the move as a pull from the pool, and read the pool tokens back
        assert f.decisions is not None
        rec = _record(f.decisions, "turn-2")
        assert rec["engine"] == other
        assert rec["predicted"][other]["pool_tokens"] >= blocks
        assert rec["realized"]["pool_tokens"] == blocks
        assert rec["realized"]["cached_tokens"] == n1
        # the engines kept the pools within their capacity
        assert 0 < kv.used_bytes() <= POOL_BYTES and 0 < swa.used_bytes() <= SWA_POOL_BYTES
        assert kv.active_leases() == 0
