"""`Slots`, the admission's forwarding slots: a free slot is taken without waiting,
waiters are served in arrival order, and a waiter that gives up (cancelled, timed out)
holds nothing, even when a slot was handed to it in the same moment."""

from __future__ import annotations

import asyncio

import pytest

from ramjet.request.admission import Slots


async def _waiter(slots: Slots, name: str, got: list[str]) -> None:
    await slots.wait()
    got.append(name)


async def test_take_until_none_is_free_then_release_gives_one_back() -> None:
    s = Slots(2)
    assert s.take() and s.take() and not s.take()
    assert s.free == 0
    s.release()
    assert s.free == 1 and s.take()


async def test_waiters_are_served_in_arrival_order_and_take_does_not_jump_them() -> None:
    s = Slots(1)
    assert s.take()
    got: list[str] = []
    tasks = [asyncio.create_task(_waiter(s, n, got)) for n in "abc"]
    await asyncio.sleep(0)
    assert s.waiting == 3
    s.release()  # to a, not to a newcomer
    assert not s.take()
    await asyncio.sleep(0)
    assert got == ["a"]
    s.release()
    s.release()
    await asyncio.gather(*tasks)
    assert got == ["a", "b", "c"] and s.free == 0 and s.waiting == 0
    s.release()
    assert s.free == 1


@pytest.mark.parametrize("handed", [False, True])
async def test_a_cancelled_waiter_holds_nothing_and_the_next_one_is_served(handed: bool) -> None:
    """Cancelled while waiting, a waiter leaves the queue; cancelled in the moment a slot
    was handed to it (`handed`: before it could run), the slot goes on to the next."""
    s = Slots(1)
    assert s.take()
    got: list[str] = []
    a = asyncio.create_task(_waiter(s, "a", got))
    b = asyncio.create_task(_waiter(s, "b", got))
    await asyncio.sleep(0)
    if handed:
        s.release()  # to a ...
        a.cancel()  # ... which is cancelled before it runs
    else:
        a.cancel()
        await asyncio.sleep(0)
        assert s.waiting == 1  # a left the queue
        s.release()
    await b
    assert a.cancelled() and got == ["b"] and s.free == 0
    s.release()
    assert s.free == 1 and s.waiting == 0


async def test_a_timed_out_waiter_holds_nothing() -> None:
    s = Slots(1)
    assert s.take()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await s.wait()
    assert s.waiting == 0 and s.free == 0
    s.release()
    assert s.free == 1 and s.take()
    s.release()
