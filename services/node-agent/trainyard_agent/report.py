"""Talking to the scheduler's NodeService: registration, the heartbeat stream, worker exit reports.

`Reporter` — one session at a time:

    CONNECTING ──RegisterNode ok──▶ STREAMING ──reregister / stream closed or broken / no answer──┐
        ▲   │                                                                                    │
        │   └─INVALID_ARGUMENT (node refused: configuration error)──▶ FATAL                      │
        └───────────────────── wait (exponential backoff, capped, jittered) ◀────────────────────┘

- CONNECTING: a fresh channel; RegisterNode carries the whole node (inventory with current health,
  labels, addresses) and the allocations whose workers still run here, so a restarted or failed-over
  scheduler rebuilds its view without touching running workers.
- STREAMING: the open Heartbeat stream carries the node's changes, and its first answer hands the agent a
  pulse session: from then on a `Pulser` (pulse.py) sends the leader an authenticated UDP datagram every
  PULSE_INTERVAL_S, which is what proves the node alive (docs/architecture.md, "Node liveness"). HTTP/2
  pulses unacknowledged for RECONNECT_AFTER_S tell the agent the leader is gone (it registers again, with
  the next replica); slow HTTP/2 keepalive (`trainyard_core.rpc.liveness`) only clears dead connections. Beats
  carry only changes: one when the stream opens, one at once when a GPU's health or the running allocations
  change, and a refresh every interval (the scheduler's `heartbeat_interval_ms`, else the agent's setting)
  when nothing does. Each has a sequence number, every GPU whose health changed since the registration, and
  the running allocations; GPU metrics are not sent (Prometheus scrapes them from the agent). The scheduler
  answers each; no answer for 3 intervals counts as a broken stream.
- The worker fence's lease is renewed every LEASE_RENEW_S while the stream is open and the leader
  acknowledged a pulse sent within ACK_WINDOW_S; renewals stop when either fails (the leader ended the
  stream, died, stopped answering, or cannot be reached) until a leader takes the node again. A leader that
  offers no pulse session gets no renewals at all (the safe side: such a leader cannot tell this node is
  alive in time).
- `stop()` ends the stream cleanly (the scheduler then counts the node's silence from that moment, not from
  a keepalive timeout earlier).
- Backoff restarts from its initial delay after every successful registration.
- FATAL: the scheduler rejected this node's registration as invalid (e.g. a malformed node id).
  Retrying cannot help; `fatal` is set and main.py ends the process with a clear message.

Leader epochs from every answer raise the launch fence (`workers/fence.py`).

`ExitReporter` — an outbox of worker exits. Each exit is sent with ReportWorkerExit until the scheduler
acknowledges it (the call is idempotent there), then `on_done` marks it reported in the worker records.
Answers that retrying cannot change (INVALID_ARGUMENT, NOT_FOUND: e.g. a job the scheduler has deleted)
are logged and end the retries too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import InvalidArgument
from trainyard_core.logs import log_context
from trainyard_core.rpc.liveness import LEASE_RENEW_S

from . import metrics
from .grpc import convert
from .health.book import HealthBook
from .model import NodeInfo, RunningAllocation
from .notify import Notifier, wait_any
from .pulse import Pulser
from .workers import lease
from .workers.fence import LeaderFence
from .workers.model import WorkerExit

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
# How long `stop()` waits for the scheduler to see the stream's clean end before cancelling it.
CLOSE_WAIT_S = 1.0


@dataclass(frozen=True)
class Link:
    """A channel to one scheduler replica, and the host:port it dials (pulses go to the same, over UDP)."""

    channel: grpc.aio.Channel
    target: str


ChannelFactory = Callable[[], Link]


class Backoff:
    """Exponential delays, capped, with jitter in [d/2, d] so agents restarted together spread out."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self._initial = initial_s
        self._max = max_s
        self._rng = rng or random.Random()
        self._attempt = 0

    def next(self) -> float:
        delay = min(self._max, self._initial * (2 ** min(self._attempt, 32)))
        self._attempt += 1
        return float(delay / 2 + self._rng.uniform(0, delay / 2))

    def reset(self) -> None:
        self._attempt = 0


@dataclass
class NodeView:
    """What the reporter reads about this node; each callable is cheap and runs on the event loop. `changes`
    is notified when the running allocations may have changed (a beat goes out then if they did)."""

    node_info: Callable[[], NodeInfo]
    running: Callable[[], list[RunningAllocation]]
    health: HealthBook
    changes: Notifier | None = None


class _Reregister(Exception):
    """The session ended in a way that calls for a new registration (not an error of ours)."""


class _Refused(Exception):
    """RegisterNode answered INVALID_ARGUMENT: this node's configuration is wrong."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details())
        self.error = error


class Reporter:
    def __init__(self, *, node_id: str, connect: ChannelFactory, view: NodeView, fence: LeaderFence,
                 interval_s: float, backoff: Backoff, clock: Clock | None = None,
                 lease_path: Path | None = None) -> None:
        self.node_id = node_id
        # The worker fence: renewed with every answer of the leader, for as long as it said at registration.
        self._lease_path = lease_path
        self._lease_s = 0.0
        self._connect = connect
        self._view = view
        self._fence = fence
        self._default_interval_s = interval_s
        self._backoff = backoff
        self._clock = clock or SystemClock()
        self._task: asyncio.Task[None] | None = None
        self._call: grpc.aio.StreamStreamCall[scheduler_pb2.HeartbeatRequest,
                                              scheduler_pb2.HeartbeatResponse] | None = None
        self._stopping = asyncio.Event()
        self._wake = Notifier()
        self.seq = 0
        self.acked_seq = 0
        self.registrations = 0
        self.connected = False
        # The current stream's pulser (None until the leader gives the stream a pulse session).
        self.pulser: Pulser | None = None
        self.fatal: InvalidArgument | None = None
        self.fatal_event = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-reporter")

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.notify()  # the beat generator returns: a clean end of the stream
        if self._call is not None and self._task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_WAIT_S)
        if self._call is not None:
            # End the stream through grpc first: the task then wakes from its read and can be cancelled.
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.connected = False

    async def _run(self) -> None:
        with log_context(node_id=self.node_id):
            warned = False
            while not self._stopping.is_set():
                link = self._connect()
                channel = link.channel
                try:
                    await self._session(channel, link.target)
                except _Refused as refused:
                    self._fail(refused.error)
                    return
                except grpc.aio.AioRpcError as exc:
                    # One warning per outage; the retries themselves are only debug lines.
                    level = logging.DEBUG if warned else logging.WARNING
                    log.log(level, "scheduler connection failed: %s: %s", exc.code().name, exc.details())
                    warned = True
                except _Reregister as why:
                    if not self._stopping.is_set():
                        log.info("registering again: %s", why)
                    warned = False
                except Exception:
                    # A bug here must not silence the node for good (the scheduler would declare it dead).
                    log.exception("scheduler session failed unexpectedly; reconnecting")
                finally:
                    self.connected = False
                    await channel.close()
                await self._pause(self._backoff.next())

    def _fail(self, exc: grpc.aio.AioRpcError) -> None:
        self.fatal = InvalidArgument(f"the scheduler refused to register node {self.node_id!r}: {exc.details()}; "
                                     "fix the agent's node_id / settings and restart it")
        log.error(self.fatal.message)
        self.fatal_event.set()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _session(self, channel: grpc.aio.Channel, target: str) -> None:
        stub = scheduler_pb2_grpc.NodeServiceStub(channel)
        health = self._view.health
        # Changes from here on are sent as "changed since registration"; the node below includes them too.
        registered_version = health.version
        node = self._view.node_info()
        try:
            answer = await stub.RegisterNode(convert.register_request(node, self._view.running()),
                                             timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise _Refused(exc) from exc
            raise
        self._fence.observe(answer.leader_epoch)
        self._lease_s = answer.worker_fence_s
        self._renew_lease()
        if self.registrations:
            metrics.SCHEDULER_RECONNECTS.labels(self.node_id).inc()
        self.registrations += 1
        self.connected = True
        self._backoff.reset()
        interval = answer.heartbeat_interval_ms / 1000 if answer.heartbeat_interval_ms > 0 \
            else self._default_interval_s
        log.info("registered with the scheduler", extra={"gpus": len(node.accelerators),
                                                         "leader_epoch": answer.leader_epoch,
                                                         "heartbeat_interval_s": interval})
        call = stub.Heartbeat(self._beats(registered_version, interval))
        self._call = call
        # A watchdog cancels the call when answers stop. (Not asyncio.wait_for around read(): cancelling a
        # pending grpc.aio read from outside the call can leave the waiting task hanging forever.)
        stale_after = max(3 * interval, 2.0)
        loop = asyncio.get_running_loop()
        stale = ""

        def expire(why: str = "the scheduler stopped answering heartbeats") -> None:
            nonlocal stale
            stale = why
            call.cancel()

        watchdog = loop.call_later(stale_after, expire)
        renewer = (asyncio.create_task(self._renew_while_open(call), name="worker-lease")
                   if self._lease_path is not None else None)
        try:
            while True:
                try:
                    response = await call.read()
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if stale and not (task and task.cancelling()):
                        raise _Reregister(stale) from None
                    raise
                watchdog.cancel()
                watchdog = loop.call_later(stale_after, expire)
                if response is grpc.aio.EOF:
                    raise _Reregister("the scheduler closed the heartbeat stream")
                assert isinstance(response, scheduler_pb2.HeartbeatResponse)
                self.acked_seq = max(self.acked_seq, response.ack_seq)
                self._fence.observe(response.leader_epoch)
                if response.reregister:
                    raise _Reregister("the scheduler asked for it")
                if response.pulse_session and self.pulser is None:
                    self.pulser = Pulser.for_session(target, response, self._clock, functools.partial(
                        expire, "the leader stopped acknowledging liveness pulses"))
                    await self.pulser.start()
        finally:
            watchdog.cancel()
            if renewer is not None:
                renewer.cancel()
            self._call = None
            call.cancel()
            if self.pulser is not None:
                await self.pulser.stop()
                self.pulser = None

    async def _renew_while_open(self, call: grpc.aio.Call) -> None:
        """The worker lease follows the leader's acknowledgements: renewed while the stream is open and a
        pulse sent within ACK_WINDOW_S was acknowledged, and no longer once the stream is done."""
        while not call.done():
            if self.pulser is not None and self.pulser.fresh():
                self._renew_lease()
            await asyncio.sleep(LEASE_RENEW_S)

    def _renew_lease(self) -> None:
        if self._lease_path is None:
            return
        try:
            lease.renew(self._lease_path, self._lease_s)
        except OSError as exc:  # a full disk: the fence runs out, which is the safe side
            log.error("could not renew the worker lease %s: %s", self._lease_path, exc)

    async def _beats(self, registered_version: int, interval: float) -> AsyncIterator[
            scheduler_pb2.HeartbeatRequest]:
        """A beat when the stream opens, then one when the health or the running allocations change, and one
        every `interval` when nothing does; ends (cleanly) when the reporter stops."""
        health = self._view.health
        notifiers = [health.changes, self._wake] + ([self._view.changes] if self._view.changes else [])
        loop = asyncio.get_running_loop()
        sent_version = -1
        sent_running: list[RunningAllocation] | None = None
        next_refresh = 0.0
        while not self._stopping.is_set():
            # Every notifier's version before the state is read: a change notified while the beat below waits to
            # be taken (a yield is an await: gRPC asks for the next message when it is ready) has no waiter to
            # wake, so the versions, not a wake-up, say that the state must be read again. (Before, only the
            # health's was compared: a gang stopped while a beat was in flight went unreported until the next
            # refresh, and its GPUs looked held by strays that long.)
            seen = [n.version for n in notifiers]
            version = health.version
            running = self._view.running()
            now = loop.time()
            if version != sent_version or running != sent_running or now >= next_refresh:
                self.seq += 1
                yield convert.heartbeat_request(node_id=self.node_id, seq=self.seq, sent_at=self._clock.now(),
                                                changed_gpus=health.changed_since(registered_version),
                                                running=running, pulses=True)
                sent_version, sent_running, next_refresh = version, running, loop.time() + interval
            if (health.version == version and [n.version for n in notifiers] == seen
                    and not self._stopping.is_set()):
                await wait_any(notifiers, timeout=max(0.0, next_refresh - loop.time()))


class ExitReporter:
    """Outbox of worker exits; `submit` never blocks. Sends one at a time, in order of submission."""

    def __init__(self, *, node_id: str, connect: ChannelFactory, backoff: Backoff,
                 on_done: Callable[[WorkerExit], None] | None = None) -> None:
        self.node_id = node_id
        self._connect = connect
        self._backoff = backoff
        self.on_done = on_done
        self._pending: dict[tuple[str, int, int], WorkerExit] = {}
        self._wake = Notifier()
        self._task: asyncio.Task[None] | None = None
        self._inflight: grpc.aio.UnaryUnaryCall[scheduler_pb2.ReportWorkerExitRequest,
                                                scheduler_pb2.ReportWorkerExitResponse] | None = None
        self.sent = 0

    @property
    def pending(self) -> list[WorkerExit]:
        return list(self._pending.values())

    def submit(self, exit: WorkerExit) -> None:
        self._pending.setdefault(exit.key, exit)
        self._wake.notify()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="exit-reporter")

    async def stop(self) -> None:
        if self._inflight is not None:
            self._inflight.cancel()  # through grpc first, as in Reporter.stop
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def flush(self, timeout: float) -> bool:
        """Wait until every submitted exit is acknowledged; False if some are still pending at `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._pending:
            left = deadline - loop.time()
            if left <= 0:
                return False
            await self._wake.wait(timeout=left)
        return True

    async def _run(self) -> None:
        with log_context(node_id=self.node_id):
            channel = self._connect().channel
            warned = False
            try:
                while True:
                    if not self._pending:
                        await self._wake.wait()
                        continue
                    exit = next(iter(self._pending.values()))
                    self._inflight = scheduler_pb2_grpc.NodeServiceStub(channel).ReportWorkerExit(
                        convert.exit_report(self.node_id, exit), timeout=RPC_TIMEOUT_S)
                    try:
                        await self._inflight
                    except Exception as exc:
                        if not isinstance(exc, grpc.aio.AioRpcError):
                            log.exception("reporting a worker exit failed unexpectedly; retrying")
                            await asyncio.sleep(self._backoff.next())
                            continue
                        if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                            log.error("the scheduler refused a worker exit report; not retrying it",
                                      extra={"job_id": exit.job_id, "rank": exit.rank,
                                             "error": f"{exc.code().name}: {exc.details()}"})
                            self._done(exit)
                            continue
                        log.log(logging.DEBUG if warned else logging.WARNING,
                                "cannot report a worker exit yet; retrying: %s: %s", exc.code().name,
                                exc.details(), extra={"job_id": exit.job_id, "rank": exit.rank})
                        warned = True
                        # A fresh channel: a long-lived one may sit in grpc's own (long) reconnect backoff.
                        await channel.close()
                        await asyncio.sleep(self._backoff.next())
                        channel = self._connect().channel
                        continue
                    warned = False
                    self._backoff.reset()
                    self.sent += 1
                    self._done(exit)
            finally:
                self._inflight = None
                await channel.close()

    def _done(self, exit: WorkerExit) -> None:
        self._pending.pop(exit.key, None)
        if self.on_done is not None:
            self.on_done(exit)
        self._wake.notify()
