"""The suite's hang report (trainyard_core.testing.hang_report): a loop stuck in an await, asked from another
thread, prints each of its tasks with the line it waits at."""

from __future__ import annotations

import asyncio
import io
import threading

from trainyard_core.testing.hang_report import dump_tasks


def test_a_running_loops_tasks_are_printed_with_where_they_wait() -> None:
    loop = asyncio.new_event_loop()
    out = io.StringIO()
    printed = threading.Event()

    async def stuck_stop() -> None:
        await asyncio.Event().wait()  # never set: a stop that never returns

    async def main() -> None:
        task = asyncio.create_task(stuck_stop(), name="gateway stop")
        await asyncio.sleep(0)
        assert dump_tasks(out, why="a test's teardown") >= 1
        await asyncio.sleep(0)  # the report runs on the loop's next turn
        if "gateway stop" in out.getvalue():
            printed.set()
        task.cancel()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()))
    thread.start()
    thread.join(10)
    loop.close()
    text = out.getvalue()
    assert printed.is_set()
    assert "==== a test's teardown:" in text and "-- gateway stop" in text
    assert "stuck_stop" in text and "asyncio.Event().wait()" in text

