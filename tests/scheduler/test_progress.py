"""Scenario tables for the pure gang-progress decision."""

from __future__ import annotations

from dataclasses import replace

import pytest

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


def test_lost_node_stops_the_gang_without_waiting_for_it() -> None:
    step = progress(make_job(state=JobState.RUNNING), _alloc(), frozenset({"n-a"}), NOW)
    assert step.alloc is not None and "n-b lost" in step.alloc.stop_reason and step.stop == ("n-a",)
    assert step.alloc.infra_failure


ONLY_A = frozenset({"n-a"})
LOST_B = "node n-b lost contact"


@pytest.mark.parametrize(("alloc", "alive", "max_restarts", "restarts", "infra_restarts", "state", "words"), [
    # A lost node: restarted at once, the budget untouched even when it is 0.
    (dict(stop_reason=LOST_B, infra_failure=True, stopped=ONLY_A), ONLY_A, 0, 0, 0, "restarting",
     [LOST_B, "infrastructure failure 1", "not counted against max_restarts"]),
    # The survivors crashed first (their peer vanished); by release time the node is lost: infrastructure.
    (dict(exits=(ex(0, code=1),), stop_reason="rank 0 on n-a exited with code 1"), ONLY_A, 0, 0, 0,
     "restarting", [LOST_B, "rank 0 on n-a exited with code 1"]),
    # The same crash with every node alive is the application's: it uses the budget...
    (dict(exits=(ex(0, code=1), ex(1, sig=15)), stop_reason="rank 0 on n-a exited with code 1"), BOTH, 2, 0, 0,
     "restarting", ["restart 1 of 2"]),
    # ... and fails the job once the budget is used up.
    (dict(exits=(ex(0, code=1), ex(1, sig=15)), stop_reason="rank 0 on n-a exited with code 1"), BOTH, 2, 2, 0,
     "failed", ["restart budget of 2 used up"]),
    # Infrastructure restarts are bounded too.
    (dict(stop_reason=LOST_B, infra_failure=True, stopped=ONLY_A), ONLY_A, 5, 0, 20, "failed",
     ["infrastructure restart limit of 20 reached"]),
    # A rank whose end the agent could not learn (its shim died too) is the node's failure, not the job's.
    (dict(exits=(ex(0, code=-1), ex(1, sig=15)), stop_reason="rank 0 on n-a exited with code -1"), BOTH, 0, 0, 0,
     "restarting", ["the end of rank 0 on n-a is unknown", "infrastructure failure 1"]),
    # A time limit is never the infrastructure's, even if a node is lost meanwhile.
    (dict(stop_reason="time limit of 60s exceeded", stopped=ONLY_A), ONLY_A, 3, 0, 0, "failed",
     ["time limit"]),
])
def test_infrastructure_failures_restart_without_using_the_budget(
        alloc: dict, alive: frozenset[str], max_restarts: int, restarts: int,  # type: ignore[type-arg]
        infra_restarts: int, state: str, words: list[str]) -> None:
    job = replace(make_job(state=JobState.RUNNING, max_restarts=max_restarts, time_limit=60),
                  restarts=restarts, infra_restarts=infra_restarts)
    step = progress(job, _alloc(**alloc), alive, NOW, infra_restart_limit=20)
    assert step.release and step.job is not None and step.job.state.value == state, step
    for w in words:
        assert w in step.job.message, step.job.message
    if state == "restarting":
        infra = "infrastructure" in step.job.message
        assert step.job.infra_restarts == infra_restarts + infra
        assert step.job.restarts == restarts + (not infra)
        assert step.job.not_before == NOW if infra else step.job.not_before > NOW


def test_an_unhealthy_gpu_in_the_gang_is_an_infrastructure_failure() -> None:
    from .builders import make_node

    nodes = {"n-a": make_node("n-a", gpus=1), "n-b": make_node("n-b", gpus=1)}
    sick = replace(nodes["n-b"].gpus[0], healthy=False, health_reason="XID 79")
    nodes["n-b"] = replace(nodes["n-b"], gpus=(sick,))
    job = make_job(state=JobState.RUNNING)
    first = progress(job, _alloc(), BOTH, NOW, nodes)
    assert first.alloc is not None and first.alloc.infra_failure and "XID 79" in first.alloc.stop_reason
    done = progress(job, replace(first.alloc, stopped=BOTH), BOTH, NOW, nodes)
    assert done.job is not None and done.job.state is JobState.RESTARTING and done.job.infra_restarts == 1


@pytest.mark.parametrize("code, sig", [(143, 15), (0, 0)])  # killed by the SIGTERM, or ended cleanly on it
def test_ranks_ended_by_their_agents_shutdown_are_an_infrastructure_failure(code: int, sig: int) -> None:
    """An agent that shuts down with its workers (kill_workers_on_stop) ends them: the host went away under the
    job, which restarts without using its budget, whatever the rank's exit status (one that checkpoints and
    exits 0 on the signal did not finish either)."""
    gone = replace(ex(1, code=code, sig=sig), agent_shutdown=True)
    job = make_job(state=JobState.RUNNING, max_restarts=0)
    first = progress(job, _alloc(exits=(gone,)), BOTH, NOW)
    assert first.alloc is not None and first.alloc.infra_failure and first.stop == ("n-a",)
    assert first.alloc.stop_reason == "rank 1 on n-b was stopped by its node's agent shutting down"
    done = progress(job, replace(first.alloc, stopped=BOTH), BOTH, NOW)
    assert done.release and done.job is not None and done.job.state is JobState.RESTARTING, done.job
    assert (done.job.infra_restarts, done.job.restarts) == (1, 0)
    assert "agent shutting down" in done.job.message and "infrastructure failure 1" in done.job.message
    # A rank that failed on its own before the agent went keeps the job's failure its own.
    own = progress(job, _alloc(exits=(ex(0, code=3, at=NOW), replace(gone, at=NOW + 1))), BOTH, NOW)
    assert own.release and own.job is not None and own.job.state is JobState.FAILED, own.job
    assert "exited with code 3" in own.job.message and own.job.infra_restarts == 0


def test_signal_exit_code_is_128_plus_signal() -> None:
    alloc = _alloc(exits=(ex(0, sig=9), ex(1)), stop_reason="rank 0 on n-a was killed by signal 9")
    step = progress(make_job(state=JobState.RUNNING), alloc, BOTH, NOW)
    assert step.job is not None and step.job.exit_code == 137


def test_a_lost_nodes_gang_is_released_only_once_its_worker_fence_has_run_out() -> None:
    job = make_job(state=JobState.RUNNING)
    alloc = _alloc(stop_reason=LOST_B, infra_failure=True, stopped=ONLY_A)
    # n-b has been silent 4 s; its shims kill their workers by 9 s (fence 8 s + margin 1 s): wait.
    early = progress(job, alloc, ONLY_A, NOW, silence={"n-b": 4.0}, fence_s=9.0)
    assert not early.release and early.job is None and early.recheck_in == 5.0
    late = progress(job, alloc, ONLY_A, NOW, silence={"n-b": 9.5}, fence_s=9.0)
    assert late.release and late.job is not None and late.job.state is JobState.RESTARTING
    # Ranks of the lost node that had already exited (or a stop it confirmed) need no fence.
    exited = progress(job, _alloc(stop_reason=LOST_B, infra_failure=True, stopped=ONLY_A, exits=(ex(1, sig=9),)),
                      ONLY_A, NOW, silence={"n-b": 0.5}, fence_s=9.0)
    assert exited.release


def test_ranks_failing_together_restart_whichever_report_came_first() -> None:
    """Both ranks crash at once on different nodes. Rank 1's report arrived first, so the gang was stopped
    for it; rank 0's came after, with an earlier exit time. That is still a failure the job restarts from
    (seen in the e2e suite: the job went FAILED instead, its restart budget untouched)."""
    stopped = _alloc(stop_reason="rank 1 on n-b exited with code 3", stopped=BOTH,
                     exits=(ex(1, code=3, at=NOW + 0.006), ex(0, code=3, at=NOW)))
    step = progress(make_job(state=JobState.RUNNING, max_restarts=1), stopped, BOTH, NOW + 1)
    assert step.release and step.job is not None
    assert step.job.state is JobState.RESTARTING and step.job.restarts == 1
    assert "rank 1 on n-b exited with code 3; restart 1 of 1" in step.job.message
