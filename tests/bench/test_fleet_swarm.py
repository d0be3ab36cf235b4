"""The fleet swarm (bench/fleet.py, issue 13): its pure parts, the simulated supervisor, and the swarm itself in
a bounded configuration — 1,000 simulated agents speaking the real agent protocol (Reporter, ExitReporter,
each with its own node certificate) to one real scheduler for 30 s, with 1-GPU jobs and 64-GPU gangs flowing,
then some nodes crashed and some silenced. The swarm test asserts behaviour only: no live node was ever seen
not ready or blamed for a stopped gang, every stopped node was seen not ready, jobs ended well. The figures
(CPU per node, detection time, latencies) are the benchmark's to report, not this test's to judge."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from bench import _simagent, fleet
from trainyard_agent.workers.fence import LeaderFence
from trainyard_agent.workers.model import LaunchRequest, WorkerExit, WorkerSpec
from trainyard_core.errors import FailedPrecondition, InvalidArgument, NotFound
from trainyard_scheduler.domain.models import Allocation, JobState, NodeAssignment
from trainyard_scheduler.domain.progress import progress

from ..scheduler.builders import NOW, make_job

# Jobs still running when it ends (those restarted after a stop) are not waited for long: that no job failed is
# what is checked, not that every one finished.
SWARM = fleet.Config(nodes=1_000, workers=2, steady_s=30.0, window_s=10.0, idle_s=1.0, quiet_s=2.0, settle_s=1.0,
                     ramp_per_s=400.0, stop_rounds=1, stop_per_round=3, drain_s=5.0, job_s=2.0, one_gpu_every_s=1.0,
                     gang_every_s=4.0, floor_every_s=1.0, keepalive_connections=20, keepalive_window_s=2.0)


# --- pure parts -------------------------------------------------------------------------------------------

def test_the_plan_puts_every_node_in_one_place_and_stop_candidates_apart() -> None:
    config = replace(SWARM, nodes=40, workers=3, stop_rounds=2, stop_per_round=3)
    p = fleet.plan(config)
    regular = [n for group in p.regular for n, _ in group]
    crash = [n for group in p.crash for n, _ in group]
    silent = [n for n, _ in p.silent]
    failover = [n for n, _ in p.failover_crash]
    everyone = regular + crash + silent + failover
    assert len(everyone) == len(set(everyone)) == 40
    assert len(crash) == len(silent) == 6 and p.stopped == frozenset(crash + silent)
    assert [len(g) for g in p.crash] == [3, 3] and [len(r) for r in p.silent_rounds] == [3, 3]
    assert {n for r in p.silent_rounds for n in r} == set(silent)
    assert len(failover) == 3, "one round's worth, crashed in the first failover"
    assert sorted(len(g) for g in p.regular) == [8, 8, 9]
    assert fleet.plan(replace(config, failovers=0)).failover_crash == ()


@pytest.mark.parametrize("changes", [{"nodes": 13, "stop_rounds": 1, "stop_per_round": 3},
                                     {"workers": 0}, {"stop_per_round": 0}])
def test_a_plan_that_cannot_hold_a_gang_is_refused(changes: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        fleet.plan(replace(SWARM, **changes))


def test_a_gang_stopped_for_a_lost_node_names_it_as_the_scheduler_words_it() -> None:
    # The reason comes from the scheduler's own decision, so a change of its wording fails here, not silently.
    alloc = Allocation(job_id="job-1", attempt=0, master_addr="fleet-00001", master_port=29500, created_at=NOW,
                       assignments=(NodeAssignment("fleet-00001", 0, (0,), (0,)),
                                    NodeAssignment("fleet-00002", 1, (0,), (1,))),
                       launched=frozenset({"fleet-00001", "fleet-00002"}))
    step = progress(make_job(state=JobState.RUNNING), alloc, frozenset({"fleet-00001"}), NOW)
    assert step.alloc is not None
    assert fleet._lost_node(step.alloc.stop_reason) == "fleet-00002"
    assert fleet._lost_node(f"restarting: {step.alloc.stop_reason} (attempt 1)") == "fleet-00002"
    assert fleet._lost_node("rank 3 exited with code 1") == ""


@pytest.mark.parametrize(("command", "seconds"), [(("sleep", "3"), 3.0), (("sleep", "0.5"), 0.5),
                                                  (("sleep", "x"), None), (("python", "train.py"), None),
                                                  (("sleep", "-1"), None)])
def test_a_simulated_job_runs_as_long_as_its_sleep(command: tuple[str, ...], seconds: float | None) -> None:
    assert _simagent.planned_seconds(command) == seconds


# --- the simulated supervisor -----------------------------------------------------------------------------

def _launch(job_id: str = "job-1", attempt: int = 0, command: tuple[str, ...] = ("sleep", "0"),
            epoch: int = 1) -> LaunchRequest:
    return LaunchRequest(job_id=job_id, attempt=attempt, command=command, env={}, working_dir="",
                         workers=(WorkerSpec(0, 0, (0,)), WorkerSpec(1, 1, (1,))), leader_epoch=epoch)


async def test_a_launch_runs_its_ranks_reports_their_exits_and_is_idempotent() -> None:
    exits: list[WorkerExit] = []
    workers = _simagent.SimWorkers(LeaderFence(), exits.append)
    seen = workers.changes.version
    first = workers.launch(_launch(command=("sleep", "0")))
    again = workers.launch(_launch(command=("sleep", "0")))
    assert not first.already_running and again.already_running and first.pids == again.pids
    assert [(r.job_id, r.ranks) for r in workers.running()] == [("job-1", (0, 1))]
    assert workers.changes.version > seen
    while workers.running():  # the timer of `sleep 0` fires on the next loop iteration
        await workers.changes.wait(timeout=5)
    assert sorted((e.rank, e.exit_code, e.signal) for e in exits) == [(0, 0, 0), (1, 0, 0)]


async def test_a_stop_ends_every_attempt_asked_for_as_killed_workers() -> None:
    exits: list[WorkerExit] = []
    workers = _simagent.SimWorkers(LeaderFence(), exits.append)
    workers.launch(_launch(attempt=1, command=("python", "train.py")))
    workers.launch(_launch(attempt=2, command=("python", "train.py")))
    assert workers.stop("job-1", 2, signal.SIGTERM) == 2
    assert [r.attempt for r in workers.running()] == [1]
    assert workers.stop("job-1", 0, signal.SIGKILL) == 2  # attempt 0: every attempt, as the supervisor
    assert not workers.running() and workers.stop("job-1", 0, signal.SIGTERM) == 0
    assert sorted((e.attempt, e.exit_code, e.signal) for e in exits) == [(1, 137, 9), (1, 137, 9), (2, 143, 15),
                                                                         (2, 143, 15)]


async def test_a_launch_is_validated_and_fenced_as_the_agent_does() -> None:
    fence = LeaderFence()
    workers = _simagent.SimWorkers(fence, lambda e: None)
    fence.observe(5)
    with pytest.raises(FailedPrecondition, match="stale scheduler leader"):
        workers.launch(_launch(epoch=4))
    with pytest.raises(InvalidArgument, match="command is empty"):
        workers.launch(_launch(command=("",)))
    with pytest.raises(InvalidArgument):
        workers.stop("../x", 0, signal.SIGTERM)
    assert not workers.running()


async def test_a_credential_renewal_is_answered_as_the_agent_answers_it() -> None:
    """The leader renews a running attempt's checkpoint credential (issue 12); a simulated node must answer as
    the agent does, or a fleet run longer than half the credential's life sees UNIMPLEMENTED."""
    fence = LeaderFence()
    workers = _simagent.SimWorkers(fence, lambda e: None)
    workers.launch(_launch(attempt=2, command=("python", "train.py")))
    assert workers.renew("job-1", 2, leader_epoch=1) == 2  # both ranks of the attempt
    with pytest.raises(FailedPrecondition, match="another attempt"):
        workers.renew("job-1", 1, leader_epoch=1)
    with pytest.raises(NotFound, match="no workers"):
        workers.renew("job-2", 1, leader_epoch=1)
    fence.observe(5)
    with pytest.raises(FailedPrecondition, match="stale scheduler leader"):
        workers.renew("job-1", 2, leader_epoch=4)
    with pytest.raises(InvalidArgument):
        workers.renew("../x", 1, leader_epoch=5)


# --- the swarm ----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_thousand_agents_on_one_leader_no_false_death_and_every_stop_seen() -> None:
    """...and then the scheduler killed and started again (a new term: every agent registers again at once):
    no live node is read not ready on the way, and every one is ready again."""
    out = fleet.run_fleet(SWARM)
    assert not out.not_ready, f"live nodes a census saw not ready: {dict(list(out.not_ready.items())[:10])}"
    assert not out.lost_contact, f"gangs stopped for live nodes: {dict(list(out.lost_contact.items())[:10])}"
    assert set(out.detect_s) == out.stopped and len(out.stopped) == 6
    assert not out.undetected, f"stopped nodes never seen not ready: {sorted(out.undetected)}"
    assert sorted(out.way.values()) == ["crash"] * 3 + ["silent"] * 3
    assert not out.job_errors, out.job_errors[:5]
    assert out.job_states["64gpu:succeeded"] >= 1 and out.job_states["1gpu:succeeded"] >= 1, out.job_states
    bad = {k: v for k, v in out.job_states.items() if k.endswith((":failed", ":cancelled"))}
    assert not bad, f"jobs that ended badly: {bad}"
    assert len(out.failover_all_ready_s) == SWARM.failovers == 1
    assert out.failover_all_ready_s[0] < SWARM.failover_watch_s, "every live node ready again after the failover"
    assert not out.failover_not_ready, \
        f"live nodes read not ready after the failover: {dict(list(out.failover_not_ready.items())[:10])}"
    # The nodes crashed in the new leader's grace, once it had heard them, were all seen lost.
    assert len(out.failover_detect_s) == SWARM.stop_per_round
    assert all(s < SWARM.failover_watch_s for s in out.failover_detect_s.values()), out.failover_detect_s
