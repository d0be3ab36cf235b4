"""Pure lifecycle rules: restart policy with backoff, time limits, preemption requeue, fair-share decay."""

from __future__ import annotations

import math
from dataclasses import replace

from trainyard_scheduler.domain.jobs import due_for_requeue, request_cancel, restart_delay
from trainyard_scheduler.domain.models import JobState, WorkerExit
from trainyard_scheduler.domain.progress import progress
from trainyard_scheduler.domain.queues import FairShareUsage, decay_usage, dominant_share

from .builders import NOW, make_job, running


def _failed_gang(max_restarts: int, restarts: int = 0):  # type: ignore[no-untyped-def]
    job, alloc = running(make_job(gpus=2, max_restarts=max_restarts), [("n-a", (0, 1))])
    job = replace(job, restarts=restarts, spec=replace(job.spec, restart_backoff_s=5.0))
    alloc = replace(alloc, exits=(WorkerExit(0, "n-a", 1, 0, NOW), WorkerExit(1, "n-a", 143, 15, NOW)),
                    stopped=frozenset({"n-a"}))
    stop = progress(job, alloc, frozenset({"n-a"}), NOW)
    alloc = stop.alloc or alloc
    return job, progress(job, alloc, frozenset({"n-a"}), NOW)


def test_a_failed_rank_with_restarts_left_goes_restarting_with_backoff() -> None:
    job, step = _failed_gang(max_restarts=3, restarts=1)
    assert step.release and step.job is not None
    assert step.job.state is JobState.RESTARTING and step.job.restarts == 2
    assert step.job.not_before == NOW + 10.0  # 5 s doubled for the second restart
    assert "restart 2 of 3" in step.job.message
    assert due_for_requeue(step.job, NOW + 9) is None
    again = due_for_requeue(step.job, NOW + 10)
    assert again is not None and again.state is JobState.PENDING and again.attempt == job.attempt + 1
    assert again.placement == () and again.exits == () and again.queued_at == NOW + 10


def test_the_budget_used_up_fails_the_job_naming_it() -> None:
    _, step = _failed_gang(max_restarts=2, restarts=2)
    assert step.job is not None and step.job.state is JobState.FAILED
    assert "restart budget of 2 used up" in step.job.message and step.job.exit_code == 1


def test_backoff_is_capped() -> None:
    job = replace(make_job(), restarts=30)
    assert restart_delay(job) == 600.0


def test_time_limit_stops_the_gang_and_fails_without_restart() -> None:
    job, alloc = running(make_job(gpus=1, time_limit=60, max_restarts=5), [("n-a", (0,))],
                         expected_end=NOW + 60, started=NOW)
    assert progress(job, alloc, frozenset({"n-a"}), NOW + 59).alloc is None
    step = progress(job, alloc, frozenset({"n-a"}), NOW + 60)
    assert step.alloc is not None and "time limit" in step.alloc.stop_reason and step.stop == ("n-a",)
    done = progress(job, replace(step.alloc, stopped=frozenset({"n-a"})), frozenset({"n-a"}), NOW + 61)
    assert done.job is not None and done.job.state is JobState.FAILED


def test_preempted_gang_is_requeued_as_a_new_attempt_remembering_the_preemptor() -> None:
    job, alloc = running(make_job(gpus=1), [("n-a", (0,))], stop_reason="preempted by vip", preempted_by="vip")
    job = replace(job, state=JobState.PREEMPTED)
    step = progress(job, replace(alloc, stopped=frozenset({"n-a"})), frozenset({"n-a"}), NOW)
    assert step.release and step.job is not None
    assert step.job.state is JobState.PENDING and step.job.attempt == 2 and step.job.preempted_by == ("vip",)
    assert step.job.restarts == 0  # preemption does not use the restart budget


def test_cancel_of_a_restarting_job_is_immediate() -> None:
    _, step = _failed_gang(max_restarts=3)
    assert step.job is not None
    cancelled = request_cancel(step.job, NOW, "")
    assert cancelled.state is JobState.CANCELLED


def test_usage_decays_by_half_life_and_integrates_holding() -> None:
    u0 = FairShareUsage(at=NOW, by_team={"a": {"H100": 1000.0}})
    u1 = decay_usage(u0, {}, NOW + 3600, 3600)
    assert math.isclose(u1.by_team["a"]["H100"], 500.0)
    # Holding 8 GPUs for one half-life adds 8 * h / ln 2 * (1 - 1/2) GPU-seconds.
    u2 = decay_usage(FairShareUsage(at=NOW), {"b": {"H100": 8}}, NOW + 3600, 3600)
    assert math.isclose(u2.by_team["b"]["H100"], 8 * 3600 / math.log(2) * 0.5)
    # Holding for a very long time approaches the capacity horizon: a share of 1 for the whole model.
    share = dominant_share(decay_usage(FairShareUsage(at=NOW), {"b": {"H100": 8}}, NOW + 1e7, 3600).by_team["b"],
                           {"H100": 8}, 1.0, 3600)
    assert math.isclose(share, 1.0, rel_tol=1e-6)
    assert dominant_share({"H100": 10.0}, {"H100": 8}, 2.0, 3600) * 2 == dominant_share({"H100": 10.0}, {"H100": 8},
                                                                                         1.0, 3600)
