"""The leader's reconcile loop: load a snapshot → decide (pure) → apply (short, CAS-guarded writes).

Each cycle reads the in-memory mirror of etcd (no store round trip), runs `place` for pending jobs and
`progress` for every placed gang, commits the resulting records, and hands agent calls (launch, stop) to
background tasks (agent_calls.py) so a slow or dead agent never holds up the loop. Agent results come back as
writes to the allocation, which wake the loop through the mirror. Nothing here holds a lock across a network
call. The placement's decisions and preemptions become records in placement_writes.py; how a failed write is taken
(the next cycle decides again) is cycle_writes.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from trainyard_core import telemetry
from trainyard_core.bounded import remember
from trainyard_core.clock import Clock
from trainyard_core.errors import Conflict, Unavailable
from trainyard_core.logs import log_context
from trainyard_core.rpc.liveness import LEASE_RENEW_S
from trainyard_core.rpc.pulse import ACK_WINDOW_S
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.waits import completes_within

from . import metrics
from .agent_calls import AGENT_RETRY_MAX_S, AGENT_RETRY_MIN_S, ORPHAN_STOP_RETRY_S, AgentCalls, AgentPort
from .cycle_writes import CycleWrites
from .domain.jobs import due_for_requeue
from .domain.models import Allocation, Job, JobState
from .domain.operations import restand
from .domain.pending import EMPTY as EMPTY_ORDER
from .domain.pending import PendingOrder, pending_order
from .domain.progress import progress
from .domain.queues import (
    DEFAULT_QUEUE,
    PolicyConfig,
    decay_usage,
)
from .domain.snapshot import ClusterSnapshot
from .launch import node_launches
from .liveness import NodeLiveness
from .node_log import NodeTransitions
from .pace import MIN_PAUSE_S, PACE_S_PER_PENDING_JOB, cycle_pause_s
from .pending_reasons import PendingReasons
from .placement_writes import PlacementWrites
from .policy.api import Profile
from .policy.index import ClusterIndex
from .policy.place import Decision, PlacementResult, place
from .state.holdings import decode_holding
from .state.repository import Repository
from .state.snapshots import PolicyState, SnapshotBuilder

log = logging.getLogger(__name__)
# A job's decision, commit, launch and stop are spans of the trace its submit began (Job.trace_parent).
_tracer = telemetry.tracer(__name__)

# Added to the worker fence before a lost node's workers are presumed gone: the agent renews its lease while
# the leader acknowledged a pulse it sent within ACK_WINDOW_S (the leader's last proof of life from it is no
# older than that pulse), once per renewal period, and shims look at the lease every 0.25 s.
FENCE_MARGIN_S = 0.5 + ACK_WINDOW_S + LEASE_RENEW_S
# Released gangs remembered (snapshots.py: their workers' late reports are not strays).
_RELEASES_REMEMBERED = 10_000
# The cycle's gauges (jobs by state, GPUs allocated and healthy, nodes ready) are set at most this often.
OBSERVE_EVERY_S = 1.0
# Agent calls (agent_calls.py): what callers of the reconciler name from here.
__all__ = ["AGENT_RETRY_MAX_S", "AGENT_RETRY_MIN_S", "ORPHAN_STOP_RETRY_S", "AgentPort", "ReconcileSettings",
           "Reconciler", "SnapshotBuilder"]


@dataclass
class ReconcileSettings:
    interval_s: float = 1.0
    stop_grace_s: float = 10.0
    port_range: tuple[int, int] = (29500, 29999)
    # Classes, speed factors, fair-share half-life, reservation depth (queues, quotas and usage come from
    # etcd each cycle and replace the ones here).
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    usage_interval_s: float = 10.0
    # host:port of the checkpoint-store, handed to workers (TRAINYARD_CHECKPOINT_STORE); "" when none.
    checkpoint_store: str = ""
    # A pending job's "why" message is rewritten at most this often (it changes as the cluster does).
    reason_interval_s: float = 5.0
    commit_concurrency: int = 64
    # Restarts after infrastructure failures a job gets before it fails (they do not use max_restarts).
    max_infra_restarts: int = 20
    # Agents' worker fence (see RegisterNodeResponse.worker_fence_s); 0: none, lost nodes' workers are
    # presumed dead at once.
    worker_fence_s: float = 0.0
    # After a cycle whose placement looked at P pending jobs, the next starts no sooner than P x this (at most
    # interval_s, and never past a node's deadline): see `cycle_pause_s`. 0: cycles run back to back.
    pace_s_per_pending_job: float = PACE_S_PER_PENDING_JOB


class Reconciler:
    def __init__(self, *, repo: Repository, mirror: PrefixMirror, liveness: NodeLiveness, agents: AgentPort,
                 profile: Profile, clock: Clock, epoch: Callable[[], int],
                 settings: ReconcileSettings,
                 worker_env: Callable[[str, int, str], Mapping[str, str]] | None = None) -> None:
        self._repo = repo
        self._mirror = mirror
        self._snapshots = SnapshotBuilder(mirror, repo.keys)
        self._liveness = liveness
        self._calls = AgentCalls(repo=repo, agents=agents, epoch=epoch, stop_grace_s=settings.stop_grace_s,
                                 wake=mirror.changed.set, monotonic=clock.monotonic, worker_env=worker_env)
        self._profile = profile
        self._clock = clock
        self._epoch = epoch
        self._settings = settings
        # (job_id, attempt) → when this leader released the gang (monotonic); the newest _RELEASES_REMEMBERED.
        self._released: dict[tuple[str, int], float] = {}
        # Why each waiting job waits, rewritten on the job at most every reason_interval_s.
        self._reasons = PendingReasons(settings.reason_interval_s, clock.monotonic)
        self._usage_written = -math.inf
        self._observed_at = -math.inf
        # Metrics: the label values allowed (configured queues, teams with a quota), events, the cluster's gauges.
        self._bounds = metrics.Bounds()
        self._events = metrics.Events(self._bounds)
        self._writes = CycleWrites()
        self._placements = PlacementWrites(repo, self._events, self._writes)
        self._gauges = metrics.ClusterGauges(self._bounds)
        self._transitions = NodeTransitions()
        # Placement's capacity index, kept between cycles and synced from each snapshot (same decisions as
        # a fresh build, a fraction of the cost at 10k nodes).
        self._index = ClusterIndex(profile.gates)
        self._index_of: ClusterSnapshot | None = None  # the snapshot the index was last synced from
        self._node_ids: tuple[str, ...] = ()
        self._recheck_at = math.inf
        self._holdings_checked = False
        self.cycles = 0
        self.last_result_size = 0
        self.last_considered = 0  # pending jobs the last cycle's placement looked at
        self.last_pause_s = 0.0  # how long the loop rested after the last cycle
        # The queue as the last cycle ordered it, built when first asked for (`pending`).
        self._pending: PendingOrder | Callable[[], PendingOrder] = EMPTY_ORDER

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle until `stop` is set. Wakes on any change in etcd and at least every interval.

        A cycle starts only from a mirror that holds every write this leader has made (read-your-writes),
        and the first only once the mirror has reached the revision at which this leader won (its epoch):
        decisions are never taken on a view that misses this leader's own placements."""
        self._repo.holdings.reset()  # what a former term expected may have been overwritten since
        try:
            await self._loop(stop)
        finally:
            self._gauges.clear()  # the cluster's gauges are the leader's to report (metrics.py)
        self._calls.cancel_all()

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not await self._caught_up(stop):
                continue
            self._mirror.changed.clear()
            try:
                if self._writes.take_holdings_refusal() or not self._holdings_checked:
                    await self._restore_holdings()
                await self.cycle()
            except Unavailable as exc:
                log.warning("reconcile: store unavailable: %s", exc)
            except Exception:
                log.exception("reconcile cycle failed")
            await self._rest(stop)
            waiter = asyncio.ensure_future(self._mirror.changed.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, timeout=self._next_wait(),
                               return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()

    async def _caught_up(self, stop: asyncio.Event) -> bool:
        """Wait (up to one interval) until the mirror includes this leader's epoch and its own writes."""
        target = max(self._epoch(), self._repo.written_revision)
        if self._mirror.revision >= target:
            return True
        waiter = asyncio.ensure_future(self._mirror.wait_for(target, timeout=self._settings.interval_s))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not waiter.done():
            waiter.cancel()
            return False
        if waiter.result():
            return True
        metrics.MIRROR_BEHIND.inc()
        log.warning("reconcile: waiting for the store's watch to deliver this leader's writes "
                    "(mirror at revision %d, writes up to %d)", self._mirror.revision, target)
        return False

    async def _restore_holdings(self) -> None:
        """Make the GPU holdings agree with the allocations: once per term, and again after a placement was
        refused because a GPU the snapshot thought free is held. Allocations whose GPUs are missing (made
        before holdings existed) get them; jobs held without an allocation (a write that bypassed the
        repository) are dropped. Each fix is its own CAS-guarded transaction."""
        snap, _ = self._snapshots.build(self._liveness, self._released)
        fixed = 0
        try:
            for job_id, alloc in snap.allocations.items():
                fixed += await self._repo.restore_holdings(alloc, snap.allocation_revisions[job_id])
            prefix = self._repo.keys.all_holdings
            for key, kv in list(self._mirror.under(prefix).items()):
                node_id = key[len(prefix):]
                orphans = sorted(j for j in decode_holding(node_id, kv).jobs if j not in snap.allocations)
                if orphans:
                    fixed += await self._repo.drop_orphan_holdings(node_id, orphans)
        except Conflict as exc:
            # Tried again when a placement is next refused by the holdings, not every cycle.
            log.error("GPU holdings not reconciled: %s", exc)
        if fixed:
            log.error("GPU holdings disagreed with the allocations and were corrected", extra={"fixes": fixed})
        self._holdings_checked = True

    async def _rest(self, stop: asyncio.Event) -> None:
        """Rest after a cycle in proportion to its placement walk (`cycle_pause_s`), never past the next node
        deadline or worker fence, and not past `stop`."""
        pause = cycle_pause_s(self.last_considered, self._settings.pace_s_per_pending_job, self._settings.interval_s)
        if pause > 0:
            pause = min(pause, self._next_wait())
        if pause < MIN_PAUSE_S:
            self.last_pause_s = 0.0
            return
        self.last_pause_s = pause
        metrics.RECONCILE_PAUSED_SECONDS.inc(pause)
        await completes_within(stop.wait(), pause)

    def _next_wait(self) -> float:
        """The interval, or less when a node's heartbeat deadline or a lost node's worker fence comes first
        (acted on at the deadline, not up to an interval later)."""
        wait = self._settings.interval_s
        expiry = self._liveness.next_expiry(self._node_ids)
        if expiry is not None:
            wait = min(wait, expiry + 0.02)
        if self._recheck_at < math.inf:
            wait = min(wait, max(0.0, self._recheck_at - self._clock.monotonic()) + 0.02)
        return wait

    async def cycle(self) -> None:
        self.cycles += 1
        with metrics.RECONCILE_SECONDS.time():
            await self._cycle()

    async def _cycle(self) -> None:
        now = self._clock.now()
        snap, policy = self._snapshots.build(self._liveness, self._released)
        self._node_ids = tuple(snap.nodes)
        self._transitions.observe(snap)
        self._recheck_at = math.inf
        config = replace(self._settings.policy, queues={"default": DEFAULT_QUEUE, **policy.queues},
                         quotas=policy.quotas, usage=policy.usage)
        self._bounds.update(config.queues, config.quotas)
        await self._place(snap, config, now)
        self._observe(snap, now)
        await self._requeue(snap, now)
        await self._account_usage(snap, config, policy, now)
        for job_id, alloc in snap.allocations.items():
            job = snap.jobs.get(job_id)
            if job is None:
                # A terminal (or missing) job with an allocation cannot come from our transactions;
                # release it so its GPUs are not held forever, loudly.
                log.error("allocation without an active job; releasing", extra={"job_id": job_id})
                await self._writes.attempt(self._repo.write(release=alloc, alloc_rev=snap.allocation_revisions[job_id]))
                continue
            with log_context(job_id=job_id, trace_id=telemetry.trace_id_of(job.trace_parent)):
                restood = restand(job, alloc)
                if restood is not None:
                    # The job's priority changed while it runs: its gang's standing follows (preemption reads
                    # it); the gang is looked at again next cycle, from the record just written.
                    await self._writes.attempt(self._repo.write(alloc=restood,
                                                                alloc_rev=snap.allocation_revisions[job_id]))
                    continue
                await self._progress(snap, job, alloc, now)
        for node_id, strays in snap.orphans().items():
            node = snap.nodes.get(node_id)
            if node is None or node_id not in snap.alive:
                continue
            for job_id, attempt in strays:
                self._calls.stop_strays(node, job_id, attempt)

    def _observe(self, snap: ClusterSnapshot, now: float) -> None:
        # Gauges for a scrape every few seconds: set at most once a second, not on every cycle (a cycle runs on
        # every change, and the gauges walk every active job and allocation).
        mono = self._clock.monotonic()
        if mono - self._observed_at < OBSERVE_EVERY_S:
            return
        self._observed_at = mono
        if self._index_of is not snap:  # no placement this cycle (nothing to place): sync it here
            self._index.sync(snap)
            self._index_of = snap
        self._gauges.observe(snap, self._index, now)

    async def _place(self, snap: ClusterSnapshot, config: PolicyConfig, now: float) -> None:
        if not snap.jobs:
            self._pending = replace(EMPTY_ORDER, as_of=now)
            self.last_considered = 0
            return
        decided_from = telemetry.now_ns()
        result = place(snap, self._profile, config, now, self._settings.port_range, index=self._index)
        self._index_of = snap
        decided = (decided_from, telemetry.now_ns())
        self.last_result_size = len(result.decisions)
        self.last_considered = len(result.considered)
        self._pending = functools.partial(_order_of, snap, result, now)
        self._events.decided(len(result.decisions), len(result.preemptions))
        for p in result.preemptions:
            await self._placements.preempt(snap, config, p, now)
        gate = asyncio.Semaphore(self._settings.commit_concurrency)

        async def commit(d: Decision) -> None:
            async with gate:
                await self._placements.commit(snap, config, d, now, decided)
        # Decisions of one session never share a GPU, so their transactions are independent.
        await asyncio.gather(*(commit(d) for d in result.decisions))
        # The reasons of the jobs left waiting, written together (one transaction for a burst of submits).
        notes = self._reasons.notes(snap, result.unplaced)
        await asyncio.gather(*(self._writes.attempt(self._repo.annotate(job, rev)) for job, rev in notes))

    @property
    def pending(self) -> PendingOrder:
        """The queue as the last cycle ordered it (ListPending answers from it while this replica leads)."""
        if callable(self._pending):
            self._pending = self._pending()
        return self._pending

    async def _requeue(self, snap: ClusterSnapshot, now: float) -> None:
        for job in snap.jobs.values():
            if job.state is JobState.RESTARTING and job.id not in snap.allocations:
                nxt = due_for_requeue(job, now)
                if nxt is not None:
                    with log_context(job_id=job.id, trace_id=telemetry.trace_id_of(job.trace_parent)):
                        if await self._writes.attempt(self._repo.write(job=nxt, job_rev=snap.job_revisions[job.id])):
                            log.info("job requeued", extra={"attempt": nxt.attempt})

    async def _account_usage(self, snap: ClusterSnapshot, config: PolicyConfig, policy: PolicyState,
                             now: float) -> None:
        """Fold the GPUs each team holds into the decayed usage record, every usage interval."""
        mono = self._clock.monotonic()
        if mono - self._usage_written < self._settings.usage_interval_s:
            return
        self._usage_written = mono
        usage = decay_usage(policy.usage, snap.gpus_held(), now, config.fair_share_half_life_s)
        await self._writes.attempt(self._repo.put_usage(usage, policy.usage_revision))

    async def _progress(self, snap: ClusterSnapshot, job: Job, alloc: Allocation, now: float) -> None:
        fence = self._settings.worker_fence_s
        step = progress(job, alloc, snap.alive, now, snap.nodes,
                        infra_restart_limit=self._settings.max_infra_restarts, silence=snap.silence,
                        fence_s=fence + FENCE_MARGIN_S if fence else 0.0)
        if step.recheck_in is not None:
            self._recheck_at = min(self._recheck_at, self._clock.monotonic() + step.recheck_in)
        if step.writes:
            ok = await self._writes.attempt(self._repo.write(
                job=step.job, job_rev=snap.job_revisions[job.id] if step.job else 0,
                alloc=None if step.release else step.alloc,
                alloc_rev=snap.allocation_revisions[job.id], release=alloc if step.release else None))
            if not ok:
                return
            if step.release:
                remember(self._released, (job.id, alloc.attempt), self._clock.monotonic(), _RELEASES_REMEMBERED)
                restart = (metrics.restart_reason(job, step.job, alloc, snap.alive, snap.nodes)
                           if step.job is not None else None)
                if restart is not None:
                    self._events.restarted(restart, job.team)
            if step.job is not None and step.job.state != job.state:
                log.info("job %s", step.job.state.value, extra={"reason": step.job.message})
                if step.job.state.terminal:
                    metrics.JOBS_FINISHED.labels(step.job.state.value).inc()
        current = step.alloc or alloc
        for node_id in step.launch:
            launch = next(x for x in node_launches(job, current, self._settings.checkpoint_store)
                          if x.node_id == node_id)
            self._calls.launch(snap.nodes[node_id], launch, job.team, job.trace_parent)
        for node_id in step.stop:
            self._calls.stop(snap.nodes[node_id], current, job.trace_parent)


def _order_of(snap: ClusterSnapshot, result: PlacementResult, now: float) -> PendingOrder:
    reasons = {u.job_id: u.reason for u in result.unplaced}
    reasons.update((p.preemptor, f"preempting {', '.join(p.victims)}") for p in result.preemptions)
    return pending_order(snap.jobs, result.considered, (d.job_id for d in result.decisions), reasons, now)
