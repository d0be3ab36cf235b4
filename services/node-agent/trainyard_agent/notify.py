"""Wake-ups between tasks of the agent's event loop without lost notifications."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from trainyard_core.waits import completes_within


class Notifier:
    """`notify()` wakes every task currently in `wait()`.

    To never miss a change, read `version`, and if it did not move call `wait()` with no `await` in
    between: `wait` registers its waiter before it first yields, so a notify that follows is seen.
    Loop-agnostic until used (futures are created inside `wait`).
    """

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()
        self.version = 0

    def notify(self) -> None:
        self.version += 1
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def wait(self, timeout: float | None = None) -> bool:
        """True when notified, False after `timeout` seconds."""
        return await wait_any((self,), timeout)


async def wait_any(notifiers: Iterable[Notifier], timeout: float | None = None) -> bool:
    """`Notifier.wait` on several at once: True when any of them is notified, False after `timeout`."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    chosen = list(notifiers)
    for n in chosen:
        n._waiters.add(fut)
    try:
        return await completes_within(fut, timeout)
    finally:
        for n in chosen:
            n._waiters.discard(fut)
