"""The read view (job_view.py) behind the routes of /v1/jobs: a GET or a page answered from it as the JSON bytes
the API sends, or None when the scheduler must answer (the route then calls it, as before the view).

The filter is built as the scheduler builds it (its own `job_filter_from_pb` over the very ListJobsRequest the
gateway would send), and checked and its page token decoded by the scheduler's rules: a bad filter or token
is refused with the error the scheduler would have sent, whoever answers. A view-served answer carries
`X-Trainyard-Revision`: the etcd revision it shows.
"""

from __future__ import annotations

import json

from fastapi import Response

from trainyard_scheduler.domain import listing
from trainyard_scheduler.domain.listing import JobFilter
from trainyard_scheduler.grpc.convert import job_filter_from_pb

from . import convert
from .job_view import JobView
from .job_view_pages import has_time_bounds
from .schemas.jobs import JobQuery

REVISION_HEADER = "X-Trainyard-Revision"
MEDIA_TYPE = "application/json"


def job_filter(query: JobQuery) -> JobFilter:
    """The scheduler's filter for `query` (InvalidArgument as ListJobs answers it, for one no job matches)."""
    request = convert.job_query_to_pb(query, page_size=1, page_token="")
    flt = job_filter_from_pb(request, request.team)  # the gateway's team is the team a call acts for
    listing.check_filter(flt)
    return flt


def revision_headers(revision: int) -> dict[str, str]:
    return {REVISION_HEADER: str(revision)} if revision else {}


async def get_job(view: JobView, job_id: str, *, team: str, revision: int) -> Response | None:
    if not await view.current(revision):
        view.count("get: view not current")
        return None
    job = view.get(job_id, team)  # NotFound for another team's job
    if job is None:
        view.count("get: not live")
        return None
    view.count("get: view")
    return Response(job.body, media_type=MEDIA_TYPE, headers=revision_headers(view.revision))


async def list_jobs(view: JobView, query: JobQuery, *, page_size: int, page_token: str,
                    revision: int) -> Response | None:
    flt = job_filter(query)
    before = listing.decode_token(page_token, flt)  # InvalidPageToken (422), as ListJobs refuses it
    if has_time_bounds(flt):
        view.count("list: time bounds")
        return None
    if not await view.current(revision):
        view.count("list: view not current")
        return None
    page = view.page(flt, before=before, limit=page_size)
    if page is None:
        view.count("list: reaches the history")
        return None
    view.count("list: view")
    token = listing.encode_token(page.jobs[-1].id, flt) if page.more and page.jobs else ""
    body = b'{"jobs":[' + b",".join(j.list_body for j in page.jobs) + b'],"next_page_token":' + \
        json.dumps(token).encode() + b"}"
    return Response(body, media_type=MEDIA_TYPE, headers=revision_headers(view.revision))
