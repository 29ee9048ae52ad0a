"""Proxy overhead: the router against going direct to the upstream, with nginx as the
reference hop (and smg where it is installed), measured in one run.

    .venv/bin/python benchmarks/proxy_overhead.py [--seconds 3] [--concurrency 32] [--repeat 1]

An upstream process answers instantly (a fixed chat completion, or 64 SSE chunks); a
load generator keeps `concurrency` requests in flight against each target for
`seconds`, non-streaming then streaming. Printed: requests/s, latency p50/p99, the
added latency over direct (target minus direct, p50 and p99), requests/s as a ratio of
direct, and the hop's CPU time per request (utime+stime of its processes from /proc).
With `--repeat N` every cell runs N times, rounds interleaved across targets so they
share the machine's noise alike, and each figure is the median of its N runs.

The last lines put the hops' CPU per request side by side (ramjet, nginx, smg, and
ramjet's multiple of each): on a shared machine wall-clock figures move with the
neighbours' load, CPU time per request much less.
Every process started here is stopped by pid before exit.
"""

from __future__ import annotations

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
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "Say something short." * 8}]}
).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the upstream (run in its own process with --upstream PORT) --------------------------


def run_upstream(port: int) -> None:
    import uvloop
    from aiohttp import web

    reply = json.dumps(
        {
            "id": "cmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * 40},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 40, "total_tokens": 50},
        }
    ).encode()
    chunk = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
    )

    async def completion(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' not in body:
            return web.Response(body=reply, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m"}]}))
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- processes ---------------------------------------------------------------------------


def wait_http(url: str, timeout: float = 15.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):  # the process has already exited
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_router(upstream: str, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    policy = tmp / "bench.yaml"
    policy.write_text(
        f"engines:\n  - id: e0\n    url: {upstream}\nincumbent:\n  name: prefix_affinity\n"
        "logging:\n  level: warning\ntimeouts:\n  drain_s: 1\n"
    )
    proc = subprocess.Popen(
        [PY, "-m", "ramjet", "serve", "--policy", str(policy), "--port", str(port)], cwd=ROOT
    )
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return proc


def start_nginx(upstream_port: int, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    assert NGINX is not None
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
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""
    )
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp)])
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def start_smg(upstream: str, port: int) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("smg") or str(Path(PY).parent / "smg")
    if not os.path.exists(exe):
        return None
    proc = subprocess.Popen(
        [exe, "launch", "--worker-urls", upstream, "--policy", "cache_aware", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=20)
    except RuntimeError:
        stop(proc)
        return None
    return proc


# -- load --------------------------------------------------------------------------------


async def load(url: str, stream: bool, seconds: float, concurrency: int) -> tuple[int, list[float]]:
    body = BODY[:-1] + (b', "stream": true}' if stream else b"}")
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status}")
                latencies.append(time.perf_counter() - t0)

        # warm the pools first
        for _ in range(2):
            async with s.post(url + "/v1/chat/completions", data=body) as r:
                await r.read()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), latencies


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; medians printed")
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.upstream:
        run_upstream(args.upstream)
        return 0

    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            up_port = free_port()
            up = subprocess.Popen([PY, __file__, "--upstream", str(up_port)])
            procs.append(up)
            upstream = f"http://127.0.0.1:{up_port}"
            wait_http(upstream + "/health")
            targets: dict[str, tuple[str, list[int]]] = {"direct": (upstream, [])}
            rport = free_port()
            router = start_router(upstream, rport, tmp)
            procs.append(router)
            targets["ramjet"] = (f"http://127.0.0.1:{rport}", [router.pid])
            notes = []
            if NGINX:
                nport = free_port()
                ngx = start_nginx(up_port, nport, tmp)
                procs.append(ngx)
                targets["nginx"] = (f"http://127.0.0.1:{nport}", [ngx.pid, *children(ngx.pid)])
            else:
                notes.append("nginx not installed: column skipped")
            sport = free_port()
            smg = start_smg(upstream, sport)
            if smg is not None:
                procs.append(smg)
                targets["smg"] = (f"http://127.0.0.1:{sport}", [smg.pid, *children(smg.pid)])
            else:
                notes.append("smg not installed or did not start (pip install smg): column skipped")

            print(f"proxy overhead: {args.concurrency} concurrent clients, {args.seconds:.0f} s per cell, "
                  f"{args.repeat} run(s) per cell, {os.cpu_count()} CPUs")  # fmt: skip
            header = (f"{'mode':<10} {'target':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
                      f"{'+p50 ms':>8} {'+p99 ms':>8} {'rps/dir':>8} {'p50/dir':>8} {'CPU us/req':>10}")  # fmt: skip
            print(header)
            print("-" * len(header))
            runs: dict[tuple[bool, str], list[tuple[float, float, float, float | None]]] = {
                (stream, name): [] for stream in (False, True) for name in targets
            }
            for _ in range(args.repeat):
                for stream in (False, True):
                    for name, (url, pids) in targets.items():
                        c0 = cpu_seconds(pids)
                        t0 = time.perf_counter()
                        n, lat = asyncio.run(load(url, stream, args.seconds, args.concurrency))
                        wall = time.perf_counter() - t0
                        cpu = (cpu_seconds(pids) - c0) / n * 1e6 if pids else None
                        runs[(stream, name)].append(
                            (n / wall, pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, cpu)
                        )
            cpu_by_mode: dict[str, dict[str, float]] = {}
            for stream in (False, True):
                mode = "stream64" if stream else "json"
                base: tuple[float, float, float] | None = None
                for name in targets:
                    cell = runs[(stream, name)]
                    rps, p50, p99 = (statistics.median(r[i] for r in cell) for i in range(3))
                    cpus = [r[3] for r in cell if r[3] is not None]
                    if base is None:
                        base = (rps, p50, p99)
                    cpu_us = f"{'-':>10}"
                    if cpus:
                        cpu_by_mode.setdefault(mode, {})[name] = statistics.median(cpus)
                        cpu_us = f"{statistics.median(cpus):10.0f}"
                    print(
                        f"{mode:<10} {name:<8} {rps:8.0f} {p50:8.2f} {p99:8.2f} "
                        f"{p50 - base[1]:8.2f} {p99 - base[2]:8.2f} {rps / base[0]:8.2f} "
                        f"{p50 / base[1]:8.2f} {cpu_us}"
                    )
            print()
            runs_note = f" (median of {args.repeat} runs)" if args.repeat > 1 else ""
            print(f"hop CPU us/request{runs_note}:")
            for mode, cpus in cpu_by_mode.items():
                line = "  ".join(f"{name} {us:6.0f}" for name, us in cpus.items())
                mine = cpus.get("ramjet")
                ratios = "  ".join(
                    f"ramjet/{name} {mine / us:5.1f}x"
                    for name, us in cpus.items()
                    if name != "ramjet" and mine is not None and us > 0
                )
                print(f"  {mode:<10} {line}   {ratios}")
            for n in notes:
                print("note:", n)
        finally:
            for p in reversed(procs):
                stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
