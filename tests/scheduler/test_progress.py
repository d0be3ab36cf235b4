"""Scenario tables for the pure gang-progress decision."""

from __future__ import annotations

from trainyard_scheduler.domain.models import Allocation, JobState, NodeAssignment, WorkerExit
from trainyard_scheduler.domain.progress import progress

from .builders import NOW, make_job

ALLOC = Allocation(job_id="job-1", attempt=0, master_addr="n-a", master_port=29500, created_at=NOW,
                   assignments=(NodeAssignment("n-a", 0, (0,), (0,)), NodeAssignment("n-b", 1, (0,), (1,))))
BOTH = frozenset({"n-a", "n-b"})


def ex(rank: int, code: int = 0, sig: int = 0, at: float = NOW) -> WorkerExit:
    return WorkerExit(rank=rank, node_id="n-a" if rank == 0 else "n-b", exit_code=code, signal=sig, at=at)


def test_launches_on_nodes_not_yet_launched() -> None:
    step = progress(make_job(state=JobState.ADMITTED), ALLOC, BOTH, NOW)
    assert step.launch == ("n-a", "n-b") and not step.writes


def test_running_once_every_node_launched() -> None:
    step = progress(make_job(state=JobState.ADMITTED), _alloc(), BOTH, NOW)
    assert step.job is not None and step.job.state is JobState.RUNNING and step.job.started_at == NOW


def _alloc(**changes: object) -> Allocation:
    from dataclasses import replace

    return replace(ALLOC, launched=BOTH, **changes)  # type: ignore[arg-type]


def test_all_ranks_exit_zero_succeeds_and_releases() -> None:
    step = progress(make_job(state=JobState.RUNNING), _alloc(exits=(ex(0), ex(1))), BOTH, NOW)
    assert step.release and step.job is not None and step.job.state is JobState.SUCCEEDED
    assert [e.rank for e in step.job.exits] == [0, 1]


def test_one_rank_failing_stops_the_gang_first() -> None:
    step = progress(make_job(state=JobState.RUNNING), _alloc(exits=(ex(1, code=3),)), BOTH, NOW)
    assert not step.release and step.alloc is not None and "exited with code 3" in step.alloc.stop_reason
    assert step.stop == ("n-a",)  # n-b's only rank already exited


def test_failed_gang_is_released_when_everything_stopped_with_first_exit_code() -> None:
    alloc = _alloc(exits=(ex(1, code=3, at=NOW), ex(0, sig=15, at=NOW + 1)), stop_reason="rank 1 exited with code 3")
    step = progress(make_job(state=JobState.RUNNING), alloc, BOTH, NOW)
    assert step.release and step.job is not None
    assert step.job.state is JobState.FAILED and step.job.exit_code == 3


def test_cancel_stops_then_cancels() -> None:
    job = make_job(state=JobState.RUNNING, cancel_requested=True)
    first = progress(job, _alloc(), BOTH, NOW)
    assert first.stop == ("n-a", "n-b") and first.alloc is not None and first.alloc.stop_reason == "cancelled"
    done = progress(job, _alloc(stop_reason="cancelled", stopped=BOTH), BOTH, NOW)
    assert done.release and done.job is not None and done.job.state is JobState.CANCELLED


def test_lost_node_fails_the_gang_without_waiting_for_it() -> None:
    step = progress(make_job(state=JobState.RUNNING), _alloc(), frozenset({"n-a"}), NOW)
    assert step.alloc is not None and "n-b lost" in step.alloc.stop_reason and step.stop == ("n-a",)


def test_signal_exit_code_is_128_plus_signal() -> None:
    alloc = _alloc(exits=(ex(0, sig=9), ex(1)), stop_reason="rank 0 on n-a was killed by signal 9")
    step = progress(make_job(state=JobState.RUNNING), alloc, BOTH, NOW)
    assert step.job is not None and step.job.exit_code == 137
