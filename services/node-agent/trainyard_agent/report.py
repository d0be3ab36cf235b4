"""Talking to the scheduler's NodeService: registration, beats, worker exit reports.

`Reporter` — one session at a time:

    CONNECTING ──RegisterNode ok, first Beat ok──▶ BEATING ──reregister / pulses unacknowledged / stop──┐
        ▲   │                                                                                          │
        │   └─INVALID_ARGUMENT (node refused: configuration error)──▶ FATAL                            │
        └───────────────────── wait (exponential backoff, capped, jittered) ◀──────────────────────────┘

- CONNECTING: a fresh channel; RegisterNode carries the whole node (inventory with current health,
  labels, addresses) and the allocations whose workers still run here, so a restarted or failed-over
  scheduler rebuilds its view without touching running workers.
- BEATING: each beat is one unary `Beat` call (the connectionless path, docs/architecture.md "Node
  liveness"). The first one's answer hands the agent a pulse session: from then on a `Pulser` (pulse.py)
  sends the leader an authenticated UDP datagram every PULSE_INTERVAL_S, which is what proves the node alive;
  pulses unacknowledged for RECONNECT_AFTER_S tell the agent the leader is gone (it registers again, with the
  next replica). Beats carry only changes: one at once when a GPU's health or the running allocations change,
  and a refresh every interval (the scheduler's `heartbeat_interval_ms`, else the agent's setting) when
  nothing does. Each has a sequence number, the session, every GPU whose health changed since the
  registration, and the running allocations; a beat the scheduler did not take is sent again until it is (or
  the session ends). GPU metrics are not sent (Prometheus scrapes them from the agent). The channel is
  closed after AGENT_IDLE_S without a call and opened again for the next (`IdleChannel`): the leader holds no
  connection for a node with nothing to say.
- The worker fence's lease is renewed every LEASE_RENEW_S while the leader acknowledged a pulse sent within
  ACK_WINDOW_S; renewals stop when it did not (the leader closed the session, died, stopped answering, or
  cannot be reached) until a leader takes the node again.
- A session that ends while the agent runs on (its pulses went unacknowledged for RECONNECT_AFTER_S, a beat
  failed for good) leaves its pulser running, with the worker lease renewals that follow it, until the next
  session's pulser starts: a leader that was only slow (busy with a failover's registrations) still hears the
  node while the agent registers again, which may take as long as the leader's appointment says (up to 30 s).
  A leader that is gone hears nothing either way, and a session the leader no longer holds (it asked for a new
  registration) is not kept.
- The first beat of a session, whose answer carries the pulse session, is sent again when it timed out, for
  FIRST_BEAT_PATIENCE_S: on a leader busy with a failover's registrations it can, and registering again then
  would put the node at the back of the leader's appointments. Any other failure (the leader gone: the
  connection refused) sends the agent back to registering at once, with the next replica.
- `stop()` sends a leaving beat, which closes the session (the scheduler then counts the node's silence from
  that moment).
- Backoff restarts from its initial delay after every successful registration. A leader busy with every
  agent's registration at once (a failover) refuses the calls it cannot serve soon with UNAVAILABLE and an
  appointment (trainyard_core.rpc.admission); the agent keeps it instead of its backoff.
- FATAL: the scheduler rejected this node's registration as invalid (e.g. a malformed node id).
  Retrying cannot help; `fatal` is set and main.py ends the process with a clear message.

Leader epochs from every answer raise the launch fence (`workers/fence.py`).

`ExitReporter` — an outbox of worker exits. Each exit is sent with ReportWorkerExit until the scheduler
acknowledges it (the call is idempotent there), then `on_done` marks it reported in the worker records.
Answers that retrying cannot change (INVALID_ARGUMENT, NOT_FOUND: e.g. a job the scheduler has deleted)
are logged and end the retries too. Its channel is opened for the first exit and closed once the outbox has
been empty for AGENT_IDLE_S.
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
from trainyard_core.rpc.errors import retry_after_s
from trainyard_core.rpc.liveness import AGENT_IDLE_S, LEASE_RENEW_S
from trainyard_core.waits import cancel_and_wait, completes_within

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
# How long the leaving beat may take when the agent stops.
CLOSE_WAIT_S = 1.0
# A beat the scheduler did not take is sent again after these delays (doubling, jittered).
RETRY_INITIAL_S = 0.2
# The longest wait a busy leader's appointment is kept for (the leader names at most 30 s; an answer naming more
# is not trusted to keep the node away longer).
MAX_APPOINTMENT_S = 60.0
RETRY_MAX_S = 2.0
# How long the first beat of a session is sent again after failures before the agent registers again.
FIRST_BEAT_PATIENCE_S = 2 * RPC_TIMEOUT_S


@dataclass(frozen=True)
class Link:
    """A channel to one scheduler replica, the host:port it dials (pulses go to the same, over UDP), and how to
    open another channel to that same replica (None: the channel is never replaced)."""

    channel: grpc.aio.Channel
    target: str
    reopen: Callable[[], grpc.aio.Channel] | None = None


class IdleChannel:
    """A session's channel, closed once no call has been made on it for AGENT_IDLE_S and opened again (to the
    same replica) for the next call: the leader holds no connection, and its ~96 KB of TLS and HTTP/2 state,
    for a node with nothing to say (liveness.AGENT_IDLE_S). Done here rather than with gRPC's
    `grpc.client_idle_timeout_ms`, which (grpcio 1.85) drops an idle connection only the first time: a channel
    that reconnected after going idle stays connected for good."""

    def __init__(self, link: Link, idle_s: float = AGENT_IDLE_S) -> None:
        self._link = link
        self._idle_s = idle_s
        self._channel: grpc.aio.Channel | None = link.channel
        self._busy = 0
        self._last = 0.0
        self._reaper: asyncio.Task[None] | None = None

    def stub(self) -> scheduler_pb2_grpc.NodeServiceStub:
        if self._channel is None:
            assert self._link.reopen is not None
            self._channel = self._link.reopen()
        return scheduler_pb2_grpc.NodeServiceStub(self._channel)

    @contextlib.asynccontextmanager
    async def using(self) -> AsyncIterator[scheduler_pb2_grpc.NodeServiceStub]:
        """The stub for one call; the idle time counts from the end of the last call."""
        self._busy += 1
        try:
            yield self.stub()
        finally:
            self._busy -= 1
            self._last = asyncio.get_running_loop().time()
            if self._reaper is None and self._link.reopen is not None:
                self._reaper = asyncio.create_task(self._reap(), name="idle-channel")

    async def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wait = self._last + self._idle_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if self._busy == 0 and self._channel is not None:
                channel, self._channel = self._channel, None
                await channel.close()
            self._reaper = None
            return

    async def close(self) -> None:
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
            self._reaper = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


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
        # Why the current session's pulses went unacknowledged ("" while they are not).
        self._silent = ""
        self._stopping = asyncio.Event()
        self._wake = Notifier()
        self.seq = 0
        self.acked_seq = 0
        self.registrations = 0
        self.connected = False
        # The current stream's pulser (None until the leader gives the stream a pulse session).
        self.pulser: Pulser | None = None
        # The pulser of a session that ended while the agent runs on, and its lease renewals: kept until the next
        # session's pulser starts (see the module docstring).
        self.lingering: Pulser | None = None
        self._lingering_renewer: asyncio.Task[None] | None = None
        self.fatal: InvalidArgument | None = None
        self.fatal_event = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-reporter")

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.notify()  # the beats end: the session sends its leaving beat
        if self._task is not None:
            # The session's own end (its leaving beat), for a while; a cancel of this stop is not swallowed.
            await completes_within(asyncio.wait({self._task}), 2 * CLOSE_WAIT_S)
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._end_lingering()
        self.connected = False

    async def _run(self) -> None:
        with log_context(node_id=self.node_id):
            warned = False
            while not self._stopping.is_set():
                link = self._connect()
                channel = IdleChannel(link)
                wait: float | None = None
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
                    # A leader busy with every agent's registration (a failover) names when to come back: an
                    # appointment, spread from other agents' (trainyard_core.rpc.admission), kept with a little
                    # jitter instead of the backoff, which would bring the fleet back sooner than it can be served.
                    asked = retry_after_s(exc)
                    if asked is not None:
                        wait = min(asked, MAX_APPOINTMENT_S) * random.uniform(1.0, 1.1)
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
                await self._pause(self._backoff.next() if wait is None else wait)

    def _fail(self, exc: grpc.aio.AioRpcError) -> None:
        self.fatal = InvalidArgument(f"the scheduler refused to register node {self.node_id!r}: {exc.details()}; "
                                     "fix the agent's node_id / settings and restart it")
        log.error(self.fatal.message)
        self.fatal_event.set()

    async def _pause(self, seconds: float) -> None:
        await completes_within(self._stopping.wait(), seconds)

    async def _session(self, channel: IdleChannel, target: str) -> None:
        health = self._view.health
        # Changes from here on are sent as "changed since registration"; the node below includes them too.
        registered_version = health.version
        node = self._view.node_info()
        try:
            async with channel.using() as stub:
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
        self._silent = ""
        beats = self._beats(registered_version, interval)
        renewer: asyncio.Task[None] | None = None
        held = True  # whether the leader may still hold this session when it ends here
        try:
            async for beat in beats:
                if self.pulser is not None:
                    beat.pulse_session = self.pulser.session
                response = await self._send(channel, beat)
                self.acked_seq = max(self.acked_seq, response.ack_seq)
                self._fence.observe(response.leader_epoch)
                if response.reregister:
                    held = False
                    raise _Reregister("the scheduler asked for it")
                if self.pulser is None:
                    if not response.pulse_session:
                        raise _Reregister("the scheduler opened no liveness pulse session")
                    await self._end_lingering()  # the new session proves this node alive from now on
                    self.pulser = Pulser.for_session(target, response, self._clock, functools.partial(
                        self._went_silent, "the leader stopped acknowledging liveness pulses"))
                    await self.pulser.start()
                    if self._lease_path is not None:
                        renewer = asyncio.create_task(self._renew_while_acknowledged(self.pulser),
                                                      name="worker-lease")
            if self._silent:
                raise _Reregister(self._silent)
            if self.pulser is not None:
                # Stopping: the leaving beat ends the session, so the scheduler counts this node's silence from
                # now (best effort: a scheduler that does not answer in time finds the node silent anyway).
                leaving = scheduler_pb2.HeartbeatRequest(node_id=self.node_id, seq=self.seq + 1, leaving=True,
                                                         pulse_session=self.pulser.session)
                with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                    async with channel.using() as stub:
                        await stub.Beat(leaving, timeout=CLOSE_WAIT_S)
                held = False
        finally:
            await beats.aclose()  # type: ignore[attr-defined]
            pulser, self.pulser = self.pulser, None
            if pulser is not None and held and not self._stopping.is_set():
                await self._linger(pulser, renewer)
            else:
                if renewer is not None:
                    renewer.cancel()
                if pulser is not None:
                    await pulser.stop()

    async def _linger(self, pulser: Pulser, renewer: asyncio.Task[None] | None) -> None:
        """Keep an ended session's pulser (and the worker lease renewals that follow its acknowledgements) running
        while the agent registers again (see the module docstring)."""
        await self._end_lingering()
        pulser.detach()
        self.lingering, self._lingering_renewer = pulser, renewer

    async def _end_lingering(self) -> None:
        pulser, renewer = self.lingering, self._lingering_renewer
        self.lingering, self._lingering_renewer = None, None
        if renewer is not None:
            renewer.cancel()
        if pulser is not None:
            await pulser.stop()

    def _went_silent(self, why: str) -> None:
        """The pulser heard no acknowledgement for RECONNECT_AFTER_S: end the session (the beats end, a beat
        being retried gives up) and register again."""
        self._silent = why
        self._wake.notify()

    async def _send(self, channel: IdleChannel,
                    beat: scheduler_pb2.HeartbeatRequest) -> scheduler_pb2.HeartbeatResponse:
        """One beat, sent until the scheduler answers it. The first beat of a session is sent again after it
        timed out, for FIRST_BEAT_PATIENCE_S (then the agent registers again); a later one after any
        failure but INVALID_ARGUMENT (the leader could not store a health change yet, or a connection broke) for
        as long as the session lasts: the pulses, not the beats, say whether the leader is still there."""
        retry = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + FIRST_BEAT_PATIENCE_S
        while True:
            try:
                async with channel.using() as stub:
                    response: scheduler_pb2.HeartbeatResponse = await stub.Beat(beat, timeout=RPC_TIMEOUT_S)
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT or (
                        self.pulser is None and (exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                                                 or loop.time() >= give_up)):
                    raise
                log.debug("beat not taken yet; sending it again: %s: %s", exc.code().name, exc.details())
            await self._wake.wait(timeout=retry.next())
            if self._silent:
                raise _Reregister(self._silent)
            if self._stopping.is_set():
                raise _Reregister("stopping")

    async def _renew_while_acknowledged(self, pulser: Pulser) -> None:
        """The worker lease follows the leader's acknowledgements: renewed while a pulse sent within
        ACK_WINDOW_S was acknowledged, and no longer once the session is over."""
        while True:
            if pulser.fresh():
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
        while not self._stopping.is_set() and not self._silent:
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
                    and not self._stopping.is_set() and not self._silent):
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
            await cancel_and_wait(self._task)
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
            channel: grpc.aio.Channel | None = None
            warned = False
            try:
                while True:
                    if not self._pending:
                        # No connection held while there is nothing to report (liveness.AGENT_IDLE_S).
                        woken = await self._wake.wait(timeout=AGENT_IDLE_S if channel is not None else None)
                        if not woken and channel is not None and not self._pending:
                            await channel.close()
                            channel = None
                        continue
                    if channel is None:
                        channel = self._connect().channel
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
                if channel is not None:
                    await channel.close()

    def _done(self, exit: WorkerExit) -> None:
        self._pending.pop(exit.key, None)
        if self.on_done is not None:
            self.on_done(exit)
        self._wake.notify()
