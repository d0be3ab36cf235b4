"""The leader renews running attempts' checkpoint-store credentials before they expire.

A job attempt's credential (worker_credentials.py) lives `job_credential_ttl_s` (an hour by default): short,
so a leaked one is soon worthless. An attempt runs for weeks, so while it runs the leader hands its nodes a
new one once the one they hold is past half its lifetime, with the agents' `RenewJobCredential`; the agent
replaces the files the workers' TRAINYARD_CHECKPOINT_CERT/_KEY/_CA name and the checkpoint client re-reads
them. Every renewal of one attempt uses the job issuer's latest credential of that attempt while it has more
than half its lifetime left (`JobIssuer.credential`), so the nodes of a gang get the same one, and a launch of
the attempt after a renewal gets the renewed one.

The shape is the reconcile loop's: `running_attempts(allocations)` and `plan(...)` are pure (snapshot and
time in, what to renew out); `CredentialRenewer` loads, decides and calls the agents, one pass at a time.

What the leader knows of a node's credential (`Held`, per job, attempt and node; this term only):
- a node it renewed: the notAfter of what it delivered;
- a node its own reconciler launched this term (the node appears in the allocation's `launched` after this
  term's first pass): the earliest notAfter its launches of that attempt handed out
  (`WorkerCredentials.launched`);
- anything else, in particular every node that runs when the term begins: unknown. A new leader does not
  know when its predecessor last renewed, so every running attempt is due at once in its first pass.

A node is due when unknown or when what it holds has no more than half its lifetime left, and not waiting
for a retry. That work is bounded: a pass delivers to at most `max_per_pass` nodes, the most urgent first
(unknown first, the oldest attempts first among those, then by notAfter), at most `concurrency` calls at a
time; what is left over goes in the next pass, which starts at once. With 10,000 running single-node attempts
a new leader renews them all in 40 passes, each minting up to 256 credentials (under 1 ms each) and planning
over all 10,000 (13 ms measured on the shared development machine), while the default lifetime leaves half
an hour.

Failures (an agent unreachable, a refusal) are logged with the job, attempt and node, never the credential,
counted in `trainyard_scheduler_credential_renewals_total{result}` and retried next pass (`interval_s`
later). The agent answers FAILED_PRECONDITION for an attempt whose workers on that node have ended; such a
node leaves the plan once its exits are in the allocation.

A leader down for longer than half a lifetime: nothing renews meanwhile, so credentials begin to expire at
most `job_credential_ttl_s` after the last renewal. Established connections to the checkpoint-store keep
working; new ones (a save after a reconnect, an async saver starting) fail with UNAVAILABLE and the client
retries; the next leader renews every running attempt in its first passes, and the clients pick the new files
up. With the agents' worker fence on (`worker_fence_s`, 8 s by default) workers do not outlive a leader
outage that long anyway.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from trainyard_core.clock import Clock
from trainyard_core.errors import TrainyardError, Unavailable
from trainyard_core.logs import log_context
from trainyard_core.security.job_credentials import JobCredential
from trainyard_core.store.api import KeyValue
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.waits import completes_within

from . import metrics
from .domain.models import Allocation, Node
from .state.codec import decode_allocation, decode_node
from .state.keys import Keys
from .worker_credentials import WorkerCredentials

log = logging.getLogger(__name__)

UNKNOWN = -math.inf
T = TypeVar("T")


@runtime_checkable
class RenewPort(Protocol):
    """How the renewer reaches agents (grpc/agent_client.py)."""

    async def renew_credential(self, node: Node, credential: JobCredential, epoch: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RenewalSettings:
    interval_s: float = 10.0   # a pass at least this often; a failed delivery is retried this much later
    max_per_pass: int = 256    # node deliveries per pass; the rest go in the next pass, at once
    concurrency: int = 32      # agent calls in flight

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.max_per_pass < 1 or self.concurrency < 1:
            raise ValueError(f"renewal settings out of range: {self}")


@dataclass(frozen=True, slots=True)
class RunningAttempt:
    """An attempt with workers to renew for: the nodes that launched them and have not stopped them."""

    job_id: str
    attempt: int
    team: str
    nodes: frozenset[str]
    started_at: float


@dataclass(frozen=True, slots=True)
class Held:
    """What the leader knows a node of an attempt holds: the notAfter of its credential (UNKNOWN: not known),
    and, after a failed delivery, when to try again."""

    not_after: float = UNKNOWN
    retry_at: float = 0.0


Key = tuple[str, int, str]  # (job id, attempt, node id)


@dataclass(frozen=True, slots=True)
class Renewal:
    attempt: RunningAttempt
    nodes: tuple[str, ...]  # the nodes of the attempt that are due


@dataclass(frozen=True, slots=True)
class Plan:
    renewals: tuple[Renewal, ...]
    # Attempts due now but left for the next pass (the per-pass bound).
    deferred: int
    # When the next node becomes due (now, with deferred work); None when nothing runs.
    next_at: float | None


def running_attempts(allocations: Iterable[Allocation]) -> list[RunningAttempt]:
    """The attempts whose workers may still run somewhere, and where: launched, not stopped, and not every rank
    of the node's share reported as exited."""
    out = []
    for alloc in allocations:
        exited = {(e.node_id, e.rank) for e in alloc.exits}
        nodes = frozenset(a.node_id for a in alloc.assignments
                          if a.node_id in alloc.launched and a.node_id not in alloc.stopped
                          and not all((a.node_id, r) in exited for r in a.ranks))
        if nodes:
            out.append(RunningAttempt(alloc.job_id, alloc.attempt, alloc.team, nodes, alloc.created_at))
    return out


def due_at(held: Held | None, ttl_s: float) -> float:
    """When a node holding `held` needs a new credential: half its lifetime before its notAfter, not before a
    retry's time; at once (-inf) when what it holds is unknown."""
    if held is None:
        return UNKNOWN
    return max(held.not_after - ttl_s / 2, held.retry_at)


def plan(running: Iterable[RunningAttempt], held: Mapping[Key, Held], now: float, *, ttl_s: float,
         limit: int) -> Plan:
    """Which attempts need a new credential now, on which of their nodes, most urgent first and at most `limit`
    node deliveries (an attempt with more nodes than that goes alone); when the next is due."""
    due: list[tuple[tuple[float, float, str, int], Renewal]] = []
    next_at: float | None = None
    for att in running:
        nodes: list[str] = []
        urgency = math.inf
        for node in sorted(att.nodes):
            h = held.get((att.job_id, att.attempt, node))
            at = due_at(h, ttl_s)
            if at <= now:
                nodes.append(node)
                urgency = min(urgency, h.not_after if h is not None else UNKNOWN)
            else:
                next_at = at if next_at is None else min(next_at, at)
        if nodes:
            due.append(((urgency, att.started_at, att.job_id, att.attempt), Renewal(att, tuple(nodes))))
    due.sort(key=lambda d: d[0])
    chosen: list[Renewal] = []
    used = 0
    for i, (_, r) in enumerate(due):
        if chosen and used + len(r.nodes) > limit:
            # In order: a smaller attempt further down does not overtake a more urgent one.
            return Plan(tuple(chosen), len(due) - i, now)
        chosen.append(r)
        used += len(r.nodes)
    return Plan(tuple(chosen), 0, next_at)


class CredentialRenewer:
    """One per term, beside the reconciler (app.py). `epoch`: the term's, sent with every call (agents refuse a
    deposed leader's); `leading`: False once the term is over (a pass then stops)."""

    def __init__(self, *, credentials: WorkerCredentials, mirror: PrefixMirror, keys: Keys, agents: RenewPort,
                 clock: Clock, epoch: Callable[[], int], settings: RenewalSettings | None = None,
                 leading: Callable[[], bool] = lambda: True) -> None:
        self._credentials = credentials
        self._mirror = mirror
        self._keys = keys
        self._agents = agents
        self._clock = clock
        self._epoch = epoch
        self._s = settings or RenewalSettings()
        self._leading = leading
        self._held: dict[Key, Held] = {}
        self._passes = 0
        self._allocs: dict[str, tuple[int, Allocation]] = {}
        self._nodes: dict[str, tuple[int, Node]] = {}
        self.renewed = 0  # deliveries that succeeded this term
        self._failures = 0  # in the pass under way

    @property
    def passes(self) -> int:
        """Passes made this term."""
        return self._passes

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: a pass, then wait until the next node is due (at most interval_s; not at all while a
        pass left work over). The first pass waits until the mirror holds this term's start."""
        while not stop.is_set() and not await self._mirror.wait_for(self._epoch(), timeout=self._s.interval_s):
            pass
        while not stop.is_set() and self._leading():
            try:
                p = await self.step()
            except Exception:
                log.exception("credential renewal pass failed")
                p = Plan((), 0, None)
            now = self._clock.now()
            wait = self._s.interval_s if p.next_at is None else min(self._s.interval_s, max(0.0, p.next_at - now))
            await completes_within(stop.wait(), wait)

    async def step(self) -> Plan:
        """One pass: snapshot, plan, deliver. Returns the plan it carried out."""
        now = self._clock.now()
        running = running_attempts(self._allocations())
        self._observe(running)
        p = plan(running, self._held, now, ttl_s=self._credentials.ttl_s, limit=self._s.max_per_pass)
        self._passes += 1
        if p.renewals:
            gate = asyncio.Semaphore(self._s.concurrency)
            nodes = self._node_records()
            renewed, self._failures = self.renewed, 0
            await asyncio.gather(*(self._renew(r, nodes, gate) for r in p.renewals))
            log.info("checkpoint-store credentials renewed", extra={
                "attempts": len(p.renewals), "renewed": self.renewed - renewed, "failed": self._failures,
                "deferred": p.deferred})
        return p

    def _observe(self, running: list[RunningAttempt]) -> None:
        """Keep `_held` to the nodes that run now; a node first seen after this term's first pass was launched
        by this leader, with the credential its launch record names."""
        live: set[Key] = set()
        for att in running:
            launched = self._credentials.launched(att.job_id, att.attempt) if self._passes else None
            for node in att.nodes:
                key = (att.job_id, att.attempt, node)
                live.add(key)
                if key not in self._held:
                    self._held[key] = Held(launched.not_after) if launched is not None else Held()
        for key in [k for k in self._held if k not in live]:
            del self._held[key]

    async def _renew(self, r: Renewal, nodes: Mapping[str, Node], gate: asyncio.Semaphore) -> None:
        att = r.attempt
        with log_context(job_id=att.job_id, attempt=att.attempt):
            try:
                cred = self._credentials.credential(att.job_id, att.attempt, att.team)
            except Exception:
                log.exception("cannot mint a checkpoint-store credential for the attempt")
                for node in r.nodes:
                    self._failed((att.job_id, att.attempt, node), "error")
                return
            await asyncio.gather(*(self._deliver(att, nodes.get(node), node, cred, gate) for node in r.nodes))

    async def _deliver(self, att: RunningAttempt, node: Node | None, node_id: str, cred: JobCredential,
                       gate: asyncio.Semaphore) -> None:
        key = (att.job_id, att.attempt, node_id)
        if node is None:
            log.warning("cannot renew the checkpoint-store credential: the node is not registered",
                        extra={"node_id": node_id})
            self._failed(key, "error")
            return
        async with gate:
            if not self._leading():
                return
            try:
                await self._agents.renew_credential(node, cred, self._epoch())
            except Unavailable as exc:
                log.warning("checkpoint-store credential not renewed, will retry: %s", exc,
                            extra={"node_id": node_id})
                self._failed(key, "unavailable")
                return
            except TrainyardError as exc:
                log.warning("checkpoint-store credential renewal refused, will retry: %s", exc.message,
                            extra={"node_id": node_id})
                self._failed(key, "refused")
                return
        self._held[key] = Held(cred.not_after.timestamp())
        self.renewed += 1
        metrics.CREDENTIAL_RENEWALS.labels("ok").inc()
        log.debug("checkpoint-store credential renewed", extra={"node_id": node_id,
                                                                "not_after": cred.not_after.isoformat()})

    def _failed(self, key: Key, result: str) -> None:
        self._failures += 1
        metrics.CREDENTIAL_RENEWALS.labels(result).inc()
        held = self._held.get(key)
        if held is not None:
            self._held[key] = Held(held.not_after, self._clock.now() + self._s.interval_s)

    # --- the snapshot: records decoded once per revision ---------------------------------------------------

    def _allocations(self) -> list[Allocation]:
        return _decoded(self._mirror.under(self._keys.allocations), self._allocs, decode_allocation)

    def _node_records(self) -> dict[str, Node]:
        prefix = self._keys.nodes
        return {n.node_id: n for n in _decoded(self._mirror.under(prefix), self._nodes, decode_node)}


def _decoded(items: Mapping[str, KeyValue], cache: dict[str, tuple[int, T]], decode: Callable[[bytes], T]) -> list[T]:
    out: list[T] = []
    for key, kv in items.items():
        hit = cache.get(key)
        if hit is None or hit[0] != kv.mod_revision:
            try:
                hit = (kv.mod_revision, decode(kv.value))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("ignoring undecodable record %s: %s", key, exc)
                continue
            cache[key] = hit
        out.append(hit[1])
    if len(cache) > len(items):
        for gone in [k for k in cache if k not in items]:
            del cache[gone]
    return out
