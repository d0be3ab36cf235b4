"""Leader election: who leads stays known to every candidate that does not, and fencing holds.

The bug these tests pin down: a standby read the leader's name once, before it began to campaign, and
never again. When that one read failed (its etcd member had just died) it named nobody for good; when the
leader changed while it waited it named the old one. Refused by the standby with no usable name, the
gateway could not find the leader and answered 503 to node calls although a leader existed.

The in-memory store with a hand-moved clock (lease expiry) and a fault wrapper make each case exact; the
campaign's own half-second rounds are the only real time, and every wait is a poll with a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from trainyard_core.clock import ManualClock
from trainyard_core.store import Put
from trainyard_core.store.election import LeaderElection
from trainyard_core.store.memory import MemoryStore
from trainyard_core.testing.wait import eventually, truthy

from .store_faults import FaultyStore

KEY = "/election-test/leader"
TTL = 2  # campaign rounds every 0.5 s
# A round is half a second; a change must be seen within a few rounds, whatever the machine's load.
SEEN_WITHIN_S = 5.0


@dataclass
class Candidate:
    election: LeaderElection
    seen: list[str] = field(default_factory=list)
    task: asyncio.Task[int] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def leader(self) -> str | None:
        """Who this candidate last saw lead (None: it has not said yet)."""
        return self.seen[-1] if self.seen else None

    def start(self) -> None:
        self.task = asyncio.create_task(self.election.campaign(self.stop, observe=self.seen.append))

    async def leads(self) -> int:
        assert self.task is not None
        return await asyncio.wait_for(asyncio.shield(self.task), SEEN_WITHIN_S)

    async def halt(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, SEEN_WITHIN_S)
        await self.election.resign()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock)


@pytest.fixture
async def candidates(store: MemoryStore) -> AsyncIterator[Callable[..., Candidate]]:
    made: list[Candidate] = []

    def make(identity: str, on: object = None) -> Candidate:
        c = Candidate(LeaderElection(on or store, KEY, identity, ttl_seconds=TTL))  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make
    for c in made:
        await c.halt()


def names(c: Candidate, who: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return c.leader == who

    return probe


async def test_a_standby_whose_first_lookups_fail_names_the_leader_once_the_store_answers(
        store: MemoryStore, candidates: Callable[..., Candidate]) -> None:
    a = candidates("10.0.0.1:50051")
    a.start()
    assert await a.leads() > 0
    faulty = FaultyStore(store)
    faulty.fail_gets(KEY, times=3)  # the member it was on just died
    b = candidates("10.0.0.2:50051", faulty)
    b.start()
    await eventually(names(b, "10.0.0.1:50051"), timeout=SEEN_WITHIN_S, what="the standby to name the leader")
    assert faulty.failed_gets == 3
    assert not b.task.done() and b.election.epoch == 0  # type: ignore[union-attr]


async def test_a_standby_keeps_the_last_leader_it_saw_while_the_store_cannot_be_read(
        store: MemoryStore, candidates: Callable[..., Candidate]) -> None:
    a = candidates("10.0.0.1:50051")
    a.start()
    await a.leads()
    faulty = FaultyStore(store)
    b = candidates("10.0.0.2:50051", faulty)
    b.start()
    await eventually(names(b, "10.0.0.1:50051"), timeout=SEEN_WITHIN_S, what="the standby to name the leader")
    faulty.fail_gets(KEY)
    await eventually(lambda: truthy(faulty.failed_gets >= 3), timeout=SEEN_WITHIN_S, what="three failed rounds")
    assert b.seen == ["10.0.0.1:50051"]


async def test_a_standby_follows_a_leader_change_while_it_campaigns(
        clock: ManualClock, candidates: Callable[..., Candidate]) -> None:
    a, b, c = candidates("10.0.0.1:50051"), candidates("10.0.0.2:50051"), candidates("10.0.0.3:50051")
    a.start()
    first = await a.leads()
    b.start()
    c.start()
    for standby in (b, c):
        await eventually(names(standby, a.election.identity), timeout=SEEN_WITHIN_S,
                         what=f"{standby.election.identity} to name the first leader")

    # The leader dies without resigning: its keepalive stops and its lease runs out.
    assert a.election._keeper is not None
    a.election._keeper.cancel()
    clock.advance(TTL + 1)

    done, _ = await asyncio.wait({b.task, c.task}, timeout=SEEN_WITHIN_S,  # type: ignore[arg-type]
                                 return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "exactly one standby takes over"
    winner, loser = (b, c) if b.task in done else (c, b)
    assert winner.task.result() > first  # type: ignore[union-attr]
    assert winner.leader == winner.election.identity
    await eventually(names(loser, winner.election.identity), timeout=SEEN_WITHIN_S,
                     what="the other standby to name the new leader, not the dead one")
    assert loser.election.epoch == 0


async def test_a_leader_that_resigns_is_named_by_nobody_until_another_leads(
        store: MemoryStore, candidates: Callable[..., Candidate]) -> None:
    a, b = candidates("10.0.0.1:50051"), candidates("10.0.0.2:50051")
    a.start()
    await a.leads()
    b.start()
    await eventually(names(b, a.election.identity), timeout=SEEN_WITHIN_S, what="the standby to name the leader")
    await a.election.resign()
    epoch = await b.leads()
    assert epoch > 0 and b.leader == b.election.identity
    kv = await store.get(KEY)
    assert kv is not None and kv.create_revision == epoch and kv.value == b"10.0.0.2:50051"


async def test_a_key_left_from_an_earlier_term_of_its_own_does_not_make_it_name_itself(
        store: MemoryStore, clock: ManualClock, candidates: Callable[..., Candidate]) -> None:
    old_lease = await store.grant_lease(TTL)
    await store.txn([], [Put(KEY, b"10.0.0.1:50051", old_lease)])
    a = candidates("10.0.0.1:50051")
    a.start()
    await eventually(lambda: truthy(a.seen == [""]), timeout=SEEN_WITHIN_S,
                     what="the candidate to say nobody leads (the key is of a lease it no longer holds)")
    clock.advance(TTL + 1)  # the old lease runs out
    epoch = await a.leads()
    kv = await store.get(KEY)
    assert kv is not None and kv.create_revision == epoch and kv.lease == a.election.lease_id != old_lease


async def test_a_win_whose_answer_was_lost_is_taken_up_on_the_next_round(
        store: MemoryStore, candidates: Callable[..., Candidate]) -> None:
    faulty = FaultyStore(store)
    faulty.lose_txn_answers(1)
    a = candidates("10.0.0.1:50051", faulty)
    a.start()
    epoch = await a.leads()
    assert faulty.lost_txns == 1
    kv = await store.get(KEY)
    assert kv is not None and kv.create_revision == epoch and kv.lease == a.election.lease_id
    # The fence is the one key's create revision: a write under it holds.
    assert (await store.txn([a.election.fence()], [Put("/election-test/x", b"1")])).succeeded


async def test_a_lease_lost_while_the_store_was_away_is_replaced(
        store: MemoryStore, candidates: Callable[..., Candidate]) -> None:
    a = candidates("10.0.0.1:50051")
    a.election.lease_id = 424242  # granted before an outage, expired since: the store no longer knows it
    a.start()
    epoch = await a.leads()
    kv = await store.get(KEY)
    assert kv is not None and kv.create_revision == epoch and kv.lease == a.election.lease_id != 424242
