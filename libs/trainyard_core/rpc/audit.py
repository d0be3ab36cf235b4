"""The audit interceptor: one audit entry per call of a method in `authz.AUDITED`, written before the answer.

Installed by `start_grpc_server` between the error-mapping interceptor and the authorization one, so it sees
the refusals of the latter (PERMISSION_DENIED, UNAUTHENTICATED) as well as the servicer's domain errors,
and records each with its status code. The principal is the caller's certificate's (`authz.current_principal`,
or the peer certificate itself when authorization refused the call before naming it); `anonymous` on a
plaintext server. The request id is the `x-request-id` metadata when the caller sent a valid one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import grpc
import grpc.aio

from .. import errors
from ..audit import (
    ANONYMOUS,
    CARRIED_HEADER,
    FORWARDED_ENTRY_HEADER,
    GATEWAY_SERVICE,
    REQUEST_ID_HEADER,
    RESULT_OK,
    AuditEntry,
    AuditLog,
    AuditSink,
    InlineAudit,
    acting_user,
    current_request_id,
    inline_audit,
    record,
    request_id_or_new,
)
from ..clock import Clock, SystemClock
from ..security import identity
from ..security.authz import AUDITED, BATCHES, Audited, current_principal
from ..security.tls import peer_principal
from .errors import status_for


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _code_name(code: Any) -> str:
    return code.name.lower() if isinstance(code, grpc.StatusCode) else "unknown"


def outcome(exc: BaseException | None, context: Any) -> tuple[str, str]:
    """(result, message) of a call that ended with `exc` (None: returned normally)."""
    if exc is None:
        code = context.code() if hasattr(context, "code") else None
        if code is None or code == grpc.StatusCode.OK:
            return RESULT_OK, ""
        return _code_name(code), str(context.details() or "")
    exc = _unwrap(exc)
    if isinstance(exc, grpc.aio.AbortError):
        return _code_name(context.code()), str(context.details() or "")
    if isinstance(exc, errors.TrainyardError):
        return _code_name(status_for(exc)), exc.message
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", "the caller went away before the answer"
    return "internal", "internal error; see the service log"


def _safe(read: Callable[[], Any], default: Any) -> Any:
    try:
        return read()
    except Exception:  # an extractor must never break the call it describes
        return default


def _principal(context: Any) -> str:
    principal = current_principal.get() or _safe(lambda: peer_principal(context), None)
    return str(principal) if principal is not None else ANONYMOUS


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for md in details.invocation_metadata or ():
        if md.key == key:
            return str(md.value)
    return None


def _request_id(details: grpc.HandlerCallDetails) -> str:
    return request_id_or_new(_metadata(details, REQUEST_ID_HEADER))


def forwarded_entry(raw: str | None, context: Any, request_id: str, *, authorized: bool = True) -> AuditEntry | None:
    """The gateway's own entry of the action, forwarded for this call to carry (FORWARDED_ENTRY_HEADER); None
    when there is none, or it is not the gateway's (on an mTLS server only the gateway's certificate may forward
    one; a plaintext server, `authorized` False, trusts every caller with everything, this included), for its
    own service, or does not parse: the caller then writes its entry itself, as it does when not told that
    this one was stored."""
    if not raw or (authorized and _safe(lambda: peer_principal(context), None) != identity.GATEWAY):
        return None
    try:
        e = AuditEntry.from_json(raw)
    except (ValueError, KeyError, TypeError):
        return None
    if e.service != GATEWAY_SERVICE or e.result != RESULT_OK:
        return None
    # Bounded as any entry; the request is this call's (the gateway sends its own as x-request-id).
    return AuditEntry.make(time=e.time, principal=e.principal, service=e.service, action=e.action,
                           request_id=request_id, role=e.role, team=e.team, detail=e.detail)


class CallAudit:
    """The audit of one service's calls into `sink` as `service`: the entry of a call, and `run`, which serves a
    call with its entry written (carried by the action's own transaction where it can be). Used by the
    interceptor for each call, and by a servicer for each item of a batch (SubmitJobs: `authz.BATCHES`)."""

    def __init__(self, sink: AuditSink, service: str, clock: Clock | None = None, *, authorized: bool = True) -> None:
        self._sink = sink
        self._authorized = authorized  # calls are authorized by certificate (mTLS): see forwarded_entry
        self._service = service
        self._clock = clock or SystemClock()

    def entry(self, method: str, spec: Audited, request: Any, response: Any | None, context: Any,
              exc: BaseException | None, request_id: str) -> AuditEntry:
        result, message = outcome(exc, context)
        detail = dict(_safe(lambda: spec.detail(request) if spec.detail else {}, {}))
        user, role = acting_user.get()
        if user:
            detail.update(acting_user=user, acting_role=role)
        return AuditEntry.make(
            time=self._clock.now(), principal=_principal(context), service=self._service, action=method,
            target=_safe(lambda: spec.target(request, response), ""), result=result, message=message,
            request_id=request_id, team=_safe(lambda: spec.team(request) if spec.team else "", ""),
            detail=detail)

    async def record(self, entry: AuditEntry) -> None:
        await record(self._sink, entry)

    async def run(self, method: str, spec: Audited, request: Any, context: Any, *, request_id: str,
                  forwarded: str | None, serve: Callable[[], Awaitable[Any]]) -> tuple[Any, bool]:
        """`serve()`'s answer, and whether the forwarded entry (`forwarded`, raw) was stored with the action.
        Sets the request id, acting user and inline audit of the current context: call it in the call's own
        task (a batch item: in its own task)."""
        current_request_id.set(request_id)
        acting_user.set(("", ""))
        response: Any | None = None
        failure: BaseException | None = None
        inline = None
        if isinstance(self._sink, AuditLog):
            # The action's own transaction may carry the entry (a submit's create): see audit.InlineAudit.
            inline = InlineAudit(self._sink, lambda target: replace(
                self.entry(method, spec, request, None, context, None, request_id), target=target),
                forwarded=forwarded_entry(forwarded, context, request_id, authorized=self._authorized))
        inline_audit.set(inline)
        try:
            response = await serve()
            return response, inline is not None and inline.forwarded_written
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if inline is None or not inline.written:
                await record(self._sink, self.entry(method, spec, request, response, context, failure, request_id))


class AuditInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Records each call of an audited (unary) method in `sink` as `service`."""

    def __init__(self, sink: AuditSink, service: str, table: Mapping[str, Audited] = AUDITED,
                 clock: Clock | None = None, *, authorized: bool = True) -> None:
        self.calls = CallAudit(sink, service, clock, authorized=authorized)
        self._table = table

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is not None and handler.unary_unary is not None and method in BATCHES:
            return self._batch(method, handler, _request_id(handler_call_details))
        spec = self._table.get(method)
        if handler is None or spec is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary
        request_id = _request_id(handler_call_details)
        forwarded = _metadata(handler_call_details, FORWARDED_ENTRY_HEADER)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            response, carried = await self.calls.run(method, spec, request, context, request_id=request_id,
                                                     forwarded=forwarded, serve=lambda: behavior(request, context))
            if carried:
                context.set_trailing_metadata(((CARRIED_HEADER, "1"),))
            return response

        return grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer, handler.response_serializer)

    def _batch(self, method: str, handler: grpc.RpcMethodHandler, request_id: str) -> grpc.RpcMethodHandler:
        """A batch (authz.BATCHES): its servicer audits each item as a call of the batched method; the batch is
        recorded only when it fails as a whole (refused by the authorization table, malformed), so an attempt
        whose items never ran still leaves its entry. A batch cancelled by its caller is not: its items that ran
        record their own cancellation."""
        behavior = handler.unary_unary
        spec = Audited(lambda _request, _response: "", detail=lambda r: {"items": len(r.items)})

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except Exception as exc:
                current_request_id.set(request_id)
                await self.calls.record(self.calls.entry(method, spec, request, None, context, exc, request_id))
                raise

        return grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer, handler.response_serializer)


class RequestIdClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds `x-request-id` (the request being served, `audit.current_request_id`) to outgoing unary calls, so
    the callee's audit entry carries the caller's request id. Calls made outside a request pass untouched."""

    async def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                    request: Any) -> Any:
        request_id = current_request_id.get()
        if request_id:
            metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
            metadata.add(REQUEST_ID_HEADER, request_id)
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)


async def record_call(sink: AuditSink | None, *, principal: str, service: str, method: str, request: Any,
                      callee: str, failure: BaseException | None = None, response: Any | None = None,
                      request_id: str = "", clock: Clock | None = None) -> None:
    """The caller's side of an audited call it made to a service without etcd (the scheduler's launches and
    stops on an agent): one entry naming the callee in `detail["callee"]`, the result as the caller saw it."""
    spec = AUDITED.get(method)
    if sink is None or spec is None:
        return
    if failure is None:
        result, message = RESULT_OK, ""
    elif isinstance(failure, grpc.aio.AioRpcError):
        result, message = _code_name(failure.code()), str(failure.details() or "")
    else:
        result, message = outcome(failure, None)
    detail = {**_safe(lambda: dict(spec.detail(request)) if spec.detail else {}, {}), "callee": callee}
    await record(sink, AuditEntry.make(
        time=(clock or SystemClock()).now(), principal=principal, service=service, action=method,
        target=_safe(lambda: spec.target(request, response), ""), result=result, message=message,
        request_id=request_id or current_request_id.get(),
        team=_safe(lambda: spec.team(request) if spec.team else "", ""),
        detail=detail))
