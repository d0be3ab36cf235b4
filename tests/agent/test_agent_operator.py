"""SetGpuHealth: the operator's override, through a real channel to a real agent registered with the real
scheduler; validated, audited (JSON lines in the state dir and a structured log line), and seen by the
scheduler."""

from __future__ import annotations

import json
import logging
import os

import grpc
import grpc.aio
import pytest

from tests.agent.agent_kit import Scheduler
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.health.operator import AUDIT_FILE
from trainyard_core.testing.wait import eventually


def set_health(gpu: int, healthy: bool, operator: str = "alice", reason: str = "reseated, dcgmi diag passed"
               ) -> agent_pb2.SetGpuHealthRequest:
    return agent_pb2.SetGpuHealthRequest(gpu_index=gpu, healthy=healthy, operator=operator, reason=reason)


async def scheduler_gpu(scheduler: Scheduler, index: int, health: int) -> types_pb2.Gpu:
    async def probe() -> types_pb2.Gpu | None:
        node = await scheduler.node()
        gpu = node.gpus[index] if node is not None else None
        return gpu if gpu is not None and gpu.health == health else None

    return await eventually(probe, timeout=5.0, what=f"the scheduler to see GPU {index} "
                                                     f"{types_pb2.GpuHealth.Name(health)}")


def audit(agent: AgentApp) -> list[dict[str, object]]:
    path = agent.settings.state_dir + "/" + AUDIT_FILE
    try:
        with open(path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


async def test_repaired_gpu_is_marked_healthy_and_audited(agent: AgentApp, scheduler: Scheduler,
                                                          agent_stub: agent_pb2_grpc.AgentServiceStub,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    await scheduler.registered()
    await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=3, kind="xid", xid=79))
    bad = await scheduler_gpu(scheduler, 3, types_pb2.GPU_HEALTH_UNHEALTHY)
    assert bad.health_action == "reboot_host"

    caplog.set_level(logging.WARNING, logger="trainyard_agent.health.operator")
    answer = await agent_stub.SetGpuHealth(set_health(3, True))
    assert (answer.gpu.index, answer.gpu.health, answer.gpu.health_reason, answer.gpu.health_action) == (
        3, types_pb2.GPU_HEALTH_HEALTHY, "", "none")
    good = await scheduler_gpu(scheduler, 3, types_pb2.GPU_HEALTH_HEALTHY)
    assert good.health_action == "none" and good.health_reason == ""

    (record,) = audit(agent)
    assert {k: v for k, v in record.items() if k != "at"} == {
        "node_id": "node-a", "gpu": 3, "uuid": answer.gpu.uuid, "set": "healthy", "operator": "alice",
        "reason": "reseated, dcgmi diag passed",
        "previous": {"health": "unhealthy", "reason": "XID 79: GPU has fallen off the bus", "action": "reboot_host"}}
    assert isinstance(record["at"], float) and record["at"] > 1e9
    (line,) = [r for r in caplog.records if r.getMessage() == "GPU health set by an operator"]
    assert (line.operator, line.gpu, line.set) == ("alice", 3, "healthy")  # type: ignore[attr-defined]


async def test_an_operator_takes_a_gpu_out_of_service(agent: AgentApp, scheduler: Scheduler,
                                                      agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    await scheduler.registered()
    answer = await agent_stub.SetGpuHealth(set_health(6, False, "bob", "fan noise, RMA ticket 4711"))
    assert answer.gpu.health == types_pb2.GPU_HEALTH_UNHEALTHY
    gpu = await scheduler_gpu(scheduler, 6, types_pb2.GPU_HEALTH_UNHEALTHY)
    assert gpu.health_reason == "marked unhealthy by bob: fan noise, RMA ticket 4711"
    assert gpu.health_action == "reset_gpu"  # the GPU only: the node is not drained
    node = await scheduler.node()
    assert node is not None and not node.cordoned
    assert [r["set"] for r in audit(agent)] == ["unhealthy"]


@pytest.mark.parametrize("request_,code,message", [
    (set_health(8, True), grpc.StatusCode.NOT_FOUND, "GPU 8 does not exist on node node-a (it has GPUs 0-7)"),
    (set_health(-1, True), grpc.StatusCode.NOT_FOUND, "GPU -1 does not exist"),
    (set_health(0, True, operator="  "), grpc.StatusCode.INVALID_ARGUMENT, "operator is required"),
    (set_health(0, True, reason=""), grpc.StatusCode.INVALID_ARGUMENT, "reason is required"),
    (set_health(0, True, reason="two\nlines"), grpc.StatusCode.INVALID_ARGUMENT, "reason contains control characters"),
    (set_health(0, True, operator="x" * 200), grpc.StatusCode.INVALID_ARGUMENT,
     "operator is 200 characters long; at most 128"),
])
async def test_bad_overrides_are_refused_and_not_audited(agent: AgentApp, agent_stub: agent_pb2_grpc.AgentServiceStub,
                                                        request_: agent_pb2.SetGpuHealthRequest,
                                                        code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent_stub.SetGpuHealth(request_)
    assert info.value.code() == code and message in (info.value.details() or "")
    assert audit(agent) == []


async def test_an_override_that_cannot_be_audited_is_not_applied(
        agent: AgentApp, agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=1, kind="xid", xid=48))
    # The audit log's path is taken by a directory: appending fails.
    os.mkdir(f"{agent.settings.state_dir}/{AUDIT_FILE}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent_stub.SetGpuHealth(set_health(1, True))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot write the audit log" in (info.value.details() or "")
    assert agent.health is not None and agent.health.get(1).health.name == "UNHEALTHY"
