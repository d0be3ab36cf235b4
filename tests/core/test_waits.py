"""`completes_within`: True when what it waits for completes, False at the timeout, and a cancellation of the
waiting task always reaches it, also one that lands in the turn in which the wait completes (which
`asyncio.wait_for` drops on Python 3.11)."""

from __future__ import annotations

import asyncio

import pytest

from trainyard_core.waits import completes_within


async def test_true_when_it_completes_and_false_at_the_timeout() -> None:
    event = asyncio.Event()
    assert await completes_within(event.wait(), 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await completes_within(event.wait(), 5) is True
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    assert await completes_within(fut, None) is True


@pytest.mark.parametrize("kind", ["event", "future"])
async def test_a_cancel_in_the_turn_the_wait_completes_reaches_the_task(kind: str) -> None:
    event = asyncio.Event()
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(completes_within(event.wait() if kind == "event" else fut, 5))
    await asyncio.sleep(0)  # the task waits
    if kind == "event":
        event.set()
    else:
        fut.set_result(None)
    task.cancel()  # the same turn: asyncio.wait_for returned True here, and the task went on
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_notifiers_wait_keeps_a_cancel_that_lands_as_it_is_notified() -> None:
    from trainyard_agent.notify import Notifier, wait_any

    notifier = Notifier()
    task = asyncio.create_task(wait_any((notifier,), 5))
    await asyncio.sleep(0)
    notifier.notify()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
