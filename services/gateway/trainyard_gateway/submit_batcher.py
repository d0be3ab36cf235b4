"""The gateway's submits to the scheduler, sent together while earlier ones are in flight (group commit).

Why: a grpc.aio server takes new calls one at a time, several event-loop turns each (bench/grpc_accept.py). On
a scheduler leader whose loop is busy, 100 concurrent `POST /v1/jobs` became 100 SubmitJob calls queued in
that accept, and most of a submit's time was spent there (docs/architecture.md, "A burst of calls of one
method"). So at most `max_calls` calls are in flight; a submit that arrives while they all are waits for the
first to answer and goes with every other submit that waited, up to `max_items`, in one SubmitJobs call. At a
low rate nothing waits (each submit is its own call, at once); under a burst the calls grow instead of
queueing in the scheduler's accept.

Each item is answered on its own (the scheduler serves it as a SubmitJob: submit_batch.py). A failure of the
whole call (the scheduler unreachable, a deadline) is every item's failure, as it is for a SubmitJob call; a
submit whose request went away before its call was sent is left out of it. A submit's time waiting counts
against its deadline: a call is given what is left of `timeout_s` for the item that has waited longest (at
least MIN_CALL_S), so no submit waits much past `timeout_s` in all, as when each was its own call.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Histogram

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.errors import Unavailable

BATCH_SIZE = Histogram("trainyard_gateway_submit_batch_size", "Submits per SubmitJobs call to the scheduler",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))

# (the request, the call's deadline in seconds) → the answer
Send = Callable[[scheduler_pb2.SubmitJobsRequest, float], Awaitable[scheduler_pb2.SubmitJobsResponse]]
# A call is given at least this long, however long its oldest item waited.
MIN_CALL_S = 0.5


@dataclass(frozen=True, slots=True)
class _Waiting:
    item: scheduler_pb2.SubmitJobsItem
    answer: asyncio.Future[scheduler_pb2.SubmitJobsResult]
    since: float  # the batcher's clock when it arrived


class SubmitBatcher:
    """Sends submits with `send` (one SubmitJobs call), at most `max_calls` calls at once, each of at most
    `max_items` submits, within `timeout_s` of the oldest item's arrival. `send` raises a domain error for a
    failed call; it is every item's."""

    def __init__(self, send: Send, *, max_items: int, max_calls: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or max_calls < 1 or timeout_s <= 0:
            raise ValueError("max_items and max_calls must be at least 1, timeout_s above 0")
        self._send = send
        self._timeout_s = timeout_s
        self._clock = clock
        self._max_items = max_items
        self._max_calls = max_calls
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._calls = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def calls_in_flight(self) -> int:
        return self._calls

    async def submit(self, item: scheduler_pb2.SubmitJobsItem) -> scheduler_pb2.SubmitJobsResult:
        """The item's result (a job, or the error SubmitJob would have failed with); raises what the call that
        carried it failed with."""
        if self._closed:
            raise Unavailable("the gateway is stopping; retry")
        answer: asyncio.Future[scheduler_pb2.SubmitJobsResult] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(item, answer, self._clock()))
        self._pump()
        return await answer

    def _pump(self) -> None:
        while self._calls < self._max_calls and self._waiting:
            batch: list[_Waiting] = []
            while self._waiting and len(batch) < self._max_items:
                waiting = self._waiting.popleft()
                if not waiting.answer.done():  # done: its request was cancelled while it waited
                    batch.append(waiting)
            if not batch:
                return
            self._calls += 1
            # A context of its own: the call is made for every item, not in the trace or request of the first.
            task = asyncio.get_running_loop().create_task(self._call(batch), context=contextvars.Context())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _call(self, batch: list[_Waiting]) -> None:
        BATCH_SIZE.observe(len(batch))
        try:
            waited = self._clock() - min(w.since for w in batch)
            reply = await self._send(scheduler_pb2.SubmitJobsRequest(items=[w.item for w in batch]),
                                     max(MIN_CALL_S, self._timeout_s - waited))
            if len(reply.results) != len(batch):
                raise Unavailable(f"the scheduler answered {len(reply.results)} results for {len(batch)} submits; "
                                  "whether they were stored is unknown: list your jobs before submitting again")
            for waiting, result in zip(batch, reply.results, strict=True):
                if not waiting.answer.done():
                    waiting.answer.set_result(result)
        except Exception as exc:
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(exc)
        except asyncio.CancelledError:
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(Unavailable("the gateway stopped before the scheduler answered; "
                                                             "the job may or may not be stored"))
            raise
        finally:
            self._calls -= 1
            if self._closed:
                self._fail_waiting()
            else:
                self._pump()

    def _fail_waiting(self) -> None:
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.answer.done():
                waiting.answer.set_exception(Unavailable("the gateway is stopping; retry"))

    async def close(self) -> None:
        """Ends the calls in flight (their items fail as unavailable) and refuses new submits."""
        self._closed = True
        self._fail_waiting()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
