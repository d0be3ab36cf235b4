"""Traces (trainyard_core.telemetry) and the trace ids in the log lines (trainyard_core.logs): every JSON line
written inside a span names the trace and the span, exported or not; the OTLP settings are checked at start-up
with a message that says what to write; spans reach an OTLP/gRPC collector, a file and the in-memory exporter;
a record's traceparent carries its trace into work done later."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from tests.scheduler.builders import make_job
from trainyard_agent.settings import AgentSettings
from trainyard_core import logs, telemetry
from trainyard_core.settings import BaseSettings, SettingsError, load_settings
from trainyard_core.testing.etcd import free_port
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state import codec

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
SPAN = 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE:032x}-{SPAN:016x}-01"


class Lines(logging.Handler):
    """Each record as the real formatter writes it."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def json_lines() -> Iterator[Lines]:
    handler = Lines(logs.JsonFormatter("tests"))
    logger = logging.getLogger("tests.telemetry")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _last(handler: Lines) -> dict[str, Any]:
    line: dict[str, Any] = json.loads(handler.lines[-1])
    return line


def _provider(settings: BaseSettings | None = None,
              memory: telemetry.MemorySpans | None = None) -> TracerProvider:
    return telemetry.tracer_provider("tests", settings or BaseSettings(), memory=memory)


# --- the trace id in every log line -------------------------------------------------------------------------

def test_a_line_outside_any_span_has_no_trace_fields(json_lines: Lines) -> None:
    logging.getLogger("tests.telemetry").info("no span")
    line = _last(json_lines)
    assert "trace_id" not in line and "span_id" not in line


def test_a_line_outside_any_span_and_job_names_the_process_trace_until_the_process_ends(json_lines: Lines) -> None:
    """A service's main opens the process's trace: lines of no request and no job (start-up, election, a
    background loop) name it; a job's trace and a span's still win; the span is recorded when it ends."""
    memory = telemetry.MemorySpans()
    log = logging.getLogger("tests.telemetry")
    span = telemetry.begin_process("tests", _provider(memory=memory).get_tracer("tests"))
    ctx = span.get_span_context()
    try:
        log.info("starting")
        assert (_last(json_lines)["trace_id"], _last(json_lines)["span_id"]) == (f"{ctx.trace_id:032x}",
                                                                                 f"{ctx.span_id:016x}")
        with logs.log_context(job_id="job-1", trace_id="f" * 32):
            log.info("cycle")
            assert _last(json_lines)["trace_id"] == "f" * 32 and "span_id" not in _last(json_lines)
        with trace.use_span(NonRecordingSpan(SpanContext(TRACE, SPAN, is_remote=False))):
            log.info("request")
        assert _last(json_lines)["trace_id"] == f"{TRACE:032x}"
        assert memory.spans() == []
    finally:
        telemetry.end_process()
    [ended] = memory.spans()
    assert ended.name == "tests.process" and ended.context is not None and ended.context.trace_id == ctx.trace_id
    assert ended.parent is None
    log.info("after")
    assert "trace_id" not in _last(json_lines)


def test_a_line_inside_a_span_that_is_not_sampled_names_its_trace_and_span(json_lines: Lines) -> None:
    """Without an exporter no span is recorded, yet the ids propagate: the line must name them."""
    unsampled = NonRecordingSpan(SpanContext(TRACE, SPAN, is_remote=False, trace_flags=TraceFlags(0)))
    with trace.use_span(unsampled):
        logging.getLogger("tests.telemetry").info("inside", extra={"job_id": "job-1"})
    line = _last(json_lines)
    assert line["trace_id"] == f"{TRACE:032x}" and line["span_id"] == f"{SPAN:016x}"
    assert line["job_id"] == "job-1" and line["msg"] == "inside"


def test_a_line_inside_a_recorded_span_names_it(json_lines: Lines) -> None:
    provider = _provider(memory=telemetry.MemorySpans())
    with provider.get_tracer("tests").start_as_current_span("work") as span:
        logging.getLogger("tests.telemetry").info("recorded")
    ctx = span.get_span_context()
    line = _last(json_lines)
    assert line["trace_id"] == f"{ctx.trace_id:032x}" and line["span_id"] == f"{ctx.span_id:016x}"


def test_the_job_trace_of_the_log_context_stands_outside_a_span_and_yields_to_one(json_lines: Lines) -> None:
    """The scheduler's cycle binds a job's trace id while it works on the job; inside a span, the span's ids."""
    log = logging.getLogger("tests.telemetry")
    with logs.log_context(job_id="job-1", trace_id="f" * 32):
        log.info("cycle")
        assert _last(json_lines)["trace_id"] == "f" * 32
        with trace.use_span(NonRecordingSpan(SpanContext(TRACE, SPAN, is_remote=False))):
            log.info("span")
        assert _last(json_lines)["trace_id"] == f"{TRACE:032x}"


def test_text_lines_name_the_trace_too() -> None:
    handler = Lines(logs.TextFormatter("tests"))
    logger = logging.getLogger("tests.telemetry.text")
    logger.addHandler(handler)
    try:
        with trace.use_span(NonRecordingSpan(SpanContext(TRACE, SPAN, is_remote=False))):
            logger.info("inside")
    finally:
        logger.removeHandler(handler)
    assert handler.lines[-1].endswith(f"inside trace_id={TRACE:032x}")


# --- settings: trace_exporter, otlp_endpoint, OTEL_EXPORTER_OTLP_ENDPOINT -----------------------------------

def _scheduler(argv: list[str] | None = None, **env: str) -> SchedulerSettings:
    return load_settings(SchedulerSettings, prog="trainyard-scheduler", argv=argv or [], env=env)


def test_spans_are_off_by_default() -> None:
    s = _scheduler()
    assert s.trace_exporter == "none" and not telemetry.exporting(s.trace_exporter)


def test_otlp_needs_an_endpoint() -> None:
    with pytest.raises(SettingsError, match=r"trace_exporter=otlp needs otlp_endpoint \(or "
                                            r"OTEL_EXPORTER_OTLP_ENDPOINT\)"):
        _scheduler(TRAINYARD_SCHEDULER_TRACE_EXPORTER="otlp")


@pytest.mark.parametrize(("endpoint", "says"), [
    ("collector:4317", "must be http://HOST:PORT or https://HOST:PORT"),
    ("grpc://collector:4317", "must be http://HOST:PORT or https://HOST:PORT"),
    ("http://", "must be http://HOST:PORT or https://HOST:PORT"),
    ("http://collector:70000", "is no URL"),
    ("http://collector:port", "is no URL"),
    ("http://collector:4318/v1/traces", "OTLP over gRPC has no path"),
    ("https://user:secret@collector:4317", "OTLP over gRPC has no path, query or credentials"),
    ("http://collector:0", "port 0"),
])
def test_a_bad_endpoint_is_a_settings_error_that_says_what_to_write(endpoint: str, says: str) -> None:
    with pytest.raises(SettingsError) as err:
        _scheduler(["--trace-exporter", "otlp", "--otlp-endpoint", endpoint])
    assert says in err.value.message and "otlp_endpoint" in err.value.message


def test_the_standard_variables_give_the_endpoint_below_the_services_own_settings(tmp_path: Path) -> None:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4317", "TRAINYARD_SCHEDULER_TRACE_EXPORTER": "otlp"}
    assert _scheduler(**otel).otlp_endpoint == "http://generic:4317"
    # The signal's own variable wins over the generic one, as OpenTelemetry's SDKs read them.
    assert _scheduler(**otel, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="https://traces:4317").otlp_endpoint == \
        "https://traces:4317"
    config = tmp_path / "scheduler.yaml"
    config.write_text("otlp_endpoint: http://from-file:4317\n")
    assert _scheduler(["--config", str(config)], **otel).otlp_endpoint == "http://from-file:4317"
    assert _scheduler(**otel, TRAINYARD_SCHEDULER_OTLP_ENDPOINT="http://own:4317").otlp_endpoint == "http://own:4317"
    assert _scheduler(["--otlp-endpoint", "http://flag:4317"], **otel).otlp_endpoint == "http://flag:4317"


def test_a_bad_standard_variable_is_named_in_the_error() -> None:
    with pytest.raises(SettingsError) as err:
        _scheduler(TRAINYARD_SCHEDULER_TRACE_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT="collector:4317")
    assert "(otlp_endpoint is OTEL_EXPORTER_OTLP_ENDPOINT's value)" in err.value.message


def test_the_standard_variables_are_not_looked_at_when_spans_go_elsewhere() -> None:
    """Set for another program (an OTLP/HTTP endpoint with a path): no reason to refuse to start."""
    s = _scheduler(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://collector:4318/v1/traces")
    assert s.trace_exporter == "none"


def test_a_ca_file_needs_https_and_must_exist(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="otlp_ca_file is for an https otlp_endpoint"):
        _scheduler(["--trace-exporter", "otlp", "--otlp-endpoint", "http://c:4317", "--otlp-ca-file",
                    str(tmp_path / "ca.pem")])
    with pytest.raises(SettingsError, match="no such file, or not readable"):
        _scheduler(["--trace-exporter", "otlp", "--otlp-endpoint", "https://c:4317", "--otlp-ca-file",
                    str(tmp_path / "ca.pem")])
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    s = _scheduler(["--trace-exporter", "otlp", "--otlp-endpoint", "https://c:4317", "--otlp-ca-file",
                    str(tmp_path / "ca.pem")])
    assert s.otlp_ca_file == str(tmp_path / "ca.pem")


def test_a_file_exporter_in_no_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(AgentSettings, prog="trainyard-agent", env={},
                      argv=["--trace-exporter", str(tmp_path / "missing" / "spans.jsonl")])
    with pytest.raises(SettingsError, match="is a directory"):
        load_settings(AgentSettings, prog="trainyard-agent", env={}, argv=["--trace-exporter", str(tmp_path)])


# --- exporters --------------------------------------------------------------------------------------------

class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OpenTelemetry collector's OTLP/gRPC trace receiver: keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.received = threading.Event()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None)


def test_otlp_sends_the_spans_to_the_collector(collector: tuple[Collector, int]) -> None:
    servicer, port = collector
    settings = load_settings(SchedulerSettings, prog="trainyard-scheduler", argv=[],
                             env={"TRAINYARD_SCHEDULER_TRACE_EXPORTER": "otlp",
                                  "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
    provider = telemetry.tracer_provider("scheduler", settings)
    try:
        with provider.get_tracer("tests").start_as_current_span("reconcile.commit",
                                                                 attributes={telemetry.JOB_ID: "job-1"}) as span:
            pass
        assert provider.force_flush(10_000)
        assert servicer.received.wait(10)
    finally:
        provider.shutdown()
    [resource_spans] = [rs for r in servicer.requests for rs in r.resource_spans]
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
    [sent] = [s for ss in resource_spans.scope_spans for s in ss.spans]
    assert service == "scheduler" and sent.name == "reconcile.commit"
    assert sent.trace_id == span.get_span_context().trace_id.to_bytes(16, "big")
    assert {a.key: a.value.string_value for a in sent.attributes} == {telemetry.JOB_ID: "job-1"}


def test_the_file_exporter_appends_one_json_object_per_span(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    provider = _provider(BaseSettings(trace_exporter=str(path)))
    try:
        tracer = provider.get_tracer("tests")
        for name in ("one", "two"):
            with tracer.start_as_current_span(name):
                pass
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["one", "two"]
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"tests"}


def test_without_an_exporter_nothing_is_recorded_but_the_ids_are_made() -> None:
    provider = _provider()
    with provider.get_tracer("tests").start_as_current_span("request") as span:
        assert not span.is_recording()
        assert span.get_span_context().is_valid
        assert telemetry.trace_id_of(telemetry.traceparent()) == f"{span.get_span_context().trace_id:032x}"


def test_memory_spans_keep_the_newest_and_find_a_trace() -> None:
    memory = telemetry.MemorySpans(limit=3)
    tracer = _provider(memory=memory).get_tracer("tests")
    for i in range(5):
        with tracer.start_as_current_span(f"span-{i}") as span:
            pass
    assert [s.name for s in memory.spans()] == ["span-2", "span-3", "span-4"]
    assert [s.name for s in memory.trace(span.get_span_context().trace_id)] == ["span-4"]
    memory.clear()
    assert memory.spans() == []


# --- a record's trace, continued later ---------------------------------------------------------------------

def test_work_done_later_for_a_record_joins_the_trace_of_the_request_that_made_it() -> None:
    memory = telemetry.MemorySpans()
    tracer = _provider(memory=memory).get_tracer("tests")
    with tracer.start_as_current_span("SubmitJob") as submit:
        kept = telemetry.traceparent()
    with tracer.start_as_current_span("an unrelated cycle"), \
            telemetry.continued(tracer, "reconcile.commit", kept, {telemetry.JOB_ID: "job-1"}) as commit:
        inside = telemetry.traceparent()
    ctx = submit.get_span_context()
    assert kept == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}" and ctx.trace_flags.sampled
    [recorded] = [s for s in memory.spans() if s.name == "reconcile.commit"]
    assert recorded.context is not None and recorded.parent is not None
    assert recorded.context.trace_id == ctx.trace_id and recorded.parent.span_id == ctx.span_id
    assert telemetry.trace_id_of(inside) == f"{ctx.trace_id:032x}"
    assert commit.get_span_context().trace_id == ctx.trace_id


def test_a_record_without_a_trace_starts_a_new_one_not_the_callers() -> None:
    tracer = _provider(memory=telemetry.MemorySpans()).get_tracer("tests")
    with tracer.start_as_current_span("cycle") as cycle, telemetry.continued(tracer, "reconcile.launch", "") as span:
        pass
    assert span.get_span_context().trace_id != cycle.get_span_context().trace_id


def test_a_finished_span_is_recorded_only_where_spans_are(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = telemetry.MemorySpans()
    tracer = _provider(memory=memory).get_tracer("tests")
    monkeypatch.setattr(telemetry, "_recording", False)
    telemetry.record_span(tracer, "reconcile.decide", TRACEPARENT, 1_000, 2_000)
    assert memory.spans() == []
    monkeypatch.setattr(telemetry, "_recording", True)
    telemetry.record_span(tracer, "reconcile.decide", TRACEPARENT, 1_000, 2_000, {telemetry.JOB_ID: "job-1"})
    [decide] = memory.spans()
    assert (decide.start_time, decide.end_time) == (1_000, 2_000)
    assert decide.context is not None and decide.parent is not None
    assert (decide.context.trace_id, decide.parent.span_id) == (TRACE, SPAN)


def test_the_job_record_keeps_the_submits_trace_and_older_records_encode_as_before() -> None:
    job = replace(make_job(), trace_parent=TRACEPARENT)
    raw = codec.encode_job(job)
    assert codec.decode_job(raw) == job and json.loads(raw)["trace_parent"] == TRACEPARENT
    # A record without one (submitted before traces were kept) has no such key, so its digest is unchanged.
    assert "trace_parent" not in json.loads(codec.encode_job(make_job()))
    assert codec.decode_job(codec.encode_job(make_job())).trace_parent == ""


@pytest.mark.parametrize(("value", "trace_id"), [
    (TRACEPARENT, f"{TRACE:032x}"),
    ("", ""),
    ("00-" + "0" * 32 + f"-{SPAN:016x}-01", ""),
    ("00-" + "z" * 32 + f"-{SPAN:016x}-01", ""),
    (TRACEPARENT[:-1], ""),
])
def test_trace_id_of(value: str, trace_id: str) -> None:
    assert telemetry.trace_id_of(value) == trace_id
