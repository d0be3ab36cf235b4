"""Prometheus metrics of the scheduler (served when --metrics-port is set), and what sets the cluster's gauges
from a snapshot (`ClusterGauges`, once a second on the leader).

Label values are bounded: a queue is one the operator configured (others, e.g. a queue deleted while jobs
still name it, count as `_other`), a team one with a quota (the rest are `_other`: teams are not configured
anywhere else, and a job's team is whatever its token says), a gang size one of GANG_SIZES, a model one some
registered node has, a node state one of the API's (`NodeState` in types.proto), reasons one of their
closed vocabularies below. `_other` is no queue or team name: both start with a letter or digit.

The gauges of the cluster (queues, teams, models, node states) are the leader's: a replica that stops leading
removes them, so only the leader reports a queue.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from .domain.models import NODE_STATES, Allocation, Job, JobState, Node, node_state
from .domain.snapshot import ClusterSnapshot
from .policy.index import ClusterIndex

RECONCILE_SECONDS = Histogram(
    "trainyard_scheduler_reconcile_seconds", "Duration of one reconcile cycle (snapshot, decide, commit)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
RECONCILE_PAUSED_SECONDS = Counter(
    "trainyard_scheduler_reconcile_paused_seconds_total",
    "Seconds the reconcile loop rested after cycles, in proportion to the pending jobs each looked at "
    "(reconcile_pace_us_per_pending_job)")
GANGS_PLACED = Counter("trainyard_scheduler_gangs_placed_total", "Gangs committed to an allocation")
PLACEMENT_CONFLICTS = Counter("trainyard_scheduler_write_conflicts_total",
                              "Leader writes that lost a compare-and-swap (retried next cycle)")
JOBS = Gauge("trainyard_scheduler_jobs", "Active jobs by state", ["state"])
JOBS_FINISHED = Counter("trainyard_scheduler_jobs_finished_total", "Jobs that reached a terminal state", ["state"])
GPUS_ALLOCATED = Gauge("trainyard_scheduler_gpus_allocated", "GPUs held by allocations")
GPUS_TOTAL = Gauge("trainyard_scheduler_gpus_healthy", "Healthy GPUs on live nodes")
NODES = Gauge("trainyard_scheduler_nodes", "Registered nodes by liveness", ["alive"])
PULSES = Counter("trainyard_scheduler_pulses_total",
                 "Liveness pulses received from agents, by result (accepted, or why one was dropped)", ["result"])
PULSE_ACKS_DROPPED = Counter("trainyard_scheduler_pulse_acks_dropped_total",
                             "Pulse acknowledgements the kernel would not send (a full send buffer, no route)")
PULSE_SESSIONS = Gauge("trainyard_scheduler_pulse_sessions", "Open liveness pulse sessions (one per agent stream)")
IS_LEADER = Gauge("trainyard_scheduler_is_leader", "1 while this replica leads")
AGENT_CALL_FAILURES = Counter("trainyard_scheduler_agent_call_failures_total", "Failed launch/stop calls to agents",
                              ["kind"])
PREEMPTIONS = Counter("trainyard_scheduler_preemptions_total",
                      "Gangs stopped to make room for another job, by reason (priority: the preemptor outranks the "
                      "gang; reclaim: the preemptor's team takes back its quota from a gang running on borrowed "
                      "GPUs) and the victim's team", ["reason", "team"])
MIRROR_BEHIND = Counter("trainyard_scheduler_mirror_behind_total",
                        "Cycles skipped because the watch had not yet delivered this leader's own writes")
HISTORY_BACKLOG = Gauge("trainyard_scheduler_history_backlog_jobs",
                        "Finished jobs not yet written to the history store (they stay in etcd until they are); 0 on a "
                        "replica that does not lead")
HISTORY_ARCHIVED = Counter("trainyard_scheduler_history_archived_total", "Finished jobs written to the history store")
HISTORY_ERRORS = Counter("trainyard_scheduler_history_errors_total",
                         "Archiving and pruning passes that failed because the history store could not be reached")
# Named under the scheduler's prefix like every metric it exports (deploy/README.md's table is tested for it).
HISTORY_PRUNED = Counter("trainyard_scheduler_history_pruned_total",
                         "Rows the leader deleted from the history store past their retention, by kind (job: a job's "
                         "row with its labels; usage: a usage record)", ["kind"])
AUDIT_MOVED = Counter("trainyard_scheduler_audit_moved_total",
                      "Audit entries the leader moved from etcd into the history store")
AUDIT_BACKLOG = Gauge("trainyard_scheduler_audit_backlog_entries",
                      "Audit entries in etcd at the leader's last pass, not yet moved to the history store (they "
                      "stay there, under their retention lease, until they are); 0 on a replica that does not lead")
JOBS_EXPIRED = Counter("trainyard_scheduler_jobs_expired_total",
                       "Archived jobs removed from etcd once job_ttl_s had passed since they ended")
CREDENTIAL_RENEWALS = Counter("trainyard_scheduler_credential_renewals_total",
                              "Deliveries of a renewed checkpoint-store credential to a node of a running attempt, by "
                              "result (ok; unavailable: the agent could not be reached; refused: the agent said no; "
                              "error: not minted or the node is not registered). Failures are retried next pass",
                              ["result"])

RESTARTS = Counter("trainyard_scheduler_restarts_total",
                   "Placed jobs started again, by reason (failure: a rank failed, counted against max_restarts; "
                   "node_lost, gpu_unhealthy, infrastructure: an infrastructure failure, not counted against it; "
                   "requeue: someone asked for a requeue) and team", ["reason", "team"])
DECISIONS = Counter("trainyard_scheduler_decisions_total",
                    "Placement decisions taken, by kind (place: a gang given its GPUs; preempt: gangs chosen to "
                    "stop for a blocked job); rate() is decisions per second. A decision whose write loses a race "
                    "is taken again next cycle, and counted again", ["kind"])
QUEUE_DEPTH = Gauge("trainyard_scheduler_queue_depth",
                    "Jobs waiting to be placed (pending, held ones included), by queue and gang size (GPUs)",
                    ["queue", "gang"])
QUEUE_OLDEST_WAIT = Gauge("trainyard_scheduler_queue_oldest_wait_seconds",
                          "How long the longest-waiting job of the queue and gang size has waited (0: none waits)",
                          ["queue", "gang"])
QUEUE_WAIT = Histogram("trainyard_scheduler_queue_wait_seconds",
                       "Time from a job's (re)queueing to its gang's placement, by queue and gang size (GPUs)",
                       ["queue", "gang"],
                       buckets=(1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0,
                                86400.0))
TEAM_JOBS_WAITING = Gauge("trainyard_scheduler_team_jobs_waiting", "Jobs waiting to be placed, by team", ["team"])
TEAM_GPUS_ALLOCATED = Gauge("trainyard_scheduler_team_gpus_allocated", "GPUs held by the team's gangs", ["team"])
MODEL_GPUS_HEALTHY = Gauge("trainyard_scheduler_model_gpus_healthy", "Healthy GPUs on live nodes, by model",
                           ["model"])
MODEL_GPUS_ALLOCATED = Gauge("trainyard_scheduler_model_gpus_allocated",
                             "GPUs on live nodes held by gangs, by model", ["model"])
MODEL_ALLOCATION = Gauge("trainyard_scheduler_model_allocation_ratio",
                         "Allocated over healthy GPUs on live nodes, by model (0 when it has no healthy one; above "
                         "1 for a moment while a gang on a GPU that went unhealthy is being stopped)", ["model"])
NODES_BY_STATE = Gauge("trainyard_scheduler_nodes_by_state",
                       "Registered nodes by state as the API names them (ready, not_ready: its agent is not heard "
                       "from; cordoned: takes no new gang, whether or not alive)", ["state"])
NODES_LOST = Counter("trainyard_scheduler_nodes_lost_total",
                     "Registered nodes this leader saw go from alive to lost (sampled once a second)")

# --- label vocabularies --------------------------------------------------------------------------------------
OTHER = "_other"
# Gang sizes in GPUs (nodes times GPUs per node); "cpu" for a CPU task.
GANG_SIZES: tuple[str, ...] = ("cpu", "1", "2-8", "9-64", "65-512", "513+")
_GANG_BOUNDS: tuple[tuple[int, str], ...] = ((1, "1"), (8, "2-8"), (64, "9-64"), (512, "65-512"))
PREEMPTION_REASONS: tuple[str, ...] = ("priority", "reclaim")
RESTART_REASONS: tuple[str, ...] = ("failure", "node_lost", "gpu_unhealthy", "infrastructure", "requeue")
DECISION_KINDS: tuple[str, ...] = ("place", "preempt")


def gang_size(gpus: int) -> str:
    """The GANG_SIZES bucket of a gang of `gpus` GPUs."""
    if gpus <= 0:
        return "cpu"
    for bound, name in _GANG_BOUNDS:
        if gpus <= bound:
            return name
    return "513+"


def restart_reason(before: Job, after: Job, alloc: Allocation, alive: frozenset[str],
                   nodes: Mapping[str, Node]) -> str | None:
    """Why releasing `alloc` started `before` again (one of RESTART_REASONS), None when it did not: it ended,
    or went back to the queue after a preemption (counted as a preemption)."""
    if after.state is JobState.PENDING and alloc.requeued_by and not alloc.preempted_by:
        return "requeue"
    if after.state is not JobState.RESTARTING:
        return None
    if after.infra_restarts <= before.infra_restarts:
        return "failure"
    if any(n not in alive for n in alloc.node_ids):
        return "node_lost"
    for a in alloc.assignments:
        node = nodes.get(a.node_id)
        if node is not None and any(not g.healthy and g.index in a.gpu_indices for g in node.gpus):
            return "gpu_unhealthy"
    return "infrastructure"


class Bounds:
    """The label values allowed now: the configured queues and the teams with a quota (set every cycle)."""

    def __init__(self) -> None:
        self.queues: Mapping[str, object] = {}
        self.teams: Mapping[str, object] = {}

    def update(self, queues: Mapping[str, object], teams: Mapping[str, object]) -> None:
        self.queues, self.teams = queues, teams

    def queue(self, name: str) -> str:
        return name if name in self.queues else OTHER

    def team(self, name: str) -> str:
        return name if name in self.teams else OTHER


class Events:
    """The counters and the wait histogram set on events of the leader's cycle, their children kept."""

    def __init__(self, bounds: Bounds) -> None:
        self._bounds = bounds
        self._decisions = {kind: DECISIONS.labels(kind) for kind in DECISION_KINDS}

    def decided(self, placed: int, preempting: int) -> None:
        if placed:
            self._decisions["place"].inc(placed)
        if preempting:
            self._decisions["preempt"].inc(preempting)

    def placed(self, job: Job, now: float) -> None:
        queued = job.queued_at or job.created_at
        QUEUE_WAIT.labels(self._bounds.queue(job.spec.queue), gang_size(job.spec.resources.total_gpus)).observe(
            max(0.0, now - queued))

    def preempted(self, reason: str, team: str) -> None:
        PREEMPTIONS.labels(reason, self._bounds.team(team)).inc()

    def restarted(self, reason: str, team: str) -> None:
        RESTARTS.labels(reason, self._bounds.team(team)).inc()


class _Family:
    """A labelled gauge published whole: the series it published before and not now are removed. Each value
    is set through `labels()` (a few hundred a second at most), not a kept child: a series another reconciler
    of the process removed (tests run one leader after another) comes back with the next publication."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self._keys: set[tuple[str, ...]] = set()

    def publish(self, values: Mapping[tuple[str, ...], float]) -> None:
        for key in self._keys - values.keys():
            self._gauge.remove(*key)  # a no-op for a series removed already
        self._keys = set(values)
        for key, value in values.items():
            self._gauge.labels(*key).set(value)

    def clear(self) -> None:
        self.publish({})


def _grid(first: Iterable[str], second: Iterable[str]) -> dict[tuple[str, ...], float]:
    return {(a, b): 0.0 for a in first for b in second}


class ClusterGauges:
    """Sets the cluster's gauges from a snapshot. Costs a walk over the active jobs and the allocations; the
    nodes are walked only when their records or liveness changed, the GPUs not at all (the placement index
    keeps the healthy ones per model)."""

    def __init__(self, bounds: Bounds) -> None:
        self._bounds = bounds
        self._depth = _Family(QUEUE_DEPTH)
        self._oldest = _Family(QUEUE_OLDEST_WAIT)
        self._team_waiting = _Family(TEAM_JOBS_WAITING)
        self._team_gpus = _Family(TEAM_GPUS_ALLOCATED)
        self._healthy = _Family(MODEL_GPUS_HEALTHY)
        self._allocated = _Family(MODEL_GPUS_ALLOCATED)
        self._ratio = _Family(MODEL_ALLOCATION)
        self._states = _Family(NODES_BY_STATE)
        self._seen: tuple[object, object] | None = None
        self._alive: frozenset[str] | None = None

    def observe(self, snap: ClusterSnapshot, index: ClusterIndex, now: float) -> None:
        """`index`: the placement index, synced from `snap`."""
        self._jobs(snap, now)
        self._gpus(snap, index)
        self._nodes(snap)

    def _jobs(self, snap: ClusterSnapshot, now: float) -> None:
        # The labels of each (queue, gang shape) and team are worked out once per observation, not per job: the
        # walk is over every active job (tens of thousands at 10k nodes) once a second, on the leader's loop.
        bounds = self._bounds
        by_state: dict[JobState, int] = {}
        depth = _grid(bounds.queues, GANG_SIZES)
        first: dict[tuple[str, ...], float] = {}
        waiting: dict[tuple[str, ...], float] = {(team,): 0.0 for team in bounds.teams}
        keys: dict[tuple[str, int, int], tuple[str, ...]] = {}
        teams: dict[str, tuple[str, ...]] = {}
        pending = JobState.PENDING
        for job in snap.jobs.values():
            state = job.state
            by_state[state] = by_state.get(state, 0) + 1
            if state is not pending:
                continue
            spec = job.spec
            shape = (spec.queue, spec.resources.nodes, spec.resources.gpus_per_node)
            key = keys.get(shape)
            if key is None:
                key = keys[shape] = (bounds.queue(shape[0]), gang_size(shape[1] * shape[2]))
            depth[key] = depth.get(key, 0.0) + 1
            queued = job.queued_at or job.created_at
            if queued < first.get(key, math.inf):
                first[key] = queued
            team = teams.get(job.team)
            if team is None:
                team = teams[job.team] = (bounds.team(job.team),)
            waiting[team] = waiting.get(team, 0.0) + 1
        for state in (JobState.PENDING, JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTED, JobState.RESTARTING):
            JOBS.labels(state.value).set(by_state.get(state, 0))
        self._depth.publish(depth)
        self._oldest.publish({key: max(0.0, now - first[key]) if key in first else 0.0 for key in depth})
        self._team_waiting.publish(waiting)

    def _gpus(self, snap: ClusterSnapshot, index: ClusterIndex) -> None:
        alive = snap.alive
        total = 0
        by_team: dict[tuple[str, ...], float] = {(team,): 0.0 for team in self._bounds.teams}
        teams: dict[str, tuple[str, ...]] = {}
        allocated: dict[str, int] = {}
        for alloc in snap.allocations.values():
            name = alloc.team
            if not name:
                job = snap.jobs.get(alloc.job_id)
                name = job.team if job is not None else ""
            team = teams.get(name)
            if team is None:
                team = teams[name] = (self._bounds.team(name),)
            for a in alloc.assignments:
                gpus = len(a.gpu_indices)
                if not gpus:
                    continue
                total += gpus
                by_team[team] = by_team.get(team, 0.0) + gpus
                if a.node_id in alive:
                    model = a.model or index.model_of.get((a.node_id, a.gpu_indices[0]), "") or "unknown"
                    allocated[model] = allocated.get(model, 0) + gpus
        GPUS_ALLOCATED.set(total)
        healthy = index.capacity
        GPUS_TOTAL.set(sum(healthy.values()))
        self._team_gpus.publish(by_team)
        models = sorted(set(healthy) | set(allocated))
        self._healthy.publish({(m,): float(healthy.get(m, 0)) for m in models})
        self._allocated.publish({(m,): float(allocated.get(m, 0)) for m in models})
        self._ratio.publish({(m,): allocated.get(m, 0) / healthy[m] if healthy.get(m) else 0.0 for m in models})

    def _nodes(self, snap: ClusterSnapshot) -> None:
        alive = snap.alive
        if self._alive is not None and alive is not self._alive:
            lost = len((self._alive - alive) & snap.nodes.keys())
            if lost:
                NODES_LOST.inc(lost)
        self._alive = alive
        if self._seen is not None and self._seen[0] is snap.nodes and self._seen[1] is alive:
            return  # the same read-only node map and live set as last time: the same counts
        self._seen = (snap.nodes, alive)
        counts = dict.fromkeys(NODE_STATES, 0)
        for node_id, node in snap.nodes.items():
            counts[node_state(node, node_id in alive)] += 1
        self._states.publish({(state,): float(n) for state, n in counts.items()})
        NODES.labels("true").set(len(alive))
        NODES.labels("false").set(len(snap.nodes) - len(alive))

    def clear(self) -> None:
        """This replica stopped leading: the cluster's gauges are no longer its to report."""
        for family in (self._depth, self._oldest, self._team_waiting, self._team_gpus, self._healthy,
                       self._allocated, self._ratio, self._states):
            family.clear()
        self._seen = None
        self._alive = None

