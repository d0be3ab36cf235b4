"""Traces (OpenTelemetry, propagated across gRPC calls) and metrics (Prometheus exposition).

A trace follows one request across the services: the gateway opens it (http_tracing.py, the caller's W3C
`traceparent` or a fresh trace id), the gRPC instrumentation carries its context to the scheduler, the agents
and the checkpoint-store, and the scheduler keeps the submit's context on the job record (`traceparent()`),
so the later cycle's decision, commit, launch and stop of the job are spans of the same trace (`continued`,
`record_span`). Every JSON log line written inside a span names its trace (logs.py); every other line names
the process's own trace, a `<service>.process` span from start to stop (`begin_process`).

`trace_exporter` says where spans go: "none" (the default), "console" (stderr, one JSON object per span),
"otlp" (an OpenTelemetry collector's OTLP/gRPC receiver at `otlp_endpoint`) or a file path (JSON lines). With
"none" no span is recorded (the sampler drops every one: nothing would read them, and building them cost the
gateway a fifth of a request's CPU, bench/gateway); trace ids are still made and propagated, so a request and
a job keep one trace id across the services and in their log lines. With an exporter, a span is recorded
unless the caller's trace context says it was not sampled (the SDK's default, parent-based).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, DEFAULT_ON
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from . import logs
from .settings import TRACES_OFF, BaseSettings

log = logging.getLogger(__name__)

CONSOLE = "console"
OTLP = "otlp"
# The collector's OTLP/gRPC port when otlp_endpoint names none.
OTLP_DEFAULT_PORT = 4317

# Span attributes that name Trainyard's own objects, the same in every service's spans.
JOB_ID = "trainyard.job_id"
ATTEMPT = "trainyard.attempt"
NODE_ID = "trainyard.node_id"
NODE_IDS = "trainyard.node_ids"
# A span's attributes, as the services build them.
SpanAttributes = dict[str, AttributeValue]

_W3C = TraceContextTextMapPropagator()
_configured = False
_recording = False


def exporting(exporter: str) -> bool:
    """Whether the `trace_exporter` setting sends spans anywhere ("none" and "" do not)."""
    return exporter not in TRACES_OFF


def recording() -> bool:
    """Whether this process records spans (tracing set up with an exporter): work that builds a span only to
    be exported (e.g. the scheduler's decision spans) is skipped when it does not."""
    return _recording


def otlp_endpoint_problem(endpoint: str) -> str:
    """Why `endpoint` cannot be the OTLP/gRPC collector address ("" when it can): http://HOST[:PORT] or
    https://HOST[:PORT], nothing else (gRPC has no path)."""
    try:
        url = urlsplit(endpoint)
        port = url.port
    except ValueError as exc:
        return f"otlp_endpoint {endpoint!r} is no URL: {exc}"
    if url.scheme not in ("http", "https") or not url.hostname:
        return (f"otlp_endpoint must be http://HOST:PORT or https://HOST:PORT (the collector's OTLP/gRPC receiver, "
                f"usually port {OTLP_DEFAULT_PORT}), got {endpoint!r}")
    if url.username is not None or url.path not in ("", "/") or url.query or url.fragment:
        return (f"otlp_endpoint {endpoint!r}: give the scheme, host and port only (OTLP over gRPC has no path, "
                "query or credentials in its address)")
    if port == 0:
        return f"otlp_endpoint {endpoint!r}: port 0 is no collector's port"
    return ""


def trace_export_problem(settings: BaseSettings) -> str:
    """Why the trace_exporter, otlp_endpoint and otlp_ca_file settings cannot work together ("" when they can)."""
    exporter = settings.trace_exporter
    if exporter == OTLP:
        if not settings.otlp_endpoint:
            return ("trace_exporter=otlp needs otlp_endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT), the collector's "
                    f"OTLP/gRPC receiver, e.g. http://otel-collector:{OTLP_DEFAULT_PORT}")
        problem = otlp_endpoint_problem(settings.otlp_endpoint)
        if problem:
            return problem
        if settings.otlp_ca_file:
            if urlsplit(settings.otlp_endpoint).scheme != "https":
                return (f"otlp_ca_file is for an https otlp_endpoint; {settings.otlp_endpoint} is plaintext: use "
                        "https:// or drop otlp_ca_file")
            if not Path(settings.otlp_ca_file).is_file() or not os.access(settings.otlp_ca_file, os.R_OK):
                return f"otlp_ca_file {settings.otlp_ca_file}: no such file, or not readable by this service"
        return ""
    if exporting(exporter) and exporter != CONSOLE:
        path = Path(exporter)
        if path.is_dir():
            return f"trace_exporter {exporter} is a directory; name a file to append spans to"
        if not path.parent.is_dir():
            return (f"trace_exporter {exporter}: directory {path.parent} does not exist (trace_exporter is none, "
                    "console, otlp or a file path)")
        if not os.access(path if path.exists() else path.parent, os.W_OK):
            return f"trace_exporter {exporter}: this service may not write there"
    return ""


class MemorySpans(SpanExporter):
    """The newest `limit` finished spans, kept in memory: the exporter for tests (`tracer_provider(...,
    memory=...)`). Thread-safe; `export` never blocks on a reader."""

    def __init__(self, limit: int = 10_000) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: int) -> list[ReadableSpan]:
        """The spans of one trace, in the order they ended."""
        return [s for s in self.spans() if s.context is not None and s.context.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()


def _json_line(span: ReadableSpan) -> str:
    return str(span.to_json(indent=None)) + "\n"


def _otlp_exporter(endpoint: str, ca_file: str) -> SpanExporter:
    # Imported here: a process that exports nowhere does not load the exporter and its protobuf types.
    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    url = urlsplit(endpoint)
    address = f"{url.hostname}:{url.port or OTLP_DEFAULT_PORT}"
    if url.scheme == "http":
        return OTLPSpanExporter(endpoint=address, insecure=True)
    credentials = None
    if ca_file:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
    # Without a CA file the system's roots verify the collector (or OTEL_EXPORTER_OTLP_CERTIFICATE's, which the
    # exporter reads).
    return OTLPSpanExporter(endpoint=address, insecure=False, credentials=credentials)


def tracer_provider(service: str, settings: BaseSettings, *, memory: MemorySpans | None = None) -> TracerProvider:
    """The provider `settings` (trace_exporter, otlp_endpoint, otlp_ca_file) ask for; `memory` also gets every
    recorded span (tests). It records spans only when they go somewhere."""
    exporter = settings.trace_exporter
    records = exporting(exporter) or memory is not None
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=DEFAULT_ON if records else ALWAYS_OFF)
    if exporter == CONSOLE:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr, formatter=_json_line)))
    elif exporter == OTLP:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(settings.otlp_endpoint, settings.otlp_ca_file)))
    elif exporting(exporter):
        out = open(exporter, "a")  # noqa: SIM115 - lives as long as the process
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=out, formatter=_json_line)))
    if memory is not None:
        provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider


def setup_tracing(service: str, settings: BaseSettings, *, memory: MemorySpans | None = None,
                  process: bool = False) -> None:
    """Install `tracer_provider(service, settings)` for the process and instrument grpc.aio servers and
    clients (they carry the trace context in each call's metadata). Once per process: a later call only opens
    the process's trace if it asks and none is open. `process`: a service's main, whose every log line names a
    trace from here on (`begin_process`)."""
    global _configured, _recording
    first = not _configured
    if first:
        _configured = True
        _recording = exporting(settings.trace_exporter) or memory is not None
        trace.set_tracer_provider(tracer_provider(service, settings, memory=memory))
        from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer

        GrpcAioInstrumentorServer().instrument()  # type: ignore[no-untyped-call]
        GrpcAioInstrumentorClient().instrument()  # type: ignore[no-untyped-call]
    if process and _process_span is None:
        begin_process(service)
    if first and _recording:
        log.info("tracing", extra={"trace_exporter": settings.trace_exporter,
                                   "otlp_endpoint": settings.otlp_endpoint if settings.trace_exporter == OTLP else ""})


_process_span: trace.Span | None = None


def begin_process(service: str, tracer_: trace.Tracer | None = None) -> trace.Span:
    """Open the process's own trace: a root span `<service>.process` that lasts until `end_process` (recorded
    then, when spans are exported), whose ids every log line outside a request's or a job's trace names
    (logs.set_process_trace). Not current in any context: the requests and jobs handled meanwhile keep their
    own traces. Call after setup_tracing, once per process (`tracer_`: tests')."""
    global _process_span
    tracer_ = tracer_ or trace.get_tracer(__name__)
    span = tracer_.start_span(f"{service}.process", context=otel_context.Context(),
                              attributes={"process.pid": os.getpid()})
    ctx = span.get_span_context()
    if ctx.is_valid:
        logs.set_process_trace(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    _process_span = span
    return span


def end_process() -> None:
    """End the process's span (`begin_process`); its exporter sends it when the provider shuts down at exit."""
    global _process_span
    if _process_span is not None:
        _process_span.end()
        _process_span = None
        logs.set_process_trace("", "")


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
    setup_tracing(service, settings)
    return {"metrics_port": start_metrics_server(settings.metrics_host, settings.metrics_port)}


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# --- a job's trace, kept on its record ---------------------------------------------------------------------

def traceparent() -> str:
    """The current span's context as a W3C traceparent ("" when there is none): what a record keeps so that
    work done for it later, in another task or process, joins the trace of the request that made it."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _parent(traceparent: str) -> otel_context.Context:
    """The context whose span is the one `traceparent` names; an empty one (a new trace) for "" or a
    malformed value, never the caller's current span."""
    if not traceparent:
        return otel_context.Context()
    return _W3C.extract({"traceparent": traceparent}, context=otel_context.Context())


def tag(attributes: Mapping[str, AttributeValue]) -> None:
    """Add attributes (a job id found while handling a call, say) to the current span, if it is recorded."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def trace_id_of(traceparent: str) -> str:
    """The trace id (32 hex digits) in a W3C traceparent, "" for "" or a malformed value. Cheap: log lines
    about a job name its trace with it on every cycle."""
    if len(traceparent) != 55 or traceparent[2] != "-" or traceparent[35] != "-":
        return ""
    trace_id = traceparent[3:35]
    try:
        return trace_id if int(trace_id, 16) else ""
    except ValueError:
        return ""


@contextlib.contextmanager
def continued(tracer_: trace.Tracer, name: str, traceparent: str,
              attributes: Mapping[str, AttributeValue] | None = None) -> Iterator[trace.Span]:
    """A span that is a child of the one `traceparent` names (a new trace for ""), current inside the block:
    its log lines and the gRPC calls made inside carry that trace. Without an exporter the span is not
    recorded but its trace id still is the record's."""
    with tracer_.start_as_current_span(name, context=_parent(traceparent), attributes=attributes) as span:
        yield span


def record_span(tracer_: trace.Tracer, name: str, traceparent: str, start_ns: int, end_ns: int,
                attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """A finished span for work already done (from `start_ns` to `end_ns`, time.time_ns()), child of the one
    `traceparent` names; nothing when this process records no spans."""
    if not _recording:
        return
    span = tracer_.start_span(name, context=_parent(traceparent), attributes=attributes, start_time=start_ns)
    span.end(end_time=max(end_ns, start_ns))


def now_ns() -> int:
    """The wall clock for span timestamps (time.time_ns), which OpenTelemetry expects."""
    return time.time_ns()
