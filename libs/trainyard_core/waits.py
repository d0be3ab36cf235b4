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
