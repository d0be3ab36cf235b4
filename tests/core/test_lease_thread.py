"""A leader's lease renewed from its own thread (trainyard_core.store.lease_thread), against the session's real
etcd: a leader whose event loop is busy longer than the lease keeps it; one whose loop has stopped, whose lease
was revoked, or that cannot reach etcd loses it."""

from __future__ import annotations

import asyncio
import threading
import time

from trainyard_core.store.election import LeaderElection
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.lease_thread import ThreadLeaseKeeper
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually, truthy

TTL = 2


def _lost_into(reasons: list[str], done: threading.Event) -> object:
    def on_lost(why: str) -> None:
        reasons.append(why)
        done.set()

    return on_lost


async def test_a_leader_whose_loop_is_busy_for_longer_than_its_lease_keeps_it(etcd_store: EtcdStore,
                                                                              key_prefix: str) -> None:
    election = LeaderElection(etcd_store, f"{key_prefix}leader", "me:1", ttl_seconds=TTL)
    epoch = await election.campaign()
    try:
        # The whole loop blocked (a storm of ready steps, as far as the lease goes), from the moment it won: the
        # thread must be renewing already, not wait for a task of the loop's to start it.
        time.sleep(2.5 * TTL)  # noqa: ASYNC251 - blocking the loop is the point
        await asyncio.sleep(TTL)  # the loop runs again: whatever the keeper saw is told now
        assert not election.lost.is_set()
        assert election.epoch == epoch
        kv = await etcd_store.get(f"{key_prefix}leader")
        assert kv is not None and kv.create_revision == epoch and kv.lease == election.lease_id
        assert await etcd_store.keepalive(election.lease_id) > 0
    finally:
        await election.resign()


async def test_a_revoked_lease_ends_leadership(etcd_store: EtcdStore, key_prefix: str) -> None:
    election = LeaderElection(etcd_store, f"{key_prefix}leader", "me:1", ttl_seconds=TTL)
    await election.campaign()
    await etcd_store.revoke_lease(election.lease_id)
    await asyncio.wait_for(election.lost.wait(), 3 * TTL)
    assert election.epoch == 0 and election.lease_id == 0
    await election.resign()


async def test_a_keeper_whose_loop_has_stopped_lets_the_lease_expire(etcd_store: EtcdStore, key_prefix: str) -> None:
    lease = await _leased_key(etcd_store, f"{key_prefix}held")
    reasons: list[str] = []
    done = threading.Event()
    stopped_at = time.monotonic()
    keeper = etcd_store.lease_keeper(lease, TTL, loop_alive=lambda: stopped_at, on_lost=_lost_into(reasons, done))
    keeper._stall = 1.0  # a loop silent for a second counts as stopped here
    keeper.start()
    assert await asyncio.to_thread(done.wait, 5 * TTL)
    assert "the event loop has not run" in reasons[0]
    # Nobody renews it any more: etcd lets it go, and the key bound to it.
    await eventually(lambda: _gone(etcd_store, f"{key_prefix}held"), timeout=3 * TTL, what="the lease to expire")
    assert keeper.join(TTL)


async def _leased_key(store: EtcdStore, key: str) -> int:
    """A lease of TTL seconds with `key` bound to it: the key goes when the lease does (reading the key, unlike
    a keepalive, does not renew the lease)."""
    lease = await store.grant_lease(TTL)
    await store.put(key, b"x", lease=lease)
    return lease


async def _gone(store: EtcdStore, key: str) -> bool:
    return await store.get(key) is None


async def test_a_keeper_that_cannot_reach_etcd_ends_leadership_within_the_ttl(etcd_store: EtcdStore) -> None:
    reasons: list[str] = []
    done = threading.Event()
    keeper = ThreadLeaseKeeper(endpoints=[("127.0.0.1", free_port())], options=etcd_store.options, lease_id=1,
                               ttl_s=TTL, loop_alive=time.monotonic, on_lost=_lost_into(reasons, done))
    began = time.monotonic()
    keeper.start()
    assert await asyncio.to_thread(done.wait, 5 * TTL)
    assert reasons[0].startswith(f"store unreachable for {TTL}s: UNAVAILABLE")
    assert time.monotonic() - began < 2 * TTL + 1
    assert keeper.renewals == 0


async def test_a_stopped_keeper_renews_no_more(etcd_store: EtcdStore, key_prefix: str) -> None:
    lease = await _leased_key(etcd_store, f"{key_prefix}held")
    reasons: list[str] = []
    keeper = etcd_store.lease_keeper(lease, TTL, loop_alive=time.monotonic,
                                     on_lost=_lost_into(reasons, threading.Event()))
    keeper.start()
    await eventually(lambda: truthy(keeper.renewals >= 4), timeout=5 * TTL, what="four renewals")
    assert await etcd_store.get(f"{key_prefix}held") is not None  # renewed past its first TTL
    keeper.stop()
    assert keeper.join(TTL)
    await eventually(lambda: _gone(etcd_store, f"{key_prefix}held"), timeout=3 * TTL, what="the lease to expire")
    assert reasons == []
