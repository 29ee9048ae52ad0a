"""`make run`'s stack on its own policy (`policies/observe.yaml`, ports moved to free ones):
`ramjet stack` gives the declared pools a directory and a signed reporter each, starts
both engines on them, and the router pulls the pools' reports; a chat through it is
answered, a turn sent straight to the other engine resumes from the pools, and SIGTERM
stops every child and removes the pools' directories (exit status 0)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import REPO, free_port, http_json

pytestmark = pytest.mark.timeout(180)


def _accepted(router: str, who: str) -> float:
    with urllib.request.urlopen(router + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ramjet_reports_accepted_total{") and f'engine="{who}"' in line
    )


def test_make_runs_stack_shares_the_pools_and_stops_cleanly(tmp_path: Path) -> None:
    policy: dict[str, Any] = yaml.safe_load((REPO / "policies" / "observe.yaml").read_text())
    assert [p["id"] for p in policy["fabric"]["pools"]] == ["host0", "swa0"]
    ports = {e["id"]: free_port() for e in policy["engines"]}
    for e in policy["engines"]:
        e["url"] = f"http://127.0.0.1:{ports[e['id']]}"
    policy["logging"]["decisions_path"] = str(tmp_path / "decisions.jsonl")
    policy["reports"] = {"poll": {"wait_s": 0.5, "timeout_s": 3, "backoff_min_s": 0.05}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    port = free_port()
    log = tmp_path / "stack.log"
    cmd = [sys.executable, "-m", "ramjet", "stack", "--policy", str(path), "--port", str(port),
           "--cache-root", str(tmp_path / "cache"), "--engine-arg=--profile=skip",
           "--engine-arg=--window=16", "--engine-arg=--max-gen=4"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        stack = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, env=env)
    router = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while "Ctrl-C stops all" not in log.read_text():
            assert stack.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        text = log.read_text()
        dirs = dict(re.findall(r"stack: pool (\w+) \(\w+\) at (\S+) ->", text))
        assert set(dirs) == {"host0", "swa0"}, text
        msgs = [
            {"role": "system", "content": "[stack] You are a careful coding agent. " * 16},
            {"role": "user", "content": "read main.py"},
        ]
        status, headers, body = http_json(
            router + "/v1/chat/completions", {"model": "mini-v4", "messages": msgs, "max_tokens": 3}
        )
        assert status == 200, body
        first = headers.get("x-ramjet-engine") or headers.get("X-Ramjet-Engine")
        assert first in ports
        n1 = body["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 15
        while any(_accepted(router, p) < 2 for p in ("host0", "swa0")):
            assert time.monotonic() < deadline, "the pools' reports do not reach the router"
            time.sleep(0.1)
        # the other engine, never asked before, resumes the conversation from the pools
        other = next(e for e in ports if e != first)
        msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "go on"}]  # fmt: skip
        deadline = time.monotonic() + 10
        while True:  # the write-through is in the background: wait for it
            status, _, b2 = http_json(
                f"http://127.0.0.1:{ports[other]}/v1/chat/completions",
                {"model": "mini-v4", "messages": msgs, "max_tokens": 1},
            )
            assert status == 200, b2
            w = b2["usage"]["prompt_work"]
            if w["pool_swa_tokens"] == n1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert w["pool_tokens"] == n1 // 256 * 256 and w["pool_swa_tokens"] == n1, w
        assert w["replayed_tokens"] == 0
    finally:
        if stack.poll() is None:
            os.kill(stack.pid, signal.SIGTERM)
        try:
            code = stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(stack.pid, signal.SIGKILL)
            stack.wait(timeout=10)
            raise
    assert code == 0, log.read_text()[-3000:]
    for d in dirs.values():
        assert not Path(d).exists()
    with contextlib.suppress(OSError):  # nothing listens any more
        urllib.request.urlopen(router + "/readyz", timeout=1)
        raise AssertionError("the router still answers")
