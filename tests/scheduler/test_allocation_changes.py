"""A gang's allocation record is changed by each of its nodes and ranks at about the same moment: every node
confirms the launch and the stop, every worker reports its exit (one call each). However many arrive at once,
every change lands (store/merged_updates.py), none is refused for losing a compare-and-swap to the others."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.agent_calls import launch_confirmed, stop_confirmed, stopping_for
from trainyard_scheduler.domain.models import Allocation, Job, WorkerExit
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job, make_node, running

NODES = [make_node(f"node-{i}", gpus=8) for i in range(32)]


async def _gang(etcd_store: EtcdStore, key_prefix: str) -> tuple[Repository, Job, Allocation]:
    repo = Repository(etcd_store, Keys(key_prefix.rstrip("/")))
    job, alloc = running(make_job("job-big", gpus=8, nodes=len(NODES)), [(n.node_id, range(8)) for n in NODES])
    await repo.write(alloc=alloc, alloc_rev=0)
    return repo, job, alloc


async def test_every_exit_of_a_large_gang_reported_at_once_is_recorded(etcd_store: EtcdStore, key_prefix: str) -> None:
    repo, job, _ = await _gang(etcd_store, key_prefix)
    exits = [WorkerExit(r, NODES[r // 8].node_id, 0, 0, 1.0) for r in range(8 * len(NODES))]
    got = await asyncio.gather(*(repo.exits.record(job.id, job.attempt, e) for e in exits), return_exceptions=True)
    assert got == [True] * len(exits)
    found = await repo.get_allocation(job.id)
    assert found is not None and sorted(e.rank for e in found[0].exits) == list(range(len(exits)))
    # A repeat changes nothing; another attempt's report is not this gang's.
    assert await repo.exits.record(job.id, job.attempt, replace(exits[0], exit_code=3))
    assert not await repo.exits.record(job.id, job.attempt + 1, exits[0])
    again = await repo.get_allocation(job.id)
    assert again is not None and again[1] == found[1]


async def test_every_nodes_launch_and_stop_confirmed_at_once_are_recorded(etcd_store: EtcdStore,
                                                                          key_prefix: str) -> None:
    repo, job, _ = await _gang(etcd_store, key_prefix)
    ids = [n.node_id for n in NODES]
    assert await asyncio.gather(*(repo.modify_allocation(job.id, job.attempt, launch_confirmed(n)) for n in ids)) \
        == [True] * len(ids)
    changes = [stopping_for("cancelled by alice"), *(stop_confirmed(n) for n in ids), stopping_for("later")]
    assert await asyncio.gather(*(repo.modify_allocation(job.id, job.attempt, c) for c in changes)) == \
        [True] * len(changes)
    found = await repo.get_allocation(job.id)
    assert found is not None
    alloc = found[0]
    assert alloc.launched == frozenset(ids) and alloc.stopped == frozenset(ids)
    assert alloc.stop_reason == "cancelled by alice"
