"""Retention and GC decisions as tables over snapshots: pure functions, no etcd, no storage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainyard_checkpoint.domain import Checkpoint, CheckpointState, RetentionPolicy, keep_reasons, validate_policy
from trainyard_checkpoint.domain.gc import (
    ActionKind,
    GcAction,
    GcTiming,
    JobSnapshot,
    StoredLocation,
    VersionedCheckpoint,
    plan,
)
from trainyard_core.errors import InvalidArgument

JOB = "job-plan"
NOW = 1_000_000.0
TIMING = GcTiming(grace_s=100, abandon_writing_s=1000, tombstone_retention_s=5000)


def ckpt(step: int, state: CheckpointState = CheckpointState.COMMITTED, *, tags: tuple[str, ...] = (),
         created: float = NOW - 10_000, aborted: float | None = None, deleted: float | None = None,
         committed: float | None = None) -> Checkpoint:
    cid = f"ckpt-{step:010d}"
    return Checkpoint(id=cid, job_id=JOB, attempt=0, step=step, world_size=1, location=f"file:///r/{JOB}/{cid}",
                      state=state, created_at=created, tags=tags, aborted_at=aborted, deleted_at=deleted,
                      committed_at=committed if committed is not None else (
                          created + 1 if state in (CheckpointState.COMMITTED, CheckpointState.DELETED) else None))


def kept(checkpoints: list[Checkpoint], policy: RetentionPolicy | None, latest: int | None = None,
         leased: tuple[int, ...] = ()) -> dict[int, str]:
    by_id = {c.id: c.step for c in checkpoints}
    reasons = keep_reasons(checkpoints, policy, latest_id=f"ckpt-{latest:010d}" if latest is not None else None,
                           leased={f"ckpt-{s:010d}": 1 for s in leased})
    return {by_id[cid]: why for cid, why in reasons.items() if why}


def committed(*steps: int) -> list[Checkpoint]:
    return [ckpt(s) for s in steps]


@pytest.mark.parametrize(("checkpoints", "policy", "latest", "leased", "expected"), [
    (committed(1, 2, 3), None, 3, (), {1: "no retention policy", 2: "no retention policy", 3: "no retention policy"}),
    (committed(100, 200, 300, 400), RetentionPolicy(keep_last=2), 400, (), {400: "latest", 300: "keep_last=2"}),
    (committed(100, 200, 300, 400), RetentionPolicy(keep_last=1), 400, (200,), {400: "latest", 200: "restore lease"}),
    ([ckpt(100, tags=("best",)), *committed(200, 300)], RetentionPolicy(keep_last=1), 300, (),
     {100: "tagged best", 300: "latest"}),
    # Every 1000 steps, saves every 500: the first of each window.
    (committed(500, 1000, 1500, 2000, 2500, 3000), RetentionPolicy(keep_every_steps=1000), 3000, (),
     {500: "keep_every_steps=1000", 1000: "keep_every_steps=1000", 2000: "keep_every_steps=1000", 3000: "latest"}),
    # Saves every 300 steps: one per window of 1000, the lowest step in it.
    (committed(300, 600, 900, 1200, 1500, 1800, 2100), RetentionPolicy(keep_last=2, keep_every_steps=1000), 2100, (),
     {300: "keep_every_steps=1000", 1200: "keep_every_steps=1000", 1800: "keep_last=2", 2100: "latest"}),
    # Latest is not always the highest step committed (a later-committed older step does not move it).
    (committed(10, 20, 30), RetentionPolicy(keep_last=1), 20, (), {30: "keep_last=1", 20: "latest"}),
])
def test_keep_reasons(checkpoints: list[Checkpoint], policy: RetentionPolicy | None, latest: int | None,
                      leased: tuple[int, ...], expected: dict[int, str]) -> None:
    assert kept(checkpoints, policy, latest, leased) == expected


def test_only_committed_are_retention_candidates() -> None:
    others = [ckpt(1, CheckpointState.WRITING), ckpt(2, CheckpointState.ABORTED, aborted=NOW),
              ckpt(3, CheckpointState.DELETED, deleted=NOW)]
    assert keep_reasons(others, RetentionPolicy(keep_last=1), latest_id=None, leased={}) == {}


def test_equal_steps_are_ordered_by_commit_time() -> None:
    first = ckpt(5, committed=NOW - 50)
    second = replace(ckpt(5, committed=NOW - 10), id="ckpt-0000000005b")
    reasons = keep_reasons([first, second], RetentionPolicy(keep_last=1), latest_id=None, leased={})
    assert reasons == {second.id: "keep_last=1", first.id: ""}


@pytest.mark.parametrize(("policy", "message"), [
    (RetentionPolicy(), "keeps nothing but the latest and tagged"),
    (RetentionPolicy(keep_last=-1), "policy.keep_last must be in [0, 100000]"),
    (RetentionPolicy(keep_every_steps=-5), "policy.keep_every_steps must be >= 0"),
])
def test_bad_policies(policy: RetentionPolicy, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_policy(policy)
    assert message in info.value.message


def snapshot(*checkpoints: Checkpoint, policy: RetentionPolicy | None = RetentionPolicy(keep_last=1),
             latest: Checkpoint | None = None) -> list[JobSnapshot]:
    records = [VersionedCheckpoint(c, 10 + i) for i, c in enumerate(checkpoints)]
    return [JobSnapshot(JOB, records, latest.id if latest else None, policy, {}, lease_guard_revision=7)]


def here(*checkpoints: Checkpoint) -> list[StoredLocation]:
    return [StoredLocation(c.job_id, c.id, c.location) for c in checkpoints]


def kinds(actions: list[GcAction]) -> list[tuple[ActionKind, str]]:
    return [(a.kind, a.checkpoint_id) for a in actions]


def test_writing_is_kept_until_abandoned() -> None:
    young = ckpt(1, CheckpointState.WRITING, created=NOW - 999)
    old = ckpt(2, CheckpointState.WRITING, created=NOW - 1000)
    actions = plan(snapshot(young, old), here(young, old), {}, TIMING, NOW)
    assert kinds(actions) == [(ActionKind.ABORT_ABANDONED, old.id)]
    assert actions[0].revision == 11 and actions[0].lease_guard_revision == 7


def test_aborted_files_wait_for_the_grace() -> None:
    recent = ckpt(1, CheckpointState.ABORTED, aborted=NOW - 99)
    due = ckpt(2, CheckpointState.ABORTED, aborted=NOW - 100)
    assert kinds(plan(snapshot(recent, due), here(recent, due), {}, TIMING, NOW)) == \
        [(ActionKind.REMOVE_ABORTED, due.id)]


def test_damaged_files_wait_for_the_grace_and_a_tag_keeps_them() -> None:
    recent = replace(ckpt(1, CheckpointState.DAMAGED), damaged_at=NOW - 99)
    due = replace(ckpt(2, CheckpointState.DAMAGED), damaged_at=NOW - 100)
    tagged = replace(ckpt(3, CheckpointState.DAMAGED, tags=("forensics",)), damaged_at=NOW - 10_000)
    good = ckpt(4)
    actions = plan(snapshot(recent, due, tagged, good, latest=good), here(recent, due, tagged, good), {}, TIMING, NOW)
    assert kinds(actions) == [(ActionKind.REMOVE_DAMAGED, due.id)]
    assert "damaged" in actions[0].reason


def test_deleted_leftovers_and_tombstones() -> None:
    straggler = ckpt(1, CheckpointState.DELETED, deleted=NOW - 200)
    fresh_straggler = ckpt(2, CheckpointState.DELETED, deleted=NOW - 50)
    old_tombstone = ckpt(3, CheckpointState.DELETED, deleted=NOW - 5000)
    young_tombstone = ckpt(4, CheckpointState.DELETED, deleted=NOW - 4999)
    actions = plan(snapshot(straggler, fresh_straggler, old_tombstone, young_tombstone),
                   here(straggler, fresh_straggler), {}, TIMING, NOW)
    assert kinds(actions) == [(ActionKind.REMOVE_ORPHAN, straggler.id), (ActionKind.PURGE_TOMBSTONE, old_tombstone.id)]


def test_retention_deletes_what_nothing_keeps() -> None:
    a, b, c = ckpt(1), ckpt(2, tags=("keep",)), ckpt(3)
    actions = plan(snapshot(a, b, c, latest=c), here(a, b, c), {}, TIMING, NOW)
    assert kinds(actions) == [(ActionKind.DELETE_BY_RETENTION, a.id)]
    assert "keep_last=1" in actions[0].reason
    assert plan(snapshot(a, b, c, policy=None, latest=c), here(a, b, c), {}, TIMING, NOW) == []


def test_orphans_wait_for_the_grace_from_first_seen() -> None:
    known = ckpt(1)
    orphan = StoredLocation(JOB, "ckpt-9999999999", f"file:///r/{JOB}/ckpt-9999999999")
    jobs = snapshot(known, latest=known)
    assert plan(jobs, [*here(known), orphan], {}, TIMING, NOW) == [], "never seen before: not yet"
    assert plan(jobs, [*here(known), orphan], {orphan.location: NOW - 99}, TIMING, NOW) == []
    actions = plan(jobs, [*here(known), orphan], {orphan.location: NOW - 100}, TIMING, NOW)
    assert kinds(actions) == [(ActionKind.REMOVE_ORPHAN, orphan.checkpoint_id)] and actions[0].revision == 0
