"""The gateway's cache of verified tokens reads a token in use again in the background before its entry runs
out (refresh-ahead), against real etcd and an injected clock: no request waits for that read, a revocation
made elsewhere still ends the entry, one made here is not undone by a read in flight, a failed read leaves the
entry to run out, and `close` ends the reads in flight."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, cast

import pytest

from trainyard_core.clock import ManualClock
from trainyard_core.contract import Role
from trainyard_core.errors import Unauthenticated, Unavailable
from trainyard_core.store import Store
from trainyard_core.store.api import KeyValue
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.wait import eventually, truthy
from trainyard_gateway.tokens import TokenStore

TTL_S = 10.0
# Stands for what a request carries in its context (its trace span, its request id in the logs).
REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="")


class GatedReads:
    """The real store, whose next `get` can be held after it has read (`hold_next`), or made to fail
    (`fail_next`); every other call goes straight through. Counts the reads asked and answered."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self.asked = 0
        self.answered = 0
        self.contexts: list[str] = []  # REQUEST as each read saw it
        self.hold_next = False
        self.fail_next: Exception | None = None
        self.gate = asyncio.Event()
        self.gate.set()

    async def get(self, key: str) -> KeyValue | None:
        self.asked += 1
        self.contexts.append(REQUEST.get())
        hold, self.hold_next = self.hold_next, False
        fail, self.fail_next = self.fail_next, None
        if fail is not None:
            self.answered += 1
            raise fail
        kv = await self._store.get(key)
        if hold:
            await self.gate.wait()
        self.answered += 1
        return kv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def _answered(reads: GatedReads, count: int) -> None:
    """Until `count` reads have been answered (a background read's task has then used its answer: nothing
    awaits between the read's answer and the cache's update)."""
    await eventually(lambda: truthy(reads.answered >= count), interval=0.01, what=f"{count} reads answered")


async def _in_use(store: EtcdStore, prefix: str) -> tuple[ManualClock, GatedReads, TokenStore, str, str]:
    """A token store over gated reads of the real store, and a token of it read once (cached since): the
    clock, the reads, the store, the token's id and its secret."""
    clock = ManualClock()
    reads = GatedReads(store)
    tokens = TokenStore(cast(Store, reads), prefix, clock=clock, cache_ttl_s=TTL_S)
    record, secret = await tokens.create(team="vision", user="alice", role=Role.MEMBER)
    assert (await tokens.authenticate(secret)).token_id == record.token_id
    assert reads.asked == 1  # the first use reads it
    return clock, reads, tokens, record.token_id, secret


async def _refresh_held(reads: GatedReads, tokens: TokenStore, secret: str) -> None:
    """A request past half the TTL starts the background read, which reads the record and is held."""
    reads.hold_next, reads.gate = True, asyncio.Event()
    await asyncio.wait_for(tokens.authenticate(secret), 5)  # answered without waiting for that read
    for _ in range(20):
        await asyncio.sleep(0)
    assert reads.asked == 2


async def test_a_token_in_use_is_read_again_in_the_background_and_no_request_waits_for_it(
        etcd_store: EtcdStore, key_prefix: str) -> None:
    clock, reads, tokens, token_id, secret = await _in_use(etcd_store, key_prefix)
    clock.advance(TTL_S / 2 - 1)
    await tokens.authenticate(secret)
    assert reads.asked == 1  # in the first half of its TTL: from the cache alone
    clock.advance(2)
    # Past half the TTL: answered from the entry at once while the record is read again (held at the gate).
    REQUEST.set("request-2")
    await _refresh_held(reads, tokens, secret)
    assert reads.contexts[-1] == ""  # the background read carries no request's context (trace, request id)
    await tokens.authenticate(secret)
    assert reads.asked == 2  # one background read of a token at a time
    reads.gate.set()
    await _answered(reads, 2)
    # The first read's entry would have run out at TTL_S; the background read (begun at TTL_S / 2 + 1) holds.
    clock.advance(TTL_S / 2)
    assert (await tokens.authenticate(secret)).token_id == token_id
    assert reads.asked == 2


async def test_a_token_revoked_elsewhere_is_dropped_by_the_background_read(etcd_store: EtcdStore,
                                                                          key_prefix: str) -> None:
    clock, reads, tokens, token_id, secret = await _in_use(etcd_store, key_prefix)
    await TokenStore(etcd_store, key_prefix, clock=clock).revoke(token_id)  # another gateway
    clock.advance(TTL_S / 2 + 1)
    await tokens.authenticate(secret)  # still within the TTL of the read that filled the entry, as before
    await _answered(reads, 2)
    with pytest.raises(Unauthenticated, match="invalid or revoked token"):
        await tokens.authenticate(secret)  # before the TTL ran out: the background read found it gone


async def test_a_revoke_here_is_not_undone_by_a_background_read_in_flight(etcd_store: EtcdStore,
                                                                          key_prefix: str) -> None:
    clock, reads, tokens, token_id, secret = await _in_use(etcd_store, key_prefix)
    clock.advance(TTL_S / 2 + 1)
    await _refresh_held(reads, tokens, secret)
    await tokens.revoke(token_id)
    reads.gate.set()
    await _answered(reads, 2 + 2)  # the held read, and the revoke's two
    with pytest.raises(Unauthenticated, match="invalid or revoked token"):
        await tokens.authenticate(secret)


async def test_a_failed_background_read_leaves_the_entry_to_run_out_without_another(
        etcd_store: EtcdStore, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    clock, reads, tokens, token_id, secret = await _in_use(etcd_store, key_prefix)
    clock.advance(TTL_S / 2 + 1)
    reads.fail_next = Unavailable("etcd is not answering")
    await tokens.authenticate(secret)
    await _answered(reads, 2)
    assert "reading token" in caplog.text and "Unavailable" in caplog.text
    assert secret not in caplog.text
    for _ in range(3):  # the entry still serves, and no request starts another read of it (an outage would
        clock.advance(1)  # have every request start, and log, one)
        assert (await tokens.authenticate(secret)).token_id == token_id
        for _ in range(20):
            await asyncio.sleep(0)
    assert reads.asked == 2
    assert caplog.text.count("reading token") == 1
    clock.advance(TTL_S)
    assert (await tokens.authenticate(secret)).token_id == token_id
    assert reads.asked == 3  # run out: read by the request itself
    clock.advance(TTL_S / 2 + 1)  # the entry that read filled is read again in the background as any other
    await tokens.authenticate(secret)
    await _answered(reads, 4)


async def test_close_ends_the_background_reads_in_flight(etcd_store: EtcdStore, key_prefix: str) -> None:
    clock, reads, tokens, _, secret = await _in_use(etcd_store, key_prefix)
    clock.advance(TTL_S / 2 + 1)
    await _refresh_held(reads, tokens, secret)
    await asyncio.wait_for(tokens.close(), 5)
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "token cache refresh"]
