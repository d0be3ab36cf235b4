"""The trace of each HTTP request: the outermost middleware, so the access log line, the audit entry and every
gRPC call the request makes (to the scheduler, the agents, the checkpoint-store) happen inside it.

A request continues the caller's trace when it sends a W3C `traceparent` header, and starts one otherwise.
With spans exported (`install(app, tracer)`), the request is a SERVER span named `<METHOD> <route template>`
(`POST /v1/jobs`, `GET /v1/jobs/{job_id}`: never the raw path, whose ids would make every name unique) with
the HTTP semantic-convention attributes and the job or node id of the path. Without (`tracer` None, the
default), no span is built at all: the request only gets a trace context (the caller's trace id or a fresh
one, a span id of its own), which is what the log lines and the gRPC calls need to carry one trace id through
every service, at the cost of two random numbers (a recorded span per request cost a fifth of a read's CPU,
bench/gateway).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainyard_core import telemetry

# Path parameters worth an attribute: which job or node a request is about.
_PATH_ATTRIBUTES = {"job_id": telemetry.JOB_ID, "node_id": telemetry.NODE_ID}


_W3C = TraceContextTextMapPropagator()
_W3C_HEADERS = (b"traceparent", b"tracestate")
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_EMPTY = otel_context.Context()


def _caller(headers: Iterable[tuple[bytes, bytes]]) -> otel_context.Context:
    """The caller's trace context from its W3C headers, or an empty context. One pass over the (lower-case)
    header list, and the parser only when the caller sent one: most callers send none."""
    sent = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in _W3C_HEADERS}
    return _W3C.extract(sent, context=_EMPTY) if sent else _EMPTY


def _random_bits(bits: int) -> int:
    value = 0
    while not value:  # zero is the invalid id
        value = random.getrandbits(bits)
    return value


class HttpTracing:
    """Pure ASGI (no BaseHTTPMiddleware: it would copy each request into a task of its own)."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer | None = None) -> None:
        self.app = app
        self._tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parent = _caller(scope["headers"])
        if self._tracer is None:
            await self._untraced(parent, scope, receive, send)
        else:
            await self._traced(self._tracer, parent, scope, receive, send)

    async def _untraced(self, parent: otel_context.Context, scope: Scope, receive: Receive, send: Send) -> None:
        caller = trace.get_current_span(parent).get_span_context()
        if caller.is_valid:
            ids = SpanContext(caller.trace_id, _random_bits(64), False, caller.trace_flags, caller.trace_state)
        else:
            ids = SpanContext(_random_bits(128), _random_bits(64), False, _NOT_SAMPLED)
        token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(ids), parent))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)

    async def _traced(self, tracer: trace.Tracer, parent: otel_context.Context, scope: Scope, receive: Receive,
                      send: Send) -> None:
        method = scope.get("method", "")
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": scope.get("path", ""),
                                      "url.scheme": scope.get("scheme", "http")}
        if scope.get("http_version"):
            attributes["network.protocol.version"] = scope["http_version"]
        client = scope.get("client")
        if client:
            attributes["client.address"] = client[0]
        span = tracer.start_span(method or "HTTP", context=parent, kind=SpanKind.SERVER, attributes=attributes)
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            try:
                await self.app(scope, receive, send_status)
            finally:
                _finish(span, scope, method, status)


def _finish(span: trace.Span, scope: Scope, method: str, status: int) -> None:
    """Name the span after the route the router matched (it sets `scope["route"]`), and record the outcome."""
    template = getattr(scope.get("route"), "path", None)
    if isinstance(template, str):
        span.update_name(f"{method} {template}")
        span.set_attribute("http.route", template)
    for param, attribute in _PATH_ATTRIBUTES.items():
        value = (scope.get("path_params") or {}).get(param)
        if isinstance(value, str) and value:
            span.set_attribute(attribute, value)
    if status:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(StatusCode.ERROR, f"HTTP {status}")


def install(app: FastAPI, tracer: trace.Tracer | None) -> None:
    """Outermost: call after every other `add_middleware`. `tracer`: record a span per request with it (spans are
    exported), or None for the trace context alone."""
    app.add_middleware(HttpTracing, tracer=tracer)
