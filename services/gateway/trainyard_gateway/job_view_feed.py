"""The stream that feeds the read view (job_view.py): the scheduler's JobWatchService.WatchJobs, held open.

One stream on the gateway's channel to the scheduler replicas (any replica serves it, from its mirror), read
in a task of its own, each message applied to the view in order. When the stream ends or fails — the replica
stopped, the network broke, or nothing came for `silence_s` (the scheduler sends progress every few seconds,
so silence means a dead peer that TCP has not noticed) — the view is told (`lost`: it answers nothing until a
new snapshot has caught up) and the stream is opened again, after a backoff that doubles from 0.1 s to 2 s
(30 s when the scheduler does not serve the stream at all: an older version, whose reads keep going to it).
A break is logged once, and the recovery once, not every retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import grpc.aio

from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.waits import cancel_and_wait

from .job_view import JobView

log = logging.getLogger(__name__)

SILENCE_S = 15.0
BACKOFF_S = (0.1, 2.0)
UNSERVED_BACKOFF_S = 30.0


class JobFeed:
    def __init__(self, view: JobView, channel: Callable[[], grpc.aio.Channel], *, silence_s: float = SILENCE_S) -> None:
        self._view = view
        self._channel = channel
        self._silence_s = silence_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Streams opened so far (a test waits for a reconnect by it).
        self.streams = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job view feed")

    async def stop(self) -> None:
        # The flag too, not only the cancel: grpc.aio may turn the cancel of a task reading a stream into the
        # call's CANCELLED status, which the loop would take for a broken stream and retry.
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        self._view.lost()

    async def _run(self) -> None:
        backoff = BACKOFF_S[0]
        logged = False
        while not self._stopping:
            try:
                why, recovered, wait = await self._follow()
            except Exception as exc:  # a bug in applying a message: log it, and start again from a snapshot
                log.exception("job view: a message of the stream could not be applied")
                why, recovered, wait = f"{type(exc).__name__}: {exc}", False, None
            self._view.lost()
            if self._stopping:
                return
            if recovered:  # a new outage, not the next retry of one
                backoff, logged = BACKOFF_S[0], False
            if not logged:
                log.warning("job view: the stream from the scheduler ended (%s); reads go to the scheduler until "
                            "it is back", why, extra={"revision": self._view.revision})
                logged = True
            if wait is None:
                wait, backoff = backoff, min(backoff * 2, BACKOFF_S[1])
            await asyncio.sleep(wait)

    async def _follow(self) -> tuple[str, bool, float | None]:
        """Read one stream until it ends: why it ended, whether it made the view ready, and how long to wait
        before the next (None: the backoff)."""
        stub = scheduler_pb2_grpc.JobWatchServiceStub(self._channel())
        call = stub.WatchJobs(scheduler_pb2.WatchJobsRequest())
        self.streams += 1
        messages = call.__aiter__()
        recovered = False
        try:
            # The flag, and asyncio.timeout rather than asyncio.wait_for: on Python 3.11 a cancel (stop's) that
            # lands while a message is arriving is swallowed by wait_for, which returns the message, and the
            # scheduler's progress messages then kept this loop, and the gateway's stop, going for ever.
            while not self._stopping:
                async with asyncio.timeout(self._silence_s):
                    message = await messages.__anext__()
                self._view.apply(message)
                if self._view.ready and not recovered:
                    recovered = True
                    log.info("job view ready", extra={"revision": self._view.revision,
                                                       "jobs": len(self._view.jobs()), "stream": self.streams})
            return "the gateway is stopping", recovered, None
        except StopAsyncIteration:
            return "the scheduler closed it", recovered, None
        except TimeoutError:
            return f"nothing for {self._silence_s:g}s", recovered, None
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                return f"{exc.code().name}: {exc.details()}: an older scheduler", recovered, UNSERVED_BACKOFF_S
            return f"{exc.code().name}: {exc.details()}", recovered, None
        finally:
            call.cancel()
