"""A standby scheduler names the leader of now to every node call it refuses (real etcd, real gRPC).

Before the fix a standby read the leader's name once, before campaigning. The control-plane suite showed
both ways that goes wrong: the standby whose one read hit the etcd member just killed (`election: store
unavailable: etcd at 127.0.0.1:... is unavailable`) refused the gateway's node calls naming nobody, for
good; and a standby that waited through a failover named the replica that no longer led.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import grpc
import grpc.aio
import pytest

from tests.core.store_faults import FaultyStore
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd_secure import settings_of
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

TTL_S = 2
# Who leads must be known within a few campaign rounds (0.5 s each) of the store answering again.
NAMED_WITHIN_S = 5.0


def settings(etcd: Mapping[str, str], prefix: str) -> SchedulerSettings:
    return SchedulerSettings(**etcd, etcd_prefix=prefix, listen_port=0, leader_ttl_s=TTL_S,
                             reconcile_interval_s=0.2, stop_grace_s=1.0, node_timeout_s=3.0)


class Replicas:
    """Scheduler replicas on one prefix; one may be given a FaultyStore over its own etcd client."""

    def __init__(self, etcd: EtcdOptions, prefix: str) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._running: dict[SchedulerApp, FaultyStore | None] = {}

    async def start(self, *, faulty: bool = False) -> tuple[SchedulerApp, FaultyStore | None]:
        store = FaultyStore(EtcdStore.from_options(self._etcd)) if faulty else None
        app = SchedulerApp(settings(settings_of(self._etcd), self._prefix), store=store)
        self._running[app] = store
        await app.start()
        return app, store

    async def stop(self, app: SchedulerApp) -> None:
        store = self._running.pop(app)
        await app.stop()
        if store is not None:
            await store.close()

    async def stop_all(self) -> None:
        for app in list(self._running):
            await self.stop(app)


@pytest.fixture
async def replicas(etcd_options: EtcdOptions, key_prefix: str) -> AsyncIterator[Replicas]:
    r = Replicas(etcd_options, key_prefix.rstrip("/"))
    yield r
    await r.stop_all()


async def refusal_names(app: SchedulerApp) -> str | None:
    """The leader a node call to `app` is sent to ('' when refused naming nobody; None if it answered)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        try:
            await scheduler_pb2_grpc.NodeServiceStub(channel).ListNodes(scheduler_pb2.ListNodesRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return str(dict(exc.trailing_metadata() or ()).get("trainyard-leader", ""))
    return None


def identity(app: SchedulerApp) -> str:
    return app.leadership.identity


async def test_a_standby_whose_leader_lookups_failed_names_the_leader_once_etcd_answers(replicas: Replicas) -> None:
    leader, _ = await replicas.start()
    await eventually(lambda: truthy(leader.leadership.is_leader), timeout=10, what="the first replica to lead")
    standby, faults = await replicas.start(faulty=True)
    assert faults is not None
    # Its etcd member is gone for its first lookups of the leader key, as after the member loss.
    faults.fail_gets(standby.keys.leader, times=4)

    async def named() -> bool:
        return await refusal_names(standby) == identity(leader)

    await eventually(named, timeout=NAMED_WITHIN_S, what="the standby's refusal to name the leader")
    assert faults.failed_gets == 4
    assert not standby.leadership.is_leader


async def test_a_standby_names_the_new_leader_after_a_failover_it_waited_through(replicas: Replicas) -> None:
    first, _ = await replicas.start()
    await eventually(lambda: truthy(first.leadership.is_leader), timeout=10, what="the first replica to lead")
    b, _ = await replicas.start()
    c, _ = await replicas.start()
    for standby in (b, c):
        async def names_first(standby: SchedulerApp = standby) -> bool:
            return await refusal_names(standby) == identity(first)

        await eventually(names_first, timeout=NAMED_WITHIN_S, what="each standby to name the first leader")

    await replicas.stop(first)  # resigns: one standby takes over at once
    await eventually(lambda: truthy(b.leadership.is_leader or c.leadership.is_leader), timeout=10,
                     what="a standby to take over")
    winner, other = (b, c) if b.leadership.is_leader else (c, b)

    async def names_winner() -> bool:
        return await refusal_names(other) == identity(winner)

    await eventually(names_winner, timeout=NAMED_WITHIN_S,
                     what="the remaining standby to name the new leader, not the stopped one")
    assert await refusal_names(winner) is None


async def test_the_queue_order_is_the_leaders_a_standby_names_it(replicas: Replicas) -> None:
    leader, _ = await replicas.start()
    await eventually(lambda: truthy(leader.leadership.is_leader), timeout=10, what="the first replica to lead")
    standby, _ = await replicas.start()

    async def names_leader() -> bool:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{standby.grpc_port}") as channel:
            try:
                await scheduler_pb2_grpc.JobServiceStub(channel).ListPending(scheduler_pb2.ListPendingRequest(),
                                                                             timeout=5)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert "is not the leader" in (exc.details() or "")
                return dict(exc.trailing_metadata() or ()).get("trainyard-leader") == identity(leader)
        raise AssertionError("a standby answered ListPending")

    await eventually(names_leader, timeout=NAMED_WITHIN_S, what="the standby's refusal to name the leader")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{leader.grpc_port}") as channel:
        jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        bad = scheduler_pb2.ListPendingRequest(limit=1001)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await jobs.ListPending(bad, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit must be from 1 to 1000" in (refused.value.details() or "")
        assert list((await jobs.ListPending(scheduler_pb2.ListPendingRequest(), timeout=5)).jobs) == []
