"""The reconciler's snapshot: decoded from the etcd mirror, with the operator's policy records and each
running job's latest checkpoint time (from the checkpoint-store's keys)."""

from __future__ import annotations

import json

from trainyard_core.clock import SystemClock
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_scheduler.domain.queues import QueueConfig, QuotaLimit, TeamQuota
from trainyard_scheduler.liveness import NodeLiveness
from trainyard_scheduler.reconcile import SnapshotBuilder
from trainyard_scheduler.state import codec
from trainyard_scheduler.state.keys import Keys

from .builders import NOW, make_job, make_node, running

KEYS = Keys("/ty")


async def test_snapshot_carries_policy_records_and_checkpoint_times() -> None:
    store = MemoryStore()
    job, alloc = running(make_job("job-run", gpus=8), [("n-a", range(8))])
    await store.put(KEYS.job(job.id), codec.encode_job(job))
    await store.put(KEYS.allocation(job.id), codec.encode_allocation(alloc))
    await store.put(KEYS.node("n-a"), codec.encode_node(make_node("n-a")))
    # What the checkpoint-store writes: the record, then the latest pointer naming it.
    await store.put(f"/ty/checkpoints/{job.id}/ckpt-1", json.dumps({"v": 1, "created_at": NOW - 42}).encode())
    await store.put(f"/ty/checkpoints-latest/{job.id}", b"ckpt-1")
    await store.put(KEYS.queue("prod"), codec.encode_queue(QueueConfig("prod", tier=3)))
    await store.put(KEYS.quota("team-a"), codec.encode_quota(TeamQuota("team-a", {"*": QuotaLimit(8)})))
    await store.put(KEYS.quota("broken"), b"{not json")  # an unreadable record is ignored, not fatal
    mirror = PrefixMirror(store, "/ty/")
    await mirror.start()
    try:
        assert await mirror.wait_for(await store.put("/ty/marker", b"x"))
        snap, policy = SnapshotBuilder(mirror, KEYS).build(NodeLiveness(SystemClock(), 5.0), {})
    finally:
        await mirror.stop()
    assert snap.jobs[job.id].last_checkpoint_at == NOW - 42
    assert set(snap.allocations) == {job.id} and set(snap.nodes) == {"n-a"}
    assert set(policy.queues) == {"prod"} and policy.queues["prod"].tier == 3
    assert set(policy.quotas) == {"team-a"}
