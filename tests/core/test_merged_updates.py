"""Changes to one record by many callers at once (trainyard_core.store.merged_updates): merged into few writes,
each caller answered by the write that carried its change."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from trainyard_core.errors import Unavailable
from trainyard_core.store.merged_updates import MergedUpdates


class Flushes:
    """A flush that records what each write carried; a write can be held open (`gate`) and can fail."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, list[int]]] = []
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    async def __call__(self, key: str, items: list[int]) -> str:
        self.writes.append((key, list(items)))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        return f"{key}:{sum(items)}"


def _held() -> tuple[Flushes, MergedUpdates[str, int, str]]:
    """Merged updates over a flush whose writes stay open until `flush.gate` is set."""
    flush = Flushes()
    flush.gate = asyncio.Event()
    return flush, MergedUpdates(flush)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_idle_key_is_written_at_once_and_changes_that_wait_go_in_one_next_write() -> None:
    flush, merged = _held()
    first = asyncio.create_task(merged.submit("a", 1))
    await _settle()
    assert flush.writes == [("a", [1])]  # alone, at once
    rest = [asyncio.create_task(merged.submit("a", i)) for i in (2, 3, 4)]
    other = asyncio.create_task(merged.submit("b", 10))  # another key does not wait for "a"
    await _settle()
    assert flush.writes == [("a", [1]), ("b", [10])]
    flush.gate.set()
    assert await first == "a:1"
    assert await asyncio.gather(*rest) == ["a:9"] * 3  # the three that waited: one write, its answer theirs
    assert await other == "b:10"
    assert flush.writes == [("a", [1]), ("b", [10]), ("a", [2, 3, 4])]
    assert merged.busy == 0


async def test_a_failed_write_fails_its_callers_only() -> None:
    flush, merged = _held()
    flush.fail = Unavailable("etcd did not answer")
    first = [asyncio.create_task(merged.submit("a", i)) for i in (1, 2)]
    await _settle()
    later = asyncio.create_task(merged.submit("a", 3))
    await _settle()
    flush.gate.set()
    for task in first:  # one write carried 1 and 2 (they came together): both hear its failure
        with pytest.raises(Unavailable):
            await task
    assert await later == "a:3"  # the next write, on its own
    assert flush.writes == [("a", [1, 2]), ("a", [3])]
    assert merged.busy == 0


async def test_a_caller_that_stops_waiting_still_has_its_change_written() -> None:
    flush, merged = _held()
    running = asyncio.create_task(merged.submit("a", 1))
    await _settle()
    gone = asyncio.create_task(merged.submit("a", 2))
    stays = asyncio.create_task(merged.submit("a", 3))
    await _settle()
    gone.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    flush.gate.set()
    assert await running == "a:1"
    assert await stays == "a:5"
    assert flush.writes == [("a", [1]), ("a", [2, 3])]


async def test_callers_waiting_on_a_cancelled_writer_are_cancelled_not_left_waiting() -> None:
    _, merged = _held()
    carried = asyncio.create_task(merged.submit("a", 1))
    await _settle()
    queued = asyncio.create_task(merged.submit("a", 2))
    await _settle()
    for writer in list(merged._writers):
        writer.cancel()
    for task in (carried, queued):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert merged.busy == 0
