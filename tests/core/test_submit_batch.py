"""SubmitJobs on the real scheduler over mTLS: each item is validated, stored, audited and answered as the
SubmitJob call it stands for; only the gateway may send a batch; a batch refused or malformed as a whole is
audited once and stores nothing."""

from __future__ import annotations

import uuid

import grpc
import grpc.aio
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2 as sc
from trainyard_core import audit, contract
from trainyard_core.audit import AuditEntry
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import authz, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.tls import ClientTls
from trainyard_core.store.etcd import EtcdStore

from .test_audit_rpcs import JOBS, OPS, G, S, Services, _job_spec, services  # noqa: F401 (a fixture)

SUBMIT = f"/{authz.JOBS}/SubmitJob"
BATCH = f"/{authz.JOBS}/SubmitJobs"


def _rid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


async def _batch(svc: Services, items: list[sc.SubmitJobsItem], caller: Principal = G,
                 request_id: str = "") -> sc.SubmitJobsResponse:
    async with secure_channel(svc.address(S), ClientTls(pki.files_for(svc.pki, caller)), S) as ch:
        metadata = ((audit.REQUEST_ID_HEADER, request_id),) if request_id else ()
        reply: sc.SubmitJobsResponse = await JOBS(ch).SubmitJobs(sc.SubmitJobsRequest(items=items), timeout=10,
                                                                  metadata=metadata)
        return reply


async def test_each_item_is_its_own_submit(services: Services, etcd_store: EtcdStore) -> None:  # noqa: F811
    forwarded = AuditEntry.make(time=1.0, principal="user:team-a/alice", service="gateway", action="POST /v1/jobs",
                                team="team-a", detail={"http_status": 201})
    ids = [_rid() for _ in range(4)]
    bad_spec = types_pb2.JobSpec(name="broken", command=["true"], resources=types_pb2.Resources(nodes=0))
    items = [
        sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=_job_spec(), team="team-a", user="alice",
                                                      idempotency_key="batch-key"),
                          request_id=ids[0], forwarded_audit_entry=forwarded.to_json().decode()),
        sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=bad_spec, team="team-a", user="alice"), request_id=ids[1]),
        sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=_job_spec(), team="Not A Team", user="bob"),
                          request_id=ids[2]),
        sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=_job_spec(), team="team-b", user="carol"),
                          request_id=ids[3]),
    ]
    reply = await _batch(services, items)
    assert [r.WhichOneof("outcome") for r in reply.results] == ["submitted", "error", "error", "submitted"]
    ok, bad, team, other = reply.results
    assert ok.submitted.created and ok.submitted.job.team == "team-a" and ok.submitted.job.user == "alice"
    assert ok.audit_carried and not other.audit_carried  # only the first item forwarded an entry
    assert other.submitted.job.team == "team-b" and other.submitted.revision > 0
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == bad.error.code == team.error.code
    assert "nodes" in bad.error.message and "team" in team.error.message
    for result in (ok, other):
        assert await etcd_store.get(services.scheduler.keys.job(result.submitted.job.id)) is not None
    # One scheduler entry per item, under the item's request id and the SubmitJob action; the forwarded one too.
    for request_id, result, outcome in zip(ids, reply.results, ("ok", "invalid_argument", "invalid_argument", "ok"),
                                           strict=True):
        entries = await services.entries(S, request_id)
        mine = [e for e in entries if e.service == "scheduler"]
        assert [(e.action, e.principal, e.result) for e in mine] == [(SUBMIT, str(G), outcome)], request_id
        if outcome == "ok":
            assert mine[0].target == f"job/{result.submitted.job.id}"
    gateway_entries = [e for e in await services.entries(S, ids[0]) if e.service == "gateway"]
    assert [(e.principal, e.target) for e in gateway_entries] == [("user:team-a/alice", f"job/{ok.submitted.job.id}")]

    # The same key with another spec: the item fails as SubmitJob would, with its error kind; the key's first
    # spec again answers the first job, not created.
    other_spec = types_pb2.JobSpec(name="other", command=["true"], resources=types_pb2.Resources(nodes=1,
                                                                                                 gpus_per_node=1))
    again = await _batch(services, [
        sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=other_spec, team="team-a", user="alice",
                                                      idempotency_key="batch-key")),
        sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=_job_spec(), team="team-a", user="alice",
                                                      idempotency_key="batch-key"))])
    reused, replay = again.results
    assert reused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert reused.error.kind == "idempotency-key-reused" and "batch-key" in reused.error.message
    assert replay.submitted.job.id == ok.submitted.job.id and not replay.submitted.created


async def test_only_the_gateway_may_send_a_batch(services: Services) -> None:  # noqa: F811
    request_id = _rid()
    item = sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=_job_spec(), team="team-a"), request_id=request_id)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _batch(services, [item], caller=OPS, request_id=request_id)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "SubmitJobs" in (refused.value.details() or "")
    # The refused batch has its one entry (its item never ran, so none of its own).
    [entry] = await services.entries(S, request_id)
    assert (entry.action, entry.principal, entry.result, entry.detail["items"]) == \
        (BATCH, str(OPS), "permission_denied", "1")


@pytest.mark.parametrize("count", [0, contract.MAX_SUBMIT_BATCH + 1])
async def test_a_batch_of_no_items_or_too_many_is_refused(services: Services, count: int) -> None:  # noqa: F811
    request_id = _rid()
    items = [sc.SubmitJobsItem(request=sc.SubmitJobRequest(spec=_job_spec(), team="team-a"))] * count
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _batch(services, items, request_id=request_id)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"1 to {contract.MAX_SUBMIT_BATCH} submits (got {count})" in (refused.value.details() or "")
    [entry] = await services.entries(S, request_id)
    assert (entry.action, entry.result) == (BATCH, "invalid_argument")
