"""Real redis-server processes for tests: one standalone server, or a three-master cluster.

Each server binds 127.0.0.1 on a free port (found by binding port 0), runs in its own temp
dir with persistence off, and is stopped by pid (SIGTERM, then SIGKILL) in `stop()`.
Tests use them through the context managers `redis_server()` and `redis_cluster()`; the
tests import this module by path (test dirs carry no `__init__.py`).

`RedisProcess.pause()` / `resume()` send SIGSTOP / SIGCONT (a hung Redis), `kill()` sends
SIGKILL (a dead one), `restart()` starts a fresh, empty server on the same port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisProcess:
    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError(
                "redis-server is not on PATH (`make test` installs it: scripts/system_deps.sh)"
            )
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--loglevel", "warning",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {log}")
            if _ping(self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout}s")

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server and its (unpersisted) data are gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process still dies, but be explicit
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextlib.contextmanager
def redis_server(*extra: str) -> Iterator[RedisProcess]:
    """A standalone redis-server on a free loopback port; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="ramjet-redis-") as tmp:
        last: Exception | None = None
        for _ in range(3):  # a free port can be taken between probe and bind: retry
            server = RedisProcess(port=free_port(), workdir=Path(tmp), extra=extra)
            try:
                server.start()
            except RuntimeError as exc:
                last = exc
                continue
            try:
                yield server
            finally:
                server.stop()
            return
        raise RuntimeError(f"could not start redis-server: {last}")


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[RedisProcess]]:
    """A cluster of `masters` masters (no replicas) built with `redis-cli --cluster create`."""
    if REDIS_CLI is None:
        raise RuntimeError("redis-cli is not on PATH")
    with tempfile.TemporaryDirectory(prefix="ramjet-redis-cluster-") as tmp:
        nodes: list[RedisProcess] = []
        try:
            for i in range(masters):
                d = Path(tmp) / f"n{i}"
                d.mkdir()
                node = RedisProcess(
                    port=free_port(),
                    workdir=d,
                    extra=(
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(d / "nodes.conf"),
                        "--cluster-port", str(free_port()),
                        "--cluster-node-timeout", "2000",
                    ),
                )  # fmt: skip
                node.start()
                nodes.append(node)
            addrs = [f"127.0.0.1:{n.port}" for n in nodes]
            subprocess.run(
                [
                    REDIS_CLI,
                    "--cluster",
                    "create",
                    *addrs,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )
            _wait_cluster_ok(nodes[0].port)
            yield nodes
        finally:
            for node in nodes:
                node.stop()


def _wait_cluster_ok(port: int, timeout: float = 15.0) -> None:
    assert REDIS_CLI is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [REDIS_CLI, "-p", str(port), "cluster", "info"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        if "cluster_state:ok" in out:
            return
        time.sleep(0.1)
    raise RuntimeError("redis cluster did not reach cluster_state:ok")
