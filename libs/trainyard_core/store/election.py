"""Leader election over the store, with fencing.

A candidate holds a lease and creates the leader key bound to it only if the key is absent. The key's
create revision is the leader's **epoch**: it only ever grows, and `fence()` gives the compare every
leader write must carry, so a deposed leader (lease expired, key re-created by another) can never commit.
Losing the lease (keepalive says 0, or the store unreachable for longer than the TTL) ends leadership;
`lost` is set and the owner must stop acting as leader at once. On etcd the lease is renewed by a thread of
its own (lease_thread.py), so a leader whose event loop is busy (a failover's registration storm) keeps it,
and one whose loop has stopped for LOOP_STALL_S lets it expire.

A candidate that does not lead reads the leader key on every round of its campaign, so it always knows who
leads now (`campaign(observe=...)` hears each change): a standby names the leader to the callers it refuses
(NotLeader), and a name read once would go stale when the leader changes while it waits, or stay empty for
good when that one read failed (an etcd member lost at that moment).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import FailedPrecondition, Unavailable
from ..waits import completes_within
from .api import Compare, KeyValue, Put, Store, absent

log = logging.getLogger(__name__)
# How often the leader's loop tells its lease keeper thread that it still runs (lease_thread.LOOP_STALL_S).
LOOP_TICK_S = 0.5


@dataclass
class _ThreadKeeping:
    """A term's lease thread, what it says when the lease is lost, and when this loop last ran."""

    lost: asyncio.Future[str]
    alive: list[float]
    keeper: Any = None


class LeaderElection:
    def __init__(self, store: Store, key: str, identity: str, ttl_seconds: int = 3) -> None:
        self._store = store
        self._key = key
        self.identity = identity
        self._ttl = ttl_seconds
        self.lease_id = 0
        self.epoch = 0
        self.lost = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._thread: _ThreadKeeping | None = None

    def fence(self) -> Compare:
        return Compare(self._key, "create", "==", self.epoch)

    async def current_leader(self) -> str:
        kv = await self._store.get(self._key)
        return kv.value.decode() if kv else ""

    def _leader_in(self, kv: KeyValue | None) -> str:
        """Who leads, given the leader key: '' when nobody does. The key may still name this candidate
        with a lease of an earlier term (it lost the lease, or never heard its own write succeed): nobody
        leads then until that lease expires, and naming ourselves would send callers back to us."""
        if kv is None:
            return ""
        who = kv.value.decode()
        return "" if who == self.identity and kv.lease != self.lease_id else who

    async def campaign(self, stop: asyncio.Event | None = None, *,
                       observe: Callable[[str], None] | None = None) -> int:
        """Block until this candidate leads (returns the epoch) or `stop` is set (returns 0).

        Every round reads the leader key first; `observe` is called with who leads ('' for nobody) each
        time that changes, so it is at most one round (about half a second) behind. While the store cannot
        be read the last answer stands: the leader most likely still leads, and whoever is sent to it
        learns soon enough if it does not."""
        told: str | None = None

        def tell(who: str) -> None:
            nonlocal told
            if observe is not None and who != told:
                told = who
                observe(who)

        while stop is None or not stop.is_set():
            try:
                if not self.lease_id:
                    self.lease_id = await self._store.grant_lease(self._ttl)
                kv = await self._store.get(self._key)
                if kv is None:
                    await self._store.txn([absent(self._key)],
                                          [Put(self._key, self.identity.encode(), self.lease_id)])
                    # Whoever won, this candidate or a rival: the key says.
                    kv = await self._store.get(self._key)
                # Bound to our lease, the key is ours, also when an earlier round's write raised but had
                # succeeded (its outcome was unknown): the lease is kept across failures for this.
                if kv is not None and kv.lease == self.lease_id:
                    self.epoch = kv.create_revision
                    self.lost.clear()
                    # The lease's thread starts now, not when the keeper task first runs: on a loop busy with a
                    # failover's storm that can be seconds, and the lease lasts three.
                    self._thread = self._start_thread_keeper()
                    self._keeper = asyncio.create_task(self._keep(self._thread), name="leader keepalive")
                    tell(self.identity)
                    log.info("became leader", extra={"epoch": self.epoch})
                    return self.epoch
                tell(self._leader_in(kv))
                # Somebody else leads: keep our lease fresh and try again shortly. The leader's lease
                # bounds how long this takes after it dies.
                if await self._store.keepalive(self.lease_id) == 0:
                    self.lease_id = 0
            except FailedPrecondition as exc:  # our lease expired while the store was unreachable
                log.warning("election: lease gone, taking a new one: %s", exc)
                self.lease_id = 0
            except Unavailable as exc:
                log.warning("election: store unavailable: %s", exc)
            await self._sleep(min(0.5, self._ttl / 4), stop)
        return 0

    async def _sleep(self, seconds: float, stop: asyncio.Event | None) -> None:
        if stop is None:
            await asyncio.sleep(seconds)
            return
        await completes_within(stop.wait(), seconds)

    async def _keep(self, thread: _ThreadKeeping | None) -> None:
        why = await (self._keep_from_thread(thread) if thread is not None else self._keep_in_loop())
        log.error("leadership lost: %s", why, extra={"epoch": self.epoch})
        self.lease_id = 0
        self.epoch = 0
        self.lost.set()

    async def _keep_in_loop(self) -> str:
        """The lease renewed by this loop (a store without a thread of its own: the in-memory one)."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                if await self._store.keepalive(self.lease_id) == 0:
                    return "lease expired"
                kv = await self._store.get(self._key)
                if kv is None or kv.create_revision != self.epoch:
                    return "leader key changed"
                last_ok = time.monotonic()
            except Unavailable as exc:
                if time.monotonic() - last_ok > self._ttl:
                    return f"store unreachable for {self._ttl:.1f}s: {exc}"

    def _start_thread_keeper(self) -> _ThreadKeeping | None:
        """The store's lease thread (lease_thread.py), started; None for a store without one (in memory)."""
        make = getattr(self._store, "lease_keeper", None)
        if make is None:
            return None
        loop = asyncio.get_running_loop()
        keeping = _ThreadKeeping(lost=loop.create_future(), alive=[time.monotonic()])

        def on_lost(why: str) -> None:  # called in the keeper's thread
            def settle() -> None:
                if not keeping.lost.done():
                    keeping.lost.set_result(why)

            with contextlib.suppress(RuntimeError):  # the loop has closed: the process is ending
                loop.call_soon_threadsafe(settle)

        keeping.keeper = make(self.lease_id, self._ttl, loop_alive=lambda: keeping.alive[0], on_lost=on_lost)
        keeping.keeper.start()
        return keeping

    async def _keep_from_thread(self, keeping: _ThreadKeeping) -> str:
        """The lease renewed by the store's thread, so that this loop being busy (every agent registering at
        once after a failover) does not end the term; this loop tells the thread it still runs, and checks
        every third of the TTL that the leader key is still the one this term created."""
        lost = keeping.lost

        async def tick() -> None:
            while True:
                keeping.alive[0] = time.monotonic()
                await asyncio.sleep(LOOP_TICK_S)

        ticker = asyncio.create_task(tick(), name="leader loop ticker")
        try:
            while not lost.done():
                await asyncio.wait({lost}, timeout=self._ttl / 3)
                if lost.done():
                    break
                try:
                    kv = await self._store.get(self._key)
                except Unavailable:
                    continue  # whether the store can be reached is the keeper's to judge, by its renewals
                if kv is None or kv.create_revision != self.epoch:
                    return "leader key changed"
            return lost.result()
        finally:
            assert keeping.keeper is not None
            keeping.keeper.stop()
            ticker.cancel()

    async def resign(self) -> None:
        """Give up leadership at once (clean shutdown): a standby takes over without waiting for TTL."""
        if self._keeper is not None:
            self._keeper.cancel()
            self._keeper = None
        if self._thread is not None:  # also when the keeper task was cancelled before it ran
            self._thread.keeper.stop()
            self._thread = None
        if self.lease_id:
            try:
                await self._store.revoke_lease(self.lease_id)
            except Unavailable:
                log.warning("could not revoke the leader lease; it expires in %ss", self._ttl)
        self.lease_id = 0
        self.epoch = 0
        self.lost.set()
