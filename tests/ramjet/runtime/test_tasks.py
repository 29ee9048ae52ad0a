"""`cancel_and_wait`: every task ends even when a cancellation is lost, and the waiter's
own cancellation is never swallowed (real tasks on the test's event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import pytest

from ramjet.runtime.tasks import cancel_and_wait

pytestmark = pytest.mark.timeout(20)


async def stopped(tasks: list[asyncio.Task[None]], **kw: float) -> asyncio.Task[None]:
    """`cancel_and_wait` in a task of its own, given 5 s to end (a hang fails the test
    instead of hanging it)."""
    stopper = asyncio.create_task(cancel_and_wait(tasks, **kw))
    await asyncio.wait((stopper,), timeout=5)
    assert stopper.done(), "cancel_and_wait did not return"
    return stopper


async def _loop_on_wait_for(arrivals: asyncio.Queue[asyncio.Future[int]]) -> None:
    """A background loop in the shape of a report pull: each turn waits for one reply
    under `asyncio.wait_for` (the futures come from the test)."""
    while True:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        arrivals.put_nowait(fut)
        await asyncio.wait_for(fut, 60)


async def test_a_cancel_lost_in_wait_for_is_repeated_until_the_task_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    arrivals: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
    task = asyncio.create_task(_loop_on_wait_for(arrivals), name="pull-loop")
    reply = await arrivals.get()
    await asyncio.sleep(0)  # the task is parked in wait_for
    reply.set_result(1)  # the reply arrives in the very turn the stop cancels
    caplog.set_level(logging.WARNING, "ramjet.runtime.tasks")
    (await stopped([task], recancel_s=0.05)).result()
    assert task.cancelled()
    if sys.version_info < (3, 12):  # where wait_for loses that cancel, it was repeated
        assert "pull-loop ran on after its cancellation" in caplog.text


async def deaf_until(release: asyncio.Event) -> None:
    """Runs until `release` is set, whatever cancels it meanwhile; then ends cancelled."""
    while not release.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await release.wait()
    raise asyncio.CancelledError


async def test_a_task_that_ignores_cancels_for_a_while_still_ends() -> None:
    ignored = 0

    async def stubborn() -> None:
        nonlocal ignored
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                ignored += 1
                if ignored == 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    try:
        (await stopped([task], recancel_s=0.01)).result()
        assert task.cancelled() and ignored == 3
    finally:
        while not task.done():  # a failed run leaves no task behind
            task.cancel()
            await asyncio.sleep(0)


@pytest.mark.parametrize("timeout_s", [None, 5.0])
async def test_the_waiters_own_cancellation_propagates(timeout_s: float | None) -> None:
    release = asyncio.Event()
    task = asyncio.create_task(deaf_until(release))
    await asyncio.sleep(0)
    try:
        stopper = asyncio.create_task(cancel_and_wait([task], timeout_s, recancel_s=0.01))
        await asyncio.sleep(0.05)
        assert not stopper.done()
        stopper.cancel()
        await asyncio.wait((stopper,), timeout=5)
        # before, `suppress(CancelledError)` swallowed this cancel and waited on
        assert stopper.cancelled()
    finally:
        release.set()
    await asyncio.wait((task,), timeout=5)
    assert task.cancelled()


async def test_timeout_gives_up_and_leaves_the_task_cancelled() -> None:
    release = asyncio.Event()
    task = asyncio.create_task(deaf_until(release))
    await asyncio.sleep(0)
    try:
        t0 = asyncio.get_running_loop().time()
        await cancel_and_wait([task], timeout_s=0.2, recancel_s=0.05)
        assert 0.15 < asyncio.get_running_loop().time() - t0 < 2
        assert not task.done()
    finally:
        release.set()
    await asyncio.wait((task,), timeout=5)
    assert task.cancelled()


async def test_every_task_is_waited_for_then_the_first_failure_is_raised() -> None:
    async def fails(msg: str) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            raise RuntimeError(msg)

    async def ends_quietly() -> None:
        await asyncio.sleep(60)

    tasks = [asyncio.create_task(fails("first")), asyncio.create_task(ends_quietly()),
             asyncio.create_task(fails("second"))]  # fmt: skip
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="first"):
        await cancel_and_wait(tasks)
    assert all(t.done() for t in tasks) and tasks[1].cancelled()
