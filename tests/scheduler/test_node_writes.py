"""Node records are written by compare-and-swap on the revision read (issue 11, finding 6).

The cordon (an operator's), GPU health from heartbeats and re-registration each read, change and write the
node across awaits. Before every node write was a CAS, a health update that read the node before an
operator's cordon landed wrote it back afterwards and the acknowledged cordon was lost. The store here
pauses the health update between its read and its write, deterministically, while the cordon completes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.clock import SystemClock
from trainyard_core.store import KeyValue
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.store.memory import MemoryStore
from trainyard_scheduler.domain.models import Node
from trainyard_scheduler.grpc.servicer import NodeServicer
from trainyard_scheduler.leadership import Leadership
from trainyard_scheduler.liveness import NodeLiveness
from trainyard_scheduler.state.codec import decode_node
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_node


class PausingReads:
    """The next read of `key` after `arm()` returns, then waits until `resume()` before its caller goes on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._key = ""
        self.paused = asyncio.Event()
        self._go = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, key: str) -> None:
        self._key = key

    def resume(self) -> None:
        self._go.set()

    async def get(self, key: str) -> KeyValue | None:
        kv: KeyValue | None = await self.inner.get(key)
        if key == self._key:
            self._key = ""
            self.paused.set()
            await self._go.wait()
        return kv


@contextlib.asynccontextmanager
async def _inner(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryStore()
        return
    store = EtcdStore.from_options(request.getfixturevalue("etcd_options"))
    try:
        yield store
    finally:
        await store.close()


async def _leader_with_a_node(store: Any, keys: Keys) -> tuple[Repository, Node, NodeServicer]:
    """A registered 8-GPU node and the node servicer of a replica that leads (epoch 1)."""
    repo = Repository(store, keys)
    node = make_node("node-1", gpus=8)
    await repo.nodes.modify(node.node_id, lambda _: node)
    leadership = Leadership("me")
    leadership.epoch = 1
    clock = SystemClock()
    return repo, node, NodeServicer(repo, leadership, NodeLiveness(clock, 60.0), clock, 500)


@pytest.mark.parametrize("kind", ["memory", "etcd"])
async def test_a_cordon_is_never_lost_to_a_concurrent_health_update(kind: str, key_prefix: str,
                                                                     request: pytest.FixtureRequest) -> None:
    keys = Keys(key_prefix.rstrip("/"))
    async with _inner(kind, request) as inner:
        store = PausingReads(inner)
        repo, node, servicer = await _leader_with_a_node(store, keys)

        store.arm(keys.node(node.node_id))
        xid = replace(node.gpus[3], healthy=False, health_reason="XID 79", health_action="restart_job")
        health = asyncio.create_task(servicer._update_health(node.node_id, {3: xid}))
        await store.paused.wait()  # the health update has read the node, uncordoned
        reply = await servicer.CordonNode(scheduler_pb2.CordonNodeRequest(
            node_id=node.node_id, cordoned=True, reason="maintenance"), None)  # type: ignore[arg-type]
        assert reply.node.cordoned
        store.resume()
        await health

        stored = await repo.nodes.get(node.node_id)
        assert stored.cordoned and stored.cordon_reason == "maintenance"
        assert not stored.gpus[3].healthy and stored.gpus[3].health_reason == "XID 79"


async def test_many_concurrent_node_writes_all_land(key_prefix: str, etcd_options: EtcdOptions) -> None:
    """Cordon flips and health changes of every GPU, all at once against a real etcd: each acknowledged
    change is in the final record."""
    keys = Keys(key_prefix.rstrip("/"))
    store = EtcdStore.from_options(etcd_options)
    try:
        repo, node, servicer = await _leader_with_a_node(store, keys)
        bad = {i: replace(node.gpus[i], healthy=False, health_reason=f"XID 79 on {i}") for i in range(8)}
        await asyncio.gather(
            servicer.CordonNode(scheduler_pb2.CordonNodeRequest(node_id=node.node_id, cordoned=True,
                                                                reason="maintenance"), None),  # type: ignore[arg-type]
            *(servicer._update_health(node.node_id, {i: g}) for i, g in bad.items()))
        stored = await repo.nodes.get(node.node_id)
        assert stored.cordoned and stored.cordon_reason == "maintenance"
        assert [g.health_reason for g in stored.gpus] == [f"XID 79 on {i}" for i in range(8)]
    finally:
        await store.close()




async def test_a_registration_reads_the_mirror_first_and_a_stale_mirror_loses_nothing() -> None:
    keys = Keys("/t")
    store = MemoryStore()
    mirror: dict[str, KeyValue] = {}

    async def from_mirror(key: str) -> KeyValue | None:
        return mirror.get(key)
    repo = Repository(store, keys, node_source=from_mirror)
    node = make_node("n-1")
    assert await repo.nodes.modify("n-1", lambda old: node, mirror_first=True) == (None, node)
    stored = await store.get(keys.node("n-1"))
    assert stored is not None
    mirror[keys.node("n-1")] = stored
    store_reads = 0
    real_get = store.get

    async def counting_get(key: str) -> KeyValue | None:
        nonlocal store_reads
        store_reads += 1
        return await real_get(key)
    store.get = counting_get  # type: ignore[method-assign]
    assert await repo.nodes.modify("n-1", lambda old: old, mirror_first=True) == (node, None)
    assert store_reads == 0, "an unchanged registration read the mirror only"

    cordoned = replace(node, cordoned=True, cordon_reason="maintenance")
    await repo.nodes.modify("n-1", lambda old: cordoned)  # etcd moves on; the mirror has not seen it yet
    relabelled = replace(node, labels={"rack": "r2"})

    def register(old: Node | None) -> Node:
        assert old is not None
        return replace(relabelled, cordoned=old.cordoned, cordon_reason=old.cordon_reason)
    before, after = await repo.nodes.modify("n-1", register, mirror_first=True)
    assert before == cordoned, "what the store held, not what the mirror showed"
    assert after is not None and after.cordoned and after.labels == {"rack": "r2"}, \
        "the stale mirror's compare-and-swap was refused, and the store's record (cordoned) was merged"
    kv = await real_get(keys.node("n-1"))
    assert kv is not None and decode_node(kv.value) == after
