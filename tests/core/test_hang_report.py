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


def test_every_task_is_listed_when_one_has_no_readable_stack() -> None:
    """grpc.aio runs Cython coroutines (a server's accept loop) whose frames print_stack cannot read: the
    report names such a task and goes on to the rest, rather than ending at the first one."""
    import grpc.aio

    out = io.StringIO()

    async def stuck_stop() -> None:
        await asyncio.Event().wait()

    async def main() -> str:
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        task = asyncio.create_task(stuck_stop(), name="gateway stop")
        try:
            await asyncio.sleep(0)
            names = {t.get_name() for t in asyncio.all_tasks()}
            assert dump_tasks(out, why="a test's teardown") >= 1
            for _ in range(3):
                await asyncio.sleep(0)  # the report runs on the loop's next turn
            return "\n".join(sorted(names))
        finally:
            task.cancel()
            await server.stop(None)

    names = asyncio.run(main())
    text = out.getvalue()
    assert "no stack: " in text  # the server's Cython task was there, and its stack unreadable
    for name in names.splitlines():
        assert f"-- {name}" in text, f"task {name!r} not reported:\n{text}"
    assert "asyncio.Event().wait()" in text  # the plain task after it still has its stack
