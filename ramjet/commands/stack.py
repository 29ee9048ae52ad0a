"""`ramjet stack --policy FILE [--port 8000]`: the local stack that `make run` starts.

1. One reference engine per engine of the policy file whose URL is on loopback
   (`python -m engine_stub serve --id ID --port PORT --cache-dir ROOT/ID`), each a child
   process, waited for on `GET /health`.
   Each gets an ephemeral report-signing keypair (`ramjet.reports.local_keys`, in a temp
   dir: `--key FILE --key-id ID-stack`) unless the policy lists keys for it.
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
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from ramjet.config import PolicyFileError, load_policy
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
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        keys = ephemeral_keys(Path(args.policy), [eid for eid, _, _ in local], Path(key_dir.name))
        for eid in keys.skipped:
            print(f"stack: engine {eid} has keys in the policy; it signs with its own key")
        for eid, port, url in local:
            cmd = [sys.executable, "-m", "engine_stub", "serve", "--id", eid, "--port", str(port),
                   "--cache-dir", str(Path(root) / eid), *keys.engine_args.get(eid, []),
                   *args.engine_arg]  # fmt: skip
            print(f"stack: engine {eid} -> {url} (pid ", end="", flush=True)
            child = subprocess.Popen(cmd)
            children.append(child)
            print(f"{child.pid})", flush=True)
        for (eid, _, url), child in zip(local, children, strict=True):
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
