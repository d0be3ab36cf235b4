"""PolicyService (queues, team quotas) and the submit-time policy checks over real gRPC on port 0 against a
real etcd: CRUD round trips, validation errors that name the field, "default" and queues in use refused,
bad input leaving etcd unchanged. The servicers are built here directly, so these tests do not depend on
how the scheduler process wires them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import policy_pb2, policy_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.clock import SystemClock
from trainyard_core.rpc.server import GrpcServer, start_grpc_server
from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.grpc.policy_servicer import PolicyServicer
from trainyard_scheduler.grpc.servicer import JobServicer
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.policy_repository import PolicyRepository
from trainyard_scheduler.state.repository import Repository


@dataclass
class Api:
    policy: policy_pb2_grpc.PolicyServiceAsyncStub
    jobs: scheduler_pb2_grpc.JobServiceAsyncStub
    keys: Keys
    store: EtcdStore


@pytest.fixture
async def api(etcd_store: EtcdStore, key_prefix: str) -> AsyncIterator[Api]:
    keys = Keys(key_prefix.rstrip("/"))
    repo = Repository(etcd_store, keys)
    jobs = JobServicer(repo, SystemClock(), asyncio.Event(), priority_classes=["low", "normal", "high", "urgent"])
    policy = PolicyServicer(PolicyRepository(etcd_store, keys))

    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_JobServiceServicer_to_server(jobs, server)
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(policy, server)

    server: GrpcServer = await start_grpc_server(
        host="127.0.0.1", port=0, register=register,
        service_names=[scheduler_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
                       policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield Api(policy=policy_pb2_grpc.PolicyServiceStub(channel),  # type: ignore[arg-type]
                  jobs=scheduler_pb2_grpc.JobServiceStub(channel),  # type: ignore[arg-type]
                  keys=keys, store=etcd_store)
    await server.stop(grace=0.5)


async def expect_error(call: object, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    for fragment in fragments:
        assert fragment in details, details
    return details


def spec(queue: str = "", **fields: object) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name="it", command=["true"], queue=queue,
                             resources=types_pb2.Resources(nodes=1, gpus_per_node=1), **fields)  # type: ignore[arg-type]


async def submit(api: Api, spec_pb: types_pb2.JobSpec, team: str = "vision") -> types_pb2.Job:
    reply = await api.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec_pb, team=team, user="ann"))
    job: types_pb2.Job = reply.job
    return job


async def test_queue_crud_round_trip(api: Api) -> None:
    listed = await api.policy.ListQueues(policy_pb2.ListQueuesRequest())
    assert [(q.name, q.tier, q.max_gpus) for q in listed.queues] == [("default", 0, 0)]  # always there

    batch = types_pb2.QueueConfig(name="batch", tier=-10, max_gpus=64, node_labels={"pool": "spot"},
                                  description="cheap, preemptible")
    put = await api.policy.PutQueue(policy_pb2.PutQueueRequest(queue=batch))
    assert put.created and put.queue == batch
    replaced = types_pb2.QueueConfig(name="batch", tier=5)
    again = await api.policy.PutQueue(policy_pb2.PutQueueRequest(queue=replaced))
    assert not again.created and again.queue == replaced  # a put replaces the whole queue
    await api.policy.PutQueue(policy_pb2.PutQueueRequest(queue=types_pb2.QueueConfig(name="default", tier=1)))

    listed = await api.policy.ListQueues(policy_pb2.ListQueuesRequest())
    assert [(q.name, q.tier) for q in listed.queues] == [("batch", 5), ("default", 1)]

    deleted = await api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="batch"))
    assert deleted.queue == replaced
    await expect_error(api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="batch")),
                       grpc.StatusCode.NOT_FOUND, "queue batch not found")


async def test_default_queue_cannot_be_deleted(api: Api) -> None:
    await expect_error(api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="default")),
                       grpc.StatusCode.FAILED_PRECONDITION, '"default" cannot be deleted')
    await api.policy.PutQueue(policy_pb2.PutQueueRequest(queue=types_pb2.QueueConfig(name="default", tier=3)))
    await expect_error(api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="default")),
                       grpc.StatusCode.FAILED_PRECONDITION, '"default" cannot be deleted')


async def test_bad_queues_are_refused_and_store_nothing(api: Api) -> None:
    cases = [
        (types_pb2.QueueConfig(name=""), "queue.name"),
        (types_pb2.QueueConfig(name="a/b"), "queue.name"),
        (types_pb2.QueueConfig(name="x" * 64), "queue.name"),
        (types_pb2.QueueConfig(name="q", tier=5000), "tier must be between -1000 and 1000"),
        (types_pb2.QueueConfig(name="q", max_gpus=-1), "max_gpus"),
        (types_pb2.QueueConfig(name="q", node_labels={"bad key!": "v"}), "node label 'bad key!'"),
        (types_pb2.QueueConfig(name="q", description="d" * 513), "description"),
    ]
    for queue, fragment in cases:
        await expect_error(api.policy.PutQueue(policy_pb2.PutQueueRequest(queue=queue)),
                           grpc.StatusCode.INVALID_ARGUMENT, fragment)
    await expect_error(api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="../jobs")),
                       grpc.StatusCode.INVALID_ARGUMENT, "name '../jobs'")
    assert (await api.store.range(api.keys.queues)).kvs == []


async def test_submit_checks_the_queue_and_a_queue_in_use_cannot_be_deleted(api: Api) -> None:
    # Well-formed, but this cluster has no such queue: the cluster would have to change, not the request.
    await expect_error(submit(api, spec(queue="batch")), grpc.StatusCode.FAILED_PRECONDITION,
                       "queue 'batch' does not exist; queues: default")
    await api.policy.PutQueue(policy_pb2.PutQueueRequest(queue=types_pb2.QueueConfig(name="batch")))
    first = await submit(api, spec(queue="batch"))
    await submit(api, spec(queue="batch"), team="nlp")
    await submit(api, spec())  # the default queue: another queue's jobs do not count
    assert first.spec.queue == "batch"
    await expect_error(api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="batch")),
                       grpc.StatusCode.FAILED_PRECONDITION, "queue batch is used by 2 unfinished job(s)")

    listed = await api.jobs.ListJobs(scheduler_pb2.ListJobsRequest())
    for job in listed.jobs:
        if job.spec.queue == "batch":
            await api.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
    await api.policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name="batch"))  # only finished jobs name it now
    await expect_error(submit(api, spec(queue="batch")), grpc.StatusCode.FAILED_PRECONDITION, "does not exist")


async def test_quota_crud_round_trip(api: Api) -> None:
    assert list((await api.policy.ListQuotas(policy_pb2.ListQuotasRequest())).quotas) == []
    await expect_error(api.policy.GetQuota(policy_pb2.GetQuotaRequest(team="vision")),
                       grpc.StatusCode.NOT_FOUND, "team vision has no quota")

    vision = types_pb2.TeamQuota(team="vision", weight=2.0, limits={
        "H100-80GB-HBM3": types_pb2.QuotaLimit(nominal=64, borrow_limit=32),
        "*": types_pb2.QuotaLimit(nominal=8)})
    put = await api.policy.PutQuota(policy_pb2.PutQuotaRequest(quota=vision))
    assert put.created and put.quota == vision
    got = (await api.policy.GetQuota(policy_pb2.GetQuotaRequest(team="vision"))).quota
    assert got == vision
    assert got.limits["H100-80GB-HBM3"].borrow_limit == 32
    assert not got.limits["*"].HasField("borrow_limit")  # unset = no limit, kept apart from 0

    nlp = types_pb2.TeamQuota(team="nlp", limits={"*": types_pb2.QuotaLimit(nominal=0, borrow_limit=0)})
    stored = await api.policy.PutQuota(policy_pb2.PutQuotaRequest(quota=nlp))
    assert stored.quota.weight == 1.0 and stored.quota.limits["*"].HasField("borrow_limit")

    everyone = await api.policy.ListQuotas(policy_pb2.ListQuotasRequest())
    assert [q.team for q in everyone.quotas] == ["nlp", "vision"]
    only = await api.policy.ListQuotas(policy_pb2.ListQuotasRequest(team="vision"))
    assert [q.team for q in only.quotas] == ["vision"]
    none = await api.policy.ListQuotas(policy_pb2.ListQuotasRequest(team="robotics"))
    assert list(none.quotas) == []

    again = await api.policy.PutQuota(policy_pb2.PutQuotaRequest(quota=types_pb2.TeamQuota(team="vision")))
    assert not again.created and dict(again.quota.limits) == {}
    deleted = await api.policy.DeleteQuota(policy_pb2.DeleteQuotaRequest(team="vision"))
    assert deleted.quota.team == "vision"
    await expect_error(api.policy.DeleteQuota(policy_pb2.DeleteQuotaRequest(team="vision")),
                       grpc.StatusCode.NOT_FOUND, "team vision has no quota")


async def test_bad_quotas_are_refused_and_store_nothing(api: Api) -> None:
    def quota(**kw: object) -> types_pb2.TeamQuota:
        return types_pb2.TeamQuota(**{"team": "vision", **kw})  # type: ignore[arg-type]

    cases = [
        (quota(team="Vision"), "quota.team 'Vision'"),
        (quota(team=""), "quota.team"),
        (quota(weight=0.0), "weight must be > 0"),
        (quota(weight=-1.0), "weight must be > 0"),
        (quota(weight=float("nan")), "weight must be > 0"),
        (quota(weight=1e9), "weight must be > 0 and <= 1000"),
        (quota(limits={"H100": types_pb2.QuotaLimit(nominal=-1)}), "H100: nominal"),
        (quota(limits={"H100": types_pb2.QuotaLimit(nominal=1, borrow_limit=-5)}), "H100: borrow_limit"),
        (quota(limits={"": types_pb2.QuotaLimit(nominal=1)}), "accelerator model ''"),
        (quota(limits={"m" * 65: types_pb2.QuotaLimit(nominal=1)}), "must be 1-64 characters"),
    ]
    for bad, fragment in cases:
        await expect_error(api.policy.PutQuota(policy_pb2.PutQuotaRequest(quota=bad)),
                           grpc.StatusCode.INVALID_ARGUMENT, fragment)
    for call in (api.policy.GetQuota(policy_pb2.GetQuotaRequest(team="a/b")),
                 api.policy.DeleteQuota(policy_pb2.DeleteQuotaRequest(team="")),
                 api.policy.ListQuotas(policy_pb2.ListQuotasRequest(team="UPPER"))):
        await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT, "team")
    assert (await api.store.range(api.keys.quotas)).kvs == []


async def test_new_spec_fields_round_trip_and_proto_defaults(api: Api) -> None:
    full = types_pb2.JobSpec(
        name="full", command=["python", "t.py"], priority_class="high",
        resources=types_pb2.Resources(nodes=2, gpus_per_node=4, accelerators=["H100", "A100"], min_memory_gb=40,
                                      min_compute_capability="8.0", vendor="nvidia", allow_mixed=True,
                                      cpus_per_node=16, speed_hints={"H100": 2.5, "A100": 1.0}),
        topology=types_pb2.TopologyRequest(tier="leaf", wait_s=600),
        preemption=types_pb2.PreemptionPolicy(signal="SIGUSR1", grace_s=60),
        restart_backoff_s=0.0, time_limit_s=5400)
    job = await submit(api, full)
    got = (await api.jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))).job
    assert got.spec == job.spec
    assert got.spec.resources == full.resources and got.spec.topology == full.topology
    assert got.spec.preemption == full.preemption and got.spec.priority_class == "high"
    assert got.spec.HasField("restart_backoff_s") and got.spec.restart_backoff_s == 0.0  # explicit 0 is kept
    assert got.spec.time_limit_s == 5400
    assert got.restarts == 0 and list(got.preempted_by) == [] and not got.HasField("not_before")
    assert got.queued_at.ToNanoseconds() == got.created_at.ToNanoseconds()

    plain = await submit(api, spec())
    assert plain.spec.queue == "default" and plain.spec.preemption.signal == "SIGTERM"
    assert plain.spec.restart_backoff_s == 10.0 and plain.spec.time_limit_s == 0
    assert plain.spec.topology.tier == "" and plain.spec.priority_class == ""


async def test_submit_refuses_bad_policy_fields_naming_them(api: Api) -> None:
    await expect_error(submit(api, spec(priority_class="vip")), grpc.StatusCode.FAILED_PRECONDITION,
                       "priority_class 'vip' is not defined; classes: high, low, normal, urgent")
    cases = [
        (spec(topology=types_pb2.TopologyRequest(tier="island")), "topology.tier"),
        (spec(topology=types_pb2.TopologyRequest(required=True)), "topology.required needs topology.tier"),
        (spec(preemption=types_pb2.PreemptionPolicy(signal="SIGKILL")), "preemption.signal 'SIGKILL'"),
        (spec(preemption=types_pb2.PreemptionPolicy(grace_s=-1)), "preemption.grace_s"),
        (spec(restart_backoff_s=4000), "restart_backoff_s"),
        (spec(time_limit_s=float("inf")), "time_limit_s"),
        (types_pb2.JobSpec(name="x", command=["true"], resources=types_pb2.Resources(
            nodes=1, gpus_per_node=0, accelerator="H100")), "CPU task"),
        (types_pb2.JobSpec(name="x", command=["true"], resources=types_pb2.Resources(
            nodes=1, gpus_per_node=1, min_compute_capability="nine")), "resources.min_compute_capability"),
    ]
    for bad, fragment in cases:
        await expect_error(submit(api, bad), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    assert (await api.store.range(api.keys.jobs)).kvs == []
    await submit(api, spec(priority_class="urgent"))  # the classes given to the servicer, not the built-in ones
