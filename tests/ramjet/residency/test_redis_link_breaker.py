"""The Redis link's breaker and fail-fast behaviour (fake clock; one real dead port)."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ramjet.residency.redis_link import (
    Breaker,
    RedisLink,
    RedisSettings,
    RedisUnavailable,
    StoreConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from manual_clock import ManualClock


def test_opens_after_consecutive_failures_and_probes_once() -> None:
    c = ManualClock(100.0)
    b = Breaker(failures=3, open_s=1.0, max_open_s=4.0, clock=c)
    assert b.allow()
    assert not b.failure() and not b.failure()
    b.success()  # a success resets the count
    assert not b.failure() and not b.failure()
    assert b.failure()  # third in a row opens
    assert b.state == "open" and not b.allow()
    c.t += 1.0
    assert b.allow()  # the probe
    assert not b.allow()  # only one
    b.failure()  # probe failed: open twice as long
    assert b.state == "open"
    c.t += 1.5
    assert not b.allow()
    c.t += 0.5
    assert b.allow()
    assert b.success()  # recovered
    assert b.state == "closed" and b.open_s == 1.0


def test_a_lost_probe_does_not_wedge_the_breaker() -> None:
    c = ManualClock(100.0)
    b = Breaker(failures=1, open_s=0.5, max_open_s=5.0, clock=c)
    b.failure()
    c.t += 0.5
    assert b.allow()  # probe sent, then cancelled: never reports back
    assert not b.allow()
    c.t += 0.5
    assert b.allow()  # another probe is allowed


def test_open_period_is_capped() -> None:
    c = ManualClock(100.0)
    b = Breaker(failures=1, open_s=1.0, max_open_s=3.0, clock=c)
    b.failure()
    for _ in range(5):
        c.t = b.open_until
        assert b.allow()
        b.failure()
    assert b.open_s == 3.0


async def test_a_dead_redis_fails_fast_and_counts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    reg = CollectorRegistry()
    link = RedisLink(
        RedisSettings(url=f"redis://127.0.0.1:{port}/0", timeout_ms=100, breaker_failures=2), reg
    )
    try:
        for _ in range(2):
            with pytest.raises(RedisUnavailable):
                await link.call(lambda c: c.ping())
        assert link.degraded
        assert reg.get_sample_value("ramjet_redis_degraded") == 1
        assert reg.get_sample_value("ramjet_redis_breaker_opens_total") == 1
        t0 = time.perf_counter()
        with pytest.raises(RedisUnavailable):
            await link.call(lambda c: c.ping())
        assert time.perf_counter() - t0 < 0.01  # open: no network at all
        assert reg.get_sample_value("ramjet_redis_errors_total", {"kind": "breaker_open"}) == 1
    finally:
        await link.close()


def test_store_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match=r"store\.url"):
        StoreConfig(kind="redis", url="http://127.0.0.1:6379")
    with pytest.raises(ValueError):
        StoreConfig(kind="redis", timeout_ms=0)
    with pytest.raises(ValueError):
        StoreConfig(kind="cassandra")  # type: ignore[arg-type]
    assert StoreConfig().kind == "memory"


async def test_a_cancel_that_lands_with_the_reply_is_not_lost() -> None:
    """A call cancelled in the turn its reply arrives ends cancelled (3.11's wait_for
    returned the reply and lost the cancel, so a report pull looped on after its stop)."""
    reg = CollectorRegistry()
    link = RedisLink(RedisSettings(url="redis://127.0.0.1:1/0", timeout_ms=5000), reg)
    reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def answer(_client: object) -> bytes:
        return await reply

    try:
        call = asyncio.create_task(link.call(answer))
        await asyncio.sleep(0)  # parked on the reply
        reply.set_result(b"PONG")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert not link.degraded  # a cancel is no Redis failure
    finally:
        await link.close()
