"""Every gRPC server's per-RPC metrics (trainyard_core.rpc.metrics), on servers built by the shared bootstrap as
the services build theirs: the status counted is the one the caller got, for unary and streaming calls alike,
domain errors and authorization refusals included, and the exposition is what Prometheus parses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core import telemetry
from trainyard_core.errors import NotFound
from trainyard_core.rpc.metrics import split_method
from trainyard_core.rpc.server import GrpcServer, insecure_channel, secure_channel, start_grpc_server
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.metrics import Scrape, scrape
from trainyard_core.testing.wait import eventually

AGENT = "trainyard.agent.v1.AgentService"
HEALTH = "grpc.health.v1.Health"


class Servicer(agent_pb2_grpc.AgentServiceServicer):
    """Answers, fails with a domain error, crashes, streams, or streams until the caller goes away."""

    def __init__(self) -> None:
        self.streaming = asyncio.Event()

    async def GetWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest, context: Any) -> Any:
        return agent_pb2.GetWorkerLogsResponse(lines=[agent_pb2.LogLine(rank=0, text="hello")])

    async def LaunchWorkers(self, request: agent_pb2.LaunchWorkersRequest, context: Any) -> Any:
        raise NotFound(f"job {request.job_id} not found")

    async def StopWorkers(self, request: agent_pb2.StopWorkersRequest, context: Any) -> Any:
        raise RuntimeError("a bug")

    async def StreamWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest, context: Any) -> AsyncIterator[Any]:
        for n in range(2):
            yield agent_pb2.LogChunk(lines=[agent_pb2.LogLine(rank=0, text=f"line {n}")])
        if request.job_id == "forever":
            self.streaming.set()
            await asyncio.Event().wait()


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The process's /metrics, served as a service serves it (`telemetry.start_metrics_server`)."""
    port = telemetry.start_metrics_server("127.0.0.1", 0)
    assert port is not None
    return port


async def _serve(servicer: Servicer, **kwargs: Any) -> GrpcServer:
    return await start_grpc_server(
        host="127.0.0.1", port=0, service_names=[AGENT],
        register=lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server), **kwargs)


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


def test_method_names_split_into_service_and_method() -> None:
    assert split_method("/trainyard.scheduler.v1.JobService/SubmitJob") == ("trainyard.scheduler.v1.JobService",
                                                                            "SubmitJob")
    assert split_method("odd") == ("unknown", "odd")


async def test_each_call_counts_under_its_type_method_and_the_code_the_caller_got(metrics_port: int) -> None:
    servicer = Servicer()
    server = await _serve(servicer)
    before = await scrape("127.0.0.1", metrics_port)
    try:
        async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
            agent = agent_pb2_grpc.AgentServiceStub(channel)
            assert (await agent.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="j-1"))).lines[0].text == "hello"
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await agent.LaunchWorkers(agent_pb2.LaunchWorkersRequest(job_id="j-2"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as crashed:
                await agent.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j-3"))
            assert crashed.value.code() == grpc.StatusCode.INTERNAL
            chunks = [c async for c in agent.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="j-4"))]
            assert len(chunks) == 2
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=AGENT))

            # A stream its caller cancels: counted when the server's handler ends, as Canceled.
            call = agent.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="forever"))
            await call.read()
            await servicer.streaming.wait()
            call.cancel()

            async def cancelled_counted() -> bool:
                now = await scrape("127.0.0.1", metrics_port)
                return _delta(before, now, "grpc_server_handled_total", grpc_method="StreamWorkerLogs",
                              grpc_code="Canceled") == 1

            await eventually(cancelled_counted, what="the cancelled stream to be counted")
    finally:
        await server.stop(0)
    after = await scrape("127.0.0.1", metrics_port)
    assert after.types["grpc_server_handled"] == "counter"
    assert after.types["grpc_server_handling_seconds"] == "histogram"

    def handled(kind: str, method: str, code: str, service: str = AGENT) -> float:
        return _delta(before, after, "grpc_server_handled_total", grpc_type=kind, grpc_service=service,
                      grpc_method=method, grpc_code=code)

    assert handled("unary", "GetWorkerLogs", "OK") == 1
    assert handled("unary", "LaunchWorkers", "NotFound") == 1  # the domain error as the mapping sent it
    assert handled("unary", "StopWorkers", "Internal") == 1  # an unexpected exception: INTERNAL, as sent
    assert handled("server_stream", "StreamWorkerLogs", "OK") == 1
    assert handled("server_stream", "StreamWorkerLogs", "Canceled") == 1
    assert handled("unary", "Check", "OK", HEALTH) == 1
    assert _delta(before, after, "grpc_server_started_total", grpc_type="server_stream",
                  grpc_method="StreamWorkerLogs") == 2
    # One histogram observation per handled call, under the same labels.
    for method, code in (("GetWorkerLogs", "OK"), ("LaunchWorkers", "NotFound"), ("StreamWorkerLogs", "Canceled")):
        assert _delta(before, after, "grpc_server_handling_seconds_count", grpc_method=method, grpc_code=code) == 1
        assert _delta(before, after, "grpc_server_handling_seconds_bucket", grpc_method=method, grpc_code=code,
                      le="+Inf") == 1
    assert after.label_values("grpc_server_handled_total", "grpc_code") <= {
        "OK", "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
        "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
        "Internal", "Unavailable", "DataLoss", "Unauthenticated"}


async def test_a_call_refused_by_authorization_counts_as_permission_denied(metrics_port: int,
                                                                           pki_dir: Path) -> None:
    """mTLS on, as the services run: a tool may read logs but not launch workers (only the scheduler may)."""
    node = identity.node("node-1")
    server = await _serve(Servicer(), tls=pki.files_for(pki_dir, node))
    before = await scrape("127.0.0.1", metrics_port)
    try:
        async with secure_channel(f"127.0.0.1:{server.port}", ClientTls(pki.files_for(pki_dir, identity.tool("ops"))),
                                  node) as channel:
            agent = agent_pb2_grpc.AgentServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent.LaunchWorkers(agent_pb2.LaunchWorkersRequest(job_id="j-1"))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await agent.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="j-1"))
    finally:
        await server.stop(0)
    after = await scrape("127.0.0.1", metrics_port)
    assert _delta(before, after, "grpc_server_handled_total", grpc_type="unary", grpc_service=AGENT,
                  grpc_method="LaunchWorkers", grpc_code="PermissionDenied") == 1
    assert _delta(before, after, "grpc_server_handled_total", grpc_method="LaunchWorkers", grpc_code="NotFound") == 0
    assert _delta(before, after, "grpc_server_handled_total", grpc_method="GetWorkerLogs", grpc_code="OK") == 1


async def test_a_method_the_server_does_not_have_is_not_counted(metrics_port: int) -> None:
    """Its name comes from the caller: counting it would let anyone add series."""
    server = await _serve(Servicer())
    before = await scrape("127.0.0.1", metrics_port)
    try:
        async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary("/no.Such/Method" + "x" * 10, request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await call(b"")
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)
    after = await scrape("127.0.0.1", metrics_port)
    assert _delta(before, after, "grpc_server_started_total") == 0
    assert "no.Such" not in after.label_values("grpc_server_started_total", "grpc_service")
