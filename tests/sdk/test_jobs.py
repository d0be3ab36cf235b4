"""The SDK's job methods against a real gateway and a real scheduler (no agents: jobs stay pending) and, for what
needs running workers, a cluster of two real agents on simulated GPUs; each test once with `Client`, once with
`AsyncClient`. Results are the gateway's models; a spec the gateway would refuse is refused before sending,
with the gateway's own message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, python, wait_for_file
from trainyard.common.v1 import types_pb2
from trainyard_core.testing.wait import eventually
from trainyard_gateway.schemas.jobs import Job, JobList, JobSubmit
from trainyard_sdk import FailedPrecondition, IdempotencyKeyReused, InvalidArgument

from .support import Sdk

SPEC: dict[str, Any] = {"name": "train-1", "command": ["python", "train.py"], "env": {"LR": "0.1"},
                        "labels": {"project": "atlas"}, "resources": {"nodes": 1, "gpus_per_node": 2}}


async def test_submit_get_and_change_a_job(sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster) -> None:
    api = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    job = await api(lambda c: c.submit_job(SPEC))
    assert isinstance(job, Job)
    assert (job.name, job.state, job.team, job.user, job.spec.env) == ("train-1", "pending", "vision", "alice",
                                                                       {"LR": "0.1"})
    got = await api(lambda c: c.get_job(job.id))
    assert (got.id, got.spec, got.created_at) == (job.id, job.spec, job.created_at)

    held = await api(lambda c: c.hold_job(job.id, reason="dataset not ready"))
    assert (held.held_by, held.hold_reason) == ("alice", "dataset not ready")
    released = await api(lambda c: c.release_job(job.id))
    assert released.held_by == "" and released.queued_at == job.queued_at
    raised = await api(lambda c: c.set_job_priority(job.id, 50))
    assert raised.spec.priority == 50
    with pytest.raises(FailedPrecondition) as refused:  # nothing runs it yet
        await api(lambda c: c.requeue_job(job.id))
    assert (refused.value.status, refused.value.code) == (409, "failed_precondition")
    cancelled = await api(lambda c: c.cancel_job(job.id, reason="wrong data"))
    assert cancelled.state == "cancelled" and cancelled.cancelled_by == "alice"
    assert [r.reason for r in scheduler.calls.requests("CancelJob")] == ["wrong data"]

    again = await api(lambda c: c.resubmit_job(job.id, {"resources": {"nodes": 2}, "env": {"LR": None}}))
    assert again.id != job.id and again.spec.resources.nodes == 2 and again.spec.env == {}
    assert again.spec.labels == {"project": "atlas", "resubmitted_from": job.id}


async def test_a_model_is_as_good_as_a_dict(sdk: Sdk, live_gateway: RunningGateway) -> None:
    api = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    job = await api(lambda c: c.submit_job(JobSubmit.model_validate(SPEC)))
    assert job.spec.resources.gpus_per_node == 2 and job.spec.labels == {"project": "atlas"}


async def test_an_idempotency_key_answers_the_first_job(sdk: Sdk, live_gateway: RunningGateway,
                                                        scheduler: Cluster) -> None:
    api = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    first = await api(lambda c: c.submit_job(SPEC, idempotency_key="run-7"))
    assert (await api(lambda c: c.submit_job(SPEC, idempotency_key="run-7"))).id == first.id
    with pytest.raises(IdempotencyKeyReused) as info:
        await api(lambda c: c.submit_job({**SPEC, "name": "other"}, idempotency_key="run-7"))
    assert (info.value.status, info.value.code) == (422, "idempotency_key_reused")
    assert "run-7" in info.value.message
    assert [r.idempotency_key for r in scheduler.calls.submits()] == ["run-7"] * 3


BAD_SPECS = [
    {"name": "x", "command": [], "resources": {"nodes": 0, "gpus_per_node": 1}},
    {"name": "bad name!", "command": ["python"], "resources": {"nodes": 1, "gpus_per_node": 1}, "extra": 1},
    {"name": "x", "command": ["python"], "resources": {"nodes": 1, "gpus_per_node": 0, "accelerator": "H100"}},
    {"name": "x", "command": ["python"], "env": {"RANK": "3"}, "resources": {"nodes": "1", "gpus_per_node": 1}},
]


@pytest.mark.parametrize("spec", BAD_SPECS)
async def test_a_bad_spec_fails_before_sending_with_the_gateways_message(
        sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster, spec: dict[str, Any]) -> None:
    token = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(token) as http:
        server = await http.post("/v1/jobs", json=spec)
    assert server.status_code == 400, server.text
    api = sdk(live_gateway.url, token)
    with pytest.raises(InvalidArgument) as info:
        await api(lambda c: c.submit_job(spec))
    assert (info.value.status, info.value.code, info.value.request_id) == (400, "invalid_argument", "")
    assert info.value.message == server.json()["error"]["message"]
    assert "SubmitJob" not in scheduler.calls.methods


async def test_list_jobs_with_filters_newest_first(sdk: Sdk, live_gateway: RunningGateway) -> None:
    api = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    a = await api(lambda c: c.submit_job({**SPEC, "name": "a", "labels": {"project": "atlas"}}))
    b = await api(lambda c: c.submit_job({**SPEC, "name": "b", "labels": {"project": "zeus"}}))
    await api(lambda c: c.cancel_job(a.id))
    assert [j.id for j in await api(lambda c: c.list_jobs())] == [b.id, a.id]
    assert [j.id for j in await api(lambda c: c.list_jobs(state=["cancelled"]))] == [a.id]
    assert [j.id for j in await api(lambda c: c.list_jobs(label={"project": "zeus"}))] == [b.id]
    assert [j.id for j in await api(lambda c: c.list_jobs(label=["project=atlas"], name_prefix="a"))] == [a.id]
    assert [j.id for j in await api(lambda c: c.list_jobs(submitted_after=b.created_at))] == [b.id]
    page = await api(lambda c: c.list_jobs_page(page_size=1))
    assert isinstance(page, JobList) and [j.id for j in page.jobs] == [b.id] and page.next_page_token


async def test_requeue_and_logs_of_a_running_job(sdk: Sdk, cluster_gateway: RunningGateway, cluster: Cluster,
                                                 tmp_path: Path) -> None:
    go = tmp_path / "go"
    api = sdk(cluster_gateway.url, await cluster_gateway.create_token("vision", "alice"))
    job = await api(lambda c: c.submit_job({"name": "talk", "command": python("""
        import os
        print(f"hello from {os.environ['RANK']}")
    """, wait_for_file(go)), "resources": {"nodes": 1, "gpus_per_node": 2}}))
    first = await cluster.wait_state(job.id, types_pb2.JOB_STATE_RUNNING)
    requeued = await api(lambda c: c.requeue_job(job.id, reason="new data loader"))
    assert requeued.requeue_requested_by == "alice"

    async def running_again() -> types_pb2.Job | None:
        now = await cluster.job(job.id)
        return now if now.state == types_pb2.JOB_STATE_RUNNING and now.attempt > first.attempt else None

    again = await eventually(running_again, timeout=60, what="the requeued job running as a new attempt")
    go.touch()
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED, timeout=60)
    text = await api(lambda c: c.job_logs(job.id))
    assert sorted(text.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert (await api(lambda c: c.job_logs(job.id, tail=1, attempt=again.attempt))).count("hello") == 2
    events = await api(lambda c: c.job_events(job.id))
    assert events.job_id == job.id and events.state == "succeeded"
    assert [e.kind for e in events.events] == [e.kind for e in (await api(lambda c: c.get_job(job.id))).events]
