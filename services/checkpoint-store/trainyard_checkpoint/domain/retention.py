"""Retention: which committed checkpoints of a job garbage collection keeps. Pure.

A job without a policy keeps every committed checkpoint. With a policy, a COMMITTED checkpoint is kept
when any of these holds, and deleted by GC otherwise:

- it is the job's `latest` (what a restarting job resumes from);
- it carries a tag (TagCheckpoint);
- it is under an active restore lease (a job is loading it);
- `keep_last` N > 0 and it is among the N committed checkpoints with the highest steps (ties by
  commit time, then id);
- `keep_every_steps` K > 0 and it has the lowest step (ties: the earliest committed) among the
  committed checkpoints in its window of K steps [n*K, (n+1)*K). With saves at multiples of K this
  keeps exactly those; with other save intervals it keeps the first one of every window.

WRITING, ABORTED and DELETED checkpoints are not retention's business (see `gc.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainyard_core.errors import InvalidArgument

from .checkpoint import Checkpoint, CheckpointState

MAX_KEEP_LAST = 100_000


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    keep_last: int = 0
    keep_every_steps: int = 0


def validate_policy(policy: RetentionPolicy, field_name: str = "policy") -> None:
    if not 0 <= policy.keep_last <= MAX_KEEP_LAST:
        raise InvalidArgument(f"{field_name}.keep_last must be in [0, {MAX_KEEP_LAST}], got {policy.keep_last}")
    if policy.keep_every_steps < 0:
        raise InvalidArgument(f"{field_name}.keep_every_steps must be >= 0, got {policy.keep_every_steps}")
    if policy.keep_last == 0 and policy.keep_every_steps == 0:
        raise InvalidArgument(f"{field_name} keeps nothing but the latest and tagged checkpoints: set "
                              f"{field_name}.keep_last >= 1 and/or {field_name}.keep_every_steps >= 1 "
                              "(to keep everything, clear the policy)")


def _newest_first(ckpt: Checkpoint) -> tuple[int, float, str]:
    return (-ckpt.step, -(ckpt.committed_at or 0.0), ckpt.id)


def keep_reasons(checkpoints: Iterable[Checkpoint], policy: RetentionPolicy | None, *, latest_id: str | None,
                 leased: Mapping[str, int]) -> dict[str, str]:
    """For each COMMITTED checkpoint of one job, why it is kept ("" when it is not kept).

    `leased` maps checkpoint ids to their active restore leases. Without a policy everything is kept.
    """
    committed = sorted((c for c in checkpoints if c.state is CheckpointState.COMMITTED), key=_newest_first)
    reasons: dict[str, str] = {}
    newest = {c.id for c in committed[:policy.keep_last]} if policy is not None else set()
    window_first: dict[int, str] = {}
    if policy is not None and policy.keep_every_steps > 0:
        # Oldest first, so the first one seen in each window is the one kept.
        for c in sorted(committed, key=lambda c: (c.step, c.committed_at or 0.0, c.id)):
            window_first.setdefault(c.step // policy.keep_every_steps, c.id)
    kept_by_window = set(window_first.values())
    for c in committed:
        if policy is None:
            reasons[c.id] = "no retention policy"
        elif c.id == latest_id:
            reasons[c.id] = "latest"
        elif c.tags:
            reasons[c.id] = "tagged " + ",".join(c.tags)
        elif leased.get(c.id, 0) > 0:
            reasons[c.id] = "restore lease"
        elif c.id in newest:
            reasons[c.id] = f"keep_last={policy.keep_last}"
        elif c.id in kept_by_window:
            reasons[c.id] = f"keep_every_steps={policy.keep_every_steps}"
        else:
            reasons[c.id] = ""
    return reasons
