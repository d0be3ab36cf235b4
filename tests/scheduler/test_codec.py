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


def test_policy_fields_queues_quotas_and_usage_round_trip() -> None:
    from dataclasses import replace

    from trainyard_scheduler.domain.queues import FairShareUsage, QueueConfig, QuotaLimit, TeamQuota

    job = replace(make_job(accelerators=["H100", "A100"], min_memory_gb=40, vendor="nvidia", min_cc="8.0",
                           allow_mixed=True, cpus=4, speed_hints={"H100": 2.5}, priority_class="high",
                           queue="prod", time_limit=3600, tier="leaf", required=True, wait_s=60,
                           preempted_by=["job-x"], max_restarts=3, signal="SIGUSR1", grace_s=30),
                  restarts=2, not_before=NOW + 5, queued_at=NOW + 1)
    from trainyard_scheduler.domain.models import CheckpointPolicy
    job = replace(job, spec=replace(job.spec, checkpoint=CheckpointPolicy(every_steps=5, interval_s=60, keep_last=2)))
    assert codec.decode_job(codec.encode_job(job)) == job
    alloc = Allocation(job_id="job-1", attempt=1, master_addr="h", master_port=1, created_at=NOW,
                       assignments=(NodeAssignment("n-a", 0, (0,), (0,), model="H100", cpus=4),), team="team-a",
                       priority=(1, 100, 5), borrowed=True, preemptible=False, preempted_by="job-y",
                       stop_signal="SIGUSR1", stop_grace_s=30.0, expected_end=NOW + 60)
    assert codec.decode_allocation(codec.encode_allocation(alloc)) == alloc
    q = QueueConfig("prod", tier=5, node_labels={"pool": "a"}, max_gpus=64, description="production")
    assert codec.decode_queue(codec.encode_queue(q)) == q
    quota = TeamQuota("team-a", {"*": QuotaLimit(8), "H100": QuotaLimit(16, 4)}, weight=2.0)
    assert codec.decode_quota(codec.encode_quota(quota)) == quota
    usage = FairShareUsage(at=NOW, by_team={"team-a": {"H100": 12.5}})
    assert codec.decode_usage(codec.encode_usage(usage)) == usage


def test_records_written_before_the_policy_fields_still_decode() -> None:
    import json

    old = json.loads(codec.encode_job(make_job()))
    for key in ("queued_at", "restarts", "not_before", "preempted_by"):
        old.pop(key)
    for key in ("priority_class", "topology", "preemption", "restart_backoff_s", "time_limit_s"):
        old["spec"].pop(key)
    old["spec"]["resources"] = {"nodes": 1, "gpus_per_node": 1, "accelerator": ""}
    job = codec.decode_job(json.dumps(old).encode())
    assert job.queued_at == job.created_at and job.spec.restart_backoff_s == 10.0
    assert job.spec.preemption.signal == "SIGTERM" and job.spec.resources.accelerators == ()
