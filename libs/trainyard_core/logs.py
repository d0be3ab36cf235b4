"""Structured logging: one JSON object per line on stderr, with context (job_id, node_id, ...) taken
from contextvars so a log line inside a job's handling names the job without threading ids through.

A log call's `extra` must not name a LogRecord attribute (`created`, `name`, `msg`, ...): the standard
library raises KeyError from inside the call, so one badly named field turned a stored write into a 503.
`setup_logging` installs a guard that writes such a field as `extra_<key>` instead, and the JSON
formatter never fails on a value it cannot serialise. tests/core/test_logging.py also refuses any such
key in the tree's `extra={...}` literals, and the tests' own handler fails a test whose log call needed
the guard, so production gets the rename and the code gets fixed.

Each line written inside an OpenTelemetry span names it (`trace_id`, `span_id`: the W3C ids in hex), whether
or not spans are exported: the services propagate trace ids either way (telemetry.py), so one request's or
one job's lines can be found in every service's log. Outside a span, a `trace_id` in the log context (the
job's trace, which the scheduler binds while it works on the job) stands. A line that is neither in a span nor
about a job (start-up, shutdown, leader election, a background loop's news, a library's own line) names the
process's trace (`set_process_trace`: the service's `<service>.process` span, telemetry.begin_process), so
every line a service writes names a trace: one search by that id finds everything the process said outside
requests and jobs.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("trainyard_log_context",
                                                                            default={})

# What `extra` may not name: every attribute a fresh LogRecord has, the two that formatting adds, and
# taskName (a record attribute from Python 3.12, so code that passes it here breaks there).
RESERVED_RECORD_KEYS: frozenset[str] = (frozenset(vars(logging.makeLogRecord({})))
                                        | {"message", "asctime", "taskName"})
# On a record whose `extra` the guard had to rename: the original keys (a tuple of str). Private (leading
# underscore), so no formatter writes it.
RENAMED_EXTRA_ATTR = "_trainyard_renamed_extra"
# The JSON line's own fields, which neither context nor extras may overwrite.
_JSON_FIELDS = frozenset({"ts", "level", "service", "logger", "msg", "exc"})
TRACE_ID = "trace_id"
SPAN_ID = "span_id"
# The trace (and span) ids, hex, of lines written outside any span and any job: the process's own trace. Empty
# until a service's main sets it; tests that do not set it see lines without them.
_process_trace: tuple[str, str] = ("", "")


def set_process_trace(trace_id: str, span_id: str) -> None:
    """Name the process's trace (hex ids; "" to clear) on every line that names no other."""
    global _process_trace
    _process_trace = (trace_id, span_id)


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Adds fields (e.g. job_id=..., node_id=...) to every log line written inside the block."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v not in (None, "")}})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Adds fields to the current context for the rest of the current task."""
    _context.set({**_context.get(), **fields})


def _free_key(key: str, taken: Mapping[str, Any] | set[str]) -> str:
    """`extra_<key>`, prefixed again until no field already has the name."""
    new = f"extra_{key}"
    while new in taken:
        new = f"extra_{new}"
    return new


def _guarded_make_record(self: logging.Logger, name: str, level: int, fn: str, lno: int, msg: object,
                         args: Any, exc_info: Any, func: str | None = None,
                         extra: Mapping[str, object] | None = None, sinfo: str | None = None) -> logging.LogRecord:
    """Logger.makeRecord, except that an `extra` key naming a record attribute is written as
    `extra_<key>` (and noted under RENAMED_EXTRA_ATTR) instead of raising KeyError into the caller."""
    record = logging.getLogRecordFactory()(name, level, fn, lno, msg, args, exc_info, func, sinfo)
    if extra is not None:
        renamed: list[str] = []
        for key, value in extra.items():
            if key in RESERVED_RECORD_KEYS or key in record.__dict__:
                renamed.append(key)
                key = _free_key(key, record.__dict__)
            record.__dict__[key] = value
        if renamed:
            record.__dict__[RENAMED_EXTRA_ATTR] = tuple(renamed)
    return record


def install_extra_guard() -> None:
    """Makes every logger rename clashing `extra` keys (see _guarded_make_record). Idempotent.

    On the Logger class, not a subclass set with setLoggerClass: modules create their loggers at import,
    before main() reaches setup_logging, and those would keep the raising makeRecord."""
    logging.Logger.makeRecord = _guarded_make_record  # type: ignore[method-assign]


def _as_text(value: object) -> str:
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__} that cannot be printed>"


def _fields(record: logging.LogRecord, *, span_id: bool) -> dict[str, Any]:
    """What a line adds to its message: the log context, the call's extras, and the current span's trace (and
    span) id, which win over a context or extra of the same name; with no trace among them, the process's."""
    fields = {**_context.get()}
    for key, value in record.__dict__.items():
        if key not in RESERVED_RECORD_KEYS and not key.startswith("_"):
            fields[key] = value
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        fields[TRACE_ID] = f"{ctx.trace_id:032x}"
        if span_id:
            fields[SPAN_ID] = f"{ctx.span_id:016x}"
    elif TRACE_ID not in fields and _process_trace[0]:
        fields[TRACE_ID] = _process_trace[0]
        if span_id:
            fields[SPAN_ID] = _process_trace[1]
    return fields


def _dumps(out: dict[str, Any]) -> str:
    """The line as strict JSON, whatever the values: a value json cannot take (a dict with tuple keys, a
    cycle, NaN, an object whose str() raises) is written as its str() rather than losing the line."""
    try:
        return json.dumps(out, default=_as_text, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        safe: dict[str, Any] = {}
        for key, value in out.items():
            try:
                json.dumps(value, default=_as_text, allow_nan=False)
                safe[_as_text(key)] = value
            except (TypeError, ValueError, RecursionError):
                safe[_as_text(key)] = _as_text(value)
        return json.dumps(safe, default=_as_text, allow_nan=False)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = _fields(record, span_id=True)
        for key, value in fields.items():
            out[_free_key(key, out.keys() | fields.keys()) if key in _JSON_FIELDS else key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _dumps(out)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        extras = _fields(record, span_id=False)
        tail = " ".join(f"{k}={_as_text(v)}" for k, v in extras.items())
        line = (f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} "
                f"{self._service} {record.getMessage()}" + (f" {tail}" if tail else ""))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _skip_unused_record_fields() -> None:
    """Neither formatter writes the caller's file, line or function, nor the thread, process or task: the
    logging module's documented switches ("Optimization" in its HOWTO) stop every record from looking them
    up (a system call for the process id, a stack walk for the caller): a gateway under read load, logging one
    access line per request, spent ~3 % of its CPU on them (py-spy)."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if sys.version_info >= (3, 12):
        logging.logAsyncioTasks = False


def setup_logging(service: str, level: str = "INFO", fmt: str = "json",
                  handler: logging.Handler | None = None) -> logging.Handler:
    """Makes `handler` (default: stderr) the root logger's only handler, formatting with JsonFormatter or
    TextFormatter, at `level`, and installs the `extra` guard. Tests pass a handler of their own."""
    install_extra_guard()
    _skip_unused_record_fields()
    handler = handler if handler is not None else logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Third-party chatter that would drown the service's own lines.
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler
