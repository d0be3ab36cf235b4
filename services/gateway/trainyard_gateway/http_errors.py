"""The one place where failures become HTTP answers. Every error has the same body:

    {"error": {"code": "not_found", "message": "job j-... not found"}}

| domain error (trainyard_core.errors)   | HTTP | code                 |
|----------------------------------------|------|----------------------|
| IdempotencyKeyReused (key, other body) | 422  | idempotency_key_reused |
| InvalidPageToken (not ours, or other filters) | 422 | invalid_page_token |
| InvalidArgument, request validation    | 400  | invalid_argument     |
| FailedPrecondition                     | 409  | failed_precondition  |
| Unauthenticated                        | 401  | unauthenticated      |
| PermissionDenied                       | 403  | permission_denied    |
| NotFound                               | 404  | not_found            |
| AlreadyExists                          | 409  | already_exists       |
| Conflict (a lost compare-and-swap)     | 409  | conflict             |
| StoreOutOfSpace (etcd's NOSPACE alarm) | 507  | insufficient_storage |
| ResourceExhausted                      | 429  | resource_exhausted   |
| Unavailable, NotLeader                 | 503  | unavailable          |
| anything else                          | 500  | internal             |

400 means one thing: the request breaks the published contract (the OpenAPI schema, whose bounds and
rules are the scheduler's own, `trainyard_core.contract`), so no request the schema calls valid is ever
answered 400. FailedPrecondition is a well-formed request the cluster cannot take as it is now (more GPUs
per node than any node has, a queue or priority class that does not exist, a queue still in use): 409,
"conflicts with the current state", like Conflict (a lost compare-and-swap: re-read and retry) and
AlreadyExists; the code tells them apart. (Google's mapping sends FAILED_PRECONDITION to 400, which would
make 400 mean "maybe valid after all".) Request validation (malformed JSON, unknown fields, wrong types,
out-of-range numbers) is 400 too, never FastAPI's 422, and the message names each offending field and, for
a name, the rule it breaks. gRPC failures are turned into domain
errors by `from_rpc_error` (normally already in `clients`). Unexpected exceptions are logged with their
traceback and answered with a generic 500 that leaks nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc.aio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainyard_core import contract, errors
from trainyard_core.rpc.errors import from_rpc_error

from .http_metrics import HttpMetrics

log = logging.getLogger("trainyard_gateway.http")

_STATUS: list[tuple[type[errors.TrainyardError], int, str]] = [
    (errors.IdempotencyKeyReused, 422, "idempotency_key_reused"),
    (errors.InvalidPageToken, 422, "invalid_page_token"),
    (errors.InvalidArgument, 400, "invalid_argument"),
    (errors.FailedPrecondition, 409, "failed_precondition"),
    (errors.Unauthenticated, 401, "unauthenticated"),
    (errors.PermissionDenied, 403, "permission_denied"),
    (errors.NotFound, 404, "not_found"),
    (errors.AlreadyExists, 409, "already_exists"),
    (errors.Conflict, 409, "conflict"),
    (errors.StoreOutOfSpace, 507, "insufficient_storage"),
    (errors.ResourceExhausted, 429, "resource_exhausted"),
    (errors.Unavailable, 503, "unavailable"),
]
_HTTP_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
               405: "method_not_allowed", 409: "conflict", 413: "too_large", 415: "unsupported_media_type",
               429: "resource_exhausted", 503: "unavailable"}
# RFC 6750: a 401 names the scheme; error="invalid_token" when a token was sent but is not valid.
WWW_AUTHENTICATE = 'Bearer realm="trainyard"'
WWW_AUTHENTICATE_INVALID = 'Bearer realm="trainyard", error="invalid_token"'
_MAX_PROBLEMS = 10


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def status_for(exc: errors.TrainyardError) -> tuple[int, str]:
    for cls, status, code in _STATUS:
        if isinstance(exc, cls):
            return status, code
    return 500, "internal"


class InvalidToken(errors.Unauthenticated):
    """A token was sent but is not valid (as opposed to: no token at all)."""


def domain_error_response(exc: errors.TrainyardError) -> JSONResponse:
    status, code = status_for(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, errors.Unauthenticated):
        headers["WWW-Authenticate"] = WWW_AUTHENTICATE_INVALID if isinstance(exc, InvalidToken) \
            else WWW_AUTHENTICATE
    elif isinstance(exc, errors.StoreOutOfSpace):
        pass  # no Retry-After: space comes back when an operator frees it, not in a second
    elif isinstance(exc, errors.Unavailable):
        headers["Retry-After"] = "1"
    elif isinstance(exc, errors.ResourceExhausted):
        headers["Retry-After"] = str(max(1, int(getattr(exc, "retry_after_s", 1))))
    if status == 500:
        log.error("unmapped domain error %s: %s", type(exc).__name__, exc.message)
        return error_response(500, "internal", "internal error; see the gateway log")
    return error_response(status, code, exc.message, headers)


def _where(loc: Sequence[Any]) -> str:
    if not loc:
        return "request"
    source, path = str(loc[0]), loc[1:]
    dotted = ""
    for part in path:
        dotted += f"[{part}]" if isinstance(part, int) else (("." if dotted else "") + str(part))
    if source == "body":
        return dotted or "request body"
    if source == "query":
        return f"query parameter {dotted}"
    if source == "header":
        return f"header {dotted}"
    if source == "path":
        return f"path parameter {dotted}"
    return ".".join(str(p) for p in loc)


def describe_validation_errors(problems: Sequence[Any]) -> str:
    """One readable sentence per problem, each naming the field: 'resources.nodes: ... (got 0)'."""
    parts: list[str] = []
    for err in problems[:_MAX_PROBLEMS]:
        kind = str(err.get("type", ""))
        loc = tuple(err.get("loc", ()))
        value = err.get("input")
        if kind == "json_invalid":
            parts.append(f"request body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')} "
                         f"at character {loc[1] if len(loc) > 1 else '?'}")
            continue
        if loc == ("body",) and isinstance(value, bytes | bytearray):
            parts.append("request body must be a JSON object sent with 'Content-Type: application/json'")
            continue
        where = _where(loc)
        if kind == "missing":
            parts.append("a JSON request body is required" if loc == ("body",) else f"{where}: required")
            continue
        if kind == "extra_forbidden":
            parts.append(f"{where}: unknown field")
            continue
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if kind == "string_pattern_mismatch":
            rule = contract.rule_for(str(err.get("ctx", {}).get("pattern", "")))
            message = f"must be {rule}" if rule else message
        if kind != "value_error" and (value is None or isinstance(value, bool | int | float | str)):
            shown = repr(value) if not isinstance(value, str) or len(value) <= 80 else repr(value[:80] + "…")
            message += f" (got {shown})"
        parts.append(f"{where}: {message}")
    if len(problems) > _MAX_PROBLEMS:
        parts.append(f"and {len(problems) - _MAX_PROBLEMS} more problems")
    return "; ".join(parts)


def install(app: FastAPI, metrics: HttpMetrics | None = None) -> None:
    """Register the handlers and the catch-all middleware on `app`; with `metrics`, the access log records each
    request in them too (http_metrics.py)."""

    async def on_domain_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, errors.TrainyardError)
        return domain_error_response(exc)

    async def on_rpc_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, grpc.aio.AioRpcError)
        return domain_error_response(from_rpc_error(exc, "scheduler"))

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(400, "invalid_argument", describe_validation_errors(exc.errors()))

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = "no such route; see /openapi.json for the API"
        elif exc.status_code == 405:
            message = "method not allowed on this route; see /openapi.json for the API"
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), message,
                              dict(exc.headers or {}))

    app.add_exception_handler(errors.TrainyardError, on_domain_error)
    app.add_exception_handler(grpc.aio.AioRpcError, on_rpc_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_middleware(AccessLogAndCatchAll, metrics=metrics)


class AccessLogAndCatchAll:
    """Logs one line per request (method, path, status, duration, caller; never headers, so never the
    token), records it in the HTTP metrics when given, and turns an unhandled exception into a generic 500
    after logging its traceback once."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics | None = None) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0
        metrics = self._metrics
        if metrics is not None:
            metrics.began()

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if status:
                raise  # the answer has begun; the server closes the connection
            status = 500
            await error_response(500, "internal", "internal error; see the gateway log")(scope, receive, send)
        finally:
            elapsed = time.monotonic() - start
            if metrics is not None:
                # No status: the request was cancelled (its caller went away) before an answer began.
                metrics.observe(scope, status or 499, elapsed)
            principal = scope.get("state", {}).get("principal")
            log.info("%s %s %s", scope.get("method"), scope.get("path"), status, extra={
                "http_status": status, "duration_ms": round(elapsed * 1000, 1),
                "team": getattr(principal, "team", ""), "user": getattr(principal, "user", "")})
