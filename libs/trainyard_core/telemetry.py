"""Traces (OpenTelemetry, propagated across gRPC calls) and metrics (Prometheus exposition)."""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, DEFAULT_ON

from .settings import BaseSettings

log = logging.getLogger(__name__)
_configured = False


def exporting(exporter: str) -> bool:
    """Whether the `trace_exporter` setting sends spans anywhere ("none" and "" do not)."""
    return exporter not in ("", "none")


def setup_tracing(service: str, exporter: str) -> None:
    """Install a tracer provider and instrument grpc.aio servers and clients.

    `exporter`: "none", "console", or a file path (JSON lines). With "none" no span is recorded (the sampler
    drops every one: nothing would read them, and building them cost the gateway a fifth of a request's CPU,
    bench/gateway); trace ids are still made and propagated to the services called, so a request keeps one
    trace id across them. With an exporter, a span is recorded unless the caller's trace context says it
    was not sampled (the SDK's default, parent-based).
    """
    global _configured
    if _configured:
        return
    _configured = True
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=DEFAULT_ON if exporting(exporter) else ALWAYS_OFF)
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporting(exporter):
        out = open(exporter, "a")  # noqa: SIM115 - lives as long as the process
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer

    GrpcAioInstrumentorServer().instrument()  # type: ignore[no-untyped-call]
    GrpcAioInstrumentorClient().instrument()  # type: ignore[no-untyped-call]


def start_metrics_server(host: str, port: int) -> int | None:
    """Serve Prometheus /metrics on a background thread; returns the bound port (None when off)."""
    if port < 0:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    bound = int(server.server_address[1])
    log.info("metrics endpoint listening", extra={"metrics_url": f"http://{host}:{bound}/metrics"})
    return bound


def setup(service: str, settings: BaseSettings) -> dict[str, Any]:
    setup_tracing(service, settings.trace_exporter)
    return {"metrics_port": start_metrics_server(settings.metrics_host, settings.metrics_port)}


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
