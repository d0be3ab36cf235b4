"""`load_latest`, run by every rank of a gang: the newest committed checkpoint that is intact.

    rank 0: next candidate (the job's latest first, then every other COMMITTED one by step, newest first)
            and a restore lease on it ──broadcast──▶
    every rank: its share of existence/size checks + verified .metadata ──all_gather of problems──▶
    every rank: DCP load through TrainyardReader (verifies each chunk it reads; reshards as DCP does)

A damaged candidate (a file missing, truncated, or a chunk whose checksum differs, found by any rank) is
logged with the shard and the chunk, reported to the service by rank 0 (which checks it and marks it
DAMAGED, moving the job's latest pointer back so later saves are accepted) and skipped by every rank
together; the next one is tried. Any other
failure (the state dict does not match the checkpoint, storage unreachable) is raised: falling back then
would silently resume from older weights for a reason that older checkpoints share.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from .env import ClientSettings
from .errors import CheckpointError, NoUsableCheckpoint, ShardCorrupt, from_dcp, integrity_failures
from .gang import Gang
from .reader import TrainyardReader, precheck
from .service import CheckpointInfo, ServiceClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Skipped:
    checkpoint_id: str
    step: int
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What `load_latest` did: the checkpoint loaded (None: the job had none) and those skipped as damaged."""

    checkpoint: CheckpointInfo | None
    skipped: tuple[Skipped, ...] = field(default=())

    @property
    def step(self) -> int | None:
        return None if self.checkpoint is None else self.checkpoint.step


class _Candidates:
    """Rank 0's iterator over the job's committed checkpoints, newest first, asking the service lazily:
    the common case (the latest is fine) costs one call."""

    def __init__(self, service: ServiceClient, job_id: str) -> None:
        self._service = service
        self._job_id = job_id
        self._tried: set[str] = set()
        self._listed: list[CheckpointInfo] | None = None

    def next(self) -> CheckpointInfo | None:
        if not self._tried:
            latest = self._service.latest(self._job_id)
            if latest is not None:
                self._tried.add(latest.id)
                return latest
        if self._listed is None:
            committed = [c for c in self._service.list_all(self._job_id) if c.committed]
            self._listed = sorted(committed, key=lambda c: (c.step, c.id), reverse=True)
        for c in self._listed:
            if c.id not in self._tried:
                self._tried.add(c.id)
                return c
        return None


def _unique(problems: list[ShardCorrupt]) -> list[ShardCorrupt]:
    seen: dict[tuple[str, str], ShardCorrupt] = {}
    for p in problems:
        seen.setdefault((p.shard, p.detail), p)
    return sorted(seen.values(), key=lambda p: p.shard)


def _try_load(state_dict: dict[str, Any], ckpt: CheckpointInfo, gang: Gang, settings: ClientSettings,
              planner: LoadPlanner | None) -> list[ShardCorrupt]:
    """Load `ckpt` into `state_dict`; the integrity problems found (empty: loaded)."""
    try:
        metadata_bytes, mine = precheck(ckpt, gang.rank, gang.world_size)
    except OSError as e:
        mine, metadata_bytes = [ShardCorrupt("?", f"cannot be read: {e}", ckpt.location)], b""
    problems = _unique([p for rank_problems in gang.all_gather(mine) for p in rank_problems])
    if problems:
        return problems
    reader = TrainyardReader(ckpt, metadata_bytes=metadata_bytes, thread_count=settings.thread_count)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state_dict, storage_reader=reader, planner=planner, process_group=gang.group,
                     no_dist=not gang.distributed)
    except CheckpointException as e:
        failures = {rank: pair[0] for rank, pair in e.failures.items()}
        damaged = integrity_failures(failures)
        if damaged is None:
            raise from_dcp(e, f"loading checkpoint {ckpt.id} (step {ckpt.step})") from None
        return _unique(damaged)
    return []


def _pick(candidates: _Candidates, service: ServiceClient, settings: ClientSettings
          ) -> tuple[CheckpointInfo | None, str | None] | CheckpointError:
    """Rank 0: the next candidate with a restore lease on it (None: no candidate left), or the error."""
    holder = f"{settings.job_id} attempt {settings.attempt}"
    try:
        while (ckpt := candidates.next()) is not None:
            try:
                return ckpt, service.acquire_restore_lease(ckpt.id, settings.restore_lease_ttl_s, holder)
            except CheckpointError as e:  # deleted since it was listed
                log.warning("skipping checkpoint %s: %s", ckpt.id, e)
        return None, None
    except CheckpointError as e:
        return e


def _report(service: ServiceClient, ckpt: CheckpointInfo, problems: list[ShardCorrupt]) -> None:
    """Rank 0 tells the service, which checks the shards itself; once it marks the checkpoint DAMAGED
    the job's latest pointer no longer names it, so this attempt can save those steps again. A report
    the service does not confirm is logged: the load still falls back, since this reader saw damage."""
    recorded = {s.path for s in ckpt.shards}
    paths = [p.shard for p in problems if p.shard in recorded]
    try:
        latest = service.report_damaged(ckpt.id, paths, "; ".join(str(p) for p in problems))
        log.warning("checkpoint %s is marked damaged; the job's latest checkpoint is now %s", ckpt.id,
                    latest or "none")
    except CheckpointError as e:
        log.warning("the checkpoint-store did not mark %s damaged: %s", ckpt.id, e)


def load_latest_collective(state_dict: dict[str, Any], *, gang: Gang, settings: ClientSettings,
                           service: Callable[[], ServiceClient],
                           planner: LoadPlanner | None = None) -> LoadOutcome:
    candidates = _Candidates(service(), settings.job_id) if gang.rank == 0 else None
    skipped: list[Skipped] = []
    while True:
        picked = _pick(candidates, service(), settings) if candidates is not None else None
        picked = gang.broadcast(picked)
        if isinstance(picked, CheckpointError):
            raise picked
        ckpt, lease = picked
        if ckpt is None:
            if skipped:
                raise NoUsableCheckpoint(
                    f"job {settings.job_id} has no intact checkpoint; skipped: "
                    + "; ".join(f"{s.checkpoint_id} (step {s.step}): {', '.join(s.problems)}" for s in skipped))
            return LoadOutcome(None, ())
        try:
            problems = _try_load(state_dict, ckpt, gang, settings, planner)
        finally:
            if lease is not None and gang.rank == 0:
                service().release_restore_lease(ckpt.id, lease)
        if not problems:
            if skipped and gang.rank == 0:
                log.warning("resumed from checkpoint %s (step %d) after skipping %d damaged one(s)",
                            ckpt.id, ckpt.step, len(skipped))
            return LoadOutcome(ckpt, tuple(skipped))
        if gang.rank == 0:
            for p in problems:
                log.warning("checkpoint %s (step %d) is damaged, falling back to an older one: %s",
                            ckpt.id, ckpt.step, p)
            _report(service(), ckpt, problems)
        skipped.append(Skipped(ckpt.id, ckpt.step, tuple(str(p) for p in problems)))
