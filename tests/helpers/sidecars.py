"""`ramjet sidecar` processes for tests: started from this repository's venv on a free
loopback port, waited for on /health, stopped by pid (SIGTERM, then SIGKILL).

    from sidecars import SidecarProcess          # tests/helpers on sys.path
    sc = SidecarProcess(argv, port, tmp_path / "sidecar.log")
    sc.health()     # the sidecar's /health JSON
    sc.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from engines import REPO


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class SidecarProcess:
    def __init__(self, argv: list[str], port: int, log: Path, ready_s: float = 30.0) -> None:
        self.port = port
        self.log = log
        self.argv = argv
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=out)
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited: {log.read_text()[-3000:]}")
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = get_json(self.url + "/health")
        return data

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def stop(self, timeout_s: float = 10.0) -> float:
        """SIGTERM, wait (SIGKILL after `timeout_s`); the seconds it took to exit."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return time.monotonic() - t0
