"""What the stream routes answer besides their events' data (schemas/logs.py): a job's recorded events as JSON
(`GET /v1/jobs/{id}/events`) and the OpenAPI description of a server-sent event stream.

OpenAPI before 3.2 has no `itemSchema`; for `text/event-stream` the `schema` then describes one event, as
an SSE parser yields it (`event`, `data`, `id`), which is how schemathesis and other tools read it. The JSON
inside `data` is described in the route's text and by the models named there.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import Field

from .common import ApiModel
from .jobs import JobEvent, JobStateName


class JobEvents(ApiModel):
    job_id: str
    state: JobStateName
    events: list[JobEvent] = Field(description="what happened to the job, oldest first (the latest 50 the "
                                               "scheduler keeps)")


class JobEnd(ApiModel):
    """`event: end` of the events stream: the job's final state."""

    state: JobStateName
    exit_code: int | None
    message: str
    finished_at: datetime | None


def sse_content(kinds: Sequence[str], id_pattern: str, about: str) -> dict[str, Any]:
    """The `content` entry of a 200 that may be an event stream: one event as an SSE parser reads it."""
    return {"text/event-stream": {"schema": {
        "type": "object",
        "description": about,
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "enum": list(kinds)},
            "data": {"type": "string", "description": "one line of JSON"},
            "id": {"type": "string", "pattern": id_pattern,
                   "description": "send the last one seen back as `Last-Event-ID` to resume after it"},
            "retry": {"type": "integer"},
        },
    }}}
