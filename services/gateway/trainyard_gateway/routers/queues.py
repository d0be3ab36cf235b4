"""/v1/queues: the operator's queues. Any valid token may list them (users pick a queue at submit);
creating, replacing and deleting one takes an operator token and is logged with the operator's identity."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response

from ..auth import Deps, QueueReader, QueueWriter
from ..schemas.common import error_responses
from ..schemas.queues import Queue, QueueList, QueuePut
from .params import QueueName

router = APIRouter(prefix="/v1/queues", tags=["queues"])
log = logging.getLogger(__name__)


@router.get("", response_model=QueueList, summary="List queues", responses=error_responses(401, 403, 429, 503))
async def list_queues(_: QueueReader, deps: Deps) -> QueueList:
    return QueueList(queues=await deps.scheduler.list_queues())


@router.put("/{name}", response_model=Queue, summary="Create or replace a queue (operator)",
            description="Answers 201 when the queue was created, 200 when an existing one was replaced.",
            responses={201: {"model": Queue, "description": "Created"},
                       **error_responses(400, 401, 403, 409, 429, 503)})
async def put_queue(name: QueueName, body: QueuePut, principal: QueueWriter, deps: Deps,
                    response: Response) -> Queue:
    queue, created = await deps.scheduler.put_queue(name, body)
    response.status_code = 201 if created else 200
    log.info("queue stored", extra={"queue": name, "was_created": created, "operator": principal.user})
    return queue


@router.delete("/{name}", response_model=Queue, summary="Delete a queue (operator)",
               description='Refused (409 failed_precondition) for "default" and for a queue that unfinished jobs '
                           "name.",
               responses=error_responses(400, 401, 403, 404, 409, 429, 503))
async def delete_queue(name: QueueName, principal: QueueWriter, deps: Deps) -> Queue:
    queue = await deps.scheduler.delete_queue(name)
    log.info("queue deleted", extra={"queue": name, "operator": principal.user})
    return queue
