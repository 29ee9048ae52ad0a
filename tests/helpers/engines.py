"""Real reference-engine processes for tests: `python -m engine_stub serve` on a free
loopback port, waited for on /health, stopped by pid (SIGTERM, then SIGKILL).

Use:

    from engines import start_engine   # after putting tests/helpers on sys.path
    with start_engine("e0", swa_ttl=2, hbm_tokens=512) as eng:
        httpx/aiohttp/urllib ... eng.url + "/v1/chat/completions"
        eng.restart()   # same port, same --cache-dir: a new epoch

Tests import this module by path (test dirs carry no `__init__.py`):

    sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))

Keyword arguments become flags (`swa_ttl=2` -> `--swa-ttl 2`; True -> a bare flag). The
defaults keep engines cheap: window 16, profiling skipped unless `profile="fast"`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, dict[str, str], Any]:
    """(status, headers, decoded JSON body) of a GET (body None) or JSON POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def signed_policy_text(urls: dict[str, str], settings: str) -> str:
    """A router policy for reference engines at `urls` (engine id -> URL) whose signed
    reports the router pulls from them, each engine's key `keys/<id>-a` (relative to the
    policy file); `settings`: YAML lines placed after the engines (policies, mode,
    timeouts, health)."""
    engines = "\n".join(f'  - {{id: {e}, url: "{u}"}}' for e, u in urls.items())
    keys = "\n".join(f"    {e}: [{{key_id: {e}-a, public_key_file: keys/{e}-a.pub}}]" for e in urls)
    return f"""\
engines:
{engines}
{settings.strip()}
reports:
  poll: {{wait_s: 0.5, timeout_s: 3, backoff_min_s: 0.05, backoff_max_s: 0.2}}
keys:
  engines:
{keys}
"""


@dataclass
class EngineProcess:
    engine_id: str
    port: int
    cache_dir: Path
    flags: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "engine_stub", "serve", "--id", self.engine_id,
                "--port", str(self.port), "--cache-dir", str(self.cache_dir)]  # fmt: skip
        for name, value in self.flags.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not False and value is not None:
                args += [flag, str(value)]
        return args

    def start(self, timeout: float = 60.0) -> None:
        self.log_path = self.cache_dir / f"{self.engine_id}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.argv(), cwd=REPO, stdout=log, stderr=log, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                status, _, _ = http_json(self.url + "/health", timeout=1.0)
                if status == 200:
                    return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"engine {self.engine_id} not healthy in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)

    def restart(self) -> None:
        self.stop()
        self.start()

    def health(self) -> dict[str, Any]:
        return http_json(self.url + "/health")[2]  # type: ignore[no-any-return]

    def chat(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        status, _, body = http_json(
            self.url + "/v1/chat/completions", {"messages": messages, **extra}
        )
        if status != 200:
            raise AssertionError(f"chat failed {status}: {body}")
        return body  # type: ignore[no-any-return]


@contextlib.contextmanager
def start_engine(
    engine_id: str = "e0", *, cache_dir: Path | None = None, **flags: Any
) -> Iterator[EngineProcess]:
    """A running engine (see the module docstring); stopped by pid on exit."""
    flags = {"window": 16, "profile": "skip", "log_level": "WARNING", **flags}
    with tempfile.TemporaryDirectory(prefix=f"engine-{engine_id}-") as tmp:
        eng = EngineProcess(engine_id, free_port(), cache_dir or Path(tmp), flags)
        eng.start()
        try:
            yield eng
        finally:
            eng.stop()
