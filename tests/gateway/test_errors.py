"""Error mapping: domain errors raised by the scheduler travel as gRPC status codes and come out as the
documented HTTP status with the one error body; unexpected failures are a generic 500."""

from __future__ import annotations

import logging

import pytest

from trainyard_core import errors
from trainyard_gateway.http_errors import status_for
from trainyard_gateway.testing import RunningGateway, StubScheduler

CASES = [
    (errors.InvalidArgument("resources.gpus_per_node: 64 is more than any node has (8)"), 400, "invalid_argument"),
    (errors.FailedPrecondition("queue 'big' is closed"), 400, "failed_precondition"),
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
async def test_scheduler_errors_through_grpc(stub_gateway: RunningGateway, stub_scheduler: StubScheduler,
                                             error: errors.TrainyardError, status: int, code: str) -> None:
    stub_scheduler.fail["job-failing"] = error
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        reply = await http.get("/v1/jobs/job-failing")
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["error"]["code"] == code
    assert error.message in body["error"]["message"]
    if status == 401:
        assert reply.headers["www-authenticate"].startswith("Bearer")
    if status == 503:
        assert reply.headers["retry-after"] == "1"


async def test_submit_refused_by_the_scheduler(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    stub_scheduler.fail["too-big"] = errors.InvalidArgument(
        "resources.gpus_per_node: no node has 64 GPUs (largest: 8)")
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        reply = await http.post("/v1/jobs", json={"name": "too-big", "command": ["true"],
                                                  "resources": {"nodes": 1, "gpus_per_node": 64}})
    assert reply.status_code == 400
    assert "gpus_per_node" in reply.json()["error"]["message"]


async def test_unreachable_scheduler_is_503(gateway: RunningGateway) -> None:
    async with gateway.client(gateway.admin_token) as http:
        reply = await http.get("/v1/jobs")
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "unavailable"
    assert "scheduler" in reply.json()["error"]["message"]


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
