"""The gateway's read view in a real deployment (a scheduler with mTLS and a history store over the session's
real etcd, and a gateway): what the read-view tests and the fast path's tests run against."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc.aio
import httpx

from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.wait import eventually, truthy
from trainyard_gateway import convert
from trainyard_gateway.job_view import JobView
from trainyard_gateway.job_view_feed import JobFeed
from trainyard_scheduler.domain.operations import WAITING_MESSAGE

from .support import Cluster, RunningGateway, running_cluster, running_gateway


@dataclass
class Deployment:
    cluster: Cluster
    gateway: RunningGateway
    channel: grpc.aio.Channel  # to the scheduler, as the gateway principal

    @property
    def view(self) -> JobView:
        view = self.gateway.app.app.state.deps.job_view  # type: ignore[union-attr]
        assert isinstance(view, JobView)
        return view

    @property
    def feed(self) -> JobFeed:
        feed = self.gateway.app._job_feed
        assert feed is not None
        return feed

    async def ready(self) -> None:
        await eventually(lambda: truthy(self.view.ready), what="the job view's first snapshot")

    async def scheduler_get(self, job_id: str, team: str = "") -> dict[str, Any]:
        reply = await scheduler_pb2_grpc.JobServiceStub(self.channel).GetJob(
            scheduler_pb2.GetJobRequest(job_id=job_id, team=team))
        return _api(reply.job)

    async def scheduler_list(self, request: scheduler_pb2.ListJobsRequest) -> dict[str, Any]:
        reply = await scheduler_pb2_grpc.JobServiceStub(self.channel).ListJobs(request)
        return {"jobs": [_api(j) for j in reply.jobs], "next_page_token": reply.next_page_token}


def _api(job: Any) -> dict[str, Any]:
    """A scheduler Job as the gateway's JSON has it."""
    loaded: dict[str, Any] = json.loads(convert.job_from_pb(job).model_dump_json())
    return loaded


@contextlib.asynccontextmanager
async def deployment(etcd_settings: dict[str, str], prefix: str, tmp_path: Path, pki_dir: Path,
                     **scheduler: Any) -> AsyncIterator[Deployment]:
    tls = pki.files_for(pki_dir, identity.SCHEDULER).settings()
    async with running_cluster(etcd=etcd_settings, prefix=prefix, state_root=tmp_path / "nodes",
                               history_url=f"sqlite+aiosqlite:///{tmp_path / 'history.db'}", **tls,
                               **scheduler) as cluster, \
            running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                            scheduler_address=cluster.address,
                            **pki.files_for(pki_dir, identity.GATEWAY).settings()) as gw:
        channel = secure_channel(cluster.address, ClientTls(pki.files_for(pki_dir, identity.GATEWAY)),
                                 identity.SCHEDULER)
        try:
            d = Deployment(cluster, gw, channel)
            await d.ready()
            yield d
        finally:
            await channel.close()


async def reasons_written(http: httpx.AsyncClient, job_ids: list[str]) -> None:
    """Until the view shows the scheduler's pending reason on each of these jobs. The leader writes it a moment
    after the submit answered: a view's answer compared with the scheduler's before then could differ by it."""
    async def seen() -> bool:
        messages = {j["id"]: j["message"] for j in (await http.get("/v1/jobs", params={"page_size": 50})).json()
                    ["jobs"]}
        return all(messages.get(job_id) not in (None, WAITING_MESSAGE) for job_id in job_ids)
    await eventually(seen, what="the new jobs' pending reasons in the view")
