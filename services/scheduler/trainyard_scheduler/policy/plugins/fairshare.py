"""Queue order: standing first (queue tier, class, priority), then the team's dominant share with usage
decay (lower first), then submission order."""

from __future__ import annotations

from collections.abc import Sequence

from ...domain.models import Job
from ...domain.queues import PolicyConfig, dominant_share, standing
from ..api import Ledger


class FairShare:
    name = "fair-share"

    def key(self, job: Job, ledger: Ledger, config: PolicyConfig) -> tuple[float, ...]:
        return _keyed(job, config, _team_share(job.team, ledger, config))

    def keys(self, jobs: Sequence[Job], ledger: Ledger, config: PolicyConfig) -> list[tuple[float, ...]]:
        shares: dict[str, float] = {}
        out = []
        for job in jobs:
            share = shares.get(job.team)
            if share is None:
                share = shares[job.team] = _team_share(job.team, ledger, config)
            out.append(_keyed(job, config, share))
        return out


def _team_share(team: str, ledger: Ledger, config: PolicyConfig) -> float:
    quota = config.quotas.get(team)
    weight = quota.weight if quota is not None else 1.0
    # Usage history plus what the team holds now (one half-life's worth), so a team that just got
    # GPUs in this session yields to the others at once.
    hist = dict(config.usage.by_team.get(team, {}))
    horizon = config.fair_share_half_life_s / 0.6931471805599453
    for model, held in ledger.holding.get(team, {}).items():
        hist[model] = hist.get(model, 0.0) + held * horizon
    return dominant_share(hist, ledger.capacity, weight, config.fair_share_half_life_s)


def _keyed(job: Job, config: PolicyConfig, share: float) -> tuple[float, ...]:
    tier, cls, prio = standing(job.spec.queue, job.spec.priority_class, job.spec.priority, config)
    return (-tier, -cls, -prio, share, job.queued_at or job.created_at)


class Fifo:
    """Standing, then submission order; no fair share (for sites that want strict FIFO within priority)."""

    name = "fifo"

    def key(self, job: Job, ledger: Ledger, config: PolicyConfig) -> tuple[float, ...]:
        tier, cls, prio = standing(job.spec.queue, job.spec.priority_class, job.spec.priority, config)
        return (-tier, -cls, -prio, job.queued_at or job.created_at)

    def keys(self, jobs: Sequence[Job], ledger: Ledger, config: PolicyConfig) -> list[tuple[float, ...]]:
        return [self.key(job, ledger, config) for job in jobs]
