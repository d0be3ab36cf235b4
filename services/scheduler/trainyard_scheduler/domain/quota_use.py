"""What a team holds now against its quota: GPUs in use and how many of them are borrowed, per quota key.

The keys are the ones placement accounts under (`TeamQuota.limit_for`): a model with its own entry is its own
key, every other model falls under "*" when the quota has that entry, and a model neither covers is its own
key (all of it borrowed, as placement treats it). A gang counts wholly as borrowed or not, as it was placed
(`Allocation.borrowed`): those are the gangs the owners of the idle quota reclaim first. A gang being stopped
still holds its GPUs and is counted until its allocation is gone. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .models import Allocation
from .queues import TeamQuota


@dataclass(frozen=True, slots=True)
class QuotaUse:
    in_use: int = 0
    borrowed: int = 0


def quota_key(quota: TeamQuota | None, model: str) -> str:
    found = quota.limit_for(model) if quota is not None else None
    return found[0] if found is not None else model


def quota_use(team: str, quota: TeamQuota | None, allocations: Iterable[Allocation]) -> Mapping[str, QuotaUse]:
    """`team`'s GPUs held now, by quota key; keys with nothing held are left out."""
    in_use: dict[str, int] = {}
    borrowed: dict[str, int] = {}
    for alloc in allocations:
        if alloc.team != team:
            continue
        for share in alloc.assignments:
            if not share.gpu_indices:
                continue
            key = quota_key(quota, share.model)
            in_use[key] = in_use.get(key, 0) + len(share.gpu_indices)
            if alloc.borrowed:
                borrowed[key] = borrowed.get(key, 0) + len(share.gpu_indices)
    return {key: QuotaUse(gpus, borrowed.get(key, 0)) for key, gpus in sorted(in_use.items())}
