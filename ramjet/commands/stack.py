"""`ramjet stack --policy FILE [--port 8000]`: the local stack that `make run` starts.

1. One reference engine per engine of the policy file whose URL is on loopback
   (`python -m engine_stub serve --id ID --port PORT --cache-dir ROOT/ID`), each a child
   process, waited for on `GET /health`.
   Each gets an ephemeral report-signing keypair (`ramjet.reports.local_keys`, in a temp
   dir: `--key FILE --key-id ID-stack`) unless the policy lists keys for it.
   Shared pools (`fabric.pools`, ARCHITECTURE 5b): each pool with a local member gets a
   directory (host and SWA pools under /dev/shm, host memory, when it is there; SSD
   pools under the cache root) and a reporter child, `python -m ramjet pool-reporter`
   (its own ephemeral key, on the port of `reports.engines.<pool id>` when that is on
   loopback, else a free one); each member engine gets `--pool-dir` (its first host or
   SSD pool, `--pool-durable` for SSD) and `--swa-pool-dir` (its first SWA pool). The
   policy copy then lists the pools' report URLs under `reports.engines`, beside every
   keyed engine's when the policy listed none.
2. The router (`python -m ramjet serve --policy COPY --port PORT`, COPY being the policy
   with those public keys merged in), a child process, waited for on its port.
   It writes the decision log where the policy's `logging.decisions_path` says (relative:
   from the working directory; `policies/observe.yaml`: `run/decisions.jsonl`), printed
   at start: the input of `ramjet report` and `ramjet explain`.
3. Until SIGINT/SIGTERM or a child's exit: then every child is stopped by pid (SIGTERM,
   then SIGKILL after a grace period), router first.

`ramjet` imports no engine code: the engines are spawned as `sys.executable -m
engine_stub`, so the stack needs the `engine` extra installed in the same interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import yaml

from ramjet.config import FabricPoolConfig, PolicyConfig, PolicyFileError, load_policy
from ramjet.reports.local_keys import ephemeral_keys

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("stack", help="run the reference engines and the router locally")
    p.add_argument("--policy", default="policies/observe.yaml", help="policy YAML file")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument(
        "--cache-root", type=Path, default=None, help="engines' SSD tiers (default: a temp dir)"
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every engine, e.g. --engine-arg=--swa-ttl=30 (repeatable)",
    )
    p.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for children"
    )
    p.set_defaults(handler=_run)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_children(children: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each live child by pid, wait, then SIGKILL stragglers."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=5)


def _wait_ready(what: str, child: subprocess.Popen[bytes], ready: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{what} exited with status {child.returncode}")
        if callable(ready) and ready():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s")


@dataclass(frozen=True)
class _LocalPool:
    pool: FabricPoolConfig
    port: int
    path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _local_pools(
    config: PolicyConfig, local_ids: set[str], cache_root: Path, shm_root: Path | None
) -> list[_LocalPool]:
    """The declared pools with a member among the engines started here."""
    out = []
    for p in config.fabric.pools:
        if not local_ids & set(p.engines):
            continue
        url = config.reports.engines.get(p.id)
        parts = urlsplit(url) if url else None
        port = parts.port if parts and parts.hostname in _LOOPBACK and parts.port else None
        root = shm_root if shm_root is not None and p.tier != "ssd" else cache_root / "pools"
        out.append(_LocalPool(p, port or _free_port(), root / p.id))
    return out


def _pool_engine_args(pools: list[_LocalPool], engine: str) -> list[str]:
    """An engine's flags for its first global-KV pool and its first SWA pool."""
    args: list[str] = []
    kv = [lp for lp in pools if engine in lp.pool.engines and lp.pool.tier != "swa"]
    swa = [lp for lp in pools if engine in lp.pool.engines and lp.pool.tier == "swa"]
    if kv:
        args += ["--pool-dir", str(kv[0].path), "--pool-id", kv[0].pool.id]
        if kv[0].pool.tier == "ssd":
            args.append("--pool-durable")
    if swa:
        args += ["--swa-pool-dir", str(swa[0].path), "--swa-pool-id", swa[0].pool.id]
    return args


def _swa_ttl(engine_args: list[str]) -> str:
    """The engines' SWA TTL as `--engine-arg` gives it (the engine's default else)."""
    for i, a in enumerate(engine_args):
        if a.startswith("--swa-ttl="):
            return a.split("=", 1)[1]
        if a == "--swa-ttl" and i + 1 < len(engine_args):
            return engine_args[i + 1]
    return "60"


def _add_pull_targets(policy_path: Path, config: PolicyConfig, pools: list[_LocalPool]) -> None:
    """List the pools' report URLs under `reports.engines` of the policy copy (and, when
    the policy listed no targets, every keyed engine's URL, which that list replaces)."""
    data: dict[str, Any] = yaml.safe_load(policy_path.read_text(encoding="utf-8"))
    reports = dict(data.get("reports") or {})
    targets = dict(reports.get("engines") or {})
    if not targets:
        keyed = set((data.get("keys") or {}).get("engines") or {})
        targets = {e.id: e.url for e in config.engines if e.id in keyed}
    for lp in pools:
        targets[lp.pool.id] = lp.url
    reports["engines"] = targets
    data["reports"] = reports
    policy_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    load_policy(policy_path)


class _Stop(Exception):
    """SIGINT/SIGTERM reached the stack: stop every child, then exit."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _run(args: argparse.Namespace) -> int:
    try:
        config = load_policy(args.policy)
    except PolicyFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    local = []
    for eng in config.engines:
        parts = urlsplit(eng.url)
        if parts.hostname in _LOOPBACK and parts.port is not None:
            local.append((eng.id, parts.port, eng.url))
        else:
            print(f"stack: engine {eng.id} at {eng.url} is not on loopback; not started")
    tmp = None
    root = args.cache_root
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="ramjet-stack-")
        root = Path(tmp.name)
    children: list[subprocess.Popen[bytes]] = []
    key_dir = tempfile.TemporaryDirectory(prefix="ramjet-stack-keys-")
    shm = None
    if config.fabric.pools and Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        shm = tempfile.TemporaryDirectory(prefix="ramjet-stack-pools-", dir="/dev/shm")
    pools = _local_pools(
        config, {eid for eid, _, _ in local}, Path(root), None if shm is None else Path(shm.name)
    )
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ids = [eid for eid, _, _ in local] + [lp.pool.id for lp in pools]
        keys = ephemeral_keys(Path(args.policy), ids, Path(key_dir.name))
        for eid in keys.skipped:
            print(f"stack: {eid} has keys in the policy; it signs with its own key")
        if pools:
            _add_pull_targets(keys.policy_path, config, pools)
        for lp in pools:
            lp.path.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "ramjet", "pool-reporter", "--pool-dir", str(lp.path),
                   "--id", lp.pool.id, "--tier", lp.pool.tier, "--port", str(lp.port),
                   "--swa-ttl", _swa_ttl(args.engine_arg), "--log-level", "WARNING",
                   *keys.engine_args.get(lp.pool.id, [])]  # fmt: skip
            if lp.pool.id in keys.skipped:
                print(f"stack: pool {lp.pool.id} signs with keys the stack lacks; not reported")
                continue
            print(f"stack: pool {lp.pool.id} ({lp.pool.tier}) at {lp.path} -> reports on "
                  f"{lp.url} (pid ", end="", flush=True)  # fmt: skip
            child = subprocess.Popen(cmd)
            children.append(child)
            print(f"{child.pid})", flush=True)
        reporters = len(children)
        for eid, port, url in local:
            cmd = [sys.executable, "-m", "engine_stub", "serve", "--id", eid, "--port", str(port),
                   "--cache-dir", str(Path(root) / eid), *keys.engine_args.get(eid, []),
                   *_pool_engine_args(pools, eid), *args.engine_arg]  # fmt: skip
            print(f"stack: engine {eid} -> {url} (pid ", end="", flush=True)
            child = subprocess.Popen(cmd)
            children.append(child)
            print(f"{child.pid})", flush=True)
        for (eid, _, url), child in zip(local, children[reporters:], strict=True):
            _wait_ready(f"engine {eid}", child, lambda u=url: _healthy(u), args.ready_timeout)
        router_cmd = [sys.executable, "-m", "ramjet", "serve", "--policy", str(keys.policy_path),
                      "--host", args.host, "--port", str(args.port)]  # fmt: skip
        router = subprocess.Popen(router_cmd)
        children.insert(0, router)
        _wait_ready("router", router, lambda: _port_open(args.host, args.port), args.ready_timeout)
        print(
            f"stack: router on http://{args.host}:{args.port} (pid {router.pid}); Ctrl-C stops all",
            flush=True,
        )
        if config.logging.decisions_path:
            log = Path(config.logging.decisions_path).resolve()
            print(f"stack: decision log {log}; then: ramjet report {log}", flush=True)
        else:
            print("stack: no decision log (logging.decisions_path unset)", flush=True)
        while all(c.poll() is None for c in children):
            time.sleep(0.2)
        dead = [c for c in children if c.poll() is not None]
        print(
            f"stack: child pid {dead[0].pid} exited ({dead[0].returncode}); stopping the rest",
            file=sys.stderr,
        )
        return 1
    except _Stop:
        print("stack: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError, OSError, PolicyFileError) as exc:
        print(f"stack: {exc}", file=sys.stderr)
        return 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        stop_children(children)
        key_dir.cleanup()
        if tmp is not None:
            tmp.cleanup()
        if shm is not None:
            shm.cleanup()
