"""SubmitJobs: the gateway's batch of submits, each item served as its own SubmitJob.

Why a batch: a grpc.aio server takes new calls one at a time, several event-loop turns each (bench/grpc_accept.py,
docs/architecture.md), so on a busy leader a burst of concurrent SubmitJob calls queued before any handler ran:
the wait between the gateway's call and the scheduler's handler was most of a submit's time under 100 clients.
The gateway sends the submits that arrive while its earlier calls are in flight together (submit_batcher.py);
here they are taken as one call and served concurrently.

Each item is what a SubmitJob call would have been: the same validation and create (`serve`, the servicer's
submit), its own audit entry under the SubmitJob action with its own request id and the gateway's forwarded
entry (`CallAudit.run`, as the audit interceptor does for a call), its own span continuing the request's trace
(the job's trace is the item's), and its own result: a failed item is answered with the status code, message
and error kind the call would have failed with, and does not fail the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core import contract, telemetry
from trainyard_core.audit import current_request_id, request_id_or_new
from trainyard_core.errors import InvalidArgument, TrainyardError
from trainyard_core.rpc.audit import CallAudit
from trainyard_core.rpc.errors import kind_of, status_for
from trainyard_core.security.authz import AUDITED, BATCHES

log = logging.getLogger(__name__)

BATCH = "/trainyard.scheduler.v1.JobService/SubmitJobs"
SUBMIT = BATCHES[BATCH]
_tracer = telemetry.tracer(__name__)
_INTERNAL = "internal error in SubmitJob; see the service log"

Serve = Callable[[scheduler_pb2.SubmitJobRequest], Awaitable[scheduler_pb2.SubmitJobResponse]]


def _error(code: grpc.StatusCode, message: str, kind: str = "") -> scheduler_pb2.SubmitJobsResult:
    return scheduler_pb2.SubmitJobsResult(error=scheduler_pb2.SubmitJobsError(code=code.value[0], message=message,
                                                                               kind=kind))


class SubmitBatch:
    """Serves SubmitJobs with `serve` (the servicer's submit) per item; `audit` records each item as a SubmitJob
    call (None: a server without an audit log)."""

    def __init__(self, serve: Serve, audit: CallAudit | None) -> None:
        self._serve = serve
        self._audit = audit

    async def __call__(self, request: scheduler_pb2.SubmitJobsRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.SubmitJobsResponse:
        n = len(request.items)
        if not 1 <= n <= contract.MAX_SUBMIT_BATCH:
            raise InvalidArgument(f"items: a SubmitJobs call carries 1 to {contract.MAX_SUBMIT_BATCH} submits "
                                  f"(got {n})")
        # gather runs each item in a task of its own, with a copy of this call's context: the request id, acting
        # user and inline audit each item sets stay its own.
        results = await asyncio.gather(*(self._one(item, context, n) for item in request.items))
        return scheduler_pb2.SubmitJobsResponse(results=results)

    def _span(self, traceparent: str, size: int) -> AbstractContextManager[trace.Span]:
        attributes: dict[str, AttributeValue] = {
            "rpc.system": "grpc", "rpc.service": "trainyard.scheduler.v1.JobService", "rpc.method": "SubmitJob",
            "trainyard.submit_batch_size": size}
        if traceparent:
            return telemetry.continued(_tracer, SUBMIT, traceparent, attributes)
        return _tracer.start_as_current_span(SUBMIT, attributes=attributes)

    async def _one(self, item: scheduler_pb2.SubmitJobsItem, context: grpc.aio.ServicerContext,
                   size: int) -> scheduler_pb2.SubmitJobsResult:
        request_id = request_id_or_new(item.request_id or None)
        with self._span(item.traceparent, size) as span:
            try:
                if self._audit is None:
                    current_request_id.set(request_id)
                    response, carried = await self._serve(item.request), False
                else:
                    response, carried = await self._audit.run(
                        SUBMIT, AUDITED[SUBMIT], item.request, context, request_id=request_id,
                        forwarded=item.forwarded_audit_entry or None, serve=lambda: self._serve(item.request))
                return scheduler_pb2.SubmitJobsResult(submitted=response, audit_carried=carried)
            except TrainyardError as exc:
                code = status_for(exc)
                span.set_status(Status(StatusCode.ERROR, exc.message))
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                return _error(code, exc.message, kind_of(exc))
            except Exception as exc:
                log.error("unhandled error in a SubmitJobs item", exc_info=exc)
                span.set_status(Status(StatusCode.ERROR, _INTERNAL))
                return _error(grpc.StatusCode.INTERNAL, _INTERNAL)
