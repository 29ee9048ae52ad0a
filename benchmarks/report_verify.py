"""Cost of verifying and applying signed reports, against bare Ed25519 verification.

    .venv/bin/python benchmarks/report_verify.py [--small N] [--large N] [--pull N]

Prints, for a small delta (4 keys, ~0.4 KB) and a large snapshot (100,000 keys,
~1.1 MB): p50 and p99 of `ReportProcessor.submit` (size check, decode, key lookup,
Ed25519, window and sequence checks, body parse, table update), the same percentiles
of a bare `Ed25519PublicKey.verify` over the same bytes (the floor), and the ratio.
Then the sustained rate of small reports through `submit` alone, and through the real
transport: a publisher app and the router's puller on loopback, in one process.
On a shared machine wall-clock figures swing with other load; the CPU-time rate of
`submit` does not.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry

from ramjet.reports.bodies import DeltaBody, SnapshotBody, TierKeys, encode_body
from ramjet.reports.config import ReportsConfig
from ramjet.reports.envelope import Envelope, decode, sign
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey

E0 = EngineId("e0")
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def processor() -> ReportProcessor:
    ring = KeyRing({"k": (E0, KEY.public_key())})
    cfg = ReportsConfig(rate_per_s=1e9, burst=10**9, max_report_bytes=8 << 20, max_keys=1 << 18)
    return ReportProcessor(ring, ResidencyTables(), cfg, CollectorRegistry())


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def frames(n: int, body_of: object, epoch: int = 1) -> list[bytes]:
    now_ms = int(time.time() * 1000)
    out = []
    for i in range(n):
        body = body_of(i)  # type: ignore[operator]
        kind = "snapshot" if isinstance(body, SnapshotBody) else "delta"
        env = Envelope(E0, "k", epoch, i + 1, now_ms + i, kind, encode_body(body))
        out.append(sign(env, KEY))
    return out


def measure(label: str, fs: list[bytes]) -> None:
    proc = processor()
    t_submit, t_floor = [], []
    pub = KEY.public_key()
    for f in fs:
        t0 = time.perf_counter()
        out = proc.submit(f)
        t1 = time.perf_counter()
        assert not hasattr(out, "reason"), out
        t_submit.append(t1 - t0)
        signed = decode(f, 8 << 20)
        t0 = time.perf_counter()
        pub.verify(signed.signature, signed.signed)
        t_floor.append(time.perf_counter() - t0)
    p50, p99 = pct(t_submit, 0.5), pct(t_submit, 0.99)
    f50, f99 = pct(t_floor, 0.5), pct(t_floor, 0.99)
    print(
        f"{label:<32} bytes={len(fs[0]):>9,}  submit p50={p50 * 1e6:9.1f} us  p99={p99 * 1e6:9.1f} us"
        f"  | ed25519 alone p50={f50 * 1e6:8.1f} us p99={f99 * 1e6:8.1f} us"
        f"  | ratio p50 {p50 / f50:5.1f}x"
    )


async def pull_rate(n: int) -> float:
    pub = ReportPublisher(E0, KEY, "k", epoch=1, snapshot=lambda: ([], []), ring_size=n + 10)
    app = web.Application()
    pub.add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    proc = processor()
    ingest = ReportIngest(proc, {E0: f"http://127.0.0.1:{port}"})
    try:
        body = DeltaBody(stored=[TierKeys(tier="hbm", keys=(PrefixKey(1), PrefixKey(2)))])
        await ingest.start()
        t0 = time.perf_counter()
        for i in range(n):
            pub.publish_delta(body)
            if i % 256 == 255:
                await asyncio.sleep(0)  # let the loop serve polls while publishing
        while (c := proc.cursor(E0)) is None or c.seq < n:
            await asyncio.sleep(0.005)
        return n / (time.perf_counter() - t0)
    finally:
        await ingest.stop()
        await runner.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", type=int, default=5000)
    ap.add_argument("--large", type=int, default=30)
    ap.add_argument("--pull", type=int, default=20000)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}  ({Path(__file__).name})")

    def small(i: int) -> DeltaBody:
        return DeltaBody(
            stored=[TierKeys(tier="hbm", keys=tuple(PrefixKey(i * 4 + j) for j in range(4)))]
        )

    def large(i: int) -> SnapshotBody:
        return SnapshotBody(
            seq=i + 1,
            residency=[TierKeys(tier="hbm", keys=tuple(PrefixKey(k) for k in range(100_000)))],
        )

    measure("small delta (4 keys)", frames(args.small, small))
    measure("large snapshot (100,000 keys)", frames(args.large, large))

    fs = frames(args.small, small)
    proc = processor()
    t0, c0 = time.perf_counter(), time.process_time()
    for f in fs:
        proc.submit(f)
    rate = len(fs) / (time.perf_counter() - t0)
    cpu_rate = len(fs) / (time.process_time() - c0)
    print(
        f"sustained submit, small deltas:        {rate:10,.0f} reports/s wall"
        f"  ({cpu_rate:,.0f} per CPU-second: the figure on an idle core)"
    )
    prate = asyncio.run(pull_rate(args.pull))
    print(
        f"sustained pull over loopback (publisher + puller in one process): {prate:10,.0f} reports/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
