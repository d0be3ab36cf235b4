"""SubmitBatcher's grouping, on its own (a `send` that the test answers by hand): at most `max_calls` calls in
flight, what waits goes together up to `max_items`, a request that left before its call is not sent, a failed
call is every item's failure, and a stopped batcher answers everything it holds."""

from __future__ import annotations

import asyncio

import pytest

from trainyard.scheduler.v1 import scheduler_pb2 as sc
from trainyard_core.errors import Unavailable
from trainyard_gateway.submit_batcher import MIN_CALL_S, SubmitBatcher


class Scheduler:
    """The `send` of the batcher: each call waits until the test answers it."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], asyncio.Future[sc.SubmitJobsResponse]]] = []
        self.timeouts: list[float] = []
        self.arrived = asyncio.Event()

    async def send(self, request: sc.SubmitJobsRequest, timeout: float) -> sc.SubmitJobsResponse:
        answer: asyncio.Future[sc.SubmitJobsResponse] = asyncio.get_running_loop().create_future()
        self.calls.append(([item.request_id for item in request.items], answer))
        self.timeouts.append(timeout)
        self.arrived.set()
        return await answer

    def answer(self, n: int, results: int | None = None) -> None:
        names, future = self.calls[n]
        count = len(names) if results is None else results
        future.set_result(sc.SubmitJobsResponse(results=[
            sc.SubmitJobsResult(submitted=sc.SubmitJobResponse(job={"id": f"job-{names[i]}"}))
            for i in range(count)]))


def _item(name: str) -> sc.SubmitJobsItem:
    return sc.SubmitJobsItem(request_id=name)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_what_arrives_while_calls_are_in_flight_goes_together() -> None:
    scheduler = Scheduler()
    batcher = SubmitBatcher(scheduler.send, max_items=3, max_calls=2, timeout_s=10)
    first = [asyncio.create_task(batcher.submit(_item(f"a{i}"))) for i in range(2)]
    await _settle()
    # Nothing was in flight: each went at once, on its own.
    assert [names for names, _ in scheduler.calls] == [["a0"], ["a1"]]
    later = [asyncio.create_task(batcher.submit(_item(f"b{i}"))) for i in range(5)]
    await _settle()
    assert len(scheduler.calls) == 2 and batcher.calls_in_flight == 2
    scheduler.answer(0)
    await _settle()
    # The first answer lets the waiting ones go, three at most in one call.
    assert scheduler.calls[2][0] == ["b0", "b1", "b2"]
    assert (await first[0]).submitted.job.id == "job-a0"
    scheduler.answer(1)
    await _settle()
    assert scheduler.calls[3][0] == ["b3", "b4"]
    scheduler.answer(2)
    scheduler.answer(3)
    assert [(await t).submitted.job.id for t in later] == [f"job-b{i}" for i in range(5)]
    assert batcher.calls_in_flight == 0


async def test_a_request_gone_before_its_call_is_not_sent() -> None:
    scheduler = Scheduler()
    batcher = SubmitBatcher(scheduler.send, max_items=10, max_calls=1, timeout_s=10)
    busy = asyncio.create_task(batcher.submit(_item("busy")))
    await _settle()
    stays, leaves = (asyncio.create_task(batcher.submit(_item(n))) for n in ("stays", "leaves"))
    await _settle()
    leaves.cancel()
    scheduler.answer(0)
    await _settle()
    assert scheduler.calls[1][0] == ["stays"]
    scheduler.answer(1)
    assert (await stays).submitted.job.id == "job-stays" and (await busy).submitted.job.id == "job-busy"


async def test_a_failed_call_is_the_failure_of_each_of_its_items() -> None:
    scheduler = Scheduler()
    batcher = SubmitBatcher(scheduler.send, max_items=10, max_calls=1, timeout_s=10)
    busy = asyncio.create_task(batcher.submit(_item("busy")))
    await _settle()
    waiting = [asyncio.create_task(batcher.submit(_item(f"w{i}"))) for i in range(3)]
    await _settle()
    scheduler.calls[0][1].set_exception(Unavailable("scheduler is unavailable: gone"))
    with pytest.raises(Unavailable, match="gone"):
        await busy
    await _settle()
    # Not the waiting ones: they go in the next call, which answers too few results.
    assert scheduler.calls[1][0] == ["w0", "w1", "w2"]
    scheduler.answer(1, results=2)
    for task in waiting:
        with pytest.raises(Unavailable, match="answered 2 results for 3 submits"):
            await task


async def test_a_closed_batcher_answers_what_it_holds_and_takes_nothing_new() -> None:
    scheduler = Scheduler()
    batcher = SubmitBatcher(scheduler.send, max_items=10, max_calls=1, timeout_s=10)
    sent = asyncio.create_task(batcher.submit(_item("sent")))
    await _settle()
    queued = asyncio.create_task(batcher.submit(_item("queued")))
    await _settle()
    await batcher.close()
    with pytest.raises(Unavailable, match="may or may not be stored"):
        await sent
    with pytest.raises(Unavailable, match="stopping"):
        await queued
    with pytest.raises(Unavailable, match="stopping"):
        await batcher.submit(_item("late"))
    assert len(scheduler.calls) == 1


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        SubmitBatcher(Scheduler().send, max_items=0, max_calls=1, timeout_s=10)
    with pytest.raises(ValueError):
        SubmitBatcher(Scheduler().send, max_items=1, max_calls=1, timeout_s=0)


async def _waited(timeout_s: float, wait_s: float) -> list[float]:
    """The deadlines of two calls: one sent at once, one carrying a submit that waited `wait_s` (on an injected
    clock) for the first to answer."""
    now = [100.0]
    scheduler = Scheduler()
    batcher = SubmitBatcher(scheduler.send, max_items=10, max_calls=1, timeout_s=timeout_s, clock=lambda: now[0])
    first = asyncio.create_task(batcher.submit(_item("first")))
    await _settle()
    waiting = asyncio.create_task(batcher.submit(_item("waiting")))
    await _settle()
    now[0] += wait_s
    scheduler.answer(0)
    await _settle()
    scheduler.answer(1)
    await asyncio.gather(first, waiting)
    return scheduler.timeouts


async def test_a_submits_wait_counts_against_its_deadline() -> None:
    """The call that carries a submit that waited gets what is left of the submit's deadline, not a whole one: no
    submit waits much past `timeout_s` in all, as when each was its own call."""
    assert await _waited(2.0, 0.2) == [2.0, pytest.approx(1.8)]
    # However long it waited, a call is given MIN_CALL_S.
    assert await _waited(0.6, 0.2) == [0.6, MIN_CALL_S]
