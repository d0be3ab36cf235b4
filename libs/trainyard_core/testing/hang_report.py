"""For the test suite: when a test's teardown is still running after a while, print the stack of every asyncio
task of the running loops, once. A fixture's teardown that waits forever shows, in CI, only the thread stacks
(the event loop idle in select), not which stop is waiting for what; this says it while the run goes on."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from typing import TextIO


def dump_tasks(out: TextIO | None = None, *, why: str = "") -> int:
    """Ask each running event loop (from this or another thread) to print its tasks' stacks; returns how many
    loops were asked."""
    out = out or sys.stderr
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    for loop in loops:
        def report(loop: asyncio.AbstractEventLoop = loop) -> None:
            tasks = asyncio.all_tasks(loop)
            print(f"\n==== {why}: {len(tasks)} asyncio tasks ====", file=out)
            for task in tasks:
                print(f"-- {task.get_name()}", file=out)
                try:
                    task.print_stack(limit=15, file=out)
                except Exception as exc:  # grpc.aio's Cython coroutines have frames print_stack cannot read
                    print(f"   {task.get_coro()!r} (no stack: {type(exc).__name__})", file=out)
            out.flush()
        loop.call_soon_threadsafe(report)
    return len(loops)


class Watchdog:
    """`start` arms a timer; `cancel` disarms it; if it fires, the running loops' tasks are printed."""

    def __init__(self, after_s: float, why: str) -> None:
        self._timer = threading.Timer(after_s, lambda: dump_tasks(why=why))
        self._timer.daemon = True

    def start(self) -> Watchdog:
        self._timer.start()
        return self

    def cancel(self) -> None:
        self._timer.cancel()
