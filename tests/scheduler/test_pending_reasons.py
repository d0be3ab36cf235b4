"""Which waiting jobs get their reason rewritten (`pending_reasons.PendingReasons`), and the GPUs a snapshot's
gangs hold per team (what fair-share usage accrues from)."""

from __future__ import annotations

from dataclasses import replace

from trainyard_scheduler.domain.models import Allocation, NodeAssignment
from trainyard_scheduler.pending_reasons import PendingReasons
from trainyard_scheduler.policy.place import Unplaced

from .builders import NOW, make_job, make_node, snapshot


def test_a_reason_is_written_when_it_changes_and_at_most_once_per_interval_per_job() -> None:
    clock = [100.0]
    reasons = PendingReasons(5.0, lambda: clock[0])
    a, b = make_job("job-a"), replace(make_job("job-b"), message="no node has 8 free GPUs")
    snap = snapshot([make_node("n-1")], [a, b])
    why = [Unplaced("job-a", "no node has 8 free GPUs"), Unplaced("job-b", "no node has 8 free GPUs")]
    first = reasons.notes(snap, why)
    # job-b says so already: nothing to write for it.
    assert [(job.id, job.message) for job, _ in first] == [("job-a", "no node has 8 free GPUs")]
    assert first[0][1] == snap.job_revisions["job-a"]  # the revision the write replaces
    moved = [Unplaced("job-a", "quota of team default used up")]
    clock[0] += 4.9
    assert reasons.notes(snap, moved) == []  # rewritten too recently
    clock[0] += 0.2
    assert [job.message for job, _ in reasons.notes(snap, moved)] == ["quota of team default used up"]
    assert reasons.notes(snap, [Unplaced("job-gone", "anything")]) == []


def test_the_gpus_each_team_holds_by_model() -> None:
    def alloc(job_id: str, team: str, *shares: tuple[str, int, str]) -> Allocation:
        return Allocation(job_id=job_id, attempt=1, master_addr="n-1", master_port=29500, created_at=NOW, team=team,
                          assignments=tuple(NodeAssignment(node, i, tuple(range(gpus)), (i,), model=model)
                                            for i, (node, gpus, model) in enumerate(shares)))
    jobs = [make_job("job-1"), make_job("job-2"), replace(make_job("job-3"), team="nlp")]
    snap = snapshot([make_node("n-1"), make_node("n-2")], jobs, [
        alloc("job-1", "vision", ("n-1", 4, "H100"), ("n-2", 2, "A100")),
        alloc("job-2", "vision", ("n-2", 1, "")),
        alloc("job-3", "", ("n-1", 2, "H100"), ("n-2", 0, "")),  # no team on the record: the job's; a CPU share
    ])
    assert snap.gpus_held() == {"vision": {"H100": 4, "A100": 2, "unknown": 1}, "nlp": {"H100": 2}}
