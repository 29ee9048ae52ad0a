"""Proxy overhead: Ramjet beside nginx, a bare aiohttp hop and SMG (SGLang's Rust gateway,
`pip install -e '.[bench]'`), every figure of issue 19's table in one run.

    .venv/bin/python benchmarks/proxy_overhead.py            # 4 interleaved rounds
    .venv/bin/python benchmarks/proxy_overhead.py --quick    # 1 short round, < 60 s
    ... --layers            # also the HTTP layer alone: aiohttp vs httptools servers
    ... --only smg_ca,ramjet_observe                          # a subset (direct always)
    ... --opt-python /path/to/python   # also Ramjet under another CPython build (_opt columns)
    ... --base /path/to/checkout       # also Ramjet from another checkout (_base columns)
    ... --base DIR --base DIR2         # and from a second one (_base2 columns)

Set-up: two upstream engines (one process, two ports; `httptools` HTTP/1.1) that parse
every request's JSON body (`"stream"` is read from the parsed body, so a proxy that
re-serializes JSON is answered correctly) and answer either a chat completion whose
`usage.prompt_tokens` is the number of prompt characters they received, or 64 SSE content
chunks 1 ms apart, a finish chunk and `data: [DONE]`. Every proxy under test runs pinned
to CPU 0 (`taskset`); the upstreams and the load generator (this process) run on the
other CPUs. Targets: `direct` (no hop: the latency baseline), nginx (if installed),
`bare` (aiohttp server + aiohttp client, nothing else), `smg_rr` and `smg_ca` (SMG
round_robin and cache_aware, if installed), `ramjet_observe` (prefix_affinity live,
tier_aware recorded, decision log on) and `ramjet_enforce` (tier_aware live). With
`--layers`, `layer_aiohttp` and `layer_httptools`: a server and Ramjet's engine client
(`ramjet.transport.http1.EnginePool`) and nothing else, aiohttp's server or an
asyncio.Protocol on httptools; what choosing Ramjet's HTTP layer could save (either is
also started when named in `--only`). With `--opt-python PYTHON`, `ramjet_observe_opt`
and `ramjet_enforce_opt`: the same routers under that interpreter (the same source tree),
to price the CPython build itself. With `--base DIR`, `ramjet_observe_base` and
`ramjet_enforce_base`: the same routers run from the checkout at DIR (its own compiled
build, if current), interleaved with this one's: a before/after of a change in one run
(a second `--base` adds `_base2` columns, and so on).

Before any timing, each target is checked with an independent client (aiohttp): a small
request must come back 200 with the completion and the prompt size the upstream saw, a
streamed one with the 64 chunks in order, `[DONE]` last, and a 1 MB prompt intact. During
timing every response is checked again (status, body, chunk count); any mismatch stops
the run with the target and the reply.

Figures (each the median over rounds; CPU is the proxy's processes' on-CPU time, all
threads, from /proc/PID/task/*/schedstat):

- small JSON: 32 connections in a closed loop; CPU us per request and requests/s (the
  req/s column is capped by what the other CPU can generate and answer: see `direct`);
- SSE: 32 concurrent streams of 64 chunks 1 ms apart; CPU us per chunk (the proxy's CPU
  over all chunks relayed, request overhead included);
- latency at 500 req/s, open loop (a request every 2 ms, whether or not earlier ones
  returned): p50 and p99 minus those of a direct run made just before it, and the CPU
  per request at that rate;
- large prompts: 1 MB and 4 MB prompts one at a time; CPU ms per request.

The last table gives each figure as a ratio to SMG cache_aware (lower is better for Ramjet).
Every process started here is stopped by pid before exit.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import cast

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
SMG = shutil.which("smg") or (str(Path(PY).parent / "smg") if (Path(PY).parent / "smg").exists() else None)  # fmt: skip
TASKSET = shutil.which("taskset")
CHUNKS = 64
PROXY_CPU = 0
REPLY_CONTENT = "ok " * 40


class BenchError(RuntimeError):
    """A target answered wrongly: the run stops (a wrong reply is never timed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def other_cpus() -> set[int]:
    cpus = os.sched_getaffinity(0)
    rest = cpus - {PROXY_CPU}
    return rest or cpus


def chat_body(content: str, stream: bool) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}
    ).encode()


SMALL_PROMPT = "Say something short. " * 8


class _HttpServer(asyncio.Protocol, abc.ABC):
    """One client connection of the benchmark's own servers, parsed by httptools (llhttp);
    a subclass answers each whole request in `request` (a parse error gets 400, close)."""

    def __init__(self) -> None:
        import httptools

        self._bad = httptools.HttpParserError
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except self._bad:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, url, body = self.parser.get_method(), self.url, b"".join(self.body)
        self.url, self.body = b"", []
        self.request(method, url, body)

    @abc.abstractmethod
    def request(self, method: bytes, url: bytes, body: bytes) -> None:
        """Answer one whole request on `self.transport`."""


# -- the upstream engines (own process: --upstream PORT,PORT) -----------------------------


def run_upstream(ports: list[int]) -> None:
    models = b'{"object":"list","data":[{"id":"m","object":"model"}]}'

    def reply(prompt_chars: int) -> bytes:
        return json.dumps(
            {
                "id": "cmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": REPLY_CONTENT},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": prompt_chars, "completion_tokens": 40},
            }
        ).encode()

    def chunk(i: int) -> bytes:
        delta = f'{{"content":"tok{i} "}}' if i < CHUNKS else "{}"
        finish = "null" if i < CHUNKS else '"stop"'
        data = (
            '{"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
            f'"choices":[{{"index":0,"delta":{delta},"finish_reason":{finish}}}]}}'
        )
        return b"data: " + data.encode() + b"\n\n"

    def framed(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def answer(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
        return b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
            status,
            ctype,
            len(body),
            body,
        )

    class Engine(_HttpServer):
        def __init__(self) -> None:
            super().__init__()
            self.streaming: asyncio.Task[None] | None = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self.streaming is not None:
                self.streaming.cancel()

        def request(self, method: bytes, url: bytes, body: bytes) -> None:
            assert self.transport is not None
            if method == b"GET":
                self.transport.write(answer(200, models))
                return
            try:
                req = json.loads(body)
                chars = sum(len(m["content"]) for m in req["messages"])
            except (ValueError, KeyError, TypeError):
                self.transport.write(answer(400, b'{"error":"body is not a chat request"}'))
                return
            if url.split(b"?")[0] != b"/v1/chat/completions":
                self.transport.write(answer(404, b'{"error":"no such route"}'))
            elif req.get("stream") is True:
                self.streaming = asyncio.ensure_future(self.stream())
            else:
                self.transport.write(answer(200, reply(chars)))

        async def stream(self) -> None:
            t = self.transport
            assert t is not None
            t.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for i in range(CHUNKS):
                t.write(framed(chunk(i)))
                await asyncio.sleep(0.001)
            t.write(framed(chunk(CHUNKS)) + framed(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            self.streaming = None

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for p in ports:
            await loop.create_server(Engine, "127.0.0.1", p, backlog=1024)
        await asyncio.Event().wait()

    uvloop.run(serve())


# -- the bare hop (own process: --bare PORT UPSTREAM,UPSTREAM) ----------------------------


def run_bare(port: int, upstreams: list[str]) -> None:
    from aiohttp import web

    state = {"n": 0}
    session: list[aiohttp.ClientSession] = []

    async def hop(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state["n"] += 1
        url = upstreams[state["n"] % len(upstreams)] + request.path_qs
        async with session[0].post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as r:
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type
            await resp.prepare(request)
            async for piece in r.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def start(app: web.Application) -> None:
        session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))

    async def stop(app: web.Application) -> None:
        await session[0].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", hop)
    app.router.add_get("/v1/models", models)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- the HTTP layer alone (own process: --layer KIND PORT UPSTREAM,UPSTREAM) -------------


def run_layer(kind: str, port: int, upstreams: list[str]) -> None:
    """A hop that is only a server in front of Ramjet's engine client
    (`ramjet.transport.http1.EnginePool`): `aiohttp` (the server Ramjet runs) or `httptools`
    (an asyncio.Protocol on llhttp). The two differ in the client-facing server alone,
    which is what choosing Ramjet's HTTP layer needs measured."""
    from ramjet.transport.http1 import EnginePool

    pools: list[EnginePool] = []
    turn = [0]

    def pool() -> EnginePool:
        turn[0] += 1
        return pools[turn[0] % len(pools)]

    hdrs = [("Content-Type", "application/json")]

    if kind == "aiohttp":
        from aiohttp import web

        async def hop(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            up = await pool().request("POST", request.path_qs, hdrs, body)
            try:
                resp = web.StreamResponse(status=up.status)
                resp.content_type = up.headers.get("Content-Type", "application/json")
                if up.content_length is not None:
                    resp.content_length = up.content_length
                await resp.prepare(request)
                while True:
                    piece = up.read_nowait() or await up.readany(30.0)
                    if not piece:
                        break
                    await resp.write(piece)
                await resp.write_eof()
                return resp
            finally:
                up.close()

        async def start(app: web.Application) -> None:
            pools.extend(EnginePool(u, limit=1024, connect_s=1.0) for u in upstreams)

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", hop)

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m"}]})

        app.router.add_get("/v1/models", models)
        app.on_startup.append(start)
        uvloop.install()
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
        return

    running: set[asyncio.Task[None]] = set()

    class Hop(_HttpServer):
        def request(self, method: bytes, raw_url: bytes, body: bytes) -> None:
            url = raw_url.decode()
            if method == b"GET":
                assert self.transport is not None
                self.transport.write(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"data":[]}')
                return
            task = asyncio.ensure_future(self.forward(url, body))
            running.add(task)
            task.add_done_callback(running.discard)

        async def forward(self, url: str, body: bytes) -> None:
            t = self.transport
            assert t is not None
            up = await pool().request("POST", url, hdrs, body)
            try:
                ctype = up.headers.get("Content-Type", "application/json")
                length = up.content_length
                framing = (
                    b"Content-Length: %d" % length
                    if length is not None
                    else b"Transfer-Encoding: chunked"
                )
                head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s\r\n\r\n" % (
                    up.status,
                    up.reason.encode(),
                    ctype.encode(),
                    framing,
                )
                while True:
                    piece = up.read_nowait() or await up.readany(30.0)
                    if not piece:
                        break
                    out = piece if length is not None else b"%x\r\n%s\r\n" % (len(piece), piece)
                    t.write(head + out if head else out)
                    head = b""
                t.write(head + (b"" if length is not None else b"0\r\n\r\n"))
            finally:
                up.close()

    async def serve() -> None:
        pools.extend(EnginePool(u, limit=1024, connect_s=1.0) for u in upstreams)
        await asyncio.get_running_loop().create_server(Hop, "127.0.0.1", port, backlog=1024)
        await asyncio.Event().wait()

    uvloop.run(serve())


# -- processes ----------------------------------------------------------------------------


def pinned(cmd: list[str]) -> list[str]:
    return [TASKSET, "-c", str(PROXY_CPU), *cmd] if TASKSET else cmd


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"{url} did not come up in {timeout:.0f} s")


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system, every thread) of `pids`, from the scheduler's nanosecond
    counters (/proc/PID/task/TID/schedstat; /proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):  # the process has already exited
            for t in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((t / "schedstat").read_text().split()[0])
    return total / 1e9


def runs_as(t: Target) -> str:
    """What a target's process runs, read from the running process (not its config): for a
    Ramjet column, whether the compiled build's library is mapped (the loader loaded it);
    for any, how many threads it has."""
    if t.proc is None:
        return "-"
    pid = t.proc.pid
    threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    if not t.name.startswith("ramjet"):
        return f"{threads} threads"
    maps = Path(f"/proc/{pid}/maps").read_text()
    built = sorted({line.split()[-1] for line in maps.splitlines() if "mypyc_ramjet" in line})
    build = f"compiled ({built[0]})" if built else "pure Python (no compiled build mapped)"
    return f"{build}, {threads} threads"


def switches(pids: list[int]) -> int:
    """Context switches (voluntary + involuntary, every thread) of `pids` so far: a proxy
    that sleeps and wakes per request, or whose threads hand work to each other, pays
    for each in CPU that the host's other load makes dearer."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for t in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    for line in (t / "status").read_text().splitlines():
                        if "ctxt_switches:" in line:
                            total += int(line.split()[-1])
    return total


def tree(pid: int) -> list[int]:
    out = [pid]
    with contextlib.suppress(OSError):
        for t in Path(f"/proc/{pid}/task").iterdir():
            kids = (t / "children").read_text().split()
            for k in kids:
                out += tree(int(k))
    return out


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None

    def pids(self) -> list[int]:
        return tree(self.proc.pid) if self.proc is not None else []


def start_ramjet(
    name: str, ups: list[str], tmp: Path, mode: str, python: str = PY, root: Path = ROOT
) -> Target:
    port = free_port()
    engines = "".join(f"  - id: e{i}\n    url: {u}\n" for i, u in enumerate(ups))
    policy = tmp / f"{name}.yaml"
    policy.write_text(
        f"engines:\n{engines}mode:\n  kind: {mode}\n"
        "incumbent:\n  name: prefix_affinity\ncandidate:\n  name: tier_aware\n"
        f"limits:\n  max_body_bytes: {64 * 1024 * 1024}\n  max_concurrent: 4096\n"
        f"logging:\n  level: warning\n  decisions_path: {tmp / name}.jsonl\n"
        "timeouts:\n  drain_s: 1\n"
    )
    cmd = [python, "-m", "ramjet", "serve", "--policy", str(policy), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # `root`'s ramjet
    proc = subprocess.Popen(pinned(cmd), cwd=root, env=env)
    wait_http(f"http://127.0.0.1:{port}/readyz", proc=proc)
    return Target(name, f"http://127.0.0.1:{port}", proc)


def start_bare(ups: list[str]) -> Target:
    port = free_port()
    proc = subprocess.Popen(pinned([PY, __file__, "--bare", str(port), ",".join(ups)]))
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc=proc)
    return Target("bare", f"http://127.0.0.1:{port}", proc)


def start_layer(kind: str, ups: list[str]) -> Target:
    port = free_port()
    cmd = [PY, __file__, "--layer", kind, str(port), ",".join(ups)]
    proc = subprocess.Popen(pinned(cmd), cwd=ROOT)
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc=proc)
    return Target(f"layer_{kind}", f"http://127.0.0.1:{port}", proc)


def start_nginx(up_ports: list[int], tmp: Path) -> Target:
    assert NGINX is not None
    port = free_port()
    servers = " ".join(f"server 127.0.0.1:{p};" for p in up_ports)
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_max_body_size 64m;
  client_body_buffer_size 8m;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream up {{ {servers} keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""
    )
    proc = subprocess.Popen(pinned([NGINX, "-c", str(conf), "-p", str(tmp)]))
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc=proc)
    return Target("nginx", f"http://127.0.0.1:{port}", proc)


def start_smg(name: str, ups: list[str], policy: str, tmp: Path) -> Target:
    assert SMG is not None
    port = free_port()
    cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += ["--log-level", "warn", "--worker-urls", *ups]
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(pinned(cmd), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=40, proc=proc)
    except BenchError:
        stop(proc)
        print((tmp / f"{name}.log").read_text()[-2000:], file=sys.stderr)
        raise
    return Target(name, f"http://127.0.0.1:{port}", proc)


# -- checks -------------------------------------------------------------------------------


def check_json(
    target: str, status: int, body: bytes, prompt_chars: int = 0, small: bool = False
) -> None:
    prompt_chars = len(SMALL_PROMPT) if small else prompt_chars
    try:
        got = json.loads(body)
        ok = (
            got["choices"][0]["message"]["content"] == REPLY_CONTENT
            and got["usage"]["prompt_tokens"] == prompt_chars
        )
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if status != 200 or not ok:
        raise BenchError(f"{target}: small request answered {status} {body[:300]!r}")


def check_stream(target: str, status: int, body: bytes) -> None:
    events = [e for e in body.split(b"\n\n") if e]
    ok = (
        status == 200
        and len(events) == CHUNKS + 2
        and events[-1] == b"data: [DONE]"
        and all(f'"tok{i} "'.encode() in events[i] for i in range(CHUNKS))
    )
    if not ok:
        raise BenchError(
            f"{target}: stream answered {status} with {len(events)} events "
            f"(want {CHUNKS} chunks, a finish chunk and [DONE]): {body[:200]!r}...{body[-200:]!r}"
        )


async def verify(t: Target) -> None:
    """Independent check with aiohttp's client before anything is timed."""
    async with aiohttp.ClientSession() as s:
        url = t.url + "/v1/chat/completions"
        hdr = {"Content-Type": "application/json"}
        for _ in range(3):
            async with s.post(url, data=chat_body(SMALL_PROMPT, False), headers=hdr) as r:
                check_json(t.name, r.status, await r.read(), len(SMALL_PROMPT))
            async with s.post(url, data=chat_body(SMALL_PROMPT, True), headers=hdr) as r:
                check_stream(t.name, r.status, await r.read())
        big = "b" * (1 << 20)
        async with s.post(url, data=chat_body(big, False), headers=hdr) as r:
            check_json(t.name, r.status, await r.read(), len(big))


# -- a lean load generator: one request at a time per connection, httptools parses --------


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.done: asyncio.Future[tuple[int, bytes]] | None = None
        self.keep = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.keep = False
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost mid-response"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        assert self.done is not None
        self.done.set_result((self.parser.get_status_code(), b"".join(self.body)))
        self.body = []


class Client:
    """Keep-alive connections to one target; `send` uses a free one or opens one."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        self.free: list[_Conn] = []

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        conn = self.free.pop() if self.free else None
        if conn is None or not conn.keep:
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(_Conn, *self.addr)
        assert conn.transport is not None
        conn.done = asyncio.get_running_loop().create_future()
        conn.transport.write(raw)
        out = await conn.done
        if conn.keep:
            self.free.append(conn)
        else:
            conn.transport.close()
        return out

    def close(self) -> None:
        for c in self.free:
            if c.transport is not None:
                c.transport.close()
        self.free.clear()


def raw_post(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


SMALL_RAW = raw_post(chat_body(SMALL_PROMPT, False))
STREAM_RAW = raw_post(chat_body(SMALL_PROMPT, True))


async def closed_loop(
    t: Target, raw: bytes, check: Callable[[int, bytes], None], seconds: float, conc: int
) -> int:
    client = Client(t.url)
    stop_at = time.monotonic() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            status, body = await client.send(raw)
            check(status, body)
            done += 1

    try:
        await asyncio.gather(*(worker() for _ in range(conc)))
    finally:
        client.close()
    return done


OPEN_WARM = 8
"""Requests sent one by one before an open-loop cell (warm connections), not timed."""


async def open_loop(t: Target, rate: float, seconds: float) -> list[float]:
    """A request every 1/rate s whatever the earlier ones do; latencies in seconds."""
    client = Client(t.url)
    lat: list[float] = []
    n = int(rate * seconds)
    tasks = []

    async def one() -> None:
        t0 = time.perf_counter()
        status, body = await client.send(SMALL_RAW)
        lat.append(time.perf_counter() - t0)
        check_json(t.name, status, body, len(SMALL_PROMPT))

    for _ in range(OPEN_WARM):  # warm connections
        await one()
    lat.clear()
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)
    client.close()
    return lat


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- the run ------------------------------------------------------------------------------


@dataclass
class Cell:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, v: float) -> None:
        self.values.setdefault(key, []).append(v)

    def med(self, key: str) -> float | None:
        v = self.values.get(key)
        return statistics.median(v) if v else None


async def measure_round(
    targets: list[Target], cells: dict[str, Cell], args: argparse.Namespace, rnd: int
) -> None:
    sec = args.seconds
    # small JSON, closed loop
    for t in targets:
        pids = t.pids()
        c0, w0, s0 = cpu_seconds(pids), time.perf_counter(), switches(pids)
        n = await closed_loop(t, SMALL_RAW, partial(check_json, t.name, small=True), sec, 32)
        wall, cpu = time.perf_counter() - w0, cpu_seconds(pids) - c0
        cells[t.name].add("rps", n / wall)
        if pids:
            cells[t.name].add("cpu_req_us", cpu / n * 1e6)
            cells[t.name].add("cs_req", (switches(pids) - s0) / n)
    # SSE, 64 chunks 1 ms apart
    for t in targets:
        pids = t.pids()
        c0 = cpu_seconds(pids)
        n = await closed_loop(t, STREAM_RAW, partial(check_stream, t.name), sec, 32)
        if pids:
            cells[t.name].add("cpu_chunk_us", (cpu_seconds(pids) - c0) / (n * (CHUNKS + 2)) * 1e6)
    # latency at 500 req/s, open loop; each hop against a direct run just before it, so
    # a neighbour's burst on the shared machine shifts both alike
    direct = targets[0]
    for t in targets[1:]:
        base = await open_loop(direct, args.rate, args.lat_seconds)
        pids = t.pids()
        c0 = cpu_seconds(pids)
        lat = await open_loop(t, args.rate, args.lat_seconds)
        if pids:
            used = cpu_seconds(pids) - c0
            cells[t.name].add("cpu_open_us", used / (len(lat) + OPEN_WARM) * 1e6)
        cells[t.name].add("p50_us", (pct(lat, 0.5) - pct(base, 0.5)) * 1e6)
        cells[t.name].add("p99_us", (pct(lat, 0.99) - pct(base, 0.99)) * 1e6)
    # large prompts (none with --large 0)
    sizes = ((1, args.large), (4, max(1, args.large // 2))) if args.large > 0 else ()
    for mb, count in sizes:
        content = "p" * (mb << 20)
        raw = raw_post(chat_body(content, False))
        for t in targets:
            client = Client(t.url)
            pids = t.pids()
            status, body = await client.send(raw)  # warm, checked, not counted
            check_json(t.name, status, body, len(content))
            c0 = cpu_seconds(pids)
            for _ in range(count):
                status, body = await client.send(raw)
                check_json(t.name, status, body, len(content))
            if pids:
                cells[t.name].add(f"cpu_{mb}mb_ms", (cpu_seconds(pids) - c0) / count * 1e3)
            client.close()
    print(f"  round {rnd + 1}/{args.rounds} done", flush=True)


ROWS = [
    ("CPU per small JSON request (us)", "cpu_req_us", "{:.0f}"),
    ("small JSON req/s (closed loop, 32 conns)", "rps", "{:.0f}"),
    ("context switches per small JSON request", "cs_req", "{:.2f}"),
    ("CPU per SSE chunk, 1 ms apart (us)", "cpu_chunk_us", "{:.1f}"),
    ("added latency at 500 req/s p50 (us)", "p50_us", "{:+.0f}"),
    ("added latency at 500 req/s p99 (us)", "p99_us", "{:+.0f}"),
    ("CPU per small JSON request at 500 req/s (us)", "cpu_open_us", "{:.0f}"),
    ("CPU per 1 MB prompt (ms)", "cpu_1mb_ms", "{:.2f}"),
    ("CPU per 4 MB prompt (ms)", "cpu_4mb_ms", "{:.2f}"),
]
FIGURES = {  # `figure:` lines for benchmarks/bench_all.py (group, unit); no "/" in a group
    "cpu_req_us": ("proxy CPU per small JSON request", "us"),
    "rps": ("proxy small JSON requests per second on one core", "req/s"),
    "cpu_chunk_us": ("proxy CPU per SSE chunk", "us"),
    "p50_us": ("proxy added latency p50 at 500 rps", "us"),
    "p99_us": ("proxy added latency p99 at 500 rps", "us"),
    "cpu_open_us": ("proxy CPU per small JSON request at 500 rps", "us"),
    "cpu_1mb_ms": ("proxy CPU per 1 MB prompt", "ms"),
    "cpu_4mb_ms": ("proxy CPU per 4 MB prompt", "ms"),
}


def report(targets: list[Target], cells: dict[str, Cell]) -> None:
    names = [t.name for t in targets]
    width = max(len(r[0]) for r in ROWS)
    print()
    print(f"{'figure':<{width}} " + " ".join(f"{n:>14}" for n in names))
    for label, key, fmt in ROWS:
        vals = [cells[n].med(key) for n in names]
        print(
            f"{label:<{width}} "
            + " ".join(f"{'-' if v is None else fmt.format(v):>14}" for v in vals)
        )
    print()
    for key, (group, unit) in FIGURES.items():
        for n in names:
            v = cells[n].med(key)
            if v is not None and n != "direct":
                print(f"figure: {group} / {n} = {v:.4g} {unit}")
    ref = "smg_ca" if "smg_ca" in cells else None
    if ref is None:
        print("\nno SMG cache_aware column (pip install -e '.[bench]'): no ratios")
        return
    print(f"\nratio to SMG cache_aware (same run; < 1.00 is cheaper/faster than {ref})")
    mine = [n for n in names if n.startswith("ramjet")]
    print(f"{'figure':<{width}} " + " ".join(f"{n:>14}" for n in mine))
    for label, key, _ in ROWS:
        r = cells[ref].med(key)
        out = []
        for n in mine:
            v = cells[n].med(key)
            if v is None or r is None or r == 0:
                out.append("-")
            elif key == "rps":
                out.append(f"{r / v:.2f}x")  # inverse: the rps ratio reads like the CPU ones
            else:
                out.append(f"{v / r:.2f}x")
        print(f"{label:<{width}} " + " ".join(f"{o:>14}" for o in out))
    print("(req/s is given as SMG's req/s over Ramjet's, so every ratio reads 'lower is better')")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, short cells (< 60 s)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0, help="per timed cell")
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop req/s for latency")
    ap.add_argument(
        "--large",
        type=int,
        default=10,
        help="1 MB prompts per round (4 MB: half; 0: no large-prompt cells)",
    )
    ap.add_argument(
        "--only", default="", help="comma-separated targets (direct is always measured)"
    )
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--bare", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--layer", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument(
        "--layers",
        action="store_true",
        help="also time the HTTP layer alone: aiohttp vs httptools in front of Ramjet's engine client",
    )
    ap.add_argument(
        "--opt-python",
        metavar="PYTHON",
        help="also Ramjet observe/enforce under this interpreter (one with the project's "
        "dependencies, e.g. a PGO+LTO CPython): columns ramjet_observe_opt, ramjet_enforce_opt",
    )
    ap.add_argument(
        "--base",
        metavar="DIR",
        type=Path,
        action="append",
        default=[],
        help="also Ramjet observe/enforce from the checkout at DIR (e.g. a worktree of main "
        "with its build): columns ramjet_observe_base, ramjet_enforce_base; repeated: "
        "_base2, _base3, ...",
    )
    args = ap.parse_args()
    if args.large < 0 or args.rounds < 1:
        ap.error("--large must be >= 0 and --rounds >= 1")
    if args.upstream:
        run_upstream([int(p) for p in args.upstream.split(",")])
        return 0
    if args.bare:
        run_bare(int(args.bare[0]), args.bare[1].split(","))
        return 0
    if args.layer:
        run_layer(args.layer[0], int(args.layer[1]), args.layer[2].split(","))
        return 0
    if args.quick:
        args.rounds, args.seconds, args.large = 1, 1.5, 3
    args.lat_seconds = 1.0 if args.quick else args.seconds
    wanted = set(filter(None, args.only.split(",")))

    def want(name: str) -> bool:
        return not wanted or name in wanted

    os.sched_setaffinity(0, other_cpus())
    notes = []
    if TASKSET is None:
        notes.append("taskset not found: proxies are not pinned")
    if len(os.sched_getaffinity(0) | {PROXY_CPU}) < 2:
        notes.append("one CPU only: proxies share it with the load")
    targets: list[Target] = []
    up: subprocess.Popen[bytes] | None = None
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            up_ports = [free_port(), free_port()]
            up = subprocess.Popen(
                [PY, __file__, "--upstream", ",".join(map(str, up_ports))],
                preexec_fn=lambda: os.sched_setaffinity(0, other_cpus()),
            )
            ups = [f"http://127.0.0.1:{p}" for p in up_ports]
            for u in ups:
                wait_http(u + "/health", proc=up)
            targets.append(Target("direct", ups[0]))
            if NGINX and want("nginx"):
                targets.append(start_nginx(up_ports, tmp))
            elif not NGINX:
                notes.append("nginx not installed (apt-get install nginx-light): column skipped")
            if want("bare"):
                targets.append(start_bare(ups))
            for k in ("aiohttp", "httptools"):  # --layers, or named in --only
                if (args.layers and want(f"layer_{k}")) or f"layer_{k}" in wanted:
                    targets.append(start_layer(k, ups))
            if SMG:
                for name, pol in (("smg_rr", "round_robin"), ("smg_ca", "cache_aware")):
                    if want(name):
                        targets.append(start_smg(name, ups, pol, tmp))
            else:
                notes.append("smg not installed (pip install -e '.[bench]'): columns skipped")
            for name, mode in (("ramjet_observe", "observe"), ("ramjet_enforce", "enforce")):
                if want(name):
                    targets.append(start_ramjet(name, ups, tmp, mode))
                if args.opt_python and want(name + "_opt"):
                    targets.append(start_ramjet(name + "_opt", ups, tmp, mode, args.opt_python))
                for i, base in enumerate(args.base):
                    col = name + "_base" + (str(i + 1) if i else "")
                    if want(col):
                        targets.append(start_ramjet(col, ups, tmp, mode, root=base.resolve()))
            for t in targets:
                uvloop.run(verify(t))
                if t.proc is not None:
                    print(f"  {t.name}: {runs_as(t)}")
            print(
                f"proxy overhead: {', '.join(t.name for t in targets)}; every target checked "
                f"(200, completion body, prompt size, {CHUNKS} SSE chunks + [DONE], 1 MB prompt)"
            )
            print(
                f"{args.rounds} interleaved round(s), {args.seconds:g} s per cell, proxies on CPU "
                f"{PROXY_CPU}, load and upstreams on CPU {sorted(other_cpus())}",
                flush=True,
            )
            cells = {t.name: Cell() for t in targets}
            for rnd in range(args.rounds):
                uvloop.run(measure_round(targets, cells, args, rnd))
            report(targets, cells)
            for n in notes:
                print("note:", n)
            print(f"self-check: every timed response verified; {time.monotonic() - t_start:.0f} s")
        finally:
            for t in reversed(targets):
                if t.proc is not None:
                    stop(t.proc)
            if up is not None:
                stop(up)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
