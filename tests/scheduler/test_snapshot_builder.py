"""The reconciler's snapshot: decoded from the etcd mirror, with the operator's policy records and each
running job's latest checkpoint time (from the checkpoint-store's latest pointers)."""

from __future__ import annotations

from trainyard_core.clock import SystemClock
from trainyard_core.ids import new_id
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
    # What the checkpoint-store writes: the latest pointer names a checkpoint id minted at its Begin.
    await store.put(f"/ty/checkpoints-latest/{job.id}", new_id("ckpt", NOW - 42).encode())
    await store.put("/ty/checkpoints-latest/job-gone", b"not-an-id")  # no time, no harm
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


async def test_a_kept_snapshot_is_the_one_a_fresh_build_would_give_after_any_writes() -> None:
    """The builder re-decodes only what changed: after every batch of random puts and deletes (jobs going
    terminal, allocations, nodes losing GPUs, policy records good and broken, checkpoints), its snapshot equals
    a fresh builder's over the same mirror, and a reload starts it over from the whole copy."""
    import random

    from trainyard_scheduler.domain.models import JobState

    rng = random.Random(1307)
    store = MemoryStore()
    mirror = PrefixMirror(store, "/ty/")
    await mirror.start()
    kept = SnapshotBuilder(mirror, KEYS)
    live = NodeLiveness(SystemClock(), 5.0)
    states = [JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED]

    async def write_one() -> int:
        pick = rng.randrange(8)
        ident = f"x-{rng.randrange(6)}"
        if pick == 0:
            job = make_job(f"job-{ident}", state=rng.choice(states))
            return await store.put(KEYS.job(job.id), codec.encode_job(job))
        if pick == 1:
            job, alloc = running(make_job(f"job-{ident}"), [(f"n-{ident}", range(2))])
            return await store.put(KEYS.allocation(job.id), codec.encode_allocation(alloc))
        if pick == 2:
            node = make_node(f"n-{ident}", unhealthy=rng.sample(range(8), rng.randrange(3)))
            return await store.put(KEYS.node(node.node_id), codec.encode_node(node))
        if pick == 3:
            raw = codec.encode_queue(QueueConfig(f"q-{ident}", tier=rng.randrange(3))) if rng.random() < 0.7 \
                else b"{broken"
            return await store.put(KEYS.queue(f"q-{ident}"), raw)
        if pick == 4:
            return await store.put(KEYS.quota(f"t-{ident}"), codec.encode_quota(TeamQuota(f"t-{ident}",
                                                                                         {"*": QuotaLimit(8)})))
        if pick == 5:
            job_id = f"job-{ident}"
            ckpt = new_id("ckpt", NOW - rng.randrange(100)) if rng.random() < 0.9 else "garbage"
            return await store.put(f"/ty/checkpoints-latest/{job_id}", ckpt.encode())
        # A delete of something that may exist.
        key = rng.choice([KEYS.job(f"job-{ident}"), KEYS.allocation(f"job-{ident}"), KEYS.node(f"n-{ident}"),
                          KEYS.queue(f"q-{ident}"), KEYS.quota(f"t-{ident}"), f"/ty/checkpoints-latest/job-{ident}"])
        await store.delete(key)
        return await store.put("/ty/marker", str(rng.random()).encode())

    try:
        for step in range(150):
            revision = 0
            for _ in range(rng.randrange(1, 6)):
                revision = await write_one()
            assert await mirror.wait_for(revision)
            if step == 75:
                await mirror.stop()  # a reload: the kept view starts from the whole copy again
                await mirror.start()
            got, got_policy = kept.build(live, {})
            want, want_policy = SnapshotBuilder(mirror, KEYS).build(live, {})
            assert got == want, f"step {step}"
            assert got_policy == want_policy, f"step {step}"
        assert any(j.state is JobState.RUNNING for j in got.jobs.values()) or got.jobs == {}
    finally:
        await mirror.stop()


async def test_a_builder_that_is_gone_is_no_longer_fed_changes() -> None:
    import gc

    store = MemoryStore()
    mirror = PrefixMirror(store, "/ty/")
    await mirror.start()
    try:
        for _ in range(3):
            SnapshotBuilder(mirror, KEYS)  # a reconciler per term, each dropped when its term ends
        gc.collect()
        assert len(mirror._subscribers) == 0
    finally:
        await mirror.stop()
