"""The etcd store moves off a dead member once, however many calls were in flight on it (real etcd).

When a member dies, every call in flight on it fails at about the same moment. Each used to step to the
next endpoint: with two endpoints, two failures stepped back onto the dead one, and the next call (the
election's keepalive, a leader's write) failed again, or waited out a whole deadline on a member that hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from trainyard_core.errors import Unavailable
from trainyard_core.store import Put
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd import free_port


@pytest.mark.parametrize("in_flight", [2, 3, 4])
async def test_calls_failing_together_on_a_dead_member_move_the_store_once(
        etcd_options: EtcdOptions, key_prefix: str, in_flight: int) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: refused, as a SIGKILLed member's port is
    live = etcd_options.endpoints
    store = EtcdStore.from_options(dataclasses.replace(etcd_options, endpoints=f"{dead},{live}"), timeout=2.0)
    try:
        # Writes are not retried: each of these fails on the dead member, all having started on it.
        results = await asyncio.gather(*(store.txn([], [Put(f"{key_prefix}w{i}", b"x")]) for i in range(in_flight)),
                                       return_exceptions=True)
        assert all(isinstance(r, Unavailable) for r in results), results
        assert store.endpoint == live
        # The next call goes to the live member at the first try.
        assert (await store.txn([], [Put(f"{key_prefix}after", b"y")])).succeeded
        assert (await store.keepalive(await store.grant_lease(5))) > 0
    finally:
        await store.close()
