"""The router's synchronous per-request Python, stage by stage, in one process, no sockets.

    .venv/bin/python benchmarks/request_path_cpu.py [--calls 20000] [--repeat 7] [--show-line]
        [--inflight N]
    .venv/bin/python benchmarks/request_path_cpu.py --quick      # make bench: 2,000 x 3

Builds the router of `benchmarks/proxy_overhead.py`'s `ramjet_observe` (two engines,
prefix_affinity live, tier_aware recorded; the decision log off, its line built and
encoded here instead) and times, on the calling thread's CPU clock (`time.thread_time`,
so a loaded machine's waits do not count; the best of `--repeat` runs of `--calls`
calls), each stage a small JSON chat request goes through between its body and its
socket writes: parse and keys, engine views, the request view, fleet stats, each policy's
pick, the mode runner's decision (both picks), the accounting (decision record, metrics,
prediction errors), the decision log's line (built and encoded: the writer thread's
work) and its queue. Every stage's result is checked (a decision names an engine offered,
the line names the request and both picks). Printed: us per call and each stage's share
of their sum; the socket writes, the event loop and the HTTP layers are not in it
(`benchmarks/proxy_profile.py` samples those). `--inflight N` opens N of the router's
requests on each engine first (as `proxy_overhead.py`'s 32 connections over two engines
leave about 16 each): tier_aware prices each one's prefill in its wait.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ramjet.native import install_ramjet

install_ramjet()  # the hot modules as `ramjet serve` runs them (ramjet/native.py)

from ramjet.app.wiring import build  # noqa: E402
from ramjet.config import parse_policy  # noqa: E402
from ramjet.decisions.log import _ENCODER, DecisionLog, decision_entry, parse_realized  # noqa: E402
from ramjet.decisions.record import DecisionRecord  # noqa: E402
from ramjet.fleet.engines import Ticket  # noqa: E402
from ramjet.fleet.views import engine_views  # noqa: E402
from ramjet.policy.fleet_stats import fleet_stats  # noqa: E402
from ramjet.proxy.exchange import Attempt, ForwardResult  # noqa: E402
from ramjet.request.parse import parse_request, to_request_view  # noqa: E402

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hello there " * 8}], "stream": False}
).encode()
TAIL = (
    b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":2}}'
)


class _Keep:
    """A decision sink that keeps the last record (the accounting is timed on its own)."""

    record: DecisionRecord | None = None

    def on_decision(self, record: DecisionRecord) -> None:
        self.record = record


def best_us(fn: Callable[[], Any], calls: int, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - t) / calls * 1e6)
    return min(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="--calls 2000 --repeat 3 (make bench)")
    ap.add_argument(
        "--show-line", action="store_true", help="also print the decision line it times"
    )
    ap.add_argument(
        "--inflight",
        type=int,
        default=0,
        help="the router's requests open on each engine while timing (default 0)",
    )
    args = ap.parse_args()
    if args.quick:
        args.calls, args.repeat = 2000, 3
    cfg = parse_policy(
        {
            "engines": [
                {"id": "e0", "url": "http://127.0.0.1:9"},
                {"id": "e1", "url": "http://127.0.0.1:10"},
            ],
            "mode": {"kind": "observe"},
            "incumbent": {"name": "prefix_affinity"},
            "candidate": {"name": "tier_aware"},
        }
    )
    router = build(cfg).router
    keep = _Keep()
    router.sink = keep
    for e in router.fleet.engines:
        e.probe_ok = True
    t0 = router.clock()
    tickets = [  # requests in flight: each is priced at its own context in tier_aware's wait
        Ticket(e, 30 + i, t0, 0) for e in router.fleet.engines for i in range(args.inflight)
    ]
    for i in range(50):  # a measured arrival rate: tier_aware's externality term is live
        router.arrivals.arrive(t0 - 1 + i * 0.02)
    lim, heads = router.parse_limits, {"Content-Type": "application/json"}
    parsed = parse_request("/v1/chat/completions", BODY, heads, lim)
    views, _, _ = engine_views(router.fleet, router.signals, router.residency, "m", t0)
    rv = to_request_view(parsed, "r1")
    fleet = fleet_stats(t0, router.arrivals, router.accounting.waits, router.work_rates)
    inc, cand = router.modes.incumbent, router.modes.candidate
    assert cand is not None
    outcome = router.modes.decide(rv, views, fleet, "s")
    ids = {v.id for v in views}
    if outcome.live.engine not in ids or outcome.candidate is None:
        raise SystemExit(f"bad decision: {outcome}")
    res = ForwardResult(
        engine=outcome.live.engine, status=200, attempts=[Attempt(outcome.live.engine, 200)]
    )
    res.ttft_s = 0.001
    res.tail.add(TAIL)
    tv = tuple(views)
    router._account(parsed, outcome, "r1", t0, res, tv)
    record = keep.record
    if record is None or record.candidate is None:
        raise SystemExit("the accounting passed no record on")
    realized = parse_realized(record.response_tail)
    entry = decision_entry(record, realized)
    line = _ENCODER.encode(entry)
    got = json.loads(line)
    if got["id"] != "r1" or got["candidate"]["engine"] not in ids or not got["predicted"]:
        raise SystemExit(f"bad decision line: {line[:200]!r}")
    # The log's queue alone: its writer sleeps through the timing (`batch_s`, an hour) and
    # writes what was queued at `close` (the compiled `DecisionLog` cannot be subclassed by
    # an interpreted class, so the writer is kept idle rather than replaced).
    log = DecisionLog(Path(tempfile.mkdtemp()) / "d.jsonl", queue_size=1 << 30, batch_s=3600.0)

    stages: list[tuple[str, Callable[[], Any]]] = [
        ("parse + keys", lambda: parse_request("/v1/chat/completions", BODY, heads, lim)),
        (
            "engine views",
            lambda: engine_views(router.fleet, router.signals, router.residency, "m", t0),
        ),
        ("request view", lambda: to_request_view(parsed, "r1")),
        (
            "fleet stats",
            lambda: fleet_stats(t0, router.arrivals, router.accounting.waits, router.work_rates),
        ),
        ("decide (both picks)", lambda: router.modes.decide(rv, views, fleet, "s")),
        ("  prefix_affinity pick", lambda: inc.pick(rv, views, fleet)),
        ("  tier_aware pick", lambda: cand.pick(rv, views, fleet)),
        (
            "accounting: record + router metrics",
            lambda: router._account(parsed, outcome, "r1", t0, res, tv),
        ),
        ("accounting: errors, usage", lambda: router.accounting.on_decision(record)),
        (
            "decision line (writer thread)",
            lambda: _ENCODER.encode(decision_entry(record, realized)),
        ),
        ("  its entry (dict)", lambda: decision_entry(record, realized)),
        ("  its encoding", lambda: _ENCODER.encode(entry)),
        ("decision log queue", lambda: log.submit(record, realized)),
    ]
    if args.show_line:
        print(line.decode())
    print(f"request path Python, us per call (thread CPU, best of {args.repeat} x {args.calls})")
    figures = [(name, best_us(fn, args.calls, args.repeat)) for name, fn in stages]
    total = sum(us for name, us in figures if not name.startswith("  "))
    for name, us in figures:
        share = "" if name.startswith("  ") else f"{us / total:6.1%}"
        print(f"  {name:38s} {us:7.2f} {share}")
    print(f"  {'sum (picks counted once, in decide)':38s} {total:7.2f}")
    for name, us in figures:
        if not name.startswith("  "):
            print(f"figure: request path CPU / {name} = {us:.2f} us")
    print(f"figure: request path CPU / sum = {total:.2f} us")
    print(
        "self-check: the decision named an offered engine with both picks, the accounting "
        "passed its record on, and its decision line names the request and the candidate"
    )
    log.close()
    for ticket in tickets:
        ticket.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
