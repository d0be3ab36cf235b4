"""An in-memory copy of everything under a prefix, kept current by a watch.

Load once (paged range), then apply watch events from the load's revision on. After a broken watch or a
compaction, reload. `revision` tells how far the copy has caught up; `changed` is set on every applied
batch, so a reconcile loop can sleep until something happens.

`include`: when given, only keys under these sub-prefixes are copied (what the consumer reads: a scheduler
does not keep the gateway's tokens, the checkpoint records or the idempotency keys that share its prefix).
The load reads each of them, every page at the revision of the first, so the copy is one snapshot; the one
watch over the whole prefix then drops the events of every other key.

`exclude`: sub-prefixes left out of the copy (the audit log under `<prefix>/audit/`, which grows with every
mutating call): their keys are neither loaded nor kept, and a batch of only such keys moves `revision` on
without setting `changed`.

`subscribe()`: a `Changes` that collects the keys touched since its owner last took them (or says "everything"
after a reload), so a consumer can keep its own decoded view current at the cost of what changed, not of the
whole copy.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Mapping

from ..errors import Unavailable
from .api import KeyValue, Store, WatchCompacted

log = logging.getLogger(__name__)
_TOP = "\U0010ffff"


class Changes:
    """Keys put or deleted in the mirror since the last `take`; `full` after a reload (every key may differ)."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._full = True

    def note(self, key: str) -> None:
        if not self._full:
            self._keys.add(key)

    def reloaded(self) -> None:
        self._full = True
        self._keys.clear()

    def take(self) -> tuple[bool, set[str]]:
        """(everything changed, the keys that did); resets."""
        full, keys = self._full, self._keys
        self._full, self._keys = False, set()
        return full, keys


class PrefixMirror:
    def __init__(self, store: Store, prefix: str, *, page_size: int = 1000, exclude: tuple[str, ...] = (),
                 include: tuple[str, ...] = ()) -> None:
        outside = [p for p in include if not p.startswith(prefix)]
        if outside:
            raise ValueError(f"included prefixes {outside} are not under {prefix!r}")
        self._store = store
        self._prefix = prefix
        self._page = page_size
        self._exclude = exclude
        # Sub-prefixes read at a load (one that lies under another is read with it).
        self._include = tuple(p for p in sorted(set(include))
                              if not any(p != q and p.startswith(q) for q in include))
        self._include_all = include
        self._items: dict[str, KeyValue] = {}
        # The same records again, by the included prefix they are under, so that a reader of one kind (the
        # nodes) walks those, not every live record.
        self._under: dict[str, dict[str, KeyValue]] = {p: {} for p in self._include}
        self.revision = 0
        self.changed = asyncio.Event()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rev_waiters: list[tuple[int, asyncio.Future[None]]] = []
        # Held weakly: a consumer that is gone (a reconciler of an ended term) stops being fed.
        self._subscribers: weakref.WeakSet[Changes] = weakref.WeakSet()

    def subscribe(self) -> Changes:
        """A change set fed from now on (it starts `full`: its owner builds from the whole copy first)."""
        changes = Changes()
        self._subscribers.add(changes)
        return changes

    @property
    def items(self) -> Mapping[str, KeyValue]:
        return self._items

    def under(self, prefix: str) -> Mapping[str, KeyValue]:
        """The copied records under `prefix`: kept apart when it is one of the included prefixes (a dictionary
        look-up), else picked from the whole copy (a walk over it)."""
        group = self._under.get(prefix)
        if group is not None:
            return group
        return {k: kv for k, kv in self._items.items() if k.startswith(prefix)}

    def _group(self, key: str) -> dict[str, KeyValue] | None:
        return next((group for p, group in self._under.items() if key.startswith(p)), None)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"mirror {self._prefix}")
        await self._ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def wait_for(self, revision: int, timeout: float = 5.0) -> bool:
        """Wait until the copy includes `revision` (read-your-writes after a commit)."""
        if self.revision >= revision:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._rev_waiters.append((revision, fut))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False

    def _kept(self, key: str) -> bool:
        if key.startswith(self._exclude):
            return False
        return not self._include_all or key.startswith(self._include_all)

    async def _load(self) -> None:
        items: dict[str, KeyValue] = {}
        revision = 0
        for prefix in self._include or (self._prefix,):
            after: str | None = None
            while True:
                page = await self._store.range(prefix, start_after=after, limit=self._page, revision=revision)
                revision = revision or page.revision
                for kv in page.kvs:
                    if self._kept(kv.key):
                        items[kv.key] = kv
                if not page.more:
                    break
                after = page.kvs[-1].key
                skipped = next((x for x in self._exclude if after.startswith(x)), None)
                if skipped is not None:
                    # Every key of the excluded range sorts before this one (the highest code point after it).
                    after = max(after, skipped + _TOP)
        self._items = items
        self._under = {p: {} for p in self._include}
        for key, kv in items.items():
            group = self._group(key)
            if group is not None:
                group[key] = kv
        for sub in self._subscribers:
            sub.reloaded()
        self._set_revision(revision)

    def _set_revision(self, revision: int, notify: bool = True) -> None:
        self.revision = max(self.revision, revision)
        if notify:
            self.changed.set()
        still = []
        for rev, fut in self._rev_waiters:
            if rev <= self.revision:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((rev, fut))
        self._rev_waiters = still

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._load()
                self._ready.set()
                backoff = 0.1
                async for batch in self._store.watch(self._prefix, start_revision=self.revision + 1):
                    kept = 0
                    for ev in batch:
                        if not self._kept(ev.key):
                            continue
                        kept += 1
                        for sub in self._subscribers:
                            sub.note(ev.key)
                        if ev.kind == "put":
                            old = self._items.get(ev.key)
                            kv = KeyValue(key=ev.key, value=ev.value,
                                          create_revision=old.create_revision if old else ev.mod_revision,
                                          mod_revision=ev.mod_revision, version=(old.version + 1) if old else 1)
                            self._items[ev.key] = kv
                            if (group := self._group(ev.key)) is not None:
                                group[ev.key] = kv
                        else:
                            self._items.pop(ev.key, None)
                            if (group := self._group(ev.key)) is not None:
                                group.pop(ev.key, None)
                    self._set_revision(max(ev.mod_revision for ev in batch), notify=kept > 0)
            except asyncio.CancelledError:
                raise
            except (Unavailable, WatchCompacted) as exc:
                log.warning("mirror of %s lost its watch, reloading: %s", self._prefix, exc)
            except Exception:
                log.exception("mirror of %s failed, reloading", self._prefix)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
