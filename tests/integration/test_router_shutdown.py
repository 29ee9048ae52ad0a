"""Stopping a router replica without 503s to clients a load balancer still sends (issue
29): `ramjet serve --shutdown-delay S` on SIGTERM fails /readyz at once but keeps
serving for S seconds, then drains and exits 0. A real `ramjet serve` process in front
of a real reference engine, on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import REPO, free_port, http_json, start_engine

pytestmark = pytest.mark.timeout(90)

BODY = {"model": "mini-v4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _serve(tmp: Path, url: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    pf = tmp / "policy.yaml"
    pf.write_text(f'engines:\n  - {{id: e0, url: "{url}"}}\nincumbent: {{name: round_robin}}\n')
    port = free_port()
    argv = [sys.executable, "-m", "ramjet", "serve", "--policy", str(pf), "--port", str(port)]
    with open(tmp / f"router-{port}.log", "ab") as log:
        proc = subprocess.Popen([*argv, *extra], cwd=REPO, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if http_json(base + "/readyz", timeout=2)[0] == 200:
                return proc, base
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with start_engine("e0") as eng:
        yield eng.url


def _status(url: str, body: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_sigterm_fails_readiness_first_and_keeps_serving_for_the_delay(
    tmp_path: Path, engine_url: str
) -> None:
    proc, base = _serve(tmp_path, engine_url, "--shutdown-delay", "2")
    try:
        assert http_json(base + "/v1/chat/completions", BODY)[0] == 200
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        status, _, ready = http_json(base + "/readyz")
        assert status == 503 and ready["draining"] is True, ready
        served = 0
        while time.monotonic() - t0 < 1.5:  # inside the delay: still served
            status, _, out = http_json(base + "/v1/chat/completions", BODY)
            assert status == 200, out
            served += 1
        assert served >= 3
        proc.wait(20)
        assert proc.returncode == 0
        assert time.monotonic() - t0 >= 2.0
    finally:
        _stop(proc)


def test_without_a_delay_sigterm_drains_at_once(tmp_path: Path, engine_url: str) -> None:
    proc, _ = _serve(tmp_path, engine_url)
    try:
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
        assert proc.returncode == 0 and time.monotonic() - t0 < 5
    finally:
        _stop(proc)


def test_a_second_signal_cuts_the_delay_short(tmp_path: Path, engine_url: str) -> None:
    proc, base = _serve(tmp_path, engine_url, "--shutdown-delay", "30")
    try:
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert http_json(base + "/readyz")[0] == 503
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
        assert proc.returncode == 0 and time.monotonic() - t0 < 5
    finally:
        _stop(proc)


def test_a_bad_delay_is_refused(tmp_path: Path) -> None:
    pf = tmp_path / "policy.yaml"
    pf.write_text(
        'engines:\n  - {id: e0, url: "http://127.0.0.1:9"}\nincumbent: {name: round_robin}\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "ramjet", "serve", "--policy", str(pf), "--shutdown-delay", "-1"],
        cwd=REPO,
        capture_output=True,
        timeout=30,
    )
    assert out.returncode == 2 and b"--shutdown-delay" in out.stderr


def test_ops_port_takes_metrics_and_admin_off_the_client_port(
    tmp_path: Path, engine_url: str
) -> None:
    ops = free_port()
    proc, base = _serve(tmp_path, engine_url, "--ops-port", str(ops))
    ops_url = f"http://127.0.0.1:{ops}"
    try:
        assert http_json(base + "/v1/chat/completions", BODY)[0] == 200
        assert _status(base + "/metrics") == 404
        assert _status(base + "/admin/reload", b"{}") in (404, 405)
        assert _status(ops_url + "/metrics") == 200
        assert _status(ops_url + "/readyz") == 200 and _status(ops_url + "/healthz") == 200
        assert _status(ops_url + "/admin/reload", b"{}") == 403  # admin.token unset
        assert _status(ops_url + "/v1/chat/completions", b"{}") == 404
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
        _stop(proc)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "ramjet",
            "serve",
            "--policy",
            str(tmp_path / "policy.yaml"),
            "--port",
            "8123",
            "--ops-port",
            "8123",
        ],
        cwd=REPO,
        capture_output=True,
        timeout=30,
    )
    assert bad.returncode == 2 and b"--ops-port" in bad.stderr
