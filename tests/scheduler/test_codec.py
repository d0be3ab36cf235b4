"""Records survive the trip through etcd's bytes unchanged."""

from __future__ import annotations

from trainyard_scheduler.domain.models import Allocation, JobEvent, NodeAssignment, WorkerExit
from trainyard_scheduler.state import codec

from .builders import NOW, make_job, make_node


def test_job_allocation_node_round_trip() -> None:
    from dataclasses import replace

    job = replace(make_job(), events=(JobEvent(NOW, "pending", "x"),), started_at=NOW,
                  placement=(NodeAssignment("n-a", 0, (1, 2), (0, 1)),),
                  exits=(WorkerExit(0, "n-a", 3, 0, NOW),))
    assert codec.decode_job(codec.encode_job(job)) == job
    alloc = Allocation(job_id="job-1", attempt=2, assignments=job.placement, master_addr="h", master_port=29501,
                       created_at=NOW, launched=frozenset({"n-a"}), exits=job.exits, stop_reason="why")
    assert codec.decode_allocation(codec.encode_allocation(alloc)) == alloc
    node = make_node("n-a", unhealthy=[3])
    assert codec.decode_node(codec.encode_node(node)) == node
