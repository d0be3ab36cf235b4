"""Extension points of placement. A plugin implements one point; a profile lists them by name.

Points, in the order a placement session uses them:
- NodeGate    (node) → None | reason. Once per node and cycle: may this node take new work at all
              (reachable, not cordoned, no stray workers)? Unhealthy GPUs are never offered.
- ModelFilter (job, model) → None | reason. Is this accelerator model acceptable to the job (exact
              model, any-of list, class: memory, compute capability, vendor)?
- ModelScore  (job, model, config) → expected throughput per GPU. The session tries acceptable models
              best first: a job runs on the fastest model that fits now.
- NodeFilter  (job, node view) → None | reason. Node-level conditions a job adds (its queue's
              partition labels, free CPUs).
- NodeScore   (job, node view) → float, lower first. Orders nodes inside the chosen domain.
- Admission   (job, model, gpus, ledger, config) → Verdict. Quotas and queue caps: may the team take these
              GPUs now, and is that within its guarantee or borrowed?
- QueueOrder  (job, ledger, config) → sort key. The order jobs are considered in, among equal standing.
- VictimCost  (victim job, allocation, now) → sort key, cheapest first. Preemption picks victims by it.

Plugins are pure and keep no state across calls: a session may call them in any order, many times.
A plugin's answer about a pending job (ModelFilter, ModelScore, NodeFilter, NodeScore, Admission) depends only
on the job's `placement_shape` (its team, queue, priority, resources, topology, time limit) and the other
arguments, never on its id, name, user or times: two waiting jobs of one shape get the same answers, and a
session decides the second as it decided the first while nothing was taken meanwhile (place.py). QueueOrder
and VictimCost may read anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..domain.models import Allocation, Job, Node
from ..domain.queues import PolicyConfig


def placement_shape(job: Job) -> tuple[object, ...]:
    """What placement reads of a pending job, besides the order it is taken in: jobs of equal shape are
    interchangeable to every plugin but QueueOrder and VictimCost (see above)."""
    spec, r = job.spec, job.spec.resources
    return (job.team, spec.queue, spec.priority_class, spec.priority, spec.time_limit_s, spec.topology, r.nodes,
            r.gpus_per_node, r.accelerator, r.accelerators, r.min_memory_gb, r.min_compute_capability, r.vendor,
            r.allow_mixed, r.cpus_per_node, tuple(sorted(r.speed_hints.items())), tuple(job.preempted_by))


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node as placement sees it: free healthy GPUs (any model) and free CPUs."""

    node: Node
    free_gpus: tuple[int, ...]
    alive: bool
    # The node still runs workers no allocation accounts for; they are being stopped.
    has_orphans: bool = False
    free_cpus: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One accelerator model as found in the fleet."""

    model: str
    vendor: str
    memory_mb: int
    compute_capability: str
    gpus: int = 0  # healthy GPUs of this model in the fleet


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    borrowed: bool = False
    reason: str = ""


@dataclass
class Ledger:
    """What teams and queues hold while a session runs (allocations plus this session's decisions)."""

    # team → accounting key (model or "*") → GPUs held within nominal / borrowed
    guaranteed: dict[str, dict[str, int]] = field(default_factory=dict)
    borrowed: dict[str, dict[str, int]] = field(default_factory=dict)
    # team → model → GPUs held (for fair share)
    holding: dict[str, dict[str, int]] = field(default_factory=dict)
    queue_gpus: dict[str, int] = field(default_factory=dict)
    capacity: Mapping[str, int] = field(default_factory=dict)

    def charge(self, team: str, queue: str, model: str, key: str, gpus: int, borrowed: bool) -> None:
        book = self.borrowed if borrowed else self.guaranteed
        row = book.setdefault(team, {})
        row[key] = row.get(key, 0) + gpus
        held = self.holding.setdefault(team, {})
        held[model] = held.get(model, 0) + gpus
        self.queue_gpus[queue] = self.queue_gpus.get(queue, 0) + gpus

    def used(self, team: str, key: str) -> tuple[int, int]:
        return self.guaranteed.get(team, {}).get(key, 0), self.borrowed.get(team, {}).get(key, 0)


class NodeGate(Protocol):
    name: str

    def admit(self, view: NodeView) -> str | None: ...


class ModelFilter(Protocol):
    name: str

    def filter(self, job: Job, model: ModelInfo) -> str | None: ...


class ModelScore(Protocol):
    name: str

    def score(self, job: Job, model: ModelInfo, config: PolicyConfig) -> float: ...


class NodeFilter(Protocol):
    name: str

    def applies(self, job: Job, config: PolicyConfig) -> bool:
        """Whether the filter constrains this job at all (skipping it keeps 10k-node sessions fast)."""
        ...

    def filter(self, job: Job, view: NodeView, config: PolicyConfig) -> str | None: ...


class NodeScore(Protocol):
    name: str

    def score(self, job: Job, view: NodeView) -> float: ...


class Admission(Protocol):
    name: str

    def admit(self, job: Job, model: str, gpus: int, ledger: Ledger, config: PolicyConfig) -> Verdict: ...


class QueueOrder(Protocol):
    name: str

    def key(self, job: Job, ledger: Ledger, config: PolicyConfig) -> tuple[float, ...]: ...

    def keys(self, jobs: Sequence[Job], ledger: Ledger, config: PolicyConfig) -> list[tuple[float, ...]]:
        """`key` of each of one team's jobs, with one ledger: what is the team's alone is worked out once (a
        session sorts each team's waiting jobs by it, every cycle)."""
        ...


class VictimCost(Protocol):
    name: str

    def cost(self, job: Job, alloc: Allocation, now: float) -> tuple[float, ...]: ...


@dataclass(frozen=True)
class Profile:
    """The plugins one scheduler runs at each point, in order."""

    gates: tuple[NodeGate, ...]
    model_filters: tuple[ModelFilter, ...]
    model_score: ModelScore
    node_filters: tuple[NodeFilter, ...]
    node_score: NodeScore
    admissions: tuple[Admission, ...]
    order: QueueOrder
    victim_cost: VictimCost
