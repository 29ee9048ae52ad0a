"""Sidecar benchmark: KV events decoded per second, and the latency from an engine event
to the router's residency table (p50, p99).

1. Decode: a batch of 64 `BlockStored` events (4 blocks of 16 tokens each, like a vLLM
   step) in both encodings, decoded and validated by `ramjet.sidecar.wire`; baseline: the
   bare msgpack decode of the same bytes (msgspec), so the ratio is what validation and
   typed events cost. Also the tracker folding decoded events into a delta.
2. Latency: in one process, the reference engine's vLLM-format ZMQ publisher, a sidecar
   (HTTP on loopback, signing with Ed25519) and a router (`RouterServer`, pulling the
   sidecar's reports by long-poll, verifying, applying to its tables). One `BlockStored`
   per sample; the clock stops when the router's table holds its key. Baseline: the bare
   ZMQ PUB -> SUB hop on the same machine.

Run: `.venv/bin/python benchmarks/sidecar.py [--samples 200]`; `--quick` (make bench):
50 samples, 0.3 s per decode rate. Every decoded batch is checked against the events
encoded, and every latency sample waits for its own key in the router's table; then a
`self-check:` line and the headline `figure:` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import msgspec
import zmq
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ramjet.native import install_ramjet

install_ramjet()  # the hot modules as `ramjet serve` runs them (ramjet/native.py)

from engine_stub.vllm_events import ZmqEventPublisher  # noqa: E402
from ramjet.app.server import RouterServer  # noqa: E402
from ramjet.config import parse_policy  # noqa: E402
from ramjet.keys.tokens import chain_keys, token_key_seed  # noqa: E402
from ramjet.reports.bodies import DeltaBuilder  # noqa: E402
from ramjet.residency.store import MemoryStore, Table  # noqa: E402
from ramjet.residency.tables import ResidencyTables  # noqa: E402
from ramjet.sidecar.runner import Sidecar, SidecarSettings  # noqa: E402
from ramjet.sidecar.tracker import VLLM_MEDIA, ResidencyTracker  # noqa: E402
from ramjet.sidecar.wire import BlockStored, EventBatch, decode_batch, encode_batch  # noqa: E402
from ramjet.types import EngineId  # noqa: E402

B = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batch(start: int, n_events: int = 64) -> EventBatch:
    events = []
    for e in range(n_events):
        toks = tuple(range(start + e * 64, start + e * 64 + 4 * B))
        hashes = tuple(start + e * 4 + i for i in range(4))
        events.append(BlockStored(hashes, None, toks, B, medium="GPU"))
    return EventBatch(time.time(), tuple(events), 0)


def bench_decode(seconds: float = 1.0) -> dict[str, float]:
    print("== decode (64 BlockStored x 4 blocks x 16 tokens per batch)")
    batch = _batch(0)
    figs: dict[str, float] = {}
    for tagged in (True, False):
        payload = encode_batch(batch, tagged=tagged)
        if decode_batch(payload).events != batch.events:
            raise SystemExit(
                f"self-check: FAILED: decode_batch (tagged={tagged}) changed the events"
            )
        rates = []
        for fn in (msgspec.msgpack.decode, decode_batch):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn(payload)
                n += 1
            rates.append(n * len(batch.events) / (time.perf_counter() - t0))
        name = "tagged maps      " if tagged else "tag-first arrays "
        print(f"{name} {len(payload):6d} B/batch   bare msgpack {rates[0]:>10,.0f} ev/s   "
              f"wire.decode_batch {rates[1]:>10,.0f} ev/s   ratio {rates[1] / rates[0]:.2f}")  # fmt: skip
        figs[name.strip()] = rates[1]
    tracker = ResidencyTracker("m", VLLM_MEDIA, B)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = _batch(n * 100_000)
        tracker.apply(b.events, DeltaBuilder())
        n += 1
    dt = time.perf_counter() - t0
    print(f"tracker.apply (new blocks)       {n * 64 / dt:>10,.0f} ev/s "
          f"({n * 256 / dt:,.0f} blocks/s)")  # fmt: skip
    figs["tracker.apply"] = n * 64 / dt
    return figs


def bench_zmq_floor(samples: int) -> list[float]:
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    ep = f"tcp://127.0.0.1:{_port()}"
    pub.bind(ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    time.sleep(0.3)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        pub.send_multipart([b"", b"\0" * 8, b"x" * 600])
        sub.recv_multipart()
        out.append(time.perf_counter() - t0)
    pub.close(0)
    sub.close(0)
    ctx.term()
    return out


async def bench_latency(samples: int) -> list[float]:
    ev, rp = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    key = Ed25519PrivateKey.generate()
    pub_b64 = base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
    publisher = ZmqEventPublisher(ev, rp)
    settings = SidecarSettings(
        engine_kind="vllm", engine_id="e0", engine_url="http://127.0.0.1:1", events_url=ev,
        profile="skip",
        replay_url=rp, key_id="e0-sc", model="m", block_tokens=B, scrape_metrics=False,
        load_interval_s=5.0,
    )  # fmt: skip
    sidecar = Sidecar(settings, key)
    from aiohttp import web

    app = web.Application()
    sidecar.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sc_port = _port()
    await web.TCPSite(runner, "127.0.0.1", sc_port).start()
    await sidecar.start()
    cfg = parse_policy(
        {
            "engines": [{"id": "e0", "url": "http://127.0.0.1:1"}],
            "incumbent": {"name": "prefix_affinity"},
            "reports": {
                "engines": {"e0": f"http://127.0.0.1:{sc_port}"},
                "poll": {"wait_s": 5, "timeout_s": 10},
            },
            "keys": {"engines": {"e0": [{"key_id": "e0-sc", "public_key": pub_b64}]}},
        }
    )
    server = RouterServer(cfg)
    await server.start()
    tables = server.router.residency
    assert isinstance(tables, ResidencyTables) and isinstance(tables.store, MemoryStore)
    store = tables.store
    await asyncio.sleep(0.5)
    out: list[float] = []
    try:
        for i in range(samples + 10):
            toks = list(range(i * B, (i + 1) * B))
            want = chain_keys(toks, token_key_seed("m"), B)[0]
            t0 = time.perf_counter()
            publisher.publish([BlockStored((10**6 + i,), None, tuple(toks), B, medium="GPU")])
            deadline = t0 + 5
            while True:
                if any(
                    k == want for k, _ in store.entries(Table.GLOBAL, EngineId("e0"), exact=True)
                ):
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"sample {i}: key never reached the router")
                await asyncio.sleep(0.0002)
            if i >= 10:  # warm-up
                out.append(time.perf_counter() - t0)
    finally:
        await server.stop(drain_s=0.5)
        await sidecar.stop()
        await runner.cleanup()
        publisher.close()
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="--samples 50, 0.3 s decode rates")
    args = ap.parse_args()
    if args.quick:
        args.samples = 50
    rates = bench_decode(0.3 if args.quick else 1.0)
    print(f"\n== engine event -> router residency ({args.samples} samples, one block each)")
    floor = bench_zmq_floor(args.samples)
    lat = asyncio.run(bench_latency(args.samples))
    for name, xs in (("bare ZMQ PUB->SUB hop", floor), ("event -> router table", lat)):
        print(f"{name:24s} p50 {_pct(xs, 0.5) * 1e3:7.3f} ms   p99 {_pct(xs, 0.99) * 1e3:7.3f} ms"
              f"   mean {statistics.mean(xs) * 1e3:7.3f} ms")  # fmt: skip
    print(f"ratio p50 (end to end / ZMQ hop): {_pct(lat, 0.5) / _pct(floor, 0.5):.0f}x")
    for name, rate in rates.items():
        print(f"figure: sidecar decode / {name} = {rate / 1e3:.0f} kev/s")
    print(f"figure: sidecar event to router table / p50 = {_pct(lat, 0.5) * 1e3:.3f} ms")
    print(f"figure: sidecar event to router table / p99 = {_pct(lat, 0.99) * 1e3:.3f} ms")
    print(
        f"figure: sidecar event to router table / bare ZMQ hop p50 = {_pct(floor, 0.5) * 1e3:.3f} ms"
    )
    print(
        f"self-check: both encodings decode to the events encoded; all {len(lat)} timed "
        "events reached the router's table as their own key (signed report, verified, applied)"
    )
    return 0


if __name__ == "__main__":
    _ = threading  # the publisher and the sidecar's stream each run a thread
    sys.exit(main())
