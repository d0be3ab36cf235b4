"""`GET /v1/jobs/{job_id}` answered from the read view without FastAPI's routing and parameter solving.

`GET /v1/jobs/{id}` is the read other teams' services and scripts make over and over (a job's state, polled).
Answered from the view (job_view.py) the route's own work is a dictionary look-up, and FastAPI's route matching
over every router and its per-request dependency solving cost several times that. Measured in process (ASGI
calls through the whole middleware stack, the access log on, a token and a job the view holds): ~150 µs a GET
through the route, ~52 µs through this middleware; a bare FastAPI endpoint takes ~35 µs the same way.

This middleware, the innermost (inside the access log, the audit, the tracing and the method check, so all of
them see the request as before), serves exactly the requests whose answer it can give as the route would, and
passes every other request on, unchanged, to the app:

- `GET` (not HEAD), no query string, no root path, a path `/v1/jobs/<id>` whose id follows the id rule
  (`contract.ID`) and is not a literal path the API also serves;
- at most one `X-Trainyard-Revision` header, of decimal digits within int64 (what the route's `MinRevision`
  takes; anything else, including what the route would refuse, goes to the route for its own answer);
- the caller authenticated and allowed `jobs.read` by the routes' own function (`auth.authorize`: the token,
  its expiry, the rate limit, the role and scopes); its refusals are answered by the error mapping's own
  function (`http_errors.domain_error_response`), as the route's exception handler answers them;
- the view answers (`job_view_reads.get_job`, the route's own call). When it cannot (not ready, not current,
  the job is not live) the request goes on to the route, which finds the caller already authenticated in the
  request's state (`_authenticate` runs once per request: the rate limit is spent once) and asks the
  scheduler as it always did.

A request taken here carries what the router would have set before the route's dependencies ran, answered or
refused: the route (`scope["route"]`, the very APIRoute object, so the metrics and the trace name it
`/v1/jobs/{job_id}`) and the path parameters.
tests/gateway/test_view_fast_path.py compares the answers of the app with and without this middleware
request by request.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from trainyard_core import contract
from trainyard_core.errors import TrainyardError

from . import job_view_reads
from .auth import authorize, team_scope
from .deps import GatewayDeps
from .http_errors import domain_error_response
from .roles import Action
from .routers import jobs

TEMPLATE = "/v1/jobs/{job_id}"
_PREFIX = jobs.router.prefix + "/"
_REVISION_HEADER = job_view_reads.REVISION_HEADER.lower().encode("latin-1")
# A revision as the route's parameter takes one: the digits of an etcd revision (the watch's event ids), at most
# int64's largest.
_REVISION = re.compile(jobs.EVENT_ID)


def _route(app: FastAPI) -> APIRoute | None:
    """The GET route of TEMPLATE, as the router sets it in the scope of the requests it serves; None when `app`
    does not serve it (then nothing is taken here)."""
    if "get" not in app.openapi().get("paths", {}).get(TEMPLATE, {}):
        return None
    for route in jobs.router.routes:
        if isinstance(route, APIRoute) and route.path == TEMPLATE and "GET" in (route.methods or ()):
            return route
    return None


def _literals(app: FastAPI) -> frozenset[str]:
    """Paths `/v1/jobs/<literal>` the API also serves: never taken for a job id."""
    paths = app.openapi().get("paths", {})
    return frozenset(p[len(_PREFIX):] for p in paths if p.startswith(_PREFIX) and "/" not in p[len(_PREFIX):]
                     and "{" not in p)


def _revision(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The X-Trainyard-Revision the request names (0: none); None when the route must judge it."""
    sent = [value for name, value in headers if name == _REVISION_HEADER]
    if not sent:
        return 0
    if len(sent) > 1 or not _REVISION.match(sent[0].decode("latin-1")):
        return None
    value = int(sent[0])
    return value if value <= jobs.INT64_MAX else None


class ViewFastPath:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._route: APIRoute | None = None
        self._literals: frozenset[str] = frozenset()
        self._ready = False

    def _prepare(self, app: Any) -> None:
        if isinstance(app, FastAPI):
            self._route = _route(app)
            self._literals = _literals(app)
        self._ready = True

    def _job_id(self, scope: Scope) -> str | None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope.get("query_string") \
                or scope.get("root_path"):
            return None
        path = str(scope["path"])
        if not path.startswith(_PREFIX):
            return None
        job_id = path[len(_PREFIX):]
        if not contract.ID.matches(job_id) or job_id in self._literals:
            return None
        return job_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._ready and scope["type"] == "http":  # the app's routes are all in place by its first request
            self._prepare(scope.get("app"))
        job_id = self._job_id(scope) if self._route is not None else None
        deps = getattr(getattr(scope.get("app"), "state", None), "deps", None) if job_id else None
        view = deps.job_view if isinstance(deps, GatewayDeps) else None
        revision = _revision(scope["headers"]) if view is not None else None
        if job_id is None or view is None or revision is None:
            await self.app(scope, receive, send)
            return
        # As the router sets them before the route's dependencies run (a refusal is counted under the route too).
        scope["route"] = self._route
        scope["path_params"] = {"job_id": job_id}
        try:
            principal = await authorize(Request(scope, receive), Action.JOBS_READ)
            response = await job_view_reads.get_job(view, job_id, team=team_scope(principal), revision=revision)
        except TrainyardError as exc:
            response = domain_error_response(exc)
        if response is None:  # the view cannot answer: the route asks the scheduler
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def install(app: FastAPI) -> None:
    """Innermost: call before every other `add_middleware`."""
    app.add_middleware(ViewFastPath)
