"""Cost of verifying and applying signed reports, against bare Ed25519 verification.

    .venv/bin/python benchmarks/report_verify.py [--small N] [--large N] [--pull N]
        [--proxy-s S] [--clients C]
    .venv/bin/python benchmarks/report_verify.py --quick   # what `make bench` runs, ~30 s

Prints, for a small delta (4 keys, ~0.4 KB) and a large snapshot (100,000 keys,
~1.1 MB): p50 and p99 of `ReportProcessor.submit` (size check, decode, key lookup,
Ed25519, window and sequence checks, body parse, table update), the same percentiles
of a bare `Ed25519PublicKey.verify` over the same bytes (the floor), and the ratio.
Then the sustained rate of small reports through `submit` alone, and through the real
transport: a publisher app and the router's puller on loopback, in one process.
On a shared machine wall-clock figures swing with other load; the CPU-time rate of
`submit` does not.

Then, with the event loop in view:
- the longest event-loop stall while a 100,000-key snapshot is applied, in one step
  (`submit`, the baseline) and in pieces (`submit_async`, 4096 keys a piece);
- a real router (`RouterServer`, report runtime on) proxying chat requests from C
  concurrent clients to a loopback upstream, for S seconds each: alone (baseline), while
  its puller ingests deltas offered at R per second (the report rate it sustains while
  proxying, and what that costs the requests; the publisher's signing shares the loop
  too), and while it applies a
  100,000-key snapshot back to back, in one step and in pieces (request p99 and the
  longest loop stall). Publisher, upstream, router and clients share one process and
  loop, so compare the rows with each other, not with other machines.

Self-checks, or the run fails: every signed report submitted is accepted (none
rejected), every published delta is pulled and applied in order, every client answer is
200 with the upstream's completion, deltas are applied while the router proxies, and at
least one 100,000-key snapshot is applied in one step and one in pieces during the
proxy rows. The `self-check:` line counts each.
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

from ramjet.native import install_ramjet

install_ramjet()  # the hot modules as `ramjet serve` runs them (ramjet/native.py)

from ramjet.app.server import RouterServer  # noqa: E402
from ramjet.config import parse_policy  # noqa: E402
from ramjet.fleet.signals import REPORTS_KEY  # noqa: E402
from ramjet.reports.bodies import DeltaBody, SnapshotBody, TierKeys, encode_body  # noqa: E402
from ramjet.reports.config import ReportsConfig  # noqa: E402
from ramjet.reports.envelope import Envelope, ReportKind, decode, sign  # noqa: E402
from ramjet.reports.ingest import ReportIngest  # noqa: E402
from ramjet.reports.keys import KeyRing, public_key_b64  # noqa: E402
from ramjet.reports.processor import ReportProcessor  # noqa: E402
from ramjet.reports.publisher import ReportPublisher  # noqa: E402
from ramjet.residency.tables import ResidencyTables  # noqa: E402
from ramjet.types import EngineId, PrefixKey  # noqa: E402

E0 = EngineId("e0")
CHECKED: dict[str, int] = {}
"""What the self-checks verified, counted (the `self-check:` line)."""


class BenchError(RuntimeError):
    """A self-check failed: the run measured something other than it claims."""


def _count(what: str, n: int = 1) -> None:
    CHECKED[what] = CHECKED.get(what, 0) + n


def _accepted(out: object) -> None:
    if hasattr(out, "reason"):
        raise BenchError(f"a signed report was rejected: {out}")
    _count("accepted")


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
        kind: ReportKind = "snapshot" if isinstance(body, SnapshotBody) else "delta"
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
        _accepted(out)
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
        _count("pulled", n)
        return n / (time.perf_counter() - t0)
    finally:
        await ingest.stop()
        await runner.cleanup()


class LoopWatch:
    """Longest gap between wake-ups of a 1 ms ticker: how long the loop was blocked."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last - 0.001)
            last = now

    def __enter__(self) -> LoopWatch:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def big_snapshot_frames(n: int, keys: int = 100_000) -> list[bytes]:
    def body(i: int) -> SnapshotBody:
        return SnapshotBody(
            seq=i + 1,
            residency=[TierKeys(tier="hbm", keys=tuple(PrefixKey(k) for k in range(keys)))],
        )

    return frames(n, body)


async def snapshot_stall(n: int) -> tuple[float, float]:
    """Longest loop stall applying n 100k-key snapshots: one step, in pieces."""
    fs = big_snapshot_frames(n)
    out = []
    for chunk in (0, 8192):
        proc = processor()
        proc.snapshot_chunk_keys = chunk
        await asyncio.sleep(0.01)
        with LoopWatch() as w:
            for f in fs:
                await asyncio.sleep(0.002)
                if chunk:
                    _accepted(await proc.submit_async(f))
                else:
                    _accepted(proc.submit(f))
            await asyncio.sleep(0.002)
        out.append(w.max_gap)
    return out[0], out[1]


async def _upstream() -> tuple[web.AppRunner, str]:
    body = (
        b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
    )

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _clients(url: str, n: int, seconds: float) -> list[float]:
    import aiohttp

    payload = {"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]}
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def one(s: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=payload) as r:
                body = await r.read()
                if r.status != 200 or b'"content":"ok"' not in body:
                    raise BenchError(f"client answer {r.status}: {body[:200]!r}")
            lat.append(time.perf_counter() - t0)
            _count("answered")

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s) for _ in range(n)))
    return lat


async def proxy_rows(seconds: float, clients: int, target: float) -> None:
    snap_holder: list[SnapshotBody] = []

    def snapshot() -> tuple[list[TierKeys], list[object]]:
        return (list(snap_holder[0].residency) if snap_holder else []), []

    pub = ReportPublisher(E0, KEY, "k", epoch=1, snapshot=snapshot, ring_size=1 << 16)  # type: ignore[arg-type]
    app = web.Application()
    pub.add_routes(app)
    prunner = web.AppRunner(app, access_log=None)
    await prunner.setup()
    psite = web.TCPSite(prunner, "127.0.0.1", 0)
    await psite.start()
    pub_url = f"http://127.0.0.1:{prunner.addresses[0][1]}"
    urunner, up_url = await _upstream()
    cfg = parse_policy(
        {
            "engines": [{"id": "e0", "url": up_url}],
            "incumbent": {"name": "least_loaded"},
            "keys": {"engines": {"e0": [{"key_id": "k", "public_key": public_key_b64(KEY.public_key())}]}},
            "reports": {
                "engines": {"e0": pub_url}, "rate_per_s": 1e6, "burst": 10**7,
                "max_report_bytes": 8 << 20, "poll": {"wait_s": 1.0, "timeout_s": 5.0},
            },
        }
    )  # fmt: skip
    server = RouterServer(cfg)
    await server.start()
    rt = server.app[REPORTS_KEY]
    proc = rt.processor
    try:
        while proc.cursor(E0) is None:
            await asyncio.sleep(0.01)

        def row(label: str, lat: list[float], gap: float, extra: str = "") -> None:
            print(
                f"  {label:<38} {len(lat) / seconds:7,.0f} req/s  p50 {pct(lat, 0.5) * 1e3:6.2f} ms"
                f"  p99 {pct(lat, 0.99) * 1e3:7.2f} ms  loop stall max {gap * 1e3:6.1f} ms{extra}"
            )

        print(f"router proxying, {clients} clients, {seconds:.0f} s a row:")
        with LoopWatch() as w:
            base = await _clients(server.url, clients, seconds)
        row("alone (baseline)", base, w.max_gap)

        body = DeltaBody(stored=[TierKeys(tier="hbm", keys=(PrefixKey(1), PrefixKey(2)))])
        stop = asyncio.Event()

        async def publish() -> None:  # `target` reports/s, in bursts of 10
            t_next = time.perf_counter()
            while not stop.is_set():
                for _ in range(10):
                    pub.publish_delta(body)
                t_next += 10 / target
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))

        seq0 = proc.cursor(E0).seq  # type: ignore[union-attr]
        t0 = time.perf_counter()
        task = asyncio.create_task(publish())
        with LoopWatch() as w:
            lat = await _clients(server.url, clients, seconds)
        stop.set()
        await task
        applied = proc.cursor(E0).seq - seq0  # type: ignore[union-attr]
        if applied <= 0:
            raise BenchError("no delta applied while the router proxied")
        _count("applied while proxying", applied)
        rate = applied / (time.perf_counter() - t0)
        row(
            f"+ deltas offered at {target:,.0f}/s",
            lat,
            w.max_gap,
            f"  | {rate:,.0f} reports/s applied",
        )
        print(f"    -> requests/s {len(lat) / max(1, len(base)):.2f}x of baseline")

        snap_holder.append(big_snapshot_body())

        async def snapshots(stop: asyncio.Event, fetched: list[int]) -> None:
            while not stop.is_set():
                await rt.ingest.fetch_snapshot(E0, pub_url)
                fetched[0] += 1
                await asyncio.sleep(0.05)

        for chunk in (0, 8192):
            proc.snapshot_chunk_keys = chunk
            stop = asyncio.Event()
            fetched = [0]
            task = asyncio.create_task(snapshots(stop, fetched))
            with LoopWatch() as w:
                lat = await _clients(server.url, clients, seconds)
            stop.set()
            await task
            label = "+ 100k-key snapshots, " + ("one step" if chunk == 0 else f"{chunk}-key pieces")
            if fetched[0] < 1:
                raise BenchError(f"no snapshot applied during the row {label!r}")
            _count("snapshots " + ("one step" if chunk == 0 else "in pieces"), fetched[0])
            row(label, lat, w.max_gap, f"  | {fetched[0]} applied")
    finally:
        await server.stop(drain_s=1.0)
        await pub.stop()
        await prunner.cleanup()
        await urunner.cleanup()


def big_snapshot_body(keys: int = 100_000) -> SnapshotBody:
    return SnapshotBody(
        seq=0, residency=[TierKeys(tier="hbm", keys=tuple(PrefixKey(k) for k in range(keys)))]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", type=int, default=5000)
    ap.add_argument("--large", type=int, default=30)
    ap.add_argument("--pull", type=int, default=20000)
    ap.add_argument("--stall", type=int, default=5, help="snapshots for the loop-stall row")
    ap.add_argument("--proxy-s", type=float, default=4.0, help="seconds per proxy row")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--report-rate", type=float, default=1000.0, help="deltas/s offered")
    ap.add_argument("--quick", action="store_true", help="fewer reports, 1 s proxy rows")
    args = ap.parse_args()
    if args.quick:
        args.small, args.large, args.pull, args.stall, args.proxy_s = 500, 3, 2000, 2, 1.0
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
        _accepted(proc.submit(f))
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
    one, pieces = asyncio.run(snapshot_stall(args.stall))
    print(
        f"longest loop stall applying a 100,000-key snapshot: one step {one * 1e3:7.1f} ms,"
        f" in 8192-key pieces {pieces * 1e3:6.1f} ms  ({one / max(pieces, 1e-9):.0f}x shorter)"
    )
    asyncio.run(proxy_rows(args.proxy_s, args.clients, args.report_rate))
    print(
        "self-check: every signed report accepted, none rejected; every published delta "
        "pulled and applied in order; every client answer 200 with the upstream's completion; "
        "deltas and 100k-key snapshots (one step and in pieces) applied while proxying ("
        + ", ".join(f"{k} {v:,}" for k, v in CHECKED.items())
        + ")"
    )
    print(
        f"report verify result: a 100,000-key snapshot stalls the loop {one * 1e3:.1f} ms in "
        f"one step, {pieces * 1e3:.1f} ms in 8192-key pieces; {prate:,.0f} reports/s pulled"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
