"""Scenario tables for the pure placement core."""

from __future__ import annotations

import pytest

from trainyard_scheduler.domain.models import Allocation, JobState, NodeAssignment
from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.policy.place import choose_master_port, place
from trainyard_scheduler.policy.registry import build_profile

from .builders import NOW, make_job, make_node, snapshot

PROFILE = build_profile()
CONFIG = PolicyConfig()


def alloc_on(job_id: str, node_id: str, gpus: tuple[int, ...], port: int = 29500) -> Allocation:
    return Allocation(job_id=job_id, attempt=0, master_addr=node_id, master_port=port, created_at=NOW,
                      assignments=(NodeAssignment(node_id, 0, gpus, tuple(range(len(gpus)))),))


@pytest.mark.parametrize(
    ("name", "nodes", "job", "allocs", "dead", "expect_nodes"),
    [
        ("fits on one node", [make_node("n-a", gpus=8)], make_job(gpus=4), [], [], ["n-a"]),
        ("gang across two nodes", [make_node("n-a", gpus=4), make_node("n-b", gpus=4)],
         make_job(nodes=2, gpus=4), [], [], ["n-a", "n-b"]),
        ("gang does not fit: all or nothing", [make_node("n-a", gpus=4), make_node("n-b", gpus=2)],
         make_job(nodes=2, gpus=4), [], [], None),
        ("dead node is not used", [make_node("n-a"), make_node("n-b")], make_job(nodes=2), [], ["n-b"], None),
        ("cordoned node is not used", [make_node("n-a", cordoned=True)], make_job(), [], [], None),
        ("unhealthy GPUs are not counted", [make_node("n-a", gpus=2, unhealthy=[1])], make_job(gpus=2), [], [],
         None),
        ("allocated GPUs are not offered twice", [make_node("n-a", gpus=4)], make_job(gpus=2),
         [alloc_on("job-x", "n-a", (0, 1, 2))], [], None),
        ("accelerator model is respected", [make_node("n-a", model="A100"), make_node("n-b", model="H100")],
         make_job(accelerator="H100"), [], [], ["n-b"]),
        ("best fit prefers the fuller node", [make_node("n-a", gpus=8), make_node("n-b", gpus=8)],
         make_job(gpus=2), [alloc_on("job-x", "n-b", (0, 1, 2, 3, 4, 5))], [], ["n-b"]),
    ],
)
def test_single_job_placement(name: str, nodes, job, allocs, dead, expect_nodes) -> None:  # type: ignore[no-untyped-def]
    result = place(snapshot(nodes, [job], allocs, dead), PROFILE, CONFIG, NOW)
    if expect_nodes is None:
        assert result.decisions == [], name
        assert [u.job_id for u in result.unplaced] == [job.id]
        assert result.unplaced[0].reason.startswith("waiting for")
    else:
        assert len(result.decisions) == 1, name
        d = result.decisions[0]
        assert sorted(a.node_id for a in d.assignments) == expect_nodes
        assert all(len(a.gpu_indices) == job.spec.resources.gpus_per_node for a in d.assignments)


def test_ranks_follow_node_rank_and_are_contiguous() -> None:
    result = place(snapshot([make_node("n-a", gpus=2), make_node("n-b", gpus=2)], [make_job(nodes=2, gpus=2)]),
                   PROFILE, CONFIG, NOW)
    (d,) = result.decisions
    assert [(a.node_rank, a.ranks) for a in d.assignments] == [(0, (0, 1)), (1, (2, 3))]


def test_jobs_in_one_call_never_share_a_gpu() -> None:
    jobs = [make_job(f"job-{i}", gpus=3, created=NOW + i) for i in range(4)]
    result = place(snapshot([make_node("n-a", gpus=8), make_node("n-b", gpus=4)], jobs), PROFILE, CONFIG, NOW)
    taken = [(a.node_id, g) for d in result.decisions for a in d.assignments for g in a.gpu_indices]
    assert len(taken) == len(set(taken))
    assert len(result.decisions) == 3  # 8 + 4 GPUs hold three 3-GPU jobs, not four


def test_priority_then_submission_order() -> None:
    jobs = [make_job("job-old", gpus=4, created=NOW), make_job("job-new", gpus=4, created=NOW + 1),
            make_job("job-vip", gpus=4, created=NOW + 2, priority=10)]
    result = place(snapshot([make_node("n-a", gpus=8)], jobs), PROFILE, CONFIG, NOW)
    assert [d.job_id for d in result.decisions] == ["job-vip", "job-old"]


def test_cancelled_and_placed_jobs_are_not_placed() -> None:
    jobs = [make_job("job-c", cancel_requested=True), make_job("job-r", state=JobState.RUNNING)]
    assert place(snapshot([make_node("n-a")], jobs), PROFILE, CONFIG, NOW).decisions == []


def test_master_port_avoids_ports_in_use() -> None:
    first = choose_master_port("job-1", 0, set(), (29500, 29502))
    second = choose_master_port("job-1", 0, {first}, (29500, 29502))
    assert first != second and 29500 <= second <= 29502


def test_node_running_workers_of_a_released_gang_takes_no_new_gang() -> None:
    from dataclasses import replace

    snap = snapshot([make_node("n-a"), make_node("n-b")], [make_job(gpus=1)])
    snap = replace(snap, reported_running={"n-a": frozenset({("job-gone", 1)}), "n-b": frozenset()})
    assert snap.orphans() == {"n-a": {("job-gone", 1)}}
    (d,) = place(snap, PROFILE, CONFIG, NOW).decisions
    assert [a.node_id for a in d.assignments] == ["n-b"]


def test_reported_workers_of_a_live_allocation_are_not_orphans() -> None:
    from dataclasses import replace

    alloc = alloc_on("job-x", "n-a", (0,))
    snap = replace(snapshot([make_node("n-a")], allocations=[alloc]),
                   reported_running={"n-a": frozenset({("job-x", 0)})})
    assert snap.orphans() == {}
    snap = replace(snap, reported_running={"n-a": frozenset({("job-x", 7)})})  # another attempt
    assert snap.orphans() == {"n-a": {("job-x", 7)}}


def test_a_report_older_than_the_release_is_stale_not_an_orphan() -> None:
    """Regression: every normally finished gang blocked its node until the agent's next heartbeat (the
    last report still listed it), delaying the next placement by up to a heartbeat interval."""
    from dataclasses import replace

    snap = replace(snapshot([make_node("n-a")], [make_job(gpus=1)]),
                   reported_running={"n-a": frozenset({("job-done", 1)})},
                   reported_at={"n-a": 10.0}, released_at={("job-done", 1): 10.5})
    assert snap.orphans() == {}
    assert [a.node_id for d in place(snap, PROFILE, CONFIG, NOW).decisions for a in d.assignments] == ["n-a"]
    # Reported again after the release: the workers really still run there.
    later = replace(snap, reported_at={"n-a": 11.0})
    assert later.orphans() == {"n-a": {("job-done", 1)}}
    assert place(later, PROFILE, CONFIG, NOW).decisions == []
