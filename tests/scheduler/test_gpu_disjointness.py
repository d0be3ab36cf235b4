"""No GPU in two gangs when the leader's mirror lags its own writes (issue 11, finding 5).

The sequence, with the real `Reconciler.run`, `PrefixMirror`, `place` and `Repository` over a store whose
watch hands over each revision only when the test releases it: job A (8 GPUs, priority 0) is pending; job C
(8 GPUs, priority 100) is created and held in the watch; the first cycle commits A on the node's 8 GPUs;
the watch then releases only C's creation. Before the fix the next cycle started at once from that stale
mirror (A pending, GPUs free), placed C on the same GPUs, and C's transaction succeeded.

Two guards prevent it, and each alone must hold: read-your-writes (a cycle starts only from a mirror that
includes this leader's writes) and the store's per-node GPU holdings (the gang's transaction compares
them). With both removed the test shows the double allocation, so it can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from trainyard_core.clock import SystemClock
from trainyard_core.errors import Conflict
from trainyard_core.store import Compare, Delete, Put, TxnResult, WatchEvent
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler import metrics
from trainyard_scheduler.domain.models import Allocation, NodeAssignment
from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.launch import NodeLaunch
from trainyard_scheduler.liveness import NodeLiveness
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.reconcile import Reconciler, ReconcileSettings
from trainyard_scheduler.state import holdings
from trainyard_scheduler.state.codec import decode_allocation
from trainyard_scheduler.state.holdings import HeldElsewhere
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job, make_node


class HeldWatch:
    """A store whose watch delivers a batch only once the test has released its revision, and which checks
    after every successful transaction that no GPU is named by two allocations."""

    def __init__(self, inner: Any, keys: Keys) -> None:
        self.inner = inner
        self._keys = keys
        self.upto = 0
        self._moved = asyncio.Event()
        self.violations: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def release(self, upto: int) -> None:
        self.upto = upto
        self._moved.set()

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        res: TxnResult = await self.inner.txn(compares, success, failure)
        if res.succeeded:
            page = await self.inner.range(self._keys.allocations)
            owner: dict[tuple[str, int], str] = {}
            for kv in page.kvs:
                alloc = decode_allocation(kv.value)
                for a in alloc.assignments:
                    for g in a.gpu_indices:
                        other = owner.setdefault((a.node_id, g), alloc.job_id)
                        if other != alloc.job_id:
                            self.violations.append(f"GPU {g} of {a.node_id} in {other} and {alloc.job_id}")
        return res

    async def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[list[WatchEvent]]:
        queue: asyncio.Queue[list[WatchEvent]] = asyncio.Queue()

        async def pump() -> None:
            async for batch in self.inner.watch(prefix, start_revision=start_revision):
                await queue.put(batch)
        task = asyncio.create_task(pump())
        try:
            while True:
                batch = await queue.get()
                while max(e.mod_revision for e in batch) > self.upto:
                    self._moved.clear()
                    await self._moved.wait()
                yield batch
        finally:
            task.cancel()


class Agents:
    def __init__(self) -> None:
        self.launched: list[tuple[str, str]] = []

    async def launch(self, node: Any, launch: NodeLaunch, epoch: int) -> None:
        self.launched.append((launch.job_id, node.node_id))

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        return None


def _no_holdings(alloc: Allocation) -> dict[str, holdings.Edit]:
    return {}


async def _always_caught_up(self: Reconciler, stop: asyncio.Event) -> bool:
    return True


def _count(counter: Any) -> float:
    return float(counter._value.get())


@contextlib.asynccontextmanager
async def _store(kind: str, etcd_options: Callable[[], EtcdOptions]) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryStore()
        return
    store = EtcdStore.from_options(etcd_options())
    try:
        yield store
    finally:
        await store.close()


GUARDS = {
    "both": (),
    "holdings only": ("read-your-writes",),
    "read-your-writes only": ("holdings",),
    "neither (shows the bug)": ("read-your-writes", "holdings"),
}


@pytest.mark.parametrize("kind", ["memory", "etcd"])
@pytest.mark.parametrize("guards", list(GUARDS), ids=list(GUARDS))
async def test_a_lagging_mirror_never_puts_a_gpu_into_two_gangs(kind: str, guards: str, request: pytest.FixtureRequest,
                                                                 key_prefix: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    removed = GUARDS[guards]
    if "holdings" in removed:
        monkeypatch.setattr(holdings, "take", _no_holdings)
    if "read-your-writes" in removed:
        monkeypatch.setattr(Reconciler, "_caught_up", _always_caught_up)
    keys = Keys(key_prefix.rstrip("/"))
    async with _store(kind, lambda: request.getfixturevalue("etcd_options")) as inner:
        store = HeldWatch(inner, keys)
        admin = Repository(store, keys)
        node = make_node("node-1", gpus=8)
        await admin.nodes.modify(node.node_id, lambda _: node)
        await admin.create_job(make_job("job-a", gpus=8, priority=0))
        store.release(admin.written_revision)
        mirror = PrefixMirror(store, keys.prefix + "/")
        await mirror.start()
        await admin.create_job(make_job("job-c", gpus=8, priority=100))
        c_created = admin.written_revision  # held: the mirror does not see C yet

        async def from_mirror(key: str) -> Any:
            return mirror.items.get(key)
        repo = Repository(store, keys, holdings_source=from_mirror)
        liveness = NodeLiveness(SystemClock(), timeout_s=3600.0)
        liveness.seen(node.node_id)
        reconciler = Reconciler(repo=repo, mirror=mirror, liveness=liveness, agents=Agents(),
                                profile=build_profile(), clock=SystemClock(), epoch=lambda: 0,
                                # As in production, a gang that just started is not preempted (C outranks A).
                                settings=ReconcileSettings(interval_s=0.05, policy=PolicyConfig(preempt_exempt_s=3600)))
        stop = asyncio.Event()
        loop = asyncio.create_task(reconciler.run(stop))
        try:
            async def placed(job_id: str) -> bool:
                return await repo.get_allocation(job_id) is not None
            await eventually(lambda: placed("job-a"), what="cycle 1 commits job A")
            behind, conflicts, cycles = (_count(metrics.MIRROR_BEHIND), _count(metrics.PLACEMENT_CONFLICTS),
                                         reconciler.cycles)
            store.release(c_created)  # the watch hands over C's creation, not A's placement

            async def stale_window_tried() -> bool:
                if "read-your-writes" not in removed:
                    # The loop noticed its mirror lacks its own writes and did not cycle on it.
                    return _count(metrics.MIRROR_BEHIND) > behind
                if "holdings" not in removed:
                    # It cycled on the stale mirror; the store refused C's gang.
                    return _count(metrics.PLACEMENT_CONFLICTS) > conflicts and reconciler.cycles > cycles
                return await placed("job-c")
            await eventually(stale_window_tried, what="a cycle on the lagging mirror")

            store.release(10**12)
            await mirror.wait_for(repo.written_revision)
            settled = reconciler.cycles
            await eventually(lambda: truthy(reconciler.cycles >= settled + 3), what="cycles on the caught-up mirror")
        finally:
            stop.set()
            mirror.changed.set()
            await loop
            await mirror.stop()
        if removed == ("read-your-writes", "holdings"):
            assert store.violations, "without either guard the stale cycle should have doubled a GPU"
            return
        assert store.violations == []
        assert await repo.get_allocation("job-c") is None
        found = await repo.get_allocation("job-a")
        assert found is not None and found[0].assignments[0].gpu_indices == tuple(range(8))


async def test_a_new_leader_does_not_cycle_before_its_mirror_reaches_its_epoch(key_prefix: str) -> None:
    """The first cycle of a term waits until the mirror includes the revision at which this leader won."""
    keys = Keys(key_prefix.rstrip("/"))
    inner = MemoryStore()
    store = HeldWatch(inner, keys)
    admin = Repository(store, keys)
    node = make_node("node-1", gpus=8)
    await admin.nodes.modify(node.node_id, lambda _: node)
    store.release(admin.written_revision)
    mirror = PrefixMirror(store, keys.prefix + "/")
    await mirror.start()
    # The job is stored before the leader key (the epoch), but the watch has not delivered it.
    await admin.create_job(make_job("job-a", gpus=8))
    epoch = await inner.put(keys.leader, b"me")
    liveness = NodeLiveness(SystemClock(), timeout_s=3600.0)
    liveness.seen(node.node_id)
    reconciler = Reconciler(repo=Repository(store, keys), mirror=mirror, liveness=liveness, agents=Agents(),
                            profile=build_profile(), clock=SystemClock(), epoch=lambda: epoch,
                            settings=ReconcileSettings(interval_s=0.05))
    behind = _count(metrics.MIRROR_BEHIND)
    stop = asyncio.Event()
    loop = asyncio.create_task(reconciler.run(stop))
    try:
        await eventually(lambda: truthy(_count(metrics.MIRROR_BEHIND) > behind), what="the loop waiting for its epoch")
        assert reconciler.cycles == 0
        store.release(epoch)
        await eventually(lambda: truthy(reconciler.cycles > 0), what="the first cycle once caught up")
        assert mirror.revision >= epoch
    finally:
        stop.set()
        await loop
        await mirror.stop()


async def test_the_store_refuses_a_gang_decided_on_stale_holdings(key_prefix: str) -> None:
    """The compare itself, with nothing kept client-side: a repository whose holdings source is behind
    the store (it sees the node holding nothing) has its transaction refused by the store."""
    keys = Keys(key_prefix.rstrip("/"))
    store = HeldWatch(MemoryStore(), keys)
    first = Repository(store, keys)
    node = make_node("node-1", gpus=8)
    await first.nodes.modify(node.node_id, lambda _: node)
    for job_id in ("job-a", "job-c"):
        await first.create_job(make_job(job_id, gpus=8))
    a = await first.get_job("job-a")
    c = await first.get_job("job-c")
    assert a is not None and c is not None
    await first.commit_placement(a[0], a[1], _alloc("job-a"))

    async def stale(key: str) -> Any:
        return None
    second = Repository(store, keys, holdings_source=stale)
    with pytest.raises(Conflict) as refused:
        await second.commit_placement(c[0], c[1], _alloc("job-c"))
    assert not isinstance(refused.value, HeldElsewhere)  # refused by the store's compare, not before it
    assert await second.get_allocation("job-c") is None
    assert store.violations == []


def _alloc(job_id: str, node_id: str = "node-1", gpus: tuple[int, ...] = tuple(range(8))) -> Allocation:
    return Allocation(job_id=job_id, attempt=1, assignments=(NodeAssignment(
        node_id=node_id, node_rank=0, gpu_indices=gpus, ranks=tuple(range(len(gpus))), model="H100"),),
        master_addr=f"{node_id}.host", master_port=29500, created_at=0.0)




async def test_gangs_sharing_a_node_in_one_cycle_both_commit(key_prefix: str, etcd_store: EtcdStore) -> None:
    """Two gangs on disjoint GPUs of one node, committed concurrently (as one cycle's decisions are): the
    second is planned on the holdings the first leaves (in the same transaction, or compared after it),
    so both land, and the node's holdings list both."""
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(etcd_store, keys)
    node = make_node("node-1", gpus=8)
    await repo.nodes.modify(node.node_id, lambda _: node)
    for job_id in ("job-a", "job-b"):
        await repo.create_job(make_job(job_id, gpus=4))
    a, b = await repo.get_job("job-a"), await repo.get_job("job-b")
    assert a is not None and b is not None
    await asyncio.gather(repo.commit_placement(a[0], a[1], _alloc("job-a", gpus=(0, 1, 2, 3))),
                         repo.commit_placement(b[0], b[1], _alloc("job-b", gpus=(4, 5, 6, 7))))
    held = await etcd_store.get(keys.holdings("node-1"))
    assert held is not None
    assert json.loads(held.value) == {"jobs": {"job-a": [0, 1, 2, 3], "job-b": [4, 5, 6, 7]}}


class HoldNextTxn:
    """Once armed, the next transaction waits for `release` before it reaches the store."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False
        self.sent = asyncio.Event()
        self.release = asyncio.Event()
        self.txns = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        self.txns += 1
        if self.armed:
            self.armed = False
            self.sent.set()
            await self.release.wait()
        res: TxnResult = await self.inner.txn(compares, success, failure)
        return res


async def test_gangs_waiting_on_a_busy_node_share_one_transaction_and_one_lost_race_fails_only_its_own(
        key_prefix: str) -> None:
    """While gang A's transaction is in flight on node-1, B and C (other GPUs of node-1) wait, then go in
    one transaction planned on A's holdings. C's job changed meanwhile, so that transaction fails; each is
    sent again alone: B lands, C alone is refused, and the holdings list exactly A and B."""
    keys = Keys(key_prefix.rstrip("/"))
    store = HoldNextTxn(MemoryStore())
    repo = Repository(store, keys)
    node = make_node("node-1", gpus=8)
    await repo.nodes.modify(node.node_id, lambda _: node)
    for job_id in ("job-a", "job-b", "job-c"):
        await repo.create_job(make_job(job_id, gpus=2))
    a, b, c = [await repo.get_job(j) for j in ("job-a", "job-b", "job-c")]
    assert a is not None and b is not None and c is not None
    store.armed = True
    first = asyncio.create_task(repo.commit_placement(a[0], a[1], _alloc("job-a", gpus=(0, 1))))
    await store.sent.wait()
    second = asyncio.create_task(repo.commit_placement(b[0], b[1], _alloc("job-b", gpus=(4, 5))))
    third = asyncio.create_task(repo.commit_placement(c[0], c[1] - 1, _alloc("job-c", gpus=(6, 7))))
    await eventually(lambda: truthy(len(repo.holdings_writes._waiting) == 2), what="B and C waiting on node-1")
    sent_before = store.txns
    store.release.set()
    await first
    await second
    with pytest.raises(Conflict):
        await third
    assert repo.holdings_writes.merged == 1  # B and C went together first ...
    assert store.txns == sent_before + 3  # ... then each alone
    held = await store.get(keys.holdings("node-1"))
    assert held is not None and json.loads(held.value) == {"jobs": {"job-a": [0, 1], "job-b": [4, 5]}}
    assert await repo.get_allocation("job-c") is None

