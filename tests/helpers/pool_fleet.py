"""Two reference engines on loopback, optionally sharing pools (issue 30), behind Ramjet
or SMG: every part a real process, stopped by pid. Used by tests/integration/test_pool_e2e.py
and benchmarks/pool_e2e.py.

    with pool_fleet(tmp, pools=True, router="ramjet") as f:
        f.router_url, f.engines["e0"].url, f.kv_dir, f.swa_dir

- `pools=True`: the engines share a global-KV pool (`--pool-dir`, id host0) and an SWA
  pool (`--swa-pool-dir`, id swa0); behind Ramjet each pool also gets its reporter
  (`ramjet pool-reporter`, its own key) and the policy declares both under
  `fabric.pools` and pulls them (`reports.engines`).
- `router="ramjet"`: `ramjet serve` on a policy with every engine's and pool's key
  (`mode`, `candidate`: tier_aware; `policy` entries merged over the top level;
  `profile_group` names both engines' `profile_group`: priced with their profiles' mean);
  `router="smg"`: `smg launch --policy cache_aware`; `router=None`: engines only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines import REPO, EngineProcess, free_port

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
POOLS = (("host0", "host"), ("swa0", "swa"))
POOL_COST = {"bandwidth_bytes_per_s": 2.0e9, "latency_s": 0.0002}


@dataclass
class Fleet:
    tmp: Path
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    router_url: str | None = None
    kv_dir: Path | None = None
    swa_dir: Path | None = None
    decisions: Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _status(url: str, body: Any = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        return int(resp.status)


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


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _spawn(f: Fleet, cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, env=env)
    f.procs.append(proc)
    return proc


@contextlib.contextmanager
def pool_fleet(
    tmp: Path,
    *,
    pools: bool = True,
    router: str | None = "ramjet",
    mode: str = "enforce",
    engine_flags: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    profile_group: str | None = None,
    pool_bytes: int = 64 << 20,
    swa_pool_bytes: int = 32 << 20,
    swa_ttl_s: float = 60.0,
    ready_s: float = 120.0,
) -> Iterator[Fleet]:
    """See the module docstring."""
    from ramjet.reports.keys import write_keypair

    tmp.mkdir(parents=True, exist_ok=True)
    f = Fleet(tmp)
    keys = tmp / "keys"
    ids = ["e0", "e1"] + ([p for p, _ in POOLS] if pools and router == "ramjet" else [])
    for who in ids:
        write_keypair(keys, f"{who}-a")
    urls: dict[str, str] = {}
    if pools:
        f.kv_dir, f.swa_dir = tmp / "pools" / "host0", tmp / "pools" / "swa0"
    try:
        if pools and router == "ramjet":
            for pid, tier in POOLS:
                port, log = free_port(), tmp / f"{pid}.log"
                cmd = [sys.executable, "-m", "ramjet", "pool-reporter", "--pool-dir",
                       str(tmp / "pools" / pid), "--id", pid, "--tier", tier, "--port", str(port),
                       "--interval", "0.2", "--key", str(keys / f"{pid}-a.key"),
                       "--key-id", f"{pid}-a", "--swa-ttl", str(swa_ttl_s)]  # fmt: skip
                proc = _spawn(f, cmd, log)
                urls[pid] = f"http://127.0.0.1:{port}"
                _wait(
                    pid, lambda u=urls[pid]: _status(u + "/ramjet/snapshot") == 200, proc, log, 60
                )
        for eid in ("e0", "e1"):
            flags: dict[str, Any] = {"window": 16, "profile": "skip", "log_level": "WARNING",
                                     "swa_ttl": swa_ttl_s, **(engine_flags or {}),
                                     "key": keys / f"{eid}-a.key", "key_id": f"{eid}-a"}  # fmt: skip
            if pools:
                flags.update(pool_dir=f.kv_dir, pool_id="host0", pool_bytes=pool_bytes,
                             swa_pool_dir=f.swa_dir, swa_pool_id="swa0",
                             swa_pool_bytes=swa_pool_bytes)  # fmt: skip
            (tmp / eid).mkdir(exist_ok=True)
            f.engines[eid] = EngineProcess(eid, free_port(), tmp / eid, flags)
        _start_engines(f, ready_s)
        urls.update({eid: eng.url for eid, eng in f.engines.items()})
        if router == "ramjet":
            f.decisions = tmp / "decisions.jsonl"
            doc: dict[str, Any] = {
                "engines": [
                    {"id": e, "url": urls[e]}
                    | ({} if profile_group is None else {"profile_group": profile_group})
                    for e in ("e0", "e1")
                ],
                "mode": mode,
                "incumbent": {"name": "prefix_affinity"},
                "candidate": {"name": "tier_aware"},
                "logging": {"decisions_path": str(f.decisions)},
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
                        w: [{"key_id": f"{w}-a", "public_key_file": f"keys/{w}-a.pub"}] for w in ids
                    }
                },
            }
            if pools:
                doc["fabric"] = {
                    "pools": [
                        {"id": p, "tier": t, "engines": ["e0", "e1"], **POOL_COST} for p, t in POOLS
                    ]
                }
            doc.update(policy or {})
            path = tmp / "policy.yaml"
            path.write_text(json.dumps(doc))
            port, log = free_port(), tmp / "router.log"
            cmd = [sys.executable, "-m", "ramjet", "serve", "--policy", str(path),
                   "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
            proc = _spawn(f, cmd, log)
            f.router_url = f"http://127.0.0.1:{port}"
            _wait("router", lambda: _status(f.router_url + "/readyz") == 200, proc, log, 60)
        elif router == "smg":
            port, log = free_port(), tmp / "smg.log"
            cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port()), "--log-level", "warn",
                   "--worker-urls", *[e.url for e in f.engines.values()]]  # fmt: skip
            proc = _spawn(f, cmd, log)
            f.router_url = f"http://127.0.0.1:{port}"
            _wait("smg", lambda: _status(f.router_url + "/v1/models") == 200, proc, log, 60)
        yield f
    finally:
        for p in reversed(f.procs):
            stop(p)
        for eng in f.engines.values():
            eng.stop()


def _start_engines(f: Fleet, ready_s: float) -> None:
    """Start every engine, then wait for each (their startup profiles run side by side)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    for eng in f.engines.values():
        eng.log_path = eng.cache_dir / f"{eng.engine_id}.log"
        with open(eng.log_path, "ab") as log:
            eng.proc = subprocess.Popen(eng.argv(), cwd=REPO, stdout=log, stderr=log, env=env)
    for eng in f.engines.values():
        assert eng.proc is not None and eng.log_path is not None
        _wait(
            f"engine {eng.engine_id}",
            lambda u=eng.url: _status(u + "/health") == 200,
            eng.proc,
            eng.log_path,
            ready_s,
        )
