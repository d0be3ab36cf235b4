"""What the checkpoint routes' tests (the gateway's and the CLI's) run against: a real gateway in front of a real
scheduler and a real checkpoint-store (real etcd, POSIX storage in a temporary directory), every hop on mTLS
with the development PKI, as deployed.

A job's checkpoints are made as its workers make them: `Stack.worker(job_id)` is a checkpoint-store client
holding the job's own credential, minted by the job issuer the scheduler would use. Its first call records the
job's team in the store (`checkpoint-teams/<job_id>`), which is what admits the gateway's calls for that team.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from tests.checkpoint.checkpoint_support import Client, dcp_like_files, write_shards
from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.rpc.server import CHANNEL_OPTIONS
from trainyard_core.security import identity, pki
from trainyard_core.security.job_credentials import JobIssuer
from trainyard_core.security.tls import target_name_option
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

from .support import RunningGateway, running_gateway

JOB: dict[str, Any] = {"name": "train", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}


@dataclass
class Worker:
    """A job's worker, as the checkpoint library talks to the store (rank 0's calls, shards written by hand)."""

    job_id: str
    client: Client

    async def begin(self, step: int, *, world_size: int = 2, code_version: str = "",
                    parameters: Mapping[str, str] | None = None, job_spec: Mapping[str, Any] | None = None,
                    attempt: int = 0) -> pb.Checkpoint:
        lineage = pb.Lineage(code_version=code_version, parameters=dict(parameters or {}),
                             job_spec=json.dumps(job_spec) if job_spec is not None else "")
        return await self.client.begin(self.job_id, step, world_size=world_size, attempt=attempt,
                                       metadata={"format": "torch.distributed.checkpoint"}, lineage=lineage)

    async def save(self, step: int, *, world_size: int = 2, **lineage: Any) -> pb.Checkpoint:
        """Begin, write every rank's shard where Begin said, commit."""
        ckpt = await self.begin(step, world_size=world_size, **lineage)
        return await self.client.commit(ckpt.id, write_shards(ckpt, dcp_like_files(world_size, step)))


@dataclass
class Stack:
    gateway: RunningGateway
    store: CheckpointApp
    issuer: JobIssuer

    @contextlib.asynccontextmanager
    async def worker(self, job_id: str, team: str = "vision", attempt: int = 0) -> AsyncIterator[Worker]:
        cred = self.issuer.credential(job_id, attempt, team, dt.datetime.now(dt.UTC))
        creds = grpc.ssl_channel_credentials(root_certificates=cred.ca, private_key=cred.key,
                                             certificate_chain=cred.cert_chain)
        channel = grpc.aio.secure_channel(f"127.0.0.1:{self.store.grpc_port}", creds,
                                          options=[*CHANNEL_OPTIONS, target_name_option(identity.CHECKPOINT_STORE)])
        try:
            yield Worker(job_id, Client(pb_grpc.CheckpointServiceStub(channel)))
        finally:
            await channel.close()

    async def submit(self, token: str, name: str = "train") -> dict[str, Any]:
        """A job submitted through the gateway with `token` (it stays pending: the scheduler has no nodes)."""
        async with self.gateway.client(token) as http:
            reply = await http.post("/v1/jobs", json={**JOB, "name": name})
        assert reply.status_code == 201, reply.text
        job: dict[str, Any] = reply.json()
        return job


@contextlib.asynccontextmanager
async def running_stack(*, etcd: Mapping[str, str], prefix: str, pki_dir: Path, storage_root: Path,
                        store: bool = True) -> AsyncIterator[Stack]:
    """The three services on free ports under `prefix` (the gateway and the store share it, as a deployment's
    services do, so one AuditLog reads both; the scheduler has its own); `pki_dir` the `pki_dir` fixture's PKI
    (the job issuer is added). With `store` False the gateway has no checkpoint_store_address (the store still runs)."""
    pki.ensure(pki_dir, [], job_issuer=True)
    cert, key = pki.job_issuer_files(pki_dir)
    issuer = JobIssuer(cert, key, pki_dir / "ca.pem", ttl_s=3600)
    scheduler = SchedulerApp(SchedulerSettings.model_validate(dict(
        **etcd, etcd_prefix=prefix + "/scheduler", listen_port=0, leader_ttl_s=2, reconcile_interval_s=0.2,
        **pki.files_for(pki_dir, identity.SCHEDULER).settings())))
    settings = CheckpointSettings(listen_host="127.0.0.1", listen_port=0, storage_url=storage_root.as_uri(),
                                  **etcd, etcd_prefix=prefix, shutdown_grace_s=1.0, gc_interval_s=0,
                                  **pki.files_for(pki_dir, identity.CHECKPOINT_STORE).settings())
    checkpoints = CheckpointApp(settings)
    await scheduler.start()
    try:
        await checkpoints.start()
        try:
            async def leads() -> bool:
                return scheduler.leadership.is_leader

            await eventually(leads, what="the scheduler to lead")
            extra = {"checkpoint_store_address": f"127.0.0.1:{checkpoints.grpc_port}"} if store else {}
            async with running_gateway(etcd=etcd, etcd_prefix=prefix,
                                       scheduler_address=f"127.0.0.1:{scheduler.grpc_port}", **extra,
                                       **pki.files_for(pki_dir, identity.GATEWAY).settings()) as gw:
                yield Stack(gateway=gw, store=checkpoints, issuer=issuer)
        finally:
            await checkpoints.stop()
    finally:
        await scheduler.stop()
