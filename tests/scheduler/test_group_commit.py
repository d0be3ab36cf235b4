"""Group commit of GPU holdings writes (`state/group_commit.py`): many gangs in few transactions, one lost
race or one oversized request failing only its own write, arrival order kept on a node, and at most
`max_in_flight` transactions at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from trainyard_core.errors import Conflict, InvalidArgument
from trainyard_core.store import Compare, Delete, Put, TxnResult
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.memory import MemoryStore
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.domain.models import Allocation, Job, NodeAssignment
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job, make_node


class Recording:
    """Passes transactions through, recording each one's writes; refuses (InvalidArgument, as etcd does
    for a request too large) any transaction of more than `max_ops` writes; counts those in flight."""

    def __init__(self, inner: Any, max_ops: int = 1_000_000) -> None:
        self.inner = inner
        self.max_ops = max_ops
        self.sent: list[list[str]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()  # a transaction reached the store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        self.sent.append([op.key for op in success])
        if len(success) > self.max_ops:
            raise InvalidArgument(f"etcd refused the transaction: too many operations ({len(success)})")
        self.in_flight += 1
        self.entered.set()
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            res: TxnResult = await self.inner.txn(compares, success, failure)
            return res
        finally:
            self.in_flight -= 1


def _alloc(job_id: str, node_id: str, gpus: tuple[int, ...]) -> Allocation:
    return Allocation(job_id=job_id, attempt=1, assignments=(NodeAssignment(
        node_id=node_id, node_rank=0, gpu_indices=gpus, ranks=tuple(range(len(gpus))), model="H100"),),
        master_addr=f"{node_id}.host", master_port=29500, created_at=0.0)


async def _pending(repo: Repository, job_ids: Sequence[str], gpus: int = 1) -> dict[str, tuple[Job, int]]:
    out = {}
    for job_id in job_ids:
        await repo.create_job(make_job(job_id, gpus=gpus))
        got = await repo.get_job(job_id)
        assert got is not None
        out[job_id] = got
    return out


async def _holdings(store: Any, keys: Keys, node_id: str) -> dict[str, list[int]]:
    kv = await store.get(keys.holdings(node_id))
    return {} if kv is None else dict(json.loads(kv.value)["jobs"])


def _settled(repo: Repository, waiting: int, *, sending: int | None = None) -> Callable[[], Awaitable[bool]]:
    """A probe: `waiting` writes wait, the committer has dispatched (no dispatch pending), and `sending`
    transactions are in flight when given."""
    committer = repo.holdings_writes

    async def probe() -> bool:
        return (len(committer._waiting) == waiting and committer._dispatching is None
                and (sending is None or len(committer._sending) == sending))
    return probe


def _commits(store: Recording, keys: Keys) -> list[list[str]]:
    """The transactions that carried placements (allocation writes), each as its jobs' allocation keys."""
    return [[k for k in sent if k.startswith(keys.allocation(""))] for sent in store.sent
            if any(k.startswith(keys.allocation("")) for k in sent)]


@pytest.mark.parametrize("kind", ["memory", "etcd"])
async def test_concurrent_gangs_on_disjoint_nodes_share_few_transactions_and_all_land(
        kind: str, key_prefix: str, request: pytest.FixtureRequest) -> None:
    """Forty one-node gangs committed at once (one cycle's decisions): at most two transactions in flight,
    far fewer transactions than gangs, and every gang's allocation and holdings stored."""
    inner = MemoryStore() if kind == "memory" else EtcdStore.from_options(request.getfixturevalue("etcd_options"))
    try:
        store = Recording(inner)
        keys = Keys(key_prefix.rstrip("/"))
        repo = Repository(store, keys)
        jobs = await _pending(repo, [f"job-{i:02d}" for i in range(40)])
        store.sent.clear()
        await asyncio.gather(*(repo.commit_placement(job, rev, _alloc(job_id, f"node-{job_id[-2:]}", (0,)))
                               for job_id, (job, rev) in jobs.items()))
        commits = _commits(store, keys)
        assert sorted(k for c in commits for k in c) == sorted(keys.allocation(j) for j in jobs)
        assert len(commits) <= 4, [len(c) for c in commits]
        assert store.most_in_flight <= 2
        for job_id in jobs:
            assert await _holdings(inner, keys, f"node-{job_id[-2:]}") == {job_id: [0]}
            assert await repo.get_allocation(job_id) is not None
    finally:
        if isinstance(inner, EtcdStore):
            await inner.close()


async def test_one_lost_race_in_a_group_fails_only_its_own_write(key_prefix: str) -> None:
    """Sixteen gangs go in two groups; one of them compares a stale job revision. Its group fails, is split
    in halves until that write is alone: it alone gets Conflict, the fifteen others land, and the number of
    transactions stays logarithmic in the group's size."""
    store = Recording(MemoryStore())
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(store, keys)
    jobs = await _pending(repo, [f"job-{i:02d}" for i in range(16)])
    store.sent.clear()
    stale = "job-11"

    async def commit(job_id: str) -> str:
        job, rev = jobs[job_id]
        try:
            await repo.commit_placement(job, rev - 1 if job_id == stale else rev,
                                        _alloc(job_id, f"node-{job_id[-2:]}", (0, 1)))
        except Conflict:
            return "conflict"
        return "placed"
    tasks = [asyncio.create_task(commit(j)) for j in jobs]
    results = dict(zip(jobs, await asyncio.gather(*tasks), strict=True))
    assert results == {j: ("conflict" if j == stale else "placed") for j in jobs}
    assert await repo.get_allocation(stale) is None
    assert await _holdings(store, keys, f"node-{stale[-2:]}") == {}
    for job_id in jobs.keys() - {stale}:
        assert await _holdings(store, keys, f"node-{job_id[-2:]}") == {job_id: [0, 1]}
    # The groups that carried the stale write, each half the size of the one before, down to it alone.
    with_stale = [len(c) for c in _commits(store, keys) if keys.allocation(stale) in c]
    assert with_stale[-1] == 1 and with_stale == sorted(with_stale, reverse=True)
    # Two groups of eight (the two slots); then per halving two transactions: 8 + 2 * log2(8) at most.
    assert len(_commits(store, keys)) <= 2 + 2 * 3, [len(c) for c in _commits(store, keys)]


async def test_a_request_etcd_refuses_as_too_large_is_split_and_only_a_write_too_large_alone_fails(
        key_prefix: str) -> None:
    """etcd refuses a group as too large (InvalidArgument, nothing written): it goes again in halves, so
    every gang that fits a transaction alone lands, and one that does not gets the refusal."""
    store = Recording(MemoryStore(), max_ops=12)
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(store, keys)
    small = await _pending(repo, [f"job-{i:02d}" for i in range(8)])
    big_job = await _pending(repo, ["job-big"], gpus=8)
    store.sent.clear()
    big = Allocation(job_id="job-big", attempt=1, master_addr="b-0.host", master_port=29500, created_at=0.0,
                     assignments=tuple(NodeAssignment(node_id=f"b-{i}", node_rank=i, gpu_indices=(0,),
                                                      ranks=(i,), model="H100") for i in range(20)))
    results = await asyncio.gather(
        *(repo.commit_placement(job, rev, _alloc(job_id, f"node-{job_id[-2:]}", (3,)))
          for job_id, (job, rev) in small.items()),
        repo.commit_placement(big_job["job-big"][0], big_job["job-big"][1], big), return_exceptions=True)
    assert all(isinstance(r, int) for r in results[:-1]), results
    assert isinstance(results[-1], InvalidArgument)
    for job_id in small:
        assert await repo.get_allocation(job_id) is not None
    assert await repo.get_allocation("job-big") is None
    assert await _holdings(store, keys, "b-0") == {}


async def test_a_write_waiting_for_a_busy_node_is_not_overtaken_on_its_nodes(key_prefix: str) -> None:
    """A two-node gang waits for node-1 (a transaction in flight there). A later gang on node-2 alone must
    not go first on node-2: it waits behind the earlier gang, which reaches node-2 first."""
    store = Recording(MemoryStore())
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(store, keys)
    for n in ("node-1", "node-2"):
        node = make_node(n, gpus=8)
        await repo.nodes.modify(n, lambda _, node=node: node)
    jobs = await _pending(repo, ["job-a", "job-wide", "job-late"])
    store.sent.clear()
    store.entered.clear()  # the setup's transactions entered too
    store.gate = asyncio.Event()
    first = asyncio.create_task(repo.commit_placement(*jobs["job-a"], _alloc("job-a", "node-1", (0,))))
    await store.entered.wait()
    wide_alloc = Allocation(job_id="job-wide", attempt=1, master_addr="node-1.host", master_port=29500,
                            created_at=0.0, assignments=tuple(
                                NodeAssignment(node_id=n, node_rank=i, gpu_indices=(1,), ranks=(i,), model="H100")
                                for i, n in enumerate(("node-1", "node-2"))))
    wide = asyncio.create_task(repo.commit_placement(*jobs["job-wide"], wide_alloc))
    late = asyncio.create_task(repo.commit_placement(*jobs["job-late"], _alloc("job-late", "node-2", (2,))))
    await eventually(_settled(repo, 2), what="job-wide and job-late waiting, the committer dispatched")
    assert store.in_flight == 1  # job-late did not take the free slot ahead of job-wide on node-2
    store.gate.set()
    await asyncio.gather(first, wide, late)
    order = [k.rsplit("/", 1)[1] for c in _commits(store, keys) for k in c]
    assert order.index("job-wide") < order.index("job-late") or any(
        keys.allocation("job-wide") in c and keys.allocation("job-late") in c for c in _commits(store, keys))
    assert await _holdings(store, keys, "node-2") == {"job-wide": [1], "job-late": [2]}


async def test_a_caller_cancelled_while_its_group_is_in_flight_does_not_fail_the_others(key_prefix: str) -> None:
    """Four gangs in one transaction; one caller is cancelled (a leadership loss cancels the cycle's commits)
    while it is in etcd. The transaction lands: the three others get their result, none an error."""
    store = Recording(MemoryStore())
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(store, keys)
    jobs = await _pending(repo, [f"job-{i:02d}" for i in range(4)])
    store.entered.clear()
    store.gate = asyncio.Event()
    tasks = {job_id: asyncio.create_task(repo.commit_placement(job, rev, _alloc(job_id, "node-1", (int(job_id[-1]),))))
             for job_id, (job, rev) in jobs.items()}
    await store.entered.wait()
    tasks["job-00"].cancel()
    await asyncio.wait({tasks["job-00"]})  # its caller is gone before the transaction answers
    store.gate.set()
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(isinstance(r, int) for r in results[1:]), results
    held = await _holdings(store, keys, "node-1")
    assert set(held) >= {"job-01", "job-02", "job-03"}


async def test_a_write_whose_caller_was_cancelled_while_waiting_is_not_sent(key_prefix: str) -> None:
    store = Recording(MemoryStore())
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(store, keys)
    jobs = await _pending(repo, ["job-a", "job-b"])
    store.sent.clear()
    store.entered.clear()  # the setup's transactions entered too
    store.gate = asyncio.Event()
    first = asyncio.create_task(repo.commit_placement(*jobs["job-a"], _alloc("job-a", "node-1", (0,))))
    await store.entered.wait()
    waiting = asyncio.create_task(repo.commit_placement(*jobs["job-b"], _alloc("job-b", "node-1", (1,))))
    await eventually(_settled(repo, 1), what="job-b waiting: node-1 is busy")
    waiting.cancel()
    store.gate.set()
    await first
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await eventually(_settled(repo, 0, sending=0), what="the committer idle")
    assert [c for c in _commits(store, keys)] == [[keys.allocation("job-a")]]
    assert await repo.get_allocation("job-b") is None
