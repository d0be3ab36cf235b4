"""The leader's calls to agents: launch a gang's workers on a node, stop them, stop strays no allocation
accounts for.

Each call runs in a background task of its own, so a slow or dead agent never holds up the reconcile loop, and
the same call (job, attempt, node, kind) is never in flight twice. A call's result comes back as a write to the
allocation (`launched`, `stopped`, `stop_reason`), which wakes the loop through the mirror; when a call ends the
loop is woken too, so that a call that could not be made is looked at again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Protocol

from trainyard_core import telemetry
from trainyard_core.bounded import remember
from trainyard_core.errors import TrainyardError, Unavailable
from trainyard_core.logs import log_context

from . import metrics
from .domain.models import Allocation, Node
from .launch import NodeLaunch
from .state.repository import AllocationChange, Repository

log = logging.getLogger(__name__)
# The spans keep the names the docs give them (reconcile.launch, reconcile.stop): they are the cycle's work.
_tracer = telemetry.tracer(__name__)

# Stray workers are asked to stop at most this often (the agent reports the result with a later heartbeat).
ORPHAN_STOP_RETRY_S = 2.0
# An agent call that did not reach its agent waits this long before it is tried again, doubling each time up to
# the max (`_spawn`): a node whose agent is gone is lost within node_timeout_s anyway; until then, a few tries.
AGENT_RETRY_MIN_S = 0.2
AGENT_RETRY_MAX_S = 5.0
# The most calls whose backoff or last stray stop is remembered (the oldest are forgotten first).
_REMEMBERED = 10_000

CallKey = tuple[str, int, str, str]  # (job id, attempt, node id, kind)


# The changes the agents' answers make to a gang's allocation (each None when already made, so a repeat writes
# nothing). A gang's nodes answer at about the same moment; Repository.modify_allocation merges their changes.
def launch_confirmed(node_id: str) -> AllocationChange:
    return lambda a: None if node_id in a.launched else replace(a, launched=a.launched | {node_id})


def stop_confirmed(node_id: str) -> AllocationChange:
    return lambda a: None if node_id in a.stopped else replace(a, stopped=a.stopped | {node_id})


def stopping_for(reason: str) -> AllocationChange:
    """The gang to be stopped for `reason`, unless a reason is already set (the first one stands)."""
    return lambda a: None if a.stop_reason else replace(a, stop_reason=reason)


class AgentPort(Protocol):
    """The scheduler's side of the agent API (grpc/agent_client.py in production, a fake in tests)."""

    async def launch(self, node: Node, launch: NodeLaunch, epoch: int) -> None: ...

    async def stop(self, node: Node, job_id: str, attempt: int, grace_s: float, reason: str, epoch: int,
                   signal: str = "") -> None: ...


class AgentCalls:
    """Launches and stops, each in flight once, with a backoff after a call that did not reach its agent."""

    def __init__(self, *, repo: Repository, agents: AgentPort, epoch: Callable[[], int], stop_grace_s: float,
                 wake: Callable[[], None], monotonic: Callable[[], float],
                 worker_env: Callable[[str, int, str], Mapping[str, str]] | None = None) -> None:
        self._repo = repo
        self._agents = agents
        self._epoch = epoch
        self._stop_grace_s = stop_grace_s
        self._wake = wake
        self._monotonic = monotonic
        # (job id, attempt, team) → what a launch adds to its workers' env: the attempt's checkpoint-store
        # credential (worker_credentials.py). Added to the agent request only, never stored.
        self._worker_env = worker_env
        self._inflight: dict[CallKey, asyncio.Task[None]] = {}
        # A call's next backoff after it did not reach its agent (`_spawn`).
        self._retry: dict[CallKey, float] = {}
        # When this leader last asked an agent to stop stray workers, per (job, attempt, node).
        self._orphan_stops: dict[CallKey, float] = {}

    def cancel_all(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()

    def launch(self, node: Node, launch: NodeLaunch, team: str, trace_parent: str) -> None:
        self._spawn((launch.job_id, launch.attempt, node.node_id, "launch"),
                    functools.partial(self._launch, node, launch, team, trace_parent))

    def stop(self, node: Node, alloc: Allocation, trace_parent: str) -> None:
        self._spawn((alloc.job_id, alloc.attempt, node.node_id, "stop"),
                    functools.partial(self._stop, node, alloc, trace_parent))

    def stop_strays(self, node: Node, job_id: str, attempt: int) -> None:
        """Ask the agent to stop workers of (job, attempt) that no allocation accounts for, at most every
        ORPHAN_STOP_RETRY_S: the agent's next heartbeat shows the stop, and until then the stray is still
        reported, so asking on every cycle would only repeat the call (and its log line)."""
        key = (job_id, attempt, node.node_id, "stop-orphan")
        mono = self._monotonic()
        if mono - self._orphan_stops.get(key, -math.inf) < ORPHAN_STOP_RETRY_S:
            return
        remember(self._orphan_stops, key, mono, _REMEMBERED)
        self._spawn(key, functools.partial(self._stop_orphan, node, job_id, attempt))

    def _spawn(self, key: CallKey, work: Callable[[], Awaitable[bool]]) -> None:
        """Run an agent call (`work` answers whether it reached the agent) unless the same call is in flight. One
        that did not reach its agent stays in flight for a backoff (AGENT_RETRY_MIN_S, doubling up to
        AGENT_RETRY_MAX_S) before the next cycle may try again: retried on the very next cycle, a call to a dead
        agent ran the loop hot until the node was lost."""
        if key in self._inflight:
            return

        async def runner() -> None:
            try:
                with log_context(job_id=key[0], node_id=key[2]):
                    reached = await work()
                if reached:
                    self._retry.pop(key, None)
                else:
                    delay = self._retry.get(key, AGENT_RETRY_MIN_S)
                    remember(self._retry, key, min(2 * delay, AGENT_RETRY_MAX_S), _REMEMBERED)
                    await asyncio.sleep(delay)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("agent call %s failed", key[3])
            finally:
                self._inflight.pop(key, None)
                self._wake()

        self._inflight[key] = asyncio.create_task(runner(), name=f"{key[3]} {key[0]} on {key[2]}")

    async def _launch(self, node: Node, launch: NodeLaunch, team: str, trace_parent: str) -> bool:
        """Launch the gang's workers on `node`, a span of the job's trace (the agent's side joins it); whether
        the agent was reached."""
        with telemetry.continued(_tracer, "reconcile.launch", trace_parent, {
                telemetry.JOB_ID: launch.job_id, telemetry.ATTEMPT: launch.attempt, telemetry.NODE_ID: node.node_id}):
            return await self._launch_on(node, launch, team)

    async def _launch_on(self, node: Node, launch: NodeLaunch, team: str) -> bool:
        if self._worker_env is not None:
            # One mint per attempt (under 1 ms), shared by its nodes: cheap enough for the event loop.
            launch = replace(launch, env={**launch.env, **self._worker_env(launch.job_id, launch.attempt, team)})
        try:
            await self._agents.launch(node, launch, self._epoch())
        except Unavailable as exc:
            metrics.AGENT_CALL_FAILURES.labels("launch").inc()
            # Retried after a backoff (`_spawn`); if the node stays unreachable its pulses stop and it is lost.
            log.warning("launch on %s failed, will retry: %s", node.node_id, exc)
            return False
        except TrainyardError as exc:
            reason = f"launch refused by {node.node_id}: {exc.message}"
            log.warning(reason)
            await self._repo.modify_allocation(launch.job_id, launch.attempt, stopping_for(reason))
            return True
        await self._repo.modify_allocation(launch.job_id, launch.attempt, launch_confirmed(node.node_id))
        log.info("workers launched", extra={"ranks": [w.rank for w in launch.workers]})
        return True

    async def _stop_orphan(self, node: Node, job_id: str, attempt: int) -> bool:
        log.warning("stopping workers no allocation accounts for", extra={"attempt": attempt})
        try:
            await self._agents.stop(node, job_id, attempt, self._stop_grace_s,
                                    "no allocation accounts for these workers (gang released)", self._epoch())
        except Unavailable as exc:
            metrics.AGENT_CALL_FAILURES.labels("stop").inc()
            log.warning("orphan stop on %s failed, will retry: %s", node.node_id, exc)
            return False
        return True

    async def _stop(self, node: Node, alloc: Allocation, trace_parent: str) -> bool:
        """Stop the gang's workers on `node`, a span of the job's trace (the agent's side joins it); whether the
        agent was reached."""
        with telemetry.continued(_tracer, "reconcile.stop", trace_parent, {
                telemetry.JOB_ID: alloc.job_id, telemetry.ATTEMPT: alloc.attempt, telemetry.NODE_ID: node.node_id}):
            return await self._stop_on(node, alloc)

    async def _stop_on(self, node: Node, alloc: Allocation) -> bool:
        try:
            grace = alloc.stop_grace_s or self._stop_grace_s
            await self._agents.stop(node, alloc.job_id, alloc.attempt, grace, alloc.stop_reason, self._epoch(),
                                    alloc.stop_signal)
        except Unavailable as exc:
            metrics.AGENT_CALL_FAILURES.labels("stop").inc()
            log.warning("stop on %s failed, will retry: %s", node.node_id, exc)
            return False
        await self._repo.modify_allocation(alloc.job_id, alloc.attempt, stop_confirmed(node.node_id))
        return True

