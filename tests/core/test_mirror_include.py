"""A mirror that copies only some sub-prefixes: what it keeps, what it drops, and that its load is one
snapshot even when writes land between its pages (real etcd and the in-memory twin)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trainyard_core.store import Store
from trainyard_core.store.api import RangeResult
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.state.keys import Keys


@pytest.fixture(params=["memory", "etcd"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        s = EtcdStore.from_options(request.getfixturevalue("etcd_options"))
        yield s
        await s.close()


class WritesBetweenPages:
    """A store that, once, writes `key` right after the first page of a range under `prefix` is read."""

    def __init__(self, inner: Store, prefix: str, key: str) -> None:
        self.inner, self._prefix, self._key, self.written = inner, prefix, key, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def range(self, prefix: str, **kw: object) -> RangeResult:
        page = await self.inner.range(prefix, **kw)  # type: ignore[arg-type]
        if prefix == self._prefix and not self.written:
            self.written = await self.inner.put(self._key, b"mid-load")
        return page


async def test_only_included_prefixes_are_copied_and_watched(store: Store, key_prefix: str) -> None:
    keys = Keys(key_prefix.rstrip("/"))
    kept = [keys.job(f"job-{i:03d}") for i in range(5)] + [keys.node("n-1"), keys.usage,
                                                            keys.checkpoints_latest + "job-001"]
    dropped = [keys.idempotency("team-a", "k1"), f"{keys.checkpoints}job-001/ckpt-1", keys.prefix + "/tokens/t-1",
               keys.prefix + "/audit/e-1", keys.leader]
    for key in kept + dropped:
        await store.put(key, b"v")
    wrapped = WritesBetweenPages(store, keys.jobs, keys.job("job-999"))
    mirror = PrefixMirror(wrapped, keys.prefix + "/", page_size=2, include=keys.mirrored)  # type: ignore[arg-type]
    await mirror.start()
    try:
        loaded = set(mirror.items)
        if isinstance(store, EtcdStore):
            # Every page was read at the first page's revision: the write between them is not in the load...
            assert loaded == set(kept)
        else:
            # ...the in-memory twin keeps no old revisions: it refused the pinned read and the mirror loaded again.
            assert loaded == set(kept) | {keys.job("job-999")}

        async def caught_up() -> bool:
            return keys.job("job-999") in mirror.items

        await eventually(caught_up, what="the mid-load write to arrive through the watch")
        before = mirror.revision
        rev = await store.put(keys.prefix + "/tokens/t-2", b"secret")
        assert await mirror.wait_for(rev), "an event outside the included prefixes still moves the revision on"
        assert mirror.revision > before and keys.prefix + "/tokens/t-2" not in mirror.items
        await store.put(keys.allocation("job-001"), b"a")
        assert await mirror.wait_for(await store.delete(keys.node("n-1")) and await store.put(keys.usage, b"u2"))
        assert keys.allocation("job-001") in mirror.items and keys.node("n-1") not in mirror.items
        assert not set(mirror.items) & set(dropped)
        # Each included prefix's records are also kept apart, current with the watch.
        for prefix in keys.mirrored:
            want = {k: kv for k, kv in mirror.items.items() if k.startswith(prefix)}
            assert dict(mirror.under(prefix)) == want, prefix
        assert set(mirror.under(keys.jobs)) == {k for k in kept if k.startswith(keys.jobs)} | {keys.job("job-999")}
        assert mirror.under(keys.nodes) == {}
        assert set(mirror.under(keys.prefix + "/jobs/job-00")) == {keys.job(f"job-{i:03d}") for i in range(5)}
    finally:
        await mirror.stop()


def test_included_prefixes_must_be_under_the_mirrored_one() -> None:
    with pytest.raises(ValueError, match="not under"):
        PrefixMirror(MemoryStore(), "/a/", include=("/b/jobs/",))
