"""`ramjet sidecar` processes for tests: started from this repository's venv on a free
loopback port, waited for on /health, stopped by pid (SIGTERM, then SIGKILL).

    from sidecars import SidecarProcess          # tests/helpers on sys.path
    sc = SidecarProcess(argv, port, tmp_path / "sidecar.log")
    sc.health()     # the sidecar's /health JSON
    sc.stop()
    router_blocks(server, "e0")   # what a router holds from reports for an engine
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

from ramjet.app.server import RouterServer
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId


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


def router_blocks(server: RouterServer, engine: str) -> dict[int, str]:
    """The router's report-backed residency for one engine: key -> tier."""
    tables = server.router.residency
    assert isinstance(tables, ResidencyTables)
    store = tables.store
    assert isinstance(store, MemoryStore)
    now = tables.clock()
    return {
        int(k): e.tier.label
        for k, e in store.entries(Table.GLOBAL, EngineId(engine), exact=True)
        if e.expires_at > now
    }
