"""Error mapping: domain errors raised by the scheduler travel as gRPC status codes and come out as the
documented HTTP status with the one error body; unexpected failures are a generic 500. Through the wire
against the real scheduler for the errors it raises on the gateway's routes (unknown job, a job id it
refuses, a job bigger than the fleet, the scheduler gone); the rest of the table without a wire."""

from __future__ import annotations

import json
import logging

import grpc.aio
import pytest

from trainyard_core import errors
from trainyard_core.rpc.errors import from_rpc_error
from trainyard_core.rpc.errors import status_for as rpc_status_for
from trainyard_core.testing.wait import eventually
from trainyard_gateway.http_errors import domain_error_response, status_for

from .support import Cluster, RunningGateway

CASES = [
    (errors.InvalidArgument("resources.gpus_per_node: 64 is more than any node has (8)"), 400, "invalid_argument"),
    (errors.FailedPrecondition("queue 'big' is closed"), 409, "failed_precondition"),
    (errors.Unauthenticated("who are you"), 401, "unauthenticated"),
    (errors.PermissionDenied("not your team's queue"), 403, "permission_denied"),
    (errors.NotFound("job job-gone not found"), 404, "not_found"),
    (errors.AlreadyExists("job already exists"), 409, "already_exists"),
    (errors.Conflict("concurrent update; retry"), 409, "conflict"),
    (errors.ResourceExhausted("team quota of 64 GPUs reached"), 429, "resource_exhausted"),
    (errors.Unavailable("etcd is unavailable"), 503, "unavailable"),
    (errors.NotLeader("not the leader", leader="10.0.0.2:50051"), 503, "unavailable"),
]


@pytest.mark.parametrize(("error", "status", "code"), CASES)
def test_status_table(error: errors.TrainyardError, status: int, code: str) -> None:
    assert status_for(error) == (status, code)


def test_unknown_domain_error_is_internal() -> None:
    assert status_for(errors.TrainyardError("?")) == (500, "internal")


@pytest.mark.parametrize(("error", "status", "code"), CASES)
def test_every_scheduler_status_becomes_the_documented_answer(error: errors.TrainyardError, status: int,
                                                              code: str) -> None:
    """The status code the scheduler's interceptor sends for each domain error, turned back into an error
    the way the gateway's clients do (`from_rpc_error`) and answered by the gateway's one handler. The
    real scheduler never raises most of these on the routes the gateway calls (see the tests below for
    those it does), so the mapping is checked here, without a wire."""
    rpc = grpc.aio.AioRpcError(rpc_status_for(error), grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details=error.message)
    reply = domain_error_response(from_rpc_error(rpc, "scheduler"))
    assert reply.status_code == status
    body = json.loads(bytes(reply.body))
    assert body["error"]["code"] == code
    assert error.message in body["error"]["message"]
    if status == 401:
        assert reply.headers["www-authenticate"].startswith("Bearer")
    if status == 503:
        assert reply.headers["retry-after"] == "1"


@pytest.mark.parametrize(("path", "method", "status", "code", "message"), [
    ("/v1/jobs/job-gone", "GetJob", 404, "not_found", "job job-gone not found"),
])
async def test_scheduler_errors_through_grpc(live_gateway: RunningGateway, scheduler: Cluster, path: str,
                                             method: str, status: int, code: str, message: str) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.get(path)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["code"] == code
    assert message in reply.json()["error"]["message"]
    assert scheduler.calls.methods == [method]  # the scheduler's answer, not the gateway's own check


async def test_submit_refused_by_the_scheduler(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x8")
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", json={"name": "too-big", "command": ["true"],
                                                  "resources": {"nodes": 1, "gpus_per_node": 64}})
    # A valid spec (the schema allows 64) this fleet cannot run: 409, never the 400 of a broken request.
    assert reply.status_code == 409
    assert reply.json()["error"]["code"] == "failed_precondition"
    message = reply.json()["error"]["message"]
    assert "gpus_per_node" in message and "more than any node has (the largest has 8 GPUs)" in message
    # One call, the gateway's batch of one; the item's failure answered as SubmitJob's would have been.
    assert scheduler.calls.methods == ["SubmitJobs"]


async def test_unreachable_scheduler_is_503(gateway: RunningGateway) -> None:
    async with gateway.client(gateway.admin_token) as http:
        reply = await http.get("/v1/jobs")
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "unavailable"
    assert "scheduler" in reply.json()["error"]["message"]


async def test_stopped_scheduler_is_503(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    async with live_gateway.client(live_gateway.admin_token) as http:
        assert (await http.get("/v1/jobs")).status_code == 200
        await scheduler.stop_scheduler()
        # The job view answers lists until it sees its stream from the scheduler end (just after the stop),
        # with what was true until then; from then on the read goes to the scheduler.
        assert live_gateway.app.app is not None
        view = live_gateway.app.app.state.deps.job_view

        async def view_lost_its_stream() -> bool:
            return view is None or not view.ready

        await eventually(view_lost_its_stream, what="the job view to see the scheduler's stream end")
        reply = await http.get("/v1/jobs")
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "unavailable"
    assert "scheduler is unavailable" in reply.json()["error"]["message"]
    assert reply.headers["retry-after"] == "1"


async def test_unexpected_exception_is_a_generic_500(gateway: RunningGateway,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    assert gateway.app.app is not None

    async def boom() -> None:
        raise RuntimeError("internal detail that must not leak")

    gateway.app.app.add_api_route("/boom", boom)
    caplog.set_level(logging.INFO)
    async with gateway.client() as http:
        reply = await http.get("/boom")
    assert reply.status_code == 500
    assert reply.json() == {"error": {"code": "internal", "message": "internal error; see the gateway log"}}
    tracebacks = [r for r in caplog.records if r.exc_info and "must not leak" in str(r.exc_info[1])]
    assert len(tracebacks) == 1


async def test_unknown_routes_and_methods_use_the_error_body(gateway: RunningGateway) -> None:
    async with gateway.client(gateway.admin_token) as http:
        missing = await http.get("/v2/whatever")
        wrong_method = await http.delete("/v1/jobs")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
