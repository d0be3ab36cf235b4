"""Admission: team quotas per accelerator model (guaranteed vs borrowed) and queue GPU caps."""

from __future__ import annotations

from ...domain.models import Job
from ...domain.queues import PolicyConfig
from ..api import Ledger, Verdict


class TeamQuota:
    """Within the team's nominal GPUs of the model: guaranteed. Above it, up to nominal + borrow_limit:
    borrowed (idle capacity, reclaimable). Beyond that: wait. A team without a quota entry borrows
    everything it runs (so any team with a quota can reclaim from it)."""

    name = "team-quota"

    def admit(self, job: Job, model: str, gpus: int, ledger: Ledger, config: PolicyConfig) -> Verdict:
        quota = config.quotas.get(job.team)
        found = quota.limit_for(model) if quota is not None else None
        if found is None:
            return Verdict(ok=True, borrowed=True)
        key, limit = found
        guaranteed, borrowed = ledger.used(job.team, key)
        # The ceiling bounds everything the team holds, however it was accounted when placed.
        if guaranteed + borrowed + gpus > limit.ceiling:
            return Verdict(ok=False, reason=(f"team {job.team} would exceed its {key} quota "
                                             f"({guaranteed + borrowed} held + {gpus} > nominal {limit.nominal}"
                                             f" + borrow limit {limit.borrow_limit})"))
        return Verdict(ok=True, borrowed=guaranteed + gpus > limit.nominal)


class QueueCap:
    """A queue with `max_gpus` never holds more than that many GPUs at once."""

    name = "queue-cap"

    def admit(self, job: Job, model: str, gpus: int, ledger: Ledger, config: PolicyConfig) -> Verdict:
        cap = config.queue(job.spec.queue).max_gpus
        held = ledger.queue_gpus.get(job.spec.queue, 0)
        if cap and held + gpus > cap:
            return Verdict(ok=False, reason=f"queue {job.spec.queue} holds {held} of its {cap} GPUs")
        return Verdict(ok=True)
