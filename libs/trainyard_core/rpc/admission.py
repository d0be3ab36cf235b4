"""Admission for a storm of one kind of call: a bounded number run at once, and the rest are told when to come back.

When a new scheduler leader takes over, every agent of the fleet registers with it at once. Handled all at
once, thousands of registrations fill the event loop's ready queue: every step of every other task (the
leader's own lease keepalive, liveness pulses, the reconcile loop) waits behind them, so the leader can lose
its lease to its own storm, and the agents whose calls waited past their deadline retry while the server still
works on the abandoned calls (work done for nobody: congestion collapse). Measured with 5,000 simulated
agents on a 2-core machine (bench/fleet): re-registration fell to ~100 per second and the new leader lost its
lease six times in a minute.

So a gated method runs at most `limit` calls at once; a caller beyond them waits for a slot while its wait is
expected to be short (`max_wait_s`, estimated from the rate at which recent calls completed), and is refused
at once otherwise: UNAVAILABLE (`errors.Busy`) with an appointment (`retry_after_s`, in the RETRY_AFTER
trailing metadata: refused callers are told successive times, one call's time apart), which the agent keeps
before trying again. The storm is thus spread over the time the server needs for it instead of being retried
into collapse. It
is the gRPC servers' counterpart of an HTTP 503 with Retry-After. A refused call did nothing, so it is not
audited (the interceptor sits outside the audit one, as a server's concurrency limit would).

Every call of a gated method is told to `on_call` before it is admitted or refused: that a caller came at all
is news to a server that cannot serve it yet (a new scheduler leader's grace lasts while agents keep coming,
served or not).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Counter

from .. import errors

# A new leader has completed no call yet: until it has a rate, this many callers per slot may wait.
UNMEASURED_WAITERS_PER_SLOT = 4
# The rate is measured over the most recent completions (at least RATE_MIN_SPAN_S of them).
RATE_WINDOW = 256
RATE_MIN_SPAN_S = 0.2
RETRY_AFTER_MIN_S = 0.5
RETRY_AFTER_MAX_S = 30.0

REFUSED = Counter("trainyard_rpc_admission_refused_total",
                  "Calls refused at once because the server was busy with calls of the same method "
                  "(answered UNAVAILABLE with a retry-after)", ["grpc_method"])

Behavior = Callable[..., Any]


class Admission:
    """The gate of one method (see the module docstring). Times are `clock`'s (monotonic seconds)."""

    def __init__(self, *, limit: int, max_wait_s: float, clock: Callable[[], float] = time.monotonic,
                 on_call: Callable[[], None] | None = None) -> None:
        if limit < 1:
            raise ValueError("an admission limit must be at least 1")
        self._limit = limit
        self._max_wait = max_wait_s
        self._clock = clock
        self._on_call = on_call
        self._slots = asyncio.Semaphore(limit)
        self.running = 0
        self.waiting = 0
        self._done: collections.deque[float] = collections.deque(maxlen=RATE_WINDOW)
        # When the next refused caller is told to come back (see `refusal`).
        self._next_appointment = -math.inf

    def rate(self) -> float | None:
        """Calls completed per second, recently (None: too few to say)."""
        if len(self._done) < 2:
            return None
        span = self._done[-1] - self._done[0]
        if span < RATE_MIN_SPAN_S or self._clock() - self._done[-1] > self._max_wait + RATE_MIN_SPAN_S:
            return None  # too short to measure, or old: the last burst is over
        return (len(self._done) - 1) / span

    def refusal(self) -> float | None:
        """Seconds a new caller should come back after, if it is refused now; None when it may wait.

        Refused callers are given appointments: the first after the calls ahead have cleared, each later one
        a call's time (1 / rate) after the one before. Told the same wait, a thousand refused agents would come
        back together and be refused again; told successive appointments, they come back at the rate the
        server completes calls. No appointment is further than RETRY_AFTER_MAX_S: callers beyond it are told
        that, and the next appointments follow it rather than the ones beyond it that were never given."""
        if self.running < self._limit:
            return None
        ahead = self.running + self.waiting
        rate = self.rate()
        if rate is None:
            if self.waiting < UNMEASURED_WAITERS_PER_SLOT * self._limit:
                return None
            rate = float(self._limit)  # a guess until a rate is measured: each slot clears a call per second
        wait = ahead / rate
        if wait <= self._max_wait:
            return None
        now = self._clock()
        appointment = min(max(self._next_appointment, now + wait), now + RETRY_AFTER_MAX_S)
        self._next_appointment = appointment + 1 / rate
        return max(RETRY_AFTER_MIN_S, appointment - now)

    async def run(self, behavior: Behavior, request: Any, context: grpc.aio.ServicerContext, method: str) -> Any:
        if self._on_call is not None:
            self._on_call()
        retry_after = self.refusal()
        if retry_after is not None:
            REFUSED.labels(method).inc()
            raise errors.Busy(f"this server is busy with {self.running + self.waiting} calls of {method}; "
                              f"retry in {retry_after:.1f}s", retry_after_s=retry_after)
        self.waiting += 1
        try:
            await self._slots.acquire()  # a caller that gives up meanwhile is cancelled here, holding nothing
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await behavior(request, context)
        finally:
            self.running -= 1
            self._slots.release()
            self._done.append(self._clock())


class AdmissionInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Puts each of `methods` (full gRPC method names, unary) behind its own `Admission`; `on_call` is told of
    every call of them, with its method, before it is admitted or refused."""

    def __init__(self, methods: Collection[str], *, limit: int, max_wait_s: float,
                 on_call: Callable[[str], None] | None = None) -> None:
        self.gates = {m: Admission(limit=limit, max_wait_s=max_wait_s,
                                   on_call=None if on_call is None else functools.partial(on_call, m))
                      for m in methods}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        gate = self.gates.get(method)
        if handler is None or gate is None or not handler.unary_unary:
            return handler
        behavior = handler.unary_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await gate.run(behavior, request, context, method)

        return grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer, handler.response_serializer)
