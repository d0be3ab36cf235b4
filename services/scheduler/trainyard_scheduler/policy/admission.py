"""Which accelerator models a job may run on, fastest first (the profile's model filters and score), and
whether its team's and queue's quotas admit it on each now (the profile's admissions over the ledger).

Separate from the session because it decides nothing about nodes or GPUs: it narrows and orders the models
the session then looks for room in, and keeps its own cache (jobs of one accelerator request get one
answer per session).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..domain.models import Job

if TYPE_CHECKING:
    from .place import _Session


class ModelAdmission:
    """A session's model choice (cached per accelerator request) and quota admission (read from the ledger,
    which the session charges at every decision, so never cached)."""

    def __init__(self) -> None:
        self._models_cache: dict[tuple[object, ...], tuple[list[str], str]] = {}

    def models(self, s: _Session, job: Job) -> tuple[list[str], str]:
        r = job.spec.resources
        shape = (r.accelerator, r.accelerators, r.vendor, r.min_memory_gb, r.min_compute_capability,
                 tuple(sorted(r.speed_hints.items())))
        hit = self._models_cache.get(shape)
        if hit is not None:
            return hit
        ok: list[tuple[float, str]] = []
        reasons: list[str] = []
        for model, info in s.catalog.items():
            rejected = next((x for f in s.profile.model_filters if (x := f.filter(job, info)) is not None), None)
            if rejected is None:
                ok.append((-s.profile.model_score.score(job, info, s.config), model))
            else:
                reasons.append(f"{model}: {rejected}")
        found = [m for _, m in sorted(ok)], "; ".join(reasons) or "no GPUs registered"
        self._models_cache[shape] = found
        return found

    def admit(self, s: _Session, job: Job, model: str) -> tuple[bool, bool, str]:
        borrowed = False
        gpus = job.spec.resources.total_gpus
        for adm in s.profile.admissions:
            v = adm.admit(job, model, gpus, s.ledger, s.config)
            if not v.ok:
                return False, False, v.reason
            borrowed = borrowed or v.borrowed
        return True, borrowed, ""
