"""A gang's placement is one etcd transaction of `placement_txn_ops(nodes)` operations. The scheduler
probes etcd's --max-txn-ops at start; the largest gang it then admits commits on a real etcd, holdings
included, one node more is refused by etcd, and the submit of a larger gang is refused with what to change."""

from __future__ import annotations

import asyncio

import pytest

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core import contract
from trainyard_core.clock import SystemClock
from trainyard_core.errors import FailedPrecondition
from trainyard_core.store import Compare
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.limits import txn_ops_limit
from trainyard_core.testing import etcd as etcd_proc
from trainyard_scheduler.domain.models import Allocation, NodeAssignment
from trainyard_scheduler.grpc import convert
from trainyard_scheduler.grpc.servicer import JobServicer
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import (
    ETCD_DEFAULT_MAX_TXN_OPS,
    Repository,
    max_gang_nodes,
    placement_txn_ops,
)

from .builders import make_job, make_node


def _gang(job_id: str, nodes: int) -> Allocation:
    return Allocation(job_id=job_id, attempt=1, created_at=0.0, master_addr="n-0.host", master_port=29500,
                      assignments=tuple(NodeAssignment(node_id=f"{job_id}-n{i}", node_rank=i,
                                                       gpu_indices=tuple(range(8)),
                                                       ranks=tuple(range(8 * i, 8 * i + 8)), model="H100")
                                        for i in range(nodes)))


async def test_the_largest_admitted_gang_commits_in_one_etcd_transaction(etcd_store: EtcdStore,
                                                                       key_prefix: str) -> None:
    keys = Keys(key_prefix.rstrip("/"))
    limit = await txn_ops_limit(etcd_store, keys.leader, 100_000)

    async def nothing_held(key: str) -> None:  # as the leader's mirror would say (read per node otherwise)
        return None
    # The leader's fence is one compare of every write (here: no leader key, create revision 0).
    repo = Repository(etcd_store, keys, fence=lambda: Compare(keys.leader, "create", "==", 0),
                      holdings_source=nothing_held, max_txn_ops=limit)
    assert limit == etcd_proc.MAX_TXN_OPS  # what the test etcd was started with, found by bisection
    assert limit >= placement_txn_ops(contract.MAX_NODES)  # the API's largest gang fits
    largest = max_gang_nodes(limit)
    for job_id in ("job-fits", "job-over"):
        await repo.create_job(make_job(job_id, nodes=largest, gpus=8))
    fits = await repo.get_job("job-fits")
    assert fits is not None
    await repo.commit_placement(fits[0], fits[1], _gang("job-fits", largest))
    held = await etcd_store.range(keys.all_holdings)
    assert len(held.kvs) == largest
    # One node more is past etcd's limit.
    over = await repo.get_job("job-over")
    assert over is not None
    with pytest.raises(Exception, match=r"(?i)too many operations"):
        await repo.commit_placement(over[0], over[1], _gang("job-over", largest + 1))


async def test_a_gang_larger_than_one_transaction_is_refused_at_submit(key_prefix: str) -> None:
    from trainyard_core.store.memory import MemoryStore

    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(MemoryStore(), keys)
    for i in range(200):
        node = make_node(f"n-{i}", gpus=8)
        await repo.nodes.modify(node.node_id, lambda _, node=node: node)
    servicer = JobServicer(repo, SystemClock(), asyncio.Event())
    spec = convert.spec_to_pb(make_job("x", nodes=max_gang_nodes(ETCD_DEFAULT_MAX_TXN_OPS) + 1, gpus=8).spec)
    with pytest.raises(FailedPrecondition, match="--max-txn-ops"):
        await servicer.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), None)  # type: ignore[arg-type]
    assert (await repo.list_jobs(limit=10))[0] == []
