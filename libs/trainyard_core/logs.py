"""Structured logging: one JSON object per line on stderr, with context (job_id, node_id, ...) taken
from contextvars so a log line inside a job's handling names the job without threading ids through.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("trainyard_log_context",
                                                                            default={})
_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


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
        out.update(_context.get())
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        extras = {**_context.get()}
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                extras[key] = value
        tail = " ".join(f"{k}={v}" for k, v in extras.items())
        line = (f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} "
                f"{self._service} {record.getMessage()}" + (f" {tail}" if tail else ""))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Third-party chatter that would drown the service's own lines.
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
