"""Per-RPC metrics of every gRPC server, under go-grpc-prometheus's names and labels, so the dashboards and
alerts written for Go services (and grpc-ecosystem's middleware) read ours unchanged:

    grpc_server_started_total{grpc_type, grpc_service, grpc_method}
    grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}
    grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method, grpc_code}   (histogram)

`grpc_type` is unary, client_stream, server_stream or bidi_stream; `grpc_service` the full service name
(`trainyard.scheduler.v1.JobService`); `grpc_code` Go's name of the status code as go-grpc-prometheus writes
it (`OK`, `NotFound`, `PermissionDenied`, `Canceled`, ...). The histogram carries the code too (Go's has none):
a dashboard that sums it over codes reads the same, and the latency of refusals stays apart from that of
answers. A stream's handling time is its whole life.

`RpcMetricsInterceptor` is installed outermost by `server.start_grpc_server`, outside the error-mapping
interceptor, so the code counted is the one the client receives: a domain error as mapped, an authorization
refusal, INTERNAL for an unexpected exception. Methods the server does not have (UNIMPLEMENTED from gRPC
itself) are not counted: their names come from the caller, and would make the label set unbounded.

Cost: the labelled children of each method are looked up once and kept, so a call costs two clock readings,
a counter increment and a histogram observation.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Counter, Histogram

LABELS = ("grpc_type", "grpc_service", "grpc_method")
STARTED = Counter("grpc_server_started_total", "RPCs started on the server", LABELS)
HANDLED = Counter("grpc_server_handled_total", "RPCs completed on the server, whatever their status",
                  (*LABELS, "grpc_code"))
HANDLING_SECONDS = Histogram(
    "grpc_server_handling_seconds", "Time from the start of an RPC to its status, by the status sent",
    (*LABELS, "grpc_code"),
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
             300.0))

# Go's codes.Code.String(): the values go-grpc-prometheus gives `grpc_code`.
CODE_NAMES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
UNARY, CLIENT_STREAM, SERVER_STREAM, BIDI_STREAM = "unary", "client_stream", "server_stream", "bidi_stream"

Behavior = Callable[..., Any]


def split_method(full: str) -> tuple[str, str]:
    """("trainyard.scheduler.v1.JobService", "SubmitJob") of "/trainyard.scheduler.v1.JobService/SubmitJob"."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


def code_after(exc: BaseException | None, context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    """The status a call ends with: the one set on the context (by `abort` or `set_code`), OK for a handler
    that returned without one, CANCELLED (DEADLINE_EXCEEDED once its deadline passed) for one cancelled
    because its caller went away, UNKNOWN for an exception gRPC itself turns into a status."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        left = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class _MethodMetrics:
    """The children of one method's series: made once, then only incremented."""

    __slots__ = ("_done", "_labels", "started")

    def __init__(self, kind: str, full_method: str) -> None:
        self._labels = (kind, *split_method(full_method))
        self.started = STARTED.labels(*self._labels)
        self._done: dict[grpc.StatusCode, tuple[Any, Any]] = {}

    def handled(self, code: grpc.StatusCode, seconds: float) -> None:
        children = self._done.get(code)
        if children is None:
            name = CODE_NAMES.get(code, "Unknown")
            children = self._done[code] = (HANDLED.labels(*self._labels, name),
                                           HANDLING_SECONDS.labels(*self._labels, name))
        children[0].inc()
        children[1].observe(seconds)


def _single(behavior: Behavior, m: _MethodMetrics) -> Behavior:
    """A handler that answers once: unary, client-streaming, or a streaming one that writes with
    `context.write` instead of yielding."""

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        m.started.inc()
        start = time.perf_counter()
        failure: BaseException | None = None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            m.handled(code_after(failure, context), time.perf_counter() - start)

    return call


def _streaming(behavior: Behavior, m: _MethodMetrics) -> Behavior:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        m.started.inc()
        start = time.perf_counter()
        failure: BaseException | None = None
        try:
            async for item in behavior(request, context):
                yield item
        except BaseException as exc:
            failure = exc
            raise
        finally:
            m.handled(code_after(failure, context), time.perf_counter() - start)

    return call


def _wrap(behavior: Behavior, m: _MethodMetrics) -> Behavior:
    return _streaming(behavior, m) if inspect.isasyncgenfunction(behavior) else _single(behavior, m)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts and times every call of a method the server has; see the module docstring. Install it first
    (outermost) so it sees the status the other interceptors settled on."""

    def __init__(self) -> None:
        self._methods: dict[tuple[str, str], _MethodMetrics] = {}

    def _metrics(self, kind: str, full_method: str) -> _MethodMetrics:
        key = (kind, full_method)
        m = self._methods.get(key)
        if m is None:
            m = self._methods[key] = _MethodMetrics(kind, full_method)
        return m

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap(handler.unary_unary, self._metrics(UNARY, method)),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap(handler.stream_unary, self._metrics(CLIENT_STREAM, method)),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap(handler.unary_stream, self._metrics(SERVER_STREAM, method)),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap(handler.stream_stream, self._metrics(BIDI_STREAM, method)),
                handler.request_deserializer, handler.response_serializer)
        return handler
