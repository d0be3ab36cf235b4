"""`completes_within`: True when what it waits for completes, False at the timeout, and a cancellation of the
waiting task always reaches it, also one that lands in the turn in which the wait completes (which
`asyncio.wait_for` drops on Python 3.11)."""

from __future__ import annotations

import asyncio

import pytest

from trainyard_core.waits import cancel_and_wait, completes_within, ended


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


async def _stubborn(started: asyncio.Event, release: asyncio.Event) -> None:
    """A task that, cancelled, finishes its cleanup (waits for `release`) before it ends."""
    started.set()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await release.wait()
        raise


async def test_cancel_and_wait_ends_the_task_and_its_cancellation_is_not_raised() -> None:
    started, release = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_stubborn(started, release))
    await started.wait()
    asyncio.get_running_loop().call_later(0.01, release.set)
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_cancel_of_the_waiting_task_is_raised_not_swallowed() -> None:
    """The stop pattern `task.cancel(); with suppress(CancelledError): await task` swallowed a cancel of the
    stopping task itself: the stop went on as if its caller had not asked it to end."""
    started, release = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_stubborn(started, release))
    await started.wait()
    stopper = asyncio.create_task(cancel_and_wait(task))
    for _ in range(3):  # a few loop turns: the stopper has cancelled the task and waits for its cleanup
        await asyncio.sleep(0)
    assert not stopper.done() and not task.done()
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_ended_raises_what_the_task_failed_with() -> None:
    async def fails() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(fails())
    with pytest.raises(ValueError, match="broken"):
        await ended(task)
