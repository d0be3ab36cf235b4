"""Compaction against a real etcd: every etcd the project starts compacts its history by itself, and a
PrefixMirror whose watch lands on compacted history reloads and catches up, missing no change."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from trainyard_core.store import Delete, Put
from trainyard_core.store.api import WatchCompacted, WatchEvent
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing import etcd as etcd_proc
from trainyard_core.testing.wait import eventually

PREFIX = "/compaction/"


@pytest.fixture
def member() -> Iterator[etcd_proc.EtcdProcess]:
    # The project's own flags with the retention cut to a second (a later flag wins), so etcd compacts
    # within the test; the mode is the one every member runs with.
    started = etcd_proc.start_single(extra_args=["--auto-compaction-retention", "1s"])
    try:
        yield started
    finally:
        etcd_proc.stop_and_clean(started)


async def compact(member: etcd_proc.EtcdProcess, revision: int) -> None:
    client = aetcd.Client(host=member.host, port=member.client_port)
    try:
        await client.compact(revision, physical=True)
    finally:
        await client.close()


async def test_every_member_runs_with_auto_compaction(member: etcd_proc.EtcdProcess) -> None:
    assert member.proc is not None
    args = list(member.proc.args)  # type: ignore[arg-type]
    assert args[args.index("--auto-compaction-mode") + 1] == "periodic"
    store = EtcdStore(member.endpoint)
    try:
        first = await store.put(f"{PREFIX}a", b"1")
        for i in range(5):
            await store.put(f"{PREFIX}a", str(i).encode())

        async def compacted() -> bool:
            await store.put(f"{PREFIX}tick", b"")  # keep the revision moving for the compactor's samples
            async with contextlib.aclosing(store.watch(PREFIX, start_revision=first)) as stream:  # type: ignore[type-var]
                try:
                    await anext(stream)
                except WatchCompacted:
                    return True
            return False

        await eventually(compacted, timeout=30, interval=0.5, what="etcd compacted its history by itself")
    finally:
        await store.close()


class CompactsUnderTheFirstWatch:
    """The store, but the first watch finds more writes made and the history up to them compacted, as when
    auto-compaction runs between a mirror's load and its watch."""

    def __init__(self, inner: EtcdStore, member: etcd_proc.EtcdProcess) -> None:
        self.inner = inner
        self._member = member
        self.watches = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[list[WatchEvent]]:
        self.watches += 1
        if self.watches == 1:
            await self.inner.txn([], [Put(f"{PREFIX}late", b"x"), Delete(f"{PREFIX}k1")])
            await self.inner.put(f"{PREFIX}k2", b"changed")
            revision = await self.inner.put(f"{PREFIX}k3", b"new")
            await compact(self._member, revision)
        async for batch in self.inner.watch(prefix, start_revision=start_revision):
            yield batch


async def test_a_mirror_reloads_after_compaction_and_catches_up(member: etcd_proc.EtcdProcess) -> None:
    store = EtcdStore(member.endpoint)
    wrapped = CompactsUnderTheFirstWatch(store, member)
    mirror = PrefixMirror(wrapped, PREFIX)  # type: ignore[arg-type]
    changes = mirror.subscribe()
    try:
        for i in range(3):
            await store.put(f"{PREFIX}k{i}", b"v")
        await mirror.start()
        changes.take()

        async def caught_up() -> bool:
            current = await store.range(PREFIX)
            return wrapped.watches >= 2 and mirror.revision >= current.revision and \
                {k: kv.value for k, kv in mirror.items.items()} == {kv.key: kv.value for kv in current.kvs}

        await eventually(caught_up, timeout=15, what="the mirror reloaded past the compaction")
        assert set(mirror.items) == {f"{PREFIX}k0", f"{PREFIX}k2", f"{PREFIX}k3", f"{PREFIX}late"}
        assert mirror.items[f"{PREFIX}k2"].value == b"changed"
        full, _ = changes.take()
        assert full  # a consumer rebuilds from the whole copy after the reload

        # And the watch opened after the reload delivers what follows.
        revision = await store.put(f"{PREFIX}after", b"y")
        assert await mirror.wait_for(revision)
        assert mirror.items[f"{PREFIX}after"].value == b"y"
    finally:
        await mirror.stop()
        await store.close()
