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

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import REPO, EngineProcess, free_port

from kvpool import Pool
from ramjet.reports.keys import write_keypair

pytestmark = pytest.mark.timeout(180)

POOL_BYTES = 8 << 20
SWA_POOL_BYTES = 4 << 20
BLOCK = 256


def _wait(what: str, ok: Any, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, ValueError):
            if ok():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready in {timeout}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=1.0) as resp:
        return int(resp.status)


def _accepted(router: str, who: str) -> float:
    """Reports of `who` the router accepted (its metrics)."""
    with urllib.request.urlopen(router + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("ramjet_reports_accepted_total{") and f'engine="{who}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def fleet(tmp: Path) -> Iterator[dict[str, Any]]:
    """Two pool reporters, two engines on the pools, the router: all processes."""
    keys = tmp / "keys"
    for who in ("e0", "e1", "host0", "swa0"):
        write_keypair(keys, f"{who}-a")
    kv_dir, swa_dir = tmp / "pools" / "host0", tmp / "pools" / "swa0"
    procs: list[subprocess.Popen[bytes]] = []
    engines: dict[str, EngineProcess] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    try:
        urls: dict[str, str] = {}
        for pid, tier, d in (("host0", "host", kv_dir), ("swa0", "swa", swa_dir)):
            port = free_port()
            log = tmp / f"{pid}.log"
            cmd = [sys.executable, "-m", "ramjet", "pool-reporter", "--pool-dir", str(d),
                   "--id", pid, "--tier", tier, "--port", str(port), "--interval", "0.2",
                   "--key", str(keys / f"{pid}-a.key"), "--key-id", f"{pid}-a",
                   "--swa-ttl", "60"]  # fmt: skip
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, env=env))
            urls[pid] = f"http://127.0.0.1:{port}"
            _wait(
                pid, lambda u=urls[pid]: _status(u + "/ramjet/snapshot") == 200, procs[-1], log, 60
            )
        for eid in ("e0", "e1"):
            flags = {"window": 16, "profile": "skip", "log_level": "WARNING", "max_gen": 4,
                     "key": keys / f"{eid}-a.key", "key_id": f"{eid}-a",
                     "pool_dir": kv_dir, "pool_id": "host0", "pool_bytes": POOL_BYTES,
                     "swa_pool_dir": swa_dir, "swa_pool_id": "swa0",
                     "swa_pool_bytes": SWA_POOL_BYTES}  # fmt: skip
            (tmp / eid).mkdir()
            eng = EngineProcess(eid, free_port(), tmp / eid, flags)
            eng.start()
            engines[eid] = eng
            urls[eid] = eng.url
        policy = tmp / "policy.yaml"
        ids = ("e0", "e1", "host0", "swa0")
        policy.write_text(
            json.dumps(
                {
                    "engines": [{"id": e, "url": urls[e]} for e in ("e0", "e1")],
                    "mode": "enforce",
                    "incumbent": {"name": "prefix_affinity"},
                    "candidate": {"name": "tier_aware"},
                    "health": {"probe_interval_s": 0.2, "consecutive_failures": 1},
                    "logging": {"decisions_path": str(tmp / "decisions.jsonl")},
                    "reports": {
                        "engines": {w: urls[w] for w in ids},
                        "poll": {
                            "wait_s": 0.5,
                            "timeout_s": 3,
                            "backoff_min_s": 0.05,
                            "backoff_max_s": 0.2,
                        },
                    },
                    "keys": {
                        "engines": {
                            w: [{"key_id": f"{w}-a", "public_key_file": f"keys/{w}-a.pub"}]
                            for w in ids
                        }
                    },
                    "fabric": {
                        "pools": [
                            {
                                "id": "host0",
                                "tier": "host",
                                "engines": ["e0", "e1"],
                                "bandwidth_bytes_per_s": 2.0e9,
                                "latency_s": 0.0002,
                            },
                            {
                                "id": "swa0",
                                "tier": "swa",
                                "engines": ["e0", "e1"],
                                "bandwidth_bytes_per_s": 2.0e9,
                                "latency_s": 0.0002,
                            },
                        ]
                    },
                }
            )
        )
        port = free_port()
        log = tmp / "router.log"
        cmd = [sys.executable, "-m", "ramjet", "serve", "--policy", str(policy),
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, env=env))
        router = f"http://127.0.0.1:{port}"
        _wait("router", lambda: _status(router + "/readyz") == 200, procs[-1], log, 60)
        yield {"router": router, "engines": engines, "kv": kv_dir, "swa": swa_dir, "tmp": tmp}
    finally:
        for p in reversed(procs):
            _stop(p)
        for eng in engines.values():
            eng.stop()


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
    with fleet(tmp_path) as f:
        router = f["router"]
        msgs = [
            {"role": "system", "content": "[pool] You are a careful coding agent. " * 16},
            {"role": "user", "content": "read main.py"},
        ]
        first, u1, answer = _chat(router, msgs, "turn-1")
        n1 = u1["prompt_tokens"]
        assert first in ("e0", "e1") and u1["prompt_work"]["prefilled_tokens"] == n1
        other = "e1" if first == "e0" else "e0"
        # the first engine wrote its blocks and its SWA state through to the pools
        kv, swa = Pool(f["kv"], POOL_BYTES), Pool(f["swa"], SWA_POOL_BYTES)
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
        f["engines"][first].stop()  # the session must move
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
        rec = _record(f["tmp"] / "decisions.jsonl", "turn-2")
        assert rec["engine"] == other
        assert rec["predicted"][other]["pool_tokens"] >= blocks
        assert rec["realized"]["pool_tokens"] == blocks
        assert rec["realized"]["cached_tokens"] == n1
        # the engines kept the pools within their capacity
        assert 0 < kv.used_bytes() <= POOL_BYTES and 0 < swa.used_bytes() <= SWA_POOL_BYTES
        assert kv.active_leases() == 0
