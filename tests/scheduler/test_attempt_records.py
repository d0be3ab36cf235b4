"""Every placed attempt leaves a record on its job when its gang is released, in the same write: the history
store's attempts and the usage records are made of them (issue 14)."""

from __future__ import annotations

from dataclasses import replace

import orjson

from trainyard_scheduler.archive import archived, redacted, usage_of
from trainyard_scheduler.domain.jobs import MAX_ATTEMPTS_KEPT, end_attempt
from trainyard_scheduler.domain.models import JobState, WorkerExit
from trainyard_scheduler.domain.progress import progress
from trainyard_scheduler.state import codec

from .builders import NOW, make_job, running


def _exits(n: int) -> tuple[WorkerExit, ...]:
    return tuple(WorkerExit(rank=r, node_id="n1" if r < 8 else "n2", exit_code=0, signal=0, at=NOW) for r in range(n))


def test_a_released_gang_leaves_its_attempt_on_the_job() -> None:
    job, alloc = running(make_job(nodes=2, gpus=8), [("n1", range(8)), ("n2", range(8))], started=NOW - 600)
    alloc = replace(alloc, launched=frozenset({"n1", "n2"}), exits=_exits(16))
    step = progress(job, alloc, frozenset({"n1", "n2"}), NOW)
    assert step.release and step.job is not None and step.job.state is JobState.SUCCEEDED
    (record,) = step.job.attempts
    assert (record.attempt, record.started_at, record.ended_at, record.nodes, record.gpus, record.model,
            record.outcome, record.reason) == (1, NOW - 600, NOW, ("n1", "n2"), 16, "H100", "succeeded", "")


def test_a_restart_and_a_preemption_each_leave_one_attempt_and_recording_is_idempotent() -> None:
    job, alloc = running(make_job(max_restarts=2), [("n1", [0])], started=NOW - 60)
    failed = replace(alloc, launched=frozenset({"n1"}), stopped=frozenset({"n1"}),
                     exits=(WorkerExit(rank=0, node_id="n1", exit_code=3, signal=0, at=NOW - 1),),
                     stop_reason="rank 0 on n1 exited with code 3")
    step = progress(job, failed, frozenset({"n1"}), NOW)
    assert step.job is not None and step.job.state is JobState.RESTARTING
    assert [(a.attempt, a.outcome, a.reason) for a in step.job.attempts] == [
        (1, "restarting", "rank 0 on n1 exited with code 3")]
    assert end_attempt(step.job, failed, NOW + 5) is step.job, "an attempt is recorded once"

    job2, alloc2 = running(replace(make_job(), attempt=2), [("n1", [0])], started=NOW)
    preempted = replace(alloc2, launched=frozenset({"n1"}), stopped=frozenset({"n1"}), stop_reason="preempted",
                        preempted_by="job-9")
    step2 = progress(replace(job2, attempts=step.job.attempts), preempted, frozenset({"n1"}), NOW + 30)
    assert step2.job is not None and step2.job.state is JobState.PENDING and step2.job.attempt == 3
    assert [(a.attempt, a.outcome) for a in step2.job.attempts] == [(1, "restarting"), (2, "preempted")]


def test_a_job_keeps_its_last_attempts_only() -> None:
    job, alloc = running(make_job(), [("n1", [0])])
    for attempt in range(1, MAX_ATTEMPTS_KEPT + 6):
        job = end_attempt(job, replace(alloc, attempt=attempt), NOW + attempt)
    assert len(job.attempts) == MAX_ATTEMPTS_KEPT and job.attempts[0].attempt == 6


def test_attempts_and_archived_at_round_trip_and_old_records_have_none() -> None:
    job, alloc = running(make_job(), [("n1", [0, 1])])
    done = replace(end_attempt(job, alloc, NOW), state=JobState.SUCCEEDED, finished_at=NOW, archived_at=NOW + 1)
    assert codec.decode_job(codec.encode_job(done)) == done
    old = orjson.loads(codec.encode_job(make_job()))
    del old["attempts"], old["archived_at"]
    again = codec.decode_job(orjson.dumps(old))
    assert (again.attempts, again.archived_at) == ((), None)


def test_the_history_keeps_no_environment_values_and_a_usage_record_per_attempt() -> None:
    job, alloc = running(make_job(team="ml"), [("n1", [0, 1]), ("n2", [0, 1])], started=NOW - 100)
    job = replace(job, spec=replace(job.spec, env={"WANDB_API_KEY": "secret-value", "EPOCHS": "3"},
                                    labels={"project": "llm-7b"}))
    done = replace(end_attempt(job, alloc, NOW), state=JobState.SUCCEEDED, finished_at=NOW)
    kept = archived(done)
    assert b"secret-value" not in kept.record
    assert codec.decode_job(kept.record).spec.env == {"WANDB_API_KEY": "", "EPOCHS": ""}
    assert redacted(make_job()) == make_job()
    (usage,) = usage_of(done)
    assert (usage.job_id, usage.attempt, usage.team, usage.project, usage.gpus, usage.nodes, usage.accelerator_model,
            usage.started_at, usage.ended_at) == (done.id, 1, "ml", "llm-7b", 4, 2, "H100", NOW - 100, NOW)
    assert (kept.state, kept.submitted_at, kept.finished_at, kept.labels) == ("succeeded", job.created_at, NOW,
                                                                              {"project": "llm-7b"})
