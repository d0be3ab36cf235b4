"""Who cancelled a job: the domain records it once, the job record keeps it, and over mTLS the scheduler takes
the user from the gateway principal and names a tool by its certificate, whatever user the tool sends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.jobs import request_cancel
from trainyard_scheduler.domain.models import JobState
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state import codec

from .builders import NOW, make_job


def test_a_cancel_records_its_user_once() -> None:
    pending = request_cancel(make_job(), NOW, "", by="alice")
    assert (pending.state, pending.cancelled_by, pending.message) == (JobState.CANCELLED, "alice",
                                                                      "cancelled by alice")
    running = request_cancel(replace(make_job(), state=JobState.RUNNING), NOW, "bad data", by="bob")
    assert (running.cancel_requested, running.cancelled_by, running.events[-1].message) == (True, "bob", "bad data")
    again = request_cancel(running, NOW + 1, "", by="carol")
    assert again is running  # the first canceller stays recorded


def test_cancelled_by_round_trips_and_old_records_have_none() -> None:
    job = request_cancel(make_job(), NOW, "", by="tool:ci")
    assert codec.decode_job(codec.encode_job(job)).cancelled_by == "tool:ci"
    old = orjson.loads(codec.encode_job(make_job()))
    del old["cancelled_by"]
    assert codec.decode_job(orjson.dumps(old)).cancelled_by == ""


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> AsyncIterator[SchedulerApp]:
    settings = SchedulerSettings.model_validate(dict(
        **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), listen_port=0, leader_ttl_s=2,
        reconcile_interval_s=0.2, tool_teams=["ops:team-a"],
        **pki.files_for(pki_dir, identity.SCHEDULER).settings()))
    app = SchedulerApp(settings)
    await app.start()
    try:
        async def leads() -> bool:
            return app.leadership.is_leader

        await eventually(leads, what="the scheduler to lead")
        yield app
    finally:
        await app.stop()


async def test_cancel_over_mtls_names_the_gateways_user_or_the_tool(leader: SchedulerApp, pki_dir: Path) -> None:
    spec = types_pb2.JobSpec(name="t", command=["true"], resources=types_pb2.Resources(nodes=1, gpus_per_node=1))
    address = f"127.0.0.1:{leader.grpc_port}"
    cancelled: dict[str, str] = {}
    for principal, user in ((identity.GATEWAY, "alice"), (identity.tool("ops"), "mallory")):
        async with secure_channel(address, ClientTls(pki.files_for(pki_dir, principal)), identity.SCHEDULER) as ch:
            jobs = scheduler_pb2_grpc.JobServiceStub(ch)
            job = (await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, team="team-a", user="u"))).job
            reply = await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, team="team-a", user=user))
            assert reply.job.state == types_pb2.JOB_STATE_CANCELLED
            stored = await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id, team="team-a"))
            cancelled[str(principal)] = stored.job.cancelled_by
    assert cancelled == {"trainyard://gateway": "alice", "trainyard://tool/ops": "tool:ops"}
