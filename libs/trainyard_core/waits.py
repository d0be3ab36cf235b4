"""Waiting with a timeout without losing a cancellation.

On Python 3.11, `asyncio.wait_for` returns the result of an await that completed in the same turn of the event
loop as a cancellation of the waiting task, and drops the cancellation. A task stopped that way runs on: the
gateway's job feed kept reading its stream, and the gateway's stop waited for it for ever (the CI hang of
stop 41). `asyncio.timeout` has no such gap. Where the waiting task may be cancelled, wait with this (or
`asyncio.timeout`), not `wait_for`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def completes_within(aw: Awaitable[Any], timeout: float | None) -> bool:
    """True once `aw` (an Event's `wait()`, a future) completes, False after `timeout` seconds (None: no limit;
    a timeout of 0 or less: at once). A cancellation of the waiting task always reaches it."""
    try:
        async with asyncio.timeout(timeout):
            await aw
        return True
    except TimeoutError:
        return False


async def ended(task: asyncio.Future[Any]) -> None:
    """Wait until `task` has ended. Its own cancellation is what a stop expects and is not raised; a cancellation
    of the waiting task that arrives meanwhile is (`contextlib.suppress(CancelledError)` around the await
    swallowed both, so a stop cancelled by its caller's timeout went on as if nothing had been asked). An
    exception the task ended with is raised, as by awaiting it."""
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait until it has ended (`ended`)."""
    task.cancel()
    await ended(task)
