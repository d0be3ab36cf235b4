"""The gateway's submits go to the scheduler together while earlier ones are in flight (submit_batcher.py), each
answered, audited and traced as its own submit; a scheduler without SubmitJobs gets one SubmitJob per request.
Real gateway, real scheduler (the `scheduler` fixture's, with its call log), real etcd."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_core.audit import AuditFilter, AuditLog
from trainyard_core.store.etcd import EtcdStore

from .support import Cluster, RunningGateway, running_gateway

BURST = 24


def _spec(i: int, gpus: int = 1) -> dict[str, Any]:
    return {"name": f"burst-{i}", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": gpus}}


@pytest.fixture
async def one_call_gateway(etcd_settings: dict[str, str], scheduler: Cluster) -> AsyncIterator[RunningGateway]:
    """At most one submit call in flight: what arrives meanwhile must wait and go together."""
    async with running_gateway(etcd=etcd_settings, etcd_prefix=scheduler.settings.etcd_prefix,
                               scheduler_address=scheduler.address, submit_calls=1) as gw:
        yield gw


async def test_a_burst_goes_in_few_calls_and_each_request_gets_its_own_answer(
        one_call_gateway: RunningGateway, scheduler: Cluster, etcd_store: EtcdStore) -> None:
    await scheduler.add_agent("node-a", "a100x8")
    scheduler.calls.clear()
    token = await one_call_gateway.create_token("vision", "alice")
    async with one_call_gateway.client(token) as http:
        # One request the fleet cannot run (64 GPUs on a node of 8) among good ones: only it fails.
        replies = await asyncio.gather(*(
            http.post("/v1/jobs", json=_spec(i, gpus=64 if i == 7 else 1), headers={"X-Request-Id": f"burst-req-{i}"})
            for i in range(BURST)))
    for i, reply in enumerate(replies):
        if i == 7:
            assert reply.status_code == 409, reply.text
            assert reply.json()["error"]["code"] == "failed_precondition"
            assert "more than any node has (the largest has 8 GPUs)" in reply.json()["error"]["message"]
        else:
            assert reply.status_code == 201, reply.text
            assert reply.json()["name"] == f"burst-{i}" and reply.json()["user"] == "alice"
    assert len({r.json()["id"] for i, r in enumerate(replies) if i != 7}) == BURST - 1
    batches = scheduler.calls.requests("SubmitJobs")
    assert scheduler.calls.requests("SubmitJob") == []
    assert sum(len(b.items) for b in batches) == BURST
    assert len(batches) < BURST and max(len(b.items) for b in batches) > 1, [len(b.items) for b in batches]
    # Each item carried its own request's id and trace: the scheduler's audit entry of each submit is its own.
    log = AuditLog(etcd_store, scheduler.settings.etcd_prefix)
    for i, reply in enumerate(replies):
        entries = (await log.query(AuditFilter(request_id=f"burst-req-{i}"))).entries
        mine = [e for e in entries if e.service == "scheduler"]
        assert len(mine) == 1, (i, entries)
        assert mine[0].action == "/trainyard.scheduler.v1.JobService/SubmitJob"
        if i == 7:
            assert mine[0].result == "failed_precondition"
        else:
            assert (mine[0].result, mine[0].target) == ("ok", f"job/{reply.json()['id']}")
            # The gateway's entry rode on the job's create (forwarded with the item), and only once.
            assert [e.service for e in entries].count("gateway") == 1
    assert len({item.traceparent for b in batches for item in b.items}) == BURST


async def test_a_scheduler_without_submit_jobs_gets_one_submit_job_per_request(
        live_gateway: RunningGateway, scheduler: Cluster) -> None:
    """A scheduler older than SubmitJobs answers it UNIMPLEMENTED, having done nothing: the gateway sends that
    submit, and the next ones, as SubmitJob calls."""
    scheduler.calls.unimplemented = frozenset({"SubmitJobs"})
    scheduler.calls.clear()
    token = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(token) as http:
        first = await http.post("/v1/jobs", json=_spec(1))
        second = await http.post("/v1/jobs", json=_spec(2))
    assert (first.status_code, second.status_code) == (201, 201), (first.text, second.text)
    assert scheduler.calls.methods == ["SubmitJobs", "SubmitJob", "SubmitJob"]
    assert [r.spec.name for r in scheduler.calls.submits()] == ["burst-1", "burst-1", "burst-2"]
    jobs = {j["name"] for j in (await scheduler_jobs(live_gateway, token))}
    assert jobs == {"burst-1", "burst-2"}, "the refused batch stored nothing; each submit stored once"


async def scheduler_jobs(gateway: RunningGateway, token: str) -> list[dict[str, Any]]:
    async with gateway.client(token) as http:
        reply = await http.get("/v1/jobs")
    assert reply.status_code == 200, reply.text
    return list(reply.json()["jobs"])
