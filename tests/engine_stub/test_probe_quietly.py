"""`engine_stub.profiler.probe_quietly`: a profile probed while something else was busy
on the engine's cores reads every figure slow (make run's two engines used to probe at
once on a two-core machine, and their profiles came out about 2x high). Engines on one
host take turns through a lock file, and a probe that did not get its CPU is taken
again; the run that got the most CPU is kept and its share recorded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from engine_stub.profiler import MIN_CPU_SHARE, ProfileResult, cpu_share, probe_quietly
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE


def _result(tag: str) -> ProfileResult:
    return ProfileResult(V41_FLASH_TP4_ESTIMATE, {"tag": tag})


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    n = 0
    while time.process_time() < end:
        n += 1  # compute: the process uses its CPU


def test_cpu_share() -> None:
    assert cpu_share(0.5, 1.0, 1) == 0.5
    assert cpu_share(1.0, 1.0, 1) == 1.0
    assert cpu_share(0.0, 0.0, 1) == 1.0  # nothing measured: nothing suspect


def test_a_probe_that_got_no_cpu_is_taken_again_and_flagged() -> None:
    calls: list[int] = []

    def starved() -> ProfileResult:
        calls.append(1)
        time.sleep(0.05)  # wall time passes, the process gets no CPU: as if contended
        return _result(f"try{len(calls)}")

    out = probe_quietly(starved, threads=1, lock_path=None, tries=3, pause_s=0.0)
    assert len(calls) == 3
    assert out.extra["contended"] is True and out.extra["probe_tries"] == 3
    assert out.extra["cpu_share"] < MIN_CPU_SHARE


def test_the_try_that_got_the_most_cpu_is_kept() -> None:
    calls: list[int] = []

    def second_is_busy() -> ProfileResult:
        calls.append(1)
        if len(calls) == 2:
            _burn(0.1)
        else:
            time.sleep(0.1)
        return _result(f"try{len(calls)}")

    out = probe_quietly(second_is_busy, threads=1, lock_path=None, tries=3, pause_s=0.0)
    assert out.extra["tag"] == "try2"  # the one that computed, not the ones that slept


def test_engines_on_one_host_probe_one_at_a_time(tmp_path: Path) -> None:
    lock = str(tmp_path / "probe.lock")
    inside: list[int] = []
    overlap: list[bool] = []

    def probe() -> ProfileResult:
        inside.append(1)
        overlap.append(len(inside) > 1)
        time.sleep(0.1)
        inside.pop()
        return _result("x")

    outs: list[ProfileResult] = []
    threads = [
        threading.Thread(
            target=lambda: outs.append(probe_quietly(probe, threads=1, lock_path=lock, tries=1))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(outs) == 3 and not any(overlap)
    assert max(o.extra["lock_wait_s"] for o in outs) >= 0.15  # the last waited for two


async def test_sidecars_take_the_same_lock_without_blocking_their_loop(tmp_path: Path) -> None:
    """The sidecar's probe (`ramjet.sidecar.runner`) holds the same host lock, awaited:
    the event loop goes on while another engine probes."""
    import asyncio

    from ramjet.runtime.probe_lock import async_host_lock, host_lock

    lock = str(tmp_path / "probe.lock")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def probe() -> float:
        async with async_host_lock(lock, timeout_s=5) as waited_s:
            return waited_s

    t = asyncio.ensure_future(ticker())
    with host_lock(lock):  # another engine is probing
        waiter = asyncio.ensure_future(probe())
        await asyncio.sleep(0.2)
        assert not waiter.done() and ticks >= 5
    assert await asyncio.wait_for(waiter, 2) >= 0.2
    t.cancel()
