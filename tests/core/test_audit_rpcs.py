"""Every mutating RPC produces exactly one audit entry: a table over every method of `authz.AUDITED`, each
called on the real service over mTLS (scheduler, node agent, checkpoint-store, the gateway's TokenService),
with the principal, action, target and result checked against what the caller saw. Refused calls
(PERMISSION_DENIED from the authorization table) and failed ones (NOT_FOUND, ...) are recorded too; reads
are not. Each call carries its own `x-request-id`, which is how its entry is found among the services' own
background calls (registration, launches, exits)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from pydantic import SecretStr

from trainyard.agent.v1 import agent_pb2 as ag
from trainyard.agent.v1 import agent_pb2_grpc
from trainyard.checkpoint.v1 import checkpoint_pb2 as ck
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.gateway.v1 import gateway_pb2 as gw
from trainyard.gateway.v1 import gateway_pb2_grpc
from trainyard.scheduler.v1 import policy_pb2 as po
from trainyard.scheduler.v1 import policy_pb2_grpc, scheduler_pb2_grpc
from trainyard.scheduler.v1 import scheduler_pb2 as sc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core import audit
from trainyard_core.audit import AuditEntry, AuditFilter, AuditLog
from trainyard_core.rpc.server import secure_channel, start_grpc_server
from trainyard_core.security import authz, identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.tls import ClientTls
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually
from trainyard_gateway.app import GatewayApp
from trainyard_gateway.settings import GatewaySettings
from trainyard_gateway.tokens import new_secret
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

from .test_security import Nodes, _all_methods

NODE_1, NODE_2, OPS = identity.node("node-1"), identity.node("node-2"), identity.tool("ops")


def test_every_rpc_that_is_not_a_read_is_audited() -> None:
    methods = _all_methods()
    writes = {m for m in methods if not m.rsplit("/", 1)[1].startswith(authz.READ_PREFIXES)} - authz.LIVENESS
    assert writes - set(authz.AUDITED) - set(authz.BATCHES) == set(), "mutating RPCs without an audit entry"
    # A batch's items are audited as calls of the method it batches (each its own entry), not the batch.
    assert set(authz.BATCHES) <= methods - set(authz.AUDITED)
    assert set(authz.BATCHES.values()) <= set(authz.AUDITED)
    assert set(authz.AUDITED) - methods == set(), "audit rows for methods that do not exist"
    assert set(authz.AUDITED) <= set(authz.RULES)
    assert "/trainyard.scheduler.v1.NodeService/Heartbeat" in methods - set(authz.AUDITED)


@dataclass
class Services:
    pki: Path
    scheduler: SchedulerApp
    agent: AgentApp
    checkpoints: CheckpointApp
    gateway: GatewayApp
    log: AuditLog
    # The team a tool acts for (checkpoint-store), the token a TokenService call is made with.
    metadata: tuple[tuple[str, str], ...] = ()

    def address(self, server: Principal) -> str:
        port = {identity.SCHEDULER: self.scheduler.grpc_port, NODE_1: self.agent.grpc_port,
                identity.CHECKPOINT_STORE: self.checkpoints.grpc_port, identity.GATEWAY: self.gateway.grpc_port}
        return f"127.0.0.1:{port[server]}"

    async def entries(self, server: Principal, request_id: str) -> list[AuditEntry]:
        if server == NODE_1:
            return [e for e in self.agent.audit.entries() if e.request_id == request_id]
        return (await self.log.query(AuditFilter(request_id=request_id))).entries


@pytest.fixture
async def services(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path, tmp_path: Path,
                   etcd_store: EtcdStore) -> AsyncIterator[Services]:
    prefix = key_prefix.rstrip("/")
    files = {p: pki.files_for(pki_dir, p) for p in (identity.SCHEDULER, identity.GATEWAY,
                                                     identity.CHECKPOINT_STORE, NODE_1)}
    scheduler = SchedulerApp(SchedulerSettings.model_validate(dict(
        **etcd_settings, etcd_prefix=prefix, listen_port=0, leader_ttl_s=2, reconcile_interval_s=0.2,
        stop_grace_s=1.0, node_timeout_s=3.0, tool_teams=["ops:team-a"], **files[identity.SCHEDULER].settings())))
    await scheduler.start()
    agent = AgentApp(AgentSettings.model_validate(dict(
        node_id="node-1", gpu_profile="a100x4", scheduler_address=f"127.0.0.1:{scheduler.grpc_port}",
        state_dir=str(tmp_path / "agent-node-1"), heartbeat_interval_s=0.2, stop_grace_s=1.0, single_tenant=True,
        **files[NODE_1].settings())))
    checkpoints = CheckpointApp(CheckpointSettings.model_validate(dict(
        listen_host="127.0.0.1", listen_port=0, storage_url=(tmp_path / "ckpt").as_uri(),
        **etcd_settings, etcd_prefix=prefix, shutdown_grace_s=1.0, gc_interval_s=0,
        **files[identity.CHECKPOINT_STORE].settings())))
    (tmp_path / "ckpt").mkdir()
    operator_token = new_secret()
    gateway = GatewayApp(GatewaySettings.model_validate(dict(
        **etcd_settings, etcd_prefix=prefix, http_port=0, grpc_port=0,
        scheduler_address=f"127.0.0.1:{scheduler.grpc_port}", bootstrap_admin_token=SecretStr(operator_token),
        **files[identity.GATEWAY].settings())))
    try:
        await agent.start()
        await checkpoints.start()
        await gateway.start()

        async def leads() -> bool:
            return scheduler.leadership.is_leader

        await eventually(leads, what="the scheduler to lead")
        yield Services(pki_dir, scheduler, agent, checkpoints, gateway, AuditLog(etcd_store, prefix),
                       metadata=(("x-trainyard-team", "team-a"), ("authorization", f"Bearer {operator_token}")))
    finally:
        await gateway.stop()
        await checkpoints.stop()
        await agent.stop(kill_workers=True)
        await scheduler.stop()


Request = Callable[[dict[str, str]], Any]  # earlier answers (by name) → the request


@dataclass(frozen=True)
class Row:
    server: Principal
    method: str  # full method
    stub: Callable[[grpc.aio.Channel], Any]
    request: Request
    caller: Principal = OPS
    target: Callable[[dict[str, str], Any], str] = lambda _saved, _answer: ""
    save: Callable[[Any], tuple[str, str]] | None = None  # remember (name, value) from a successful answer


def _m(service: str, name: str) -> str:
    return f"/{service}/{name}"


def _job_spec() -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name="audited", command=["true"], resources=types_pb2.Resources(nodes=1, gpus_per_node=1))


S, A, C, G = identity.SCHEDULER, NODE_1, identity.CHECKPOINT_STORE, identity.GATEWAY
JOBS = scheduler_pb2_grpc.JobServiceStub
NODES = scheduler_pb2_grpc.NodeServiceStub
POLICY = policy_pb2_grpc.PolicyServiceStub
AGENT = agent_pb2_grpc.AgentServiceStub
CKPT = checkpoint_pb2_grpc.CheckpointServiceStub
TOKENS = gateway_pb2_grpc.TokenServiceStub


def _fixed(value: str) -> Callable[[dict[str, str], Any], str]:
    return lambda _saved, _answer: value


def _saved(kind: str, name: str) -> Callable[[dict[str, str], Any], str]:
    return lambda saved, _answer: f"{kind}/{saved[name]}" if name in saved else ""


def _ck(saved: dict[str, str]) -> str:
    return saved.get("checkpoint", "ck-missing")


ROWS: list[Row] = [
    # Refused by the authorization table: a node may not submit jobs.
    Row(S, _m(authz.JOBS, "SubmitJob"), JOBS, lambda s: sc.SubmitJobRequest(spec=_job_spec(), team="team-a"),
        caller=NODE_1),
    Row(S, _m(authz.JOBS, "SubmitJob"), JOBS, lambda s: sc.SubmitJobRequest(spec=_job_spec(), team="team-a"),
        target=lambda _s, answer: f"job/{answer.job.id}" if answer else "", save=lambda a: ("job", a.job.id)),
    # The job operations (each ok or failed_precondition, as the job's state is when it is asked).
    Row(S, _m(authz.JOBS, "HoldJob"), JOBS, lambda s: sc.HoldJobRequest(job_id=s["job"], team="team-a",
                                                                         reason="audit test"),
        target=_saved("job", "job")),
    Row(S, _m(authz.JOBS, "ReleaseJob"), JOBS, lambda s: sc.ReleaseJobRequest(job_id=s["job"], team="team-a"),
        target=_saved("job", "job")),
    Row(S, _m(authz.JOBS, "SetJobPriority"), JOBS, lambda s: sc.SetJobPriorityRequest(job_id=s["job"], team="team-a",
                                                                                       priority=3),
        target=_saved("job", "job")),
    Row(S, _m(authz.JOBS, "RequeueJob"), JOBS, lambda s: sc.RequeueJobRequest(job_id="job-none", team="team-a"),
        target=_fixed("job/job-none")),
    Row(S, _m(authz.JOBS, "HoldJob"), JOBS, lambda s: sc.HoldJobRequest(job_id="job-none", team="team-a"),
        caller=NODE_1, target=_fixed("job/job-none")),  # refused: a node may not
    Row(S, _m(authz.JOBS, "CancelJob"), JOBS, lambda s: sc.CancelJobRequest(job_id=s["job"], team="team-a"),
        target=_saved("job", "job")),
    # Fails: no such job.
    Row(S, _m(authz.JOBS, "CancelJob"), JOBS, lambda s: sc.CancelJobRequest(job_id="job-none", team="team-a"),
        target=_fixed("job/job-none")),
    Row(S, _m(authz.NODES, "RegisterNode"), NODES, lambda s: sc.RegisterNodeRequest(
        node=types_pb2.Node(node_id="node-2", agent_address="127.0.0.1:1")), caller=NODE_2,
        target=_fixed("node/node-2")),
    Row(S, _m(authz.NODES, "ReportWorkerExit"), NODES, lambda s: sc.ReportWorkerExitRequest(
        node_id="node-1", job_id="job-none", attempt=1), caller=NODE_1, target=_fixed("job/job-none")),
    Row(S, _m(authz.NODES, "CordonNode"), NODES, lambda s: sc.CordonNodeRequest(node_id="node-1", cordoned=True,
                                                                               reason="audit test"),
        target=_fixed("node/node-1")),
    Row(S, _m(authz.POLICY, "PutQueue"), POLICY, lambda s: po.PutQueueRequest(
        queue=types_pb2.QueueConfig(name="batch")), target=_fixed("queue/batch")),
    Row(S, _m(authz.POLICY, "DeleteQueue"), POLICY, lambda s: po.DeleteQueueRequest(name="batch"),
        target=_fixed("queue/batch")),
    Row(S, _m(authz.POLICY, "PutQuota"), POLICY, lambda s: po.PutQuotaRequest(quota=types_pb2.TeamQuota(team="team-a")),
        target=_fixed("team/team-a")),
    Row(S, _m(authz.POLICY, "DeleteQuota"), POLICY, lambda s: po.DeleteQuotaRequest(team="team-a"),
        target=_fixed("team/team-a")),
    # The agent: launch and stop come only from the scheduler; epoch 0 is below any leader's, so nothing runs.
    Row(A, _m(authz.AGENT, "LaunchWorkers"), AGENT, lambda s: ag.LaunchWorkersRequest(job_id="job-x", attempt=1),
        caller=S, target=_fixed("job/job-x")),
    Row(A, _m(authz.AGENT, "LaunchWorkers"), AGENT, lambda s: ag.LaunchWorkersRequest(job_id="job-x", attempt=1),
        caller=OPS, target=_fixed("job/job-x")),  # refused: tools may not launch
    Row(A, _m(authz.AGENT, "StopWorkers"), AGENT, lambda s: ag.StopWorkersRequest(job_id="job-x", attempt=1),
        caller=S, target=_fixed("job/job-x")),
    # Fails (no credential in it), and refused for a tool.
    Row(A, _m(authz.AGENT, "RenewJobCredential"), AGENT, lambda s: ag.RenewJobCredentialRequest(
        job_id="job-x", attempt=1), caller=S, target=_fixed("job/job-x")),
    Row(A, _m(authz.AGENT, "RenewJobCredential"), AGENT, lambda s: ag.RenewJobCredentialRequest(
        job_id="job-x", attempt=1), caller=OPS, target=_fixed("job/job-x")),
    Row(A, _m(authz.AGENT, "SetGpuHealth"), AGENT, lambda s: ag.SetGpuHealthRequest(
        gpu_index=0, healthy=False, operator="ops", reason="audit test"), target=_fixed("gpu/0")),
    Row(A, _m(authz.AGENT, "InjectFault"), AGENT, lambda s: ag.InjectFaultRequest(gpu_index=1, kind="xid", xid=79),
        target=_fixed("gpu/1")),
    # The checkpoint-store, as an operator's tool.
    Row(C, _m(authz.CHECKPOINTS, "BeginCheckpoint"), CKPT, lambda s: ck.BeginCheckpointRequest(
        job_id="job-ck", attempt=1, step=10, world_size=1),
        target=lambda _s, answer: f"checkpoint/{answer.checkpoint.id}" if answer else "",
        save=lambda a: ("checkpoint", a.checkpoint.id)),
    Row(C, _m(authz.CHECKPOINTS, "TagCheckpoint"), CKPT, lambda s: ck.TagCheckpointRequest(
        checkpoint_id=_ck(s), tag="best"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "UntagCheckpoint"), CKPT, lambda s: ck.UntagCheckpointRequest(
        checkpoint_id=_ck(s), tag="best"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "CommitCheckpoint"), CKPT, lambda s: ck.CommitCheckpointRequest(
        checkpoint_id=_ck(s)), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "AbortCheckpoint"), CKPT, lambda s: ck.AbortCheckpointRequest(
        checkpoint_id=_ck(s), reason="audit test"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "ReportDamaged"), CKPT, lambda s: ck.ReportDamagedRequest(
        checkpoint_id=_ck(s), reason="audit test"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "AcquireRestoreLease"), CKPT, lambda s: ck.AcquireRestoreLeaseRequest(
        checkpoint_id=_ck(s), ttl_s=30, holder="audit"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "RenewRestoreLease"), CKPT, lambda s: ck.RenewRestoreLeaseRequest(
        checkpoint_id=_ck(s), lease_id="lease-none"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "ReleaseRestoreLease"), CKPT, lambda s: ck.ReleaseRestoreLeaseRequest(
        checkpoint_id=_ck(s), lease_id="lease-none"), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "SetRetention"), CKPT, lambda s: ck.SetRetentionRequest(
        job_id="job-ck", policy=ck.RetentionPolicy(keep_last=3)), target=_fixed("job/job-ck")),
    Row(C, _m(authz.CHECKPOINTS, "DeleteCheckpoint"), CKPT, lambda s: ck.DeleteCheckpointRequest(
        checkpoint_id=_ck(s)), target=lambda s, _a: f"checkpoint/{_ck(s)}"),
    Row(C, _m(authz.CHECKPOINTS, "RunGc"), CKPT, lambda s: ck.RunGcRequest(dry_run=True)),
    # The gateway's TokenService: tools only.
    Row(G, _m(authz.TOKENS, "CreateToken"), TOKENS, lambda s: gw.CreateTokenRequest(team="team-a", user="ann"),
        target=lambda _s, answer: f"token/{answer.token.token_id}" if answer else "",
        save=lambda a: ("token", a.token.token_id)),
    Row(G, _m(authz.TOKENS, "RevokeToken"), TOKENS, lambda s: gw.RevokeTokenRequest(token_id=s.get("token", "tok-x")),
        target=lambda s, _a: f"token/{s.get('token', 'tok-x')}"),
    Row(G, _m(authz.TOKENS, "RevokeToken"), TOKENS, lambda s: gw.RevokeTokenRequest(token_id="tok-none"),
        caller=NODE_1, target=_fixed("token/tok-none")),  # refused
]


async def _call(services: Services, row: Row, request: Any, request_id: str) -> tuple[grpc.StatusCode, Any]:
    async with secure_channel(services.address(row.server), ClientTls(pki.files_for(services.pki, row.caller)),
                              row.server) as channel:
        method = getattr(row.stub(channel), row.method.rsplit("/", 1)[1])
        try:
            answer = await method(request, metadata=((audit.REQUEST_ID_HEADER, request_id), *services.metadata),
                                  timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), None
        return grpc.StatusCode.OK, answer


def test_the_table_calls_every_audited_method() -> None:
    assert {r.method for r in ROWS} == set(authz.AUDITED)


async def test_every_mutating_call_produces_one_audit_entry(services: Services) -> None:
    saved: dict[str, str] = {}
    seen: dict[str, set[str]] = {}
    for row in ROWS:
        request_id = f"t-{uuid.uuid4().hex[:12]}"
        code, answer = await _call(services, row, row.request(saved), request_id)
        if answer is not None and row.save is not None:
            name, value = row.save(answer)
            saved[name] = value
        entries = await services.entries(row.server, request_id)
        assert len(entries) == 1, f"{row.method} as {row.caller}: {len(entries)} audit entries"
        e = entries[0]
        result = "ok" if code == grpc.StatusCode.OK else code.name.lower()
        expected = (str(row.caller), row.method, row.target(saved, answer), result)
        assert (e.principal, e.action, e.target, e.result) == expected, row.method
        assert e.message == "" if result == "ok" else e.message, row.method
        if row.server == G and result == "ok":  # the bearer token's user beside the tool's certificate
            assert (e.detail.get("acting_user"), e.detail.get("acting_role")) == ("admin/admin", "operator")
        seen.setdefault(row.method, set()).add(result)
    # The table covers a refusal and a failure, not only successes.
    assert "permission_denied" in seen[_m(authz.JOBS, "SubmitJob")]
    assert "not_found" in seen[_m(authz.JOBS, "CancelJob")]
    assert seen[_m(authz.JOBS, "CancelJob")] >= {"ok", "not_found"}
    assert "not_found" in seen[_m(authz.JOBS, "RequeueJob")]
    assert "permission_denied" in seen[_m(authz.JOBS, "HoldJob")]
    assert "ok" in seen[_m(authz.TOKENS, "CreateToken")]


async def test_reads_leave_no_entry(services: Services) -> None:
    for server, row_stub, name, request in [
        (S, JOBS, "ListJobs", sc.ListJobsRequest(team="team-a")),
        (S, NODES, "ListNodes", sc.ListNodesRequest()),
        (A, AGENT, "ListWorkers", ag.ListWorkersRequest()),
        (G, TOKENS, "ListTokens", gw.ListTokensRequest()),
    ]:
        request_id = f"t-{uuid.uuid4().hex[:12]}"
        row = Row(server, f"/x/{name}", row_stub, request=lambda _s: None)  # the request is passed below
        code, _ = await _call(services, row, request, request_id)
        assert code == grpc.StatusCode.OK, name
        assert await services.entries(server, request_id) == [], name


async def test_the_schedulers_launches_are_in_both_logs_under_one_request_id(services: Services) -> None:
    async with secure_channel(services.address(S), ClientTls(pki.files_for(services.pki, OPS)), S) as channel:
        job = (await JOBS(channel).SubmitJob(sc.SubmitJobRequest(spec=_job_spec(), team="team-a"),
                                             metadata=services.metadata)).job
    launch = _m(authz.AGENT, "LaunchWorkers")

    async def launched() -> list[AuditEntry]:
        return (await services.log.query(AuditFilter(action=launch, target=f"job/{job.id}"))).entries

    [ours] = await eventually(launched, timeout=20, what="the scheduler's record of the launch")
    assert (ours.principal, ours.service, ours.result, ours.detail["callee"]) == \
        ("trainyard://scheduler", "scheduler", "ok", "node/node-1")
    [theirs] = await services.entries(NODE_1, ours.request_id)
    assert (theirs.principal, theirs.action, theirs.target, theirs.result) == \
        ("trainyard://scheduler", launch, f"job/{job.id}", "ok")


async def test_a_call_whose_entry_cannot_be_written_still_gets_its_true_answer(
        pki_dir: Path, key_prefix: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd unreachable for the audit log only: the registration is answered as done (it was), the failed
    write is logged at ERROR and counted."""
    monkeypatch.setattr(audit, "WRITE_BACKOFF_S", 0.01)
    dead = EtcdStore(f"127.0.0.1:{free_port()}", timeout=0.3)
    server = await start_grpc_server(
        host="127.0.0.1", port=0, register=lambda s: scheduler_pb2_grpc.add_NodeServiceServicer_to_server(Nodes(), s),
        service_names=["trainyard.scheduler.v1.NodeService"], tls=pki.files_for(pki_dir, S),
        audit=AuditLog(dead, key_prefix), audit_service="scheduler")
    before = audit.WRITE_FAILURES.labels(sink="etcd")._value.get()
    try:
        async with secure_channel(f"127.0.0.1:{server.port}", ClientTls(pki.files_for(pki_dir, NODE_1)), S) as ch:
            with caplog.at_level(logging.ERROR, logger="trainyard_core.audit"):
                reply = await NODES(ch).RegisterNode(sc.RegisterNodeRequest(node=types_pb2.Node(node_id="node-1")))
        assert reply.node_id == "node-1"
        assert audit.WRITE_FAILURES.labels(sink="etcd")._value.get() == before + 1
        [rec] = [r for r in caplog.records if r.getMessage() == "audit entry not written"]
        assert rec.audit_action == _m(authz.NODES, "RegisterNode")  # type: ignore[attr-defined]
        assert rec.audit_principal == "trainyard://node/node-1"  # type: ignore[attr-defined]
    finally:
        await server.stop(0)
        await dead.close()


async def test_a_submits_entry_is_stored_by_the_jobs_own_transaction(services: Services,
                                                                     etcd_store: EtcdStore) -> None:
    """The scheduler's entry of a submit rides on the job's create (audit.InlineAudit): the job and its entry
    have one create revision. With the audit bucket's lease revoked under it, the submit still stores its job
    (the create is retried without the entry) and the entry is written once, on its own, after it."""
    row = Row(S, _m(authz.JOBS, "SubmitJob"), JOBS, lambda s: sc.SubmitJobRequest(spec=_job_spec(), team="team-a"))
    for carried in (True, False):
        if not carried:
            leases = set(services.scheduler.audit._leases.values())
            assert leases, "the first submit's entry took its bucket's lease"
            for lease in leases:
                await etcd_store.revoke_lease(lease)
        request_id = f"t-{uuid.uuid4().hex[:12]}"
        code, answer = await _call(services, row, row.request({}), request_id)
        assert code == grpc.StatusCode.OK
        [entry] = await services.entries(S, request_id)
        assert (entry.target, entry.result) == (f"job/{answer.job.id}", "ok")
        job = await etcd_store.get(services.scheduler.keys.job(answer.job.id))
        stored = await etcd_store.get(services.log.key(entry.id))
        assert job is not None and stored is not None
        if carried:
            assert stored.create_revision == job.create_revision
        else:
            assert stored.create_revision > job.create_revision


async def test_only_the_gateways_certificate_may_forward_its_entry(services: Services, etcd_store: EtcdStore) -> None:
    """An entry forwarded with a submit (audit.FORWARDED_ENTRY_HEADER) is carried by the job's create when the
    gateway's certificate sent it, and the answer says so (CARRIED_HEADER); from any other caller it is ignored:
    nothing is stored in the gateway's name, and the caller is not told that it was."""
    forged = AuditEntry.make(time=1.0, principal="user:team-a/mallory", service="gateway", action="POST /v1/jobs",
                             team="team-a", detail={"http_status": 201})
    for caller, carried in ((OPS, False), (G, True)):
        request_id = f"t-{uuid.uuid4().hex[:12]}"
        async with secure_channel(services.address(S), ClientTls(pki.files_for(services.pki, caller)), S) as ch:
            call = JOBS(ch).SubmitJob(sc.SubmitJobRequest(spec=_job_spec(), team="team-a"), timeout=10, metadata=(
                (audit.REQUEST_ID_HEADER, request_id), (audit.FORWARDED_ENTRY_HEADER, forged.to_json().decode())))
            answer = await call
            told = dict(await call.trailing_metadata() or ()).get(audit.CARRIED_HEADER)
        entries = {e.service: e for e in await services.entries(S, request_id)}
        job = await etcd_store.get(services.scheduler.keys.job(answer.job.id))
        assert job is not None
        if not carried:
            assert told is None and sorted(entries) == ["scheduler"]
            continue
        assert told == "1" and sorted(entries) == ["gateway", "scheduler"]
        e = entries["gateway"]
        assert (e.principal, e.target, e.request_id, e.result) == \
            ("user:team-a/mallory", f"job/{answer.job.id}", request_id, "ok")
        stored = await etcd_store.get(services.log.key(e.id))
        assert stored is not None and stored.create_revision == job.create_revision
