"""Why each waiting job waits, written to the job for its user to read (`message`), at most so often.

The reason placement gives a job that it could not place moves with the cluster (a node frees up, another job
takes the GPUs): rewritten on every cycle, a queue of thousands would be a write storm. So a job's reason is
written when it differs from what the job says, and at most once per `interval_s` per job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from trainyard_core.bounded import remember

from .domain.models import Job
from .domain.snapshot import ClusterSnapshot
from .policy.place import Unplaced

# The most jobs whose last rewrite is remembered (the oldest are forgotten first: at worst written again).
_REMEMBERED = 100_000


class PendingReasons:
    def __init__(self, interval_s: float, monotonic: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._monotonic = monotonic
        self._written: dict[str, float] = {}  # job id → when its reason was last rewritten (monotonic)

    def notes(self, snap: ClusterSnapshot, unplaced: Iterable[Unplaced]) -> list[tuple[Job, int]]:
        """For each job placement left waiting, the record that tells its user why, and the revision it replaces;
        none for a job that says so already or was told otherwise less than `interval_s` ago."""
        out = []
        mono = self._monotonic()
        for u in unplaced:
            job = snap.jobs.get(u.job_id)
            if job is None or job.message == u.reason:
                continue
            if mono - self._written.get(job.id, -math.inf) < self._interval_s:
                continue
            remember(self._written, job.id, mono, _REMEMBERED)
            out.append((replace(job, message=u.reason), snap.job_revisions[job.id]))
        return out
