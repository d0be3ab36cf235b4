"""The gateway's trace per HTTP request (trainyard_gateway.http_tracing): with spans exported, a SERVER span
named after the route template that continues the caller's W3C trace; without (the default, as the real gateway
runs here), a trace id per request all the same, in the request's log lines."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from tests.gateway.support import RunningGateway, running_gateway
from trainyard_core import logs, telemetry
from trainyard_core.settings import BaseSettings
from trainyard_core.testing.etcd import free_port
from trainyard_gateway import http_tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CALLER_SPAN}-01"
HEX32 = re.compile(r"[0-9a-f]{32}")


# --- spans exported: the middleware on an app of its own --------------------------------------------------

def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/jobs/{job_id}")
    async def job(job_id: str) -> dict[str, str]:
        return {"id": job_id, "traceparent": telemetry.traceparent()}

    @app.get("/v1/nodes/{node_id}")
    async def node(node_id: str) -> JSONResponse:
        return JSONResponse({"error": "unavailable"}, status_code=503)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    return app


@pytest.fixture
async def traced() -> AsyncIterator[tuple[httpx.AsyncClient, telemetry.MemorySpans]]:
    memory = telemetry.MemorySpans()
    provider = telemetry.tracer_provider("gateway", BaseSettings(), memory=memory)
    app = _app()
    http_tracing.install(app, provider.get_tracer("tests"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client, memory


def _server_span(memory: telemetry.MemorySpans) -> ReadableSpan:
    [span] = [s for s in memory.spans() if s.kind is SpanKind.SERVER]
    return span


async def test_a_request_is_a_server_span_named_after_its_route_template(
        traced: tuple[httpx.AsyncClient, telemetry.MemorySpans]) -> None:
    client, memory = traced
    reply = await client.get("/v1/jobs/job-123")
    assert reply.status_code == 200
    span = _server_span(memory)
    assert span.name == "GET /v1/jobs/{job_id}"
    assert span.attributes is not None
    assert {k: span.attributes.get(k) for k in ("http.request.method", "http.route", "url.path",
                                                 "http.response.status_code", telemetry.JOB_ID)} == {
        "http.request.method": "GET", "http.route": "/v1/jobs/{job_id}", "url.path": "/v1/jobs/job-123",
        "http.response.status_code": 200, telemetry.JOB_ID: "job-123"}
    assert span.status.status_code is StatusCode.UNSET
    # What the handler's calls carry (the gRPC instrumentation sends the current context) is this span.
    assert span.context is not None
    assert reply.json()["traceparent"].startswith(f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-")


async def test_a_request_continues_the_callers_trace(traced: tuple[httpx.AsyncClient, telemetry.MemorySpans]) -> None:
    client, memory = traced
    await client.get("/v1/jobs/job-1", headers={"traceparent": TRACEPARENT})
    span = _server_span(memory)
    assert span.context is not None and span.parent is not None
    assert f"{span.context.trace_id:032x}" == TRACE and f"{span.parent.span_id:016x}" == CALLER_SPAN


async def test_server_errors_mark_the_span(traced: tuple[httpx.AsyncClient, telemetry.MemorySpans]) -> None:
    client, memory = traced
    assert (await client.get("/v1/nodes/node-1")).status_code == 503
    span = _server_span(memory)
    assert span.name == "GET /v1/nodes/{node_id}" and span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None and span.attributes[telemetry.NODE_ID] == "node-1"
    memory.clear()
    assert (await client.get("/boom")).status_code == 500
    span = _server_span(memory)
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


async def test_a_path_no_route_matches_never_names_the_span(
        traced: tuple[httpx.AsyncClient, telemetry.MemorySpans]) -> None:
    """The raw path would make a name per id (and per probe of a scanner)."""
    client, memory = traced
    assert (await client.get("/v1/nothing/here-1")).status_code == 404
    span = _server_span(memory)
    assert span.name == "GET" and span.attributes is not None and "http.route" not in span.attributes


# --- no exporter: the real gateway as it runs by default ---------------------------------------------------

class AccessLines(logging.Handler):
    """The gateway's access log lines, as the real JSON formatter writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logs.JsonFormatter("gateway"))
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def access_lines() -> Iterator[AccessLines]:
    handler = AccessLines()
    logger = logging.getLogger("trainyard_gateway")  # the access log's logger is below it
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture
async def gateway(etcd_settings: dict[str, str], key_prefix: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}") as gw:
        assert gw.app.settings.trace_exporter == "none"
        yield gw


async def test_without_an_exporter_each_request_still_has_a_trace_id_in_its_log_line(
        gateway: RunningGateway, access_lines: AccessLines) -> None:
    async with gateway.client() as http:
        # No scheduler behind it: /healthz answers 503, which is as good a request as any here.
        for _ in range(2):
            await http.get("/healthz")
        await http.get("/healthz", headers={"traceparent": TRACEPARENT})
    lines = [line for line in access_lines.lines if line["msg"].startswith("GET /healthz ")]
    assert len(lines) == 3
    first, second, continued = lines
    assert HEX32.fullmatch(first["trace_id"]) and HEX32.fullmatch(second["trace_id"])
    assert first["trace_id"] != second["trace_id"]
    # The caller's trace, with a span id of the gateway's own.
    assert continued["trace_id"] == TRACE and continued["span_id"] != CALLER_SPAN
