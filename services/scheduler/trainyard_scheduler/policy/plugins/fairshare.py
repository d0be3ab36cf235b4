"""Queue order: standing first (queue tier, class, priority), then the team's dominant share with usage
decay (lower first), then submission order."""

from __future__ import annotations

from ...domain.models import Job
from ...domain.queues import PolicyConfig, dominant_share, standing
from ..api import Ledger


class FairShare:
    name = "fair-share"

    def key(self, job: Job, ledger: Ledger, config: PolicyConfig) -> tuple[float, ...]:
        tier, cls, prio = standing(job.spec.queue, job.spec.priority_class, job.spec.priority, config)
        quota = config.quotas.get(job.team)
        weight = quota.weight if quota is not None else 1.0
        # Usage history plus what the team holds now (one half-life's worth), so a team that just got
        # GPUs in this session yields to the others at once.
        hist = dict(config.usage.by_team.get(job.team, {}))
        horizon = config.fair_share_half_life_s / 0.6931471805599453
        for model, held in ledger.holding.get(job.team, {}).items():
            hist[model] = hist.get(model, 0.0) + held * horizon
        share = dominant_share(hist, ledger.capacity, weight, config.fair_share_half_life_s)
        return (-tier, -cls, -prio, share, job.queued_at or job.created_at)


class Fifo:
    """Standing, then submission order; no fair share (for sites that want strict FIFO within priority)."""

    name = "fifo"

    def key(self, job: Job, ledger: Ledger, config: PolicyConfig) -> tuple[float, ...]:
        tier, cls, prio = standing(job.spec.queue, job.spec.priority_class, job.spec.priority, config)
        return (-tier, -cls, -prio, job.queued_at or job.created_at)
