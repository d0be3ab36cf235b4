"""Queues, priority classes, team quotas and fair-share usage: the operator's policy, as data.

Where each lives:
- Priority classes and accelerator speed factors: the scheduler's settings (static per deployment).
- Queues and team quotas: etcd (`{p}/queues/<name>`, `{p}/quotas/<team>`), changed at run time through
  the gateway's admin API; every replica's mirror sees them.
- Fair-share usage: etcd (`{p}/usage`), one record the leader rewrites every few seconds, so a new
  leader continues the decayed history instead of starting from zero.

A job's standing is `(queue tier, class value, priority)`, compared lexicographically; fair share only
orders jobs of equal standing. Quotas are per team and per accelerator model (`"*"` counts every
model): work within the team's `nominal` GPUs is guaranteed; above it the team *borrows* idle GPUs up
to `borrow_limit` more, and borrowed gangs are the first to be reclaimed when an owner needs its quota.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from trainyard_core import contract
from trainyard_core.contract import ANY_MODEL as ANY_MODEL
from trainyard_core.contract import MAX_GPUS as MAX_GPUS
from trainyard_core.errors import InvalidArgument

# Queue names, as the policy servicer checks them before a record is built.
NAME_RE = re.compile(contract.QUEUE_NAME.pattern)


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """`value` orders classes (higher first). `preemptible`: gangs of this class may be stopped for a job
    of higher standing. `can_preempt`: jobs of this class may stop others (by standing, or to reclaim
    their team's quota)."""

    name: str
    value: int
    preemptible: bool = True
    can_preempt: bool = True


DEFAULT_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass("low", -100, preemptible=True, can_preempt=False),
    PriorityClass("normal", 0, preemptible=True, can_preempt=True),
    PriorityClass("high", 100, preemptible=True, can_preempt=True),
    PriorityClass("critical", 1000, preemptible=False, can_preempt=True),
)
DEFAULT_CLASS = "normal"


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A named queue. `tier` orders queues (higher first, like Slurm's partition PriorityTier);
    `node_labels` restricts its jobs to nodes carrying all of them (a partition); `max_gpus` caps the
    GPUs its jobs hold at once (0: no cap)."""

    name: str
    tier: int = 0
    node_labels: Mapping[str, str] = field(default_factory=dict)
    max_gpus: int = 0
    description: str = ""


DEFAULT_QUEUE = QueueConfig(contract.DEFAULT_QUEUE)


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    nominal: int
    # GPUs the team may use above nominal when they are idle; None: no limit.
    borrow_limit: int | None = None

    @property
    def ceiling(self) -> float:
        return math.inf if self.borrow_limit is None else self.nominal + self.borrow_limit


@dataclass(frozen=True, slots=True)
class TeamQuota:
    """`limits` per accelerator model (or ANY_MODEL); `weight` scales the team's fair share."""

    team: str
    limits: Mapping[str, QuotaLimit] = field(default_factory=dict)
    weight: float = 1.0

    def limit_for(self, model: str) -> tuple[str, QuotaLimit] | None:
        """The limit that governs `model` and the key it is accounted under."""
        if model in self.limits:
            return model, self.limits[model]
        if ANY_MODEL in self.limits:
            return ANY_MODEL, self.limits[ANY_MODEL]
        return None


@dataclass(frozen=True)
class FairShareUsage:
    """Decayed GPU-seconds per team and model, as of `at` (wall-clock seconds)."""

    at: float = 0.0
    by_team: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


def decay_usage(usage: FairShareUsage, holding: Mapping[str, Mapping[str, int]], now: float,
                half_life_s: float) -> FairShareUsage:
    """Advance usage to `now`: old usage halves every `half_life_s`, and the GPUs each team holds now
    (`holding[team][model]`) are added for the elapsed time (integrated exactly under the decay)."""
    dt = max(0.0, now - usage.at) if usage.at else 0.0
    keep = 0.5 ** (dt / half_life_s) if half_life_s > 0 else 0.0
    # ∫_0^dt g·2^(-(dt-s)/h) ds = g·h/ln2·(1 - 2^(-dt/h))
    gain = (half_life_s / math.log(2)) * (1 - keep) if half_life_s > 0 else dt
    out: dict[str, dict[str, float]] = {}
    for team in set(usage.by_team) | set(holding):
        old = usage.by_team.get(team, {})
        now_held = holding.get(team, {})
        row = {}
        for model in set(old) | set(now_held):
            v = old.get(model, 0.0) * keep + now_held.get(model, 0) * gain
            if v > 1e-6:
                row[model] = v
        if row:
            out[team] = row
    return FairShareUsage(at=now, by_team=out)


def dominant_share(usage: Mapping[str, float], capacity: Mapping[str, int], weight: float,
                   half_life_s: float) -> float:
    """Dominant Resource Fairness over accelerator models: the team's largest share of any one model's
    capacity (usage normalised by what holding the whole model for ever would accumulate), divided by
    its weight. Lower goes first."""
    horizon = half_life_s / math.log(2) if half_life_s > 0 else 1.0
    best = 0.0
    for model, used in usage.items():
        cap = capacity.get(model, 0)
        if cap > 0:
            best = max(best, used / (cap * horizon))
    return best / weight if weight > 0 else math.inf


@dataclass(frozen=True)
class PolicyConfig:
    """Everything placement needs from the operator. Immutable; built once per cycle from settings
    and the mirror."""

    classes: Mapping[str, PriorityClass] = field(
        default_factory=lambda: {c.name: c for c in DEFAULT_CLASSES})
    default_class: str = DEFAULT_CLASS
    queues: Mapping[str, QueueConfig] = field(default_factory=lambda: {"default": DEFAULT_QUEUE})
    quotas: Mapping[str, TeamQuota] = field(default_factory=dict)
    # Relative throughput per GPU of each model (A100 = 1.0 by convention); unknown models get 1.0.
    speed_factors: Mapping[str, float] = field(default_factory=dict)
    usage: FairShareUsage = FairShareUsage()
    fair_share_half_life_s: float = 3600.0
    # How many blocked jobs (highest standing first) hold a reservation that backfill must respect.
    reservation_depth: int = 1
    preemption: bool = True
    # Blocked jobs per session that may look for victims (bounds a session's work at 10k nodes).
    max_preemptors: int = 16
    # A gang may not be preempted before it has run this long, doubled for each time its job was preempted
    # before (capped at 64x): a job preempted again and again still gets to its next checkpoint
    # (Slurm's PreemptExemptTime, with backoff).
    preempt_exempt_s: float = 0.0
    # Blocked jobs per session, beyond reservation_depth, whose reservation search may come up empty (they
    # would not fit even with every gang ended) before the session stops looking.
    max_reservation_misses: int = 4

    def exempt_until(self, placed_at: float, times_preempted: int) -> float:
        return placed_at + self.preempt_exempt_s * float(2 ** min(times_preempted, 6))

    def priority_class(self, name: str) -> PriorityClass:
        return self.classes.get(name or self.default_class) or self.classes[self.default_class]

    def queue(self, name: str) -> QueueConfig:
        return self.queues.get(name) or (DEFAULT_QUEUE if name == "default" else QueueConfig(name))

    def speed(self, model: str, hints: Mapping[str, float]) -> float:
        return hints.get(model) or self.speed_factors.get(model) or 1.0


# --- validation of operator input ----------------------------------------------------------------------

def validate_queue(q: QueueConfig) -> None:
    problems: list[str] = []
    if not contract.QUEUE_NAME.matches(q.name):
        problems.append(f"queue name {q.name[:80]!r} must be {contract.QUEUE_NAME.rule}")
    lo, hi = contract.MIN_QUEUE_TIER, contract.MAX_QUEUE_TIER
    if not lo <= q.tier <= hi:
        problems.append(f"tier must be between {lo} and {hi}, got {q.tier}")
    if not 0 <= q.max_gpus <= MAX_GPUS:
        problems.append(f"max_gpus must be between 0 (no cap) and {MAX_GPUS}, got {q.max_gpus}")
    if len(q.node_labels) > contract.MAX_NODE_LABELS:
        problems.append(f"node_labels: at most {contract.MAX_NODE_LABELS}")
    for k, v in q.node_labels.items():
        if not contract.LABEL_KEY.matches(k):
            problems.append(f"node label {k[:80]!r} must be {contract.LABEL_KEY.rule}")
        if len(v) > contract.MAX_NODE_LABEL_VALUE_LENGTH:
            problems.append(f"node label {k[:80]!r}: values are at most {contract.MAX_NODE_LABEL_VALUE_LENGTH} "
                            "characters")
    if len(q.description) > contract.MAX_QUEUE_DESCRIPTION:
        problems.append(f"description: at most {contract.MAX_QUEUE_DESCRIPTION} characters")
    if problems:
        raise InvalidArgument("invalid queue: " + "; ".join(problems))


def validate_quota(q: TeamQuota) -> None:
    problems: list[str] = []
    if not contract.TEAM.matches(q.team):
        problems.append(f"team {q.team[:80]!r} must be {contract.TEAM.rule}")
    if not (0 < q.weight <= contract.MAX_QUOTA_WEIGHT) or math.isnan(q.weight):
        problems.append(f"weight must be > 0 and <= {contract.MAX_QUOTA_WEIGHT:g}, got {q.weight}")
    if len(q.limits) > contract.MAX_QUOTA_MODELS:
        problems.append(f"at most {contract.MAX_QUOTA_MODELS} accelerator models per quota")
    for model, lim in q.limits.items():
        if not contract.MODEL_NAME.matches(model):
            problems.append(f"accelerator model {model[:80]!r} must be {contract.MODEL_NAME.rule}, or "
                            f"'{ANY_MODEL}' for any model")
        if not 0 <= lim.nominal <= MAX_GPUS:
            problems.append(f"{model}: nominal must be between 0 and {MAX_GPUS}, got {lim.nominal}")
        if lim.borrow_limit is not None and not 0 <= lim.borrow_limit <= MAX_GPUS:
            problems.append(f"{model}: borrow_limit must be between 0 and {MAX_GPUS} (or unset for no "
                            f"limit), got {lim.borrow_limit}")
    if problems:
        raise InvalidArgument("invalid quota: " + "; ".join(problems))


def validate_classes(classes: Iterable[PriorityClass], default: str) -> None:
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise InvalidArgument("priority class names must be unique")
    if default not in names:
        raise InvalidArgument(f"default priority class {default!r} is not one of {', '.join(names)}")
    for c in classes:
        if not contract.PRIORITY_CLASS.matches(c.name):
            raise InvalidArgument(f"priority class name {c.name!r} must be {contract.PRIORITY_CLASS.rule}")


def standing(queue: str, priority_class: str, priority: int, config: PolicyConfig) -> tuple[int, int, int]:
    """A job's standing: (queue tier, class value, priority); higher goes first and may preempt lower."""
    return config.queue(queue).tier, config.priority_class(priority_class).value, priority
