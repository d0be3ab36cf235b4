"""Poll for a condition with a deadline instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T | None]], *, timeout: float = 10.0,
                     interval: float = 0.05, what: str = "condition") -> T:
    """Call `probe` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        await asyncio.sleep(interval)


async def truthy(value: T) -> T:
    """`value` as an awaitable, for a probe that reads state synchronously:
    `await eventually(lambda: truthy(app.leadership.is_leader), what="the app to lead")`."""
    return value


def until(condition: Callable[[], T | None], timeout: float, what: str | Callable[[], str],
          interval: float = 0.05) -> T:
    """The synchronous twin of `eventually`, for code driving real processes from outside (e2e tests,
    benchmarks): poll `condition` until it returns something truthy (returned) or `timeout` seconds pass
    (AssertionError naming `what`, which may be a callable giving the latest state)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout}s: {what() if callable(what) else what}; "
                                 f"last value: {got!r}")
        time.sleep(interval)
