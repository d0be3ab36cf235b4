"""The one place where domain errors become gRPC status codes, and back.

Servers install `ErrorMappingInterceptor`; servicers raise domain errors (`trainyard_core.errors`) and
never call `context.abort` for them. An unexpected exception is logged with its traceback and answered
with INTERNAL and a short message that does not leak internals. Clients turn an `AioRpcError` back into
the domain error with `from_rpc_error`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from .. import errors

log = logging.getLogger(__name__)

_TO_CODE: list[tuple[type[errors.TrainyardError], grpc.StatusCode]] = [
    (errors.NotLeader, grpc.StatusCode.UNAVAILABLE),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Conflict, grpc.StatusCode.ABORTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]

_FROM_CODE: dict[grpc.StatusCode, type[errors.TrainyardError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.ABORTED: errors.Conflict,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
}


def status_for(exc: errors.TrainyardError) -> grpc.StatusCode:
    for cls, code in _TO_CODE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.UNKNOWN


# Errors one status code cannot tell apart travel with their kind in this trailing metadata key: etcd being out
# of space and a rate limit are both RESOURCE_EXHAUSTED, but the gateway answers them 507 and 429; a reused
# idempotency key and a page token handed out for other filters are INVALID_ARGUMENTs the gateway answers
# 422 (the request is well formed: only its meaning is wrong).
ERROR_KIND = "trainyard-error"
_KINDS: dict[str, type[errors.TrainyardError]] = {"store-out-of-space": errors.StoreOutOfSpace,
                                                  "idempotency-key-reused": errors.IdempotencyKeyReused,
                                                  "invalid-page-token": errors.InvalidPageToken}


# How long a busy server asks the caller to wait before trying again (errors.Busy; rpc/admission.py), in whole
# milliseconds: the gRPC counterpart of HTTP's Retry-After.
RETRY_AFTER = "trainyard-retry-after-ms"


def _trailer(exc: grpc.aio.AioRpcError, name: str) -> str | None:
    """The value of trailing metadata `name` of a failed call (None when it has none)."""
    for key, value in exc.trailing_metadata() or ():
        if key == name:
            return str(value)
    return None


def retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """The wait a refused call was asked for (RETRY_AFTER), in seconds; None when none (or an unreadable one)."""
    value = _trailer(exc, RETRY_AFTER)
    if value is None:
        return None
    try:
        ms = int(value)
    except ValueError:
        return None
    return ms / 1000 if ms >= 0 else None


def kind_of(exc: errors.TrainyardError) -> str:
    """The error kind (ERROR_KIND) that tells `exc` apart from others of its status code; "" when none."""
    return next((k for k, cls in _KINDS.items() if isinstance(exc, cls)), "")


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status code of a number (google.rpc.Code), UNKNOWN for one that is not a code."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def from_rpc_error(exc: grpc.aio.AioRpcError, what: str = "") -> errors.TrainyardError:
    """Turn a failed call back into the domain error it stands for."""
    return from_status(exc.code(), exc.details() or "", _trailer(exc, ERROR_KIND) or "", what)


def from_status(code: grpc.StatusCode, details: str, kind: str = "", what: str = "") -> errors.TrainyardError:
    """The domain error a status code, its message and error kind (ERROR_KIND) stand for: a failed call's, or a
    failed item's of a batch (SubmitJobs)."""
    detail = details or code.name
    cls = _KINDS.get(kind) or _FROM_CODE.get(code)
    if cls is None:
        return errors.Unavailable(f"{what + ': ' if what else ''}{code.name}: {detail}")
    if cls is errors.Unavailable and what:
        return errors.Unavailable(f"{what} is unavailable: {detail}")
    return cls(detail)


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    # A TaskGroup wraps a single domain error in an ExceptionGroup; map the error it carries.
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, errors.TrainyardError):
        code = status_for(exc)
        # Trailing, not initial, metadata: a stream may already have sent its initial metadata.
        trailing: list[tuple[str, str]] = []
        if isinstance(exc, errors.NotLeader) and exc.leader:
            trailing.append(("trainyard-leader", exc.leader))
        kind = kind_of(exc)
        if kind:
            trailing.append((ERROR_KIND, kind))
        if isinstance(exc, errors.Busy):
            trailing.append((RETRY_AFTER, str(max(0, round(exc.retry_after_s * 1000)))))
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        await context.abort(code, exc.message)
    log.error("unhandled error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the service log")


Behavior = Callable[..., Any]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps domain errors raised by any handler (unary or streaming) to gRPC status codes."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method

        def wrap_unary(behavior: Behavior) -> Behavior:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return call

        def wrap_stream(behavior: Behavior) -> Behavior:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in behavior(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream), handler.request_deserializer,
                handler.response_serializer)
        return handler
