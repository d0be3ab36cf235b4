"""The job operations as pure decisions (domain/operations.py, and their part in progress and placement): each
transition, each refusal, and the idempotent repeats that return the job itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainyard_core.errors import FailedPrecondition, InvalidArgument
from trainyard_scheduler.domain import operations
from trainyard_scheduler.domain.jobs import request_cancel
from trainyard_scheduler.domain.models import Allocation, Job, JobState, WorkerExit
from trainyard_scheduler.domain.progress import progress
from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.policy.place import place
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.state.codec import decode_allocation, decode_job, encode_allocation, encode_job

from .builders import NOW, fleet, make_job, running, snapshot

LATER = NOW + 60


# --- hold and release ------------------------------------------------------------------------------------

def test_hold_keeps_the_job_pending_in_its_place_and_says_why() -> None:
    job = make_job(created=NOW)
    held = operations.hold(job, LATER, "alice", "waiting for the dataset")
    assert (held.state, held.held_by, held.hold_reason, held.queued_at) == (
        JobState.PENDING, "alice", "waiting for the dataset", NOW)
    assert held.message == "held by alice: waiting for the dataset; not placed until released"
    assert (held.events[-1].kind, held.events[-1].message, held.updated_at) == (
        "held", "held by alice: waiting for the dataset", LATER)


def test_holding_a_held_job_changes_nothing_and_keeps_the_first_holder() -> None:
    held = operations.hold(make_job(), NOW, "alice")
    assert operations.hold(held, LATER, "bob", "mine") is held


@pytest.mark.parametrize("state", [JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTED, JobState.RESTARTING,
                                   JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_only_a_pending_job_can_be_held(state: JobState) -> None:
    with pytest.raises(FailedPrecondition, match=f"is {state.value}: only a pending job can be held"):
        operations.hold(make_job(state=state), NOW, "alice")


def test_release_puts_the_job_back_in_its_original_place() -> None:
    held = operations.hold(make_job(created=NOW), NOW + 1, "alice")
    released = operations.release(held, LATER, "ada")
    assert (released.state, released.held_by, released.hold_reason, released.queued_at) == (
        JobState.PENDING, "", "", NOW)
    assert released.message == "waiting for placement"
    assert released.events[-1].kind == "released"
    assert released.events[-1].message == "released by ada (held by alice); back in its place in the queue"


def test_releasing_a_job_that_is_not_held_changes_nothing() -> None:
    job = make_job()
    assert operations.release(job, NOW, "alice") is job


@pytest.mark.parametrize("state", [JobState.RUNNING, JobState.SUCCEEDED, JobState.CANCELLED])
def test_release_of_a_job_that_is_not_pending_is_refused(state: JobState) -> None:
    with pytest.raises(FailedPrecondition, match=f"is {state.value}: only a pending job can be held or released"):
        operations.release(make_job(state=state), NOW, "alice")


def test_a_held_job_can_be_cancelled() -> None:
    held = operations.hold(make_job(), NOW, "alice")
    assert request_cancel(held, LATER, "", by="alice").state is JobState.CANCELLED


def test_placement_passes_over_a_held_job_and_takes_it_once_released() -> None:
    nodes = fleet(per_leaf=1, gpus=8)
    held = operations.hold(make_job("job-1", gpus=8, created=NOW), NOW, "alice")
    younger = make_job("job-2", gpus=4, created=NOW + 1)
    profile = build_profile()
    result = place(snapshot(nodes, [held, younger]), profile, PolicyConfig(), LATER)
    assert [d.job_id for d in result.decisions] == ["job-2"]
    assert "job-1" not in {u.job_id for u in result.unplaced}  # not considered at all, so no reason rewritten
    released = operations.release(held, LATER, "alice")
    result = place(snapshot(nodes, [released, younger]), profile, PolicyConfig(), LATER)
    assert [d.job_id for d in result.decisions] == ["job-1"]  # first in the queue again: it is the older


# --- priority --------------------------------------------------------------------------------------------

def test_priority_change_is_recorded_with_who_did_it() -> None:
    changed = operations.set_priority(make_job(priority=5), LATER, "alice", -20)
    assert changed.spec.priority == -20
    assert (changed.events[-1].kind, changed.events[-1].message) == ("priority_changed", "priority 5 -> -20 by alice")


def test_the_same_priority_changes_nothing() -> None:
    job = make_job(priority=5)
    assert operations.set_priority(job, LATER, "alice", 5) is job


@pytest.mark.parametrize("priority", [-1001, 1001])
def test_a_priority_out_of_range_is_invalid(priority: int) -> None:
    with pytest.raises(InvalidArgument, match="priority must be between -1000 and 1000"):
        operations.set_priority(make_job(), NOW, "alice", priority)


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_finished_jobs_priority_cannot_change(state: JobState) -> None:
    with pytest.raises(FailedPrecondition, match="a finished job's priority cannot change"):
        operations.set_priority(make_job(state=state), NOW, "alice", 1)


def test_a_running_gangs_standing_follows_its_jobs_priority() -> None:
    job, alloc = running(make_job(priority=5, priority_class="high"), [("n-0a-0", [0])])
    assert operations.restand(job, alloc) is None
    lowered = operations.set_priority(job, NOW, "alice", -3)
    restood = operations.restand(lowered, alloc)
    assert restood is not None and restood.priority == (alloc.priority[0], alloc.priority[1], -3)


# --- requeue -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("state", [JobState.ADMITTED, JobState.RUNNING])
def test_a_requeue_is_asked_of_a_placed_job(state: JobState) -> None:
    asked = operations.request_requeue(make_job(state=state), LATER, "alice", "new data")
    assert (asked.state, asked.requeue_requested_by) == (state, "alice")
    assert (asked.events[-1].kind, asked.events[-1].message) == ("requeue_requested",
                                                                 "requeue requested by alice: new data")


def test_asking_again_or_of_a_preempted_job_changes_nothing() -> None:
    asked = operations.request_requeue(make_job(state=JobState.RUNNING), NOW, "alice")
    assert operations.request_requeue(asked, LATER, "bob") is asked
    preempted = make_job(state=JobState.PREEMPTED)
    assert operations.request_requeue(preempted, LATER, "bob") is preempted


@pytest.mark.parametrize("state", [JobState.PENDING, JobState.RESTARTING, JobState.SUCCEEDED, JobState.FAILED,
                                   JobState.CANCELLED])
def test_only_an_admitted_or_running_job_can_be_requeued(state: JobState) -> None:
    with pytest.raises(FailedPrecondition, match=f"is {state.value}: only an admitted or running job"):
        operations.request_requeue(make_job(state=state), NOW, "alice")


def test_a_job_being_cancelled_is_not_requeued() -> None:
    with pytest.raises(FailedPrecondition, match="being cancelled"):
        operations.request_requeue(make_job(state=JobState.RUNNING, cancel_requested=True), NOW, "alice")


def _asked_running(signal: str = "SIGTERM", grace_s: float = 0.0) -> tuple[Job, Allocation]:
    job, alloc = running(make_job(state=JobState.RUNNING, max_restarts=2, signal=signal, grace_s=grace_s),
                         [("n-a", [0]), ("n-b", [0])], started=NOW)
    alloc = replace(alloc, launched=frozenset({"n-a", "n-b"}))
    return operations.request_requeue(job, NOW + 5, "alice"), alloc


def test_progress_stops_a_requeued_gang_like_a_preemption_then_queues_a_new_attempt() -> None:
    job, alloc = _asked_running(signal="SIGUSR1", grace_s=30.0)
    alive = frozenset({"n-a", "n-b"})
    first = progress(job, alloc, alive, LATER)
    assert first.alloc is not None and first.job is None and not first.release
    assert (first.alloc.stop_reason, first.alloc.requeued_by, first.alloc.stop_signal, first.alloc.stop_grace_s) == (
        "requeued by alice", "alice", "SIGUSR1", 30.0)
    assert first.stop == ("n-a", "n-b")
    # Both ranks exit on the signal (not a failure: the gang was already being stopped for the requeue).
    stopped = replace(first.alloc, exits=(WorkerExit(0, "n-a", 0, 0, LATER), WorkerExit(1, "n-b", 143, 0, LATER)))
    done = progress(job, stopped, alive, LATER + 1)
    assert done.release and done.job is not None
    after = done.job
    assert (after.state, after.attempt, after.restarts, after.infra_restarts, after.requeue_requested_by) == (
        JobState.PENDING, 2, 0, 0, "")
    assert after.queued_at == LATER + 1 and after.placement == () and after.preempted_by == ()
    assert after.message.startswith("requeued by alice: attempt 2 queued")
    [record] = after.attempts
    assert (record.attempt, record.outcome, record.reason) == (1, "pending", "requeued by alice")


def test_a_failure_seen_first_wins_and_the_requeue_is_dropped() -> None:
    job, alloc = _asked_running()
    failed = replace(alloc, exits=(WorkerExit(1, "n-b", 3, 0, NOW + 1),))
    alive = frozenset({"n-a", "n-b"})
    first = progress(job, failed, alive, LATER)
    assert first.alloc is not None and first.alloc.stop_reason == "rank 1 on n-b exited with code 3"
    assert first.alloc.requeued_by == ""
    stopped = replace(first.alloc, exits=(*first.alloc.exits, WorkerExit(0, "n-a", 0, 15, LATER)))
    done = progress(job, stopped, alive, LATER + 1)
    assert done.job is not None and done.job.state is JobState.RESTARTING and done.job.restarts == 1
    assert done.job.requeue_requested_by == ""  # would stop the next attempt otherwise


def test_a_cancel_after_the_requeue_wins() -> None:
    job, alloc = _asked_running()
    alive = frozenset({"n-a", "n-b"})
    first = progress(job, alloc, alive, LATER)
    assert first.alloc is not None
    cancelled = request_cancel(job, LATER, "", by="bob")
    stopped = replace(first.alloc, stopped=frozenset({"n-a", "n-b"}))
    done = progress(cancelled, stopped, alive, LATER + 1)
    assert done.job is not None and done.job.state is JobState.CANCELLED


def test_the_new_fields_round_trip_and_an_old_record_reads_without_them() -> None:
    job = operations.hold(make_job(), NOW, "alice", "why")
    asked = replace(make_job(state=JobState.RUNNING), requeue_requested_by="bob")
    for j in (job, asked):
        assert decode_job(encode_job(j)) == j
    plain = make_job()
    assert b"held_by" not in encode_job(plain)  # unchanged encoding (and archive digest) for jobs without them
    _, alloc = running(make_job(), [("n-a", [0])])
    marked = replace(alloc, requeued_by="bob")
    assert decode_allocation(encode_allocation(marked)) == marked
    assert b"requeued_by" not in encode_allocation(alloc)
