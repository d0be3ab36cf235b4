"""Structured logging (trainyard_core.logs): a log call's `extra` never crashes its caller, the JSON line
never fails on a value, context fields reach the line, and no log call in the tree passes `extra` a key
that names a LogRecord attribute (issue 11: `extra={"created": ...}` answered PUT /v1/queues with 503)."""

from __future__ import annotations

import ast
import io
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainyard_core import logs

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("libs", "services", "bench", "tools", "tests")
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}


def reserved_extra_keys(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, key) for every constant key of an `extra=` dict literal (or dict(...) call) in a logging-style
    call (`<anything>.info(..., extra=...)`) that names a LogRecord attribute."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS):
            continue
        for kw in node.keywords:
            if kw.arg != "extra":
                continue
            keys: list[str] = []
            if isinstance(kw.value, ast.Dict):
                keys = [k.value for k in kw.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            elif isinstance(kw.value, ast.Call) and isinstance(kw.value.func, ast.Name) and kw.value.func.id == "dict":
                keys = [k.arg for k in kw.value.keywords if k.arg is not None]
            found += [(kw.value.lineno, k) for k in keys if k in logs.RESERVED_RECORD_KEYS]
    return found


def logging_calls_with_extra(source: str) -> int:
    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS
               and any(kw.arg == "extra" for kw in node.keywords))


def python_files() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_no_log_call_in_the_tree_passes_extra_a_record_attribute() -> None:
    clashes, calls = [], 0
    for path in python_files():
        source = path.read_text()
        calls += logging_calls_with_extra(source)
        clashes += [f"{path.relative_to(ROOT)}:{line}: extra key {key!r}"
                    for line, key in reserved_extra_keys(source, str(path))]
    assert calls > 50, f"the scan found only {calls} log calls with extra=; is it reading the tree?"
    assert not clashes, ("these log calls pass `extra` a LogRecord attribute name (stdlib raises KeyError from "
                         "the call; rename the key, e.g. created -> created_at):\n" + "\n".join(clashes))


@pytest.mark.parametrize(("snippet", "expected"), [
    ('log.info("queue stored", extra={"queue": q, "created": c})', [(1, "created")]),
    ('logger.warning("x", extra=dict(name=n, ok=1))', [(1, "name")]),
    ('self._log.log(logging.INFO, "x", extra={"message": m, "asctime": a, "taskName": t})',
     [(1, "message"), (1, "asctime"), (1, "taskName")]),
    ('log.info("queue stored", extra={"queue": q, "created_at": c, **more})', []),
    ('ConfigDict(extra={"created": 1})', []),  # not a logging call
])
def test_the_scan_names_every_reserved_key(snippet: str, expected: list[tuple[int, str]]) -> None:
    assert reserved_extra_keys(snippet) == expected


def test_the_reserved_set_covers_every_record_attribute() -> None:
    assert set(vars(logging.makeLogRecord({}))) | {"message", "asctime"} <= logs.RESERVED_RECORD_KEYS
    assert {"created", "name", "msg", "args", "levelname", "process", "thread"} <= logs.RESERVED_RECORD_KEYS


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """A logger of its own (not propagating: the tests' root handler fails on a renamed key by design)
    writing JSON lines to a buffer."""
    logs.install_extra_guard()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter("svc"))
    logger = logging.getLogger("tests.core.logging")
    logger.handlers[:] = [handler]
    logger.propagate, logger.level = False, logging.INFO
    try:
        yield out
    finally:
        logger.handlers.clear()
        logger.propagate = True


def parsed(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_record_attribute_in_extra_is_renamed_not_raised(lines: io.StringIO) -> None:
    # Built apart from the call, so the tree scan above does not count this deliberate clash.
    clashing = {"queue": "batch", "created": True, "name": "n", "extra_name": "kept"}
    log = logging.getLogger("tests.core.logging")
    log.info("queue stored", extra=clashing)
    (line,) = parsed(lines)
    assert line["msg"] == "queue stored" and line["logger"] == "tests.core.logging"
    # Nothing is lost: `name` takes extra_name, so the caller's own extra_name moves one further.
    assert (line["queue"], line["extra_created"], line["extra_name"], line["extra_extra_name"]) == (
        "batch", True, "n", "kept")
    assert isinstance(line["ts"], str) and line["ts"].endswith("Z")  # `created` the timestamp, untouched


def test_a_renamed_record_notes_the_keys_it_renamed() -> None:
    logs.install_extra_guard()
    record = logging.getLogger("x").makeRecord("x", logging.INFO, "f.py", 1, "m", (), None,
                                               extra={"created": 1, "queue": "q"})
    assert getattr(record, logs.RENAMED_EXTRA_ATTR) == ("created",)
    assert record.extra_created == 1 and record.queue == "q" and record.created != 1  # type: ignore[attr-defined]
    clean = logging.getLogger("x").makeRecord("x", logging.INFO, "f.py", 1, "m", (), None, extra={"queue": "q"})
    assert not hasattr(clean, logs.RENAMED_EXTRA_ATTR)


def test_the_tests_root_handler_fails_a_log_call_that_needed_the_rename() -> None:
    # What keeps new code honest where the scan cannot see (an `extra` built at run time).
    clashing = {"created": True}
    with pytest.raises(AssertionError, match=r"extra keys \['created'\] that name LogRecord attributes"):
        logging.getLogger("tests.core.logging.root").info("stored", extra=clashing)


def test_tests_log_at_info_through_the_production_json_formatter() -> None:
    root = logging.getLogger()
    assert root.getEffectiveLevel() == logging.INFO
    assert [type(h.formatter) for h in root.handlers if type(h).__name__ == "FormatEveryRecord"] == [
        logs.JsonFormatter]


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def test_the_json_line_never_fails_on_a_value(lines: io.StringIO) -> None:
    cycle: list[object] = []
    cycle.append(cycle)
    log = logging.getLogger("tests.core.logging")
    log.info("odd values", extra={"tuple_keys": {(1, 2): "a"}, "cycle": cycle, "nan": math.nan,
                                  "bad": Unprintable(), "raw": b"\x00\xff", "gpus": {3, 1}, "ok": 7})
    (line,) = parsed(lines)  # strict JSON: json.loads would accept NaN, the line has none
    assert "NaN" not in lines.getvalue()
    assert line["ok"] == 7 and line["tuple_keys"] == "{(1, 2): 'a'}" and line["nan"] == "nan"
    assert line["bad"] == "<Unprintable that cannot be printed>" and line["raw"] == "b'\\x00\\xff'"
    assert line["cycle"] == "[[...]]" and line["msg"] == "odd values"


def test_context_fields_reach_the_line_and_cannot_overwrite_its_own(lines: io.StringIO) -> None:
    log = logging.getLogger("tests.core.logging")
    with logs.log_context(job_id="j-1", node_id="node-a", empty=""):
        with logs.log_context(rank=3):
            log.info("rank started", extra={"service": "not-this", "level": "loud"})
        log.warning("after")
    log.info("outside")
    first, second, third = parsed(lines)
    assert (first["job_id"], first["node_id"], first["rank"]) == ("j-1", "node-a", 3)
    assert (first["service"], first["level"]) == ("svc", "info")
    assert (first["extra_service"], first["extra_level"]) == ("not-this", "loud")
    assert "empty" not in first
    assert (second["job_id"], second["level"]) == ("j-1", "warning") and "rank" not in second
    assert "job_id" not in third


def test_an_exception_is_written_into_the_line(lines: io.StringIO) -> None:
    log = logging.getLogger("tests.core.logging")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"attempt": 2})
    (line,) = parsed(lines)
    assert line["attempt"] == 2 and "ValueError: boom" in str(line["exc"])


def test_the_text_formatter_survives_an_unprintable_value() -> None:
    logs.install_extra_guard()
    record = logging.getLogger("x").makeRecord("x", logging.INFO, "f.py", 1, "m", (), None,
                                               extra={"bad": Unprintable(), "created": 1})
    assert logs.TextFormatter("svc").format(record).endswith(
        "svc m bad=<Unprintable that cannot be printed> extra_created=1")
