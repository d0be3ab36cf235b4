"""/v1/jobs/{id}/logs and /v1/jobs/{id}/events: a job's output and its changes, read once or followed as
server-sent events (`sse`). Reads of a job like `GET /v1/jobs/{id}`: the same role check, another team's job
is 404, and the job is read before any stream starts, so every refusal is an ordinary JSON error and a
stream that starts is one the caller may see. Opening a stream is one request of the token's rate limit.
The designs are in `joblogs` (the plain read and its fair cap), `logstream` (following, resuming) and
`jobevents` (watching)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import Field

from trainyard_core import contract as c

from .. import roles
from ..auth import Deps, JobReader, team_scope
from ..clients_streams import watch_job
from ..jobevents import EVENT_ID_PATTERN, job_events
from ..joblogs import logs_of
from ..logstream import MAX_ID_LENGTH, POSITIONS_PATTERN, FollowQuery, LogFollow, decode_positions
from ..schemas.common import error_responses
from ..schemas.streams import JobEvents, sse_content
from ..sse import LAST_EVENT_ID_HEADER, event_stream
from .params import JobId, Time

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

MAX_RANK_FILTERS = 1024
Rank = Annotated[int, Field(ge=0, le=c.INT32_MAX)]

LOGS_DESCRIPTION = """\
Without `follow`: plain text, one line per output line, each prefixed with its rank (`[rank 0] ...`), ordered
by attempt, then rank. At most the gateway's line cap (100,000 lines unless configured) is answered, shared
fairly: every rank keeps its newest lines, as many as an equal share allows, and a leading `[gateway]` line
says what was left out. Nodes that cannot be reached are named in trailing `[gateway]` lines (503 only when
none answers).

With `follow=true`: server-sent events (`text/event-stream`), one per line: `event: line`, `data:
{"rank", "attempt", "node", "stream", "time", "text"}` (`time`: when the worker wrote it; null for lines of
files an agent wrote before it kept a time per line). A
node that cannot be read for now: `event: warning`, `data: {"node", "attempt", "ranks", "message"}`; it is
tried again. When the job has ended (with `attempt=N`: when that attempt is over) and every node's stream has
drained: `event: end`, `data: {"state", "exit_code", "message"}`, and the stream closes. By default the
current attempt and every later one are followed (across restarts). A comment line every 15 s keeps an idle
connection open. Every `line` event's `id` is the last line sent of every rank (each line's sequence number in
its attempt and rank): send the last one back as `Last-Event-ID` (or `?last_event_id=`) and the stream resumes
after it, nothing sent twice and nothing left out, while the agents keep the lines (even after log rotation
dropped older ones). Ids are opaque; one handed out by a gateway of an earlier version still resumes, but may
send again lines the client already has.

Attempts: the current one by default, `attempt=N` one of them, `attempt=0` every one, each read from the nodes
it ran on (an earlier attempt's logs are on its own nodes, for as long as their agents keep them). `since`:
only the lines written at or after it (a line of unknown time, from files an agent wrote before it kept a time
per line, is kept unless a later line of its rank was written before `since`), and no attempt that ended
before it. `tail=N`: the last N lines of each rank (of those
`since` selects; with `follow`, then the new ones). `rank` (repeatable): only these ranks."""

EVENTS_DESCRIPTION = """\
Without `watch`: the job's recorded events (JSON). With `watch=true`: server-sent events, `event: job` with the
whole job (as `GET /v1/jobs/{id}` answers it) now and after every change, then `event: end`, `data: {"state",
"exit_code", "message", "finished_at"}` once it has ended, and the stream closes. An event's `id` is a digest
of the job it carries: sent back as `Last-Event-ID`, the resumed stream starts with the job only if it changed
since (with what was missed in its `events`)."""


@router.get("/{job_id}/logs", response_class=Response, summary="Logs of every rank of a job, or follow them",
            description=LOGS_DESCRIPTION,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}},
                                         **sse_content(("line", "warning", "end"), POSITIONS_PATTERN,
                                                       "with follow=true: one event")},
                             "description": "the merged logs (text/plain), or with follow=true their events"},
                       **error_responses(400, 401, 403, 404, 429, 503)})
async def get_job_logs(
    job_id: JobId,
    principal: JobReader,
    deps: Deps,
    follow: Annotated[bool, Query(description="stream the lines as server-sent events until the job ends")] = False,
    tail: Annotated[int, Query(ge=0, le=c.MAX_LOG_TAIL, description="last N lines of each rank; 0 for all")] = 0,
    attempt: Annotated[int | None, Query(ge=0, le=c.INT32_MAX, description="attempt to show; default the current "
                                                                           "one (with follow: and the later ones), "
                                                                           "0 for every attempt")] = None,
    rank: Annotated[list[Rank] | None, Query(max_length=MAX_RANK_FILTERS,
                                             description="only this rank (repeatable)")] = None,
    since: Annotated[Time | None, Query(description="only the lines written at or after this time (RFC 3339, "
                                                    "with a time zone); a line of unknown time is kept unless a later "
                                                    "line of its rank was written before it")] = None,
    last_event_id: Annotated[str, Query(max_length=MAX_ID_LENGTH, pattern=POSITIONS_PATTERN,
                                        description="with follow: resume after this event (for clients that "
                                                    "cannot send the Last-Event-ID header)")] = "",
    # A plain `str` (not `str | None`): the document then says string, never null, which no header can be.
    last_event_id_header: Annotated[str, Header(
        alias=LAST_EVENT_ID_HEADER, max_length=MAX_ID_LENGTH, pattern=POSITIONS_PATTERN,
        description="with follow: resume after this event")] = "",
) -> Response:
    team = team_scope(principal)
    show_addresses = roles.allows(principal, roles.Action.NODES_ADDRESSES)
    job = await deps.scheduler.get_job(job_id, team=team)  # 404 for another team's job, before any stream
    ranks = frozenset(rank or ())
    if not follow:
        text = await logs_of(deps.scheduler, deps.agents, job, tail_lines=tail, attempt=attempt, ranks=ranks,
                             since=since, max_lines=deps.settings.max_log_lines, show_addresses=show_addresses,
                             timeout_s=deps.settings.request_timeout_s)
        return PlainTextResponse(text)
    resume = last_event_id_header or last_event_id
    query = FollowQuery(job_id=job.id, team=team, attempt=attempt, ranks=ranks, since=since, tail=tail,
                        resume=decode_positions(resume) if resume else None, show_addresses=show_addresses)
    stream = LogFollow(deps.scheduler, deps.agents, query, job, timeout_s=deps.settings.request_timeout_s)
    return event_stream(stream.events(), on_close=stream.close)


@router.get("/{job_id}/events", response_class=Response, summary="A job's events, or watch its changes",
            description=EVENTS_DESCRIPTION,
            responses={200: {"model": JobEvents,
                             "content": sse_content(("job", "end"), EVENT_ID_PATTERN, "with watch=true: one event"),
                             "description": "the job's events (JSON), or with watch=true its changes"},
                       **error_responses(400, 401, 403, 404, 429, 503)})
async def get_job_events(
    job_id: JobId,
    principal: JobReader,
    deps: Deps,
    watch: Annotated[bool, Query(description="stream the job's changes as server-sent events until it "
                                             "ends")] = False,
    last_event_id: Annotated[str, Query(pattern=EVENT_ID_PATTERN,
                                        description="with watch: resume after this event")] = "",
    last_event_id_header: Annotated[str, Header(alias=LAST_EVENT_ID_HEADER, pattern=EVENT_ID_PATTERN,
                                                description="with watch: resume after this event")] = "",
) -> Response:
    team = team_scope(principal)
    if not watch:
        job = await deps.scheduler.get_job(job_id, team=team)
        body = JobEvents(job_id=job.id, state=job.state, events=job.events)
        return JSONResponse(body.model_dump(mode="json"))
    changes = watch_job(deps.scheduler, job_id, team=team)
    # 404 (or 503) here, as an HTTP error, before the stream starts.
    first = await anext(changes, None) or await deps.scheduler.get_job(job_id, team=team)
    return event_stream(job_events(deps.scheduler, first, changes, team=team,
                                   last_event_id=last_event_id_header or last_event_id))
