"""The router's event-loop stall while it takes in one huge body (issue 29, case 1).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/big_body_loop.py [--rounds 6]

The router runs in this process (`RouterServer`, the fast server in front), before two
reference engines (`python -m engine_stub serve`, stopped by pid at the end); a task on
its event loop sleeps 1 ms at a time and records how late each wake-up is (the loop's
gaps: whatever held the loop or the GIL). Each round sends, from a process of its own
(`http.client`), either

- a baseline body: a small chat request for a model not served (404, no engine work), or
- the huge body: 950,000 one-word messages, 32.3 MB (400 `too_many_messages`, counted in
  the child process),

and the worst gap during each is kept. Printed: the median over rounds of the worst gap
for each, their difference (the stall the huge body adds), and a `self-check:` line
(every answer's status and error code verified). The figure that matters for the small
streams beside the body is that difference: `hostile_clients.py` case 1 measures their
TTFT end to end, which on a shared machine is dominated by its noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from engines import start_engine  # noqa: E402
from hostile_clients import SENDER  # noqa: E402
from router_rig import router_config  # noqa: E402

from ramjet.app.server import RouterServer  # noqa: E402


async def send(url: str, path: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SENDER, url, str(path), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    status, reply = out.split(b"\n", 1)
    return int(status), json.loads(reply).get("error", {}).get("code", "")


async def worst_gap(url: str, path: Path) -> tuple[float, int, str]:
    """The loop's worst lateness (s) while `path` is sent and answered."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def monitor() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            gaps.append(time.perf_counter() - t - 0.001)

    m = asyncio.create_task(monitor())
    status, code = await send(url, path)
    done.set()
    await m
    if "--verbose" in sys.argv:
        top = sorted(gaps)[-3:]
        print(f"  {path.name}: worst gaps {[round(x * 1000, 1) for x in top]} ms", flush=True)
    return max(gaps), status, code


async def run(rounds: int, tmp: Path, urls: list[str]) -> int:
    cfg = router_config(
        urls,
        timeouts={"first_byte_s": 30, "idle_s": 30, "body_s": 30, "header_deadline_s": 10},
        limits={"max_body_bytes": 32 << 20, "max_inflight_body_bytes": 256 << 20},
    )
    server = RouterServer(cfg)
    await server.start()
    server.router.start_counting_child()  # as `ramjet serve` does
    small = tmp / "small.json"
    small.write_bytes(
        json.dumps(
            {"model": "not-served", "messages": [{"role": "user", "content": "w"}] * 20}
        ).encode()
    )
    big = tmp / "big.json"
    big.write_bytes(
        json.dumps(
            {"model": "mini-v4", "messages": [{"role": "user", "content": "w"}] * 950_000}
        ).encode()
    )
    base: list[float] = []
    huge: list[float] = []
    bad: list[str] = []
    try:
        await asyncio.sleep(2.0)  # the counting child is up
        for _ in range(rounds):
            g, status, code = await worst_gap(server.url, small)
            base.append(g)
            if (status, code) != (404, "model_not_found"):
                bad.append(f"baseline answered {status} {code}")
            g, status, code = await worst_gap(server.url, big)
            huge.append(g)
            if (status, code) != (400, "too_many_messages"):
                bad.append(f"huge body answered {status} {code}")
    finally:
        await server.stop(drain_s=0.5)
    b, h = statistics.median(base), statistics.median(huge)
    print(f"baseline (small body): worst loop gap, median of {rounds}: {b * 1000:.1f} ms")
    print(f"huge body (32.3 MB):   worst loop gap, median of {rounds}: {h * 1000:.1f} ms")
    print(f"figure: big body loop / stall added by the huge body = {(h - b) * 1000:.1f} ms")
    print(f"figure: big body loop / huge vs baseline worst gap = {h / max(b, 1e-6):.1f}x")
    if bad:
        print(f"self-check: FAILED: {'; '.join(bad[:3])}")
        return 1
    print(f"self-check: {2 * rounds} answers verified (404 baseline, 400 too_many_messages)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--verbose", action="store_true", help="print each round's worst gaps")
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="big-body-loop-") as tmpdir,
        start_engine("e0") as e0,
        start_engine("e1") as e1,
    ):
        return asyncio.run(run(args.rounds, Path(tmpdir), [e0.url, e1.url]))


if __name__ == "__main__":
    sys.exit(main())
