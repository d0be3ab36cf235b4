"""The fast path of `GET /v1/jobs/{id}` (view_fast_path.py): every request gets the answer the route gives, and
the route is left out only for the answers the read view gives.

Against a real deployment (scheduler with mTLS and a history store, real etcd, a gateway), each request is sent
to two apps over the same dependencies (the view, the tokens, the scheduler client): the gateway's app as
`create_app` builds it, and the same app without the fast path, which is how every request was answered
before it. Their answers must be equal: status, body and the headers a client reads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from trainyard_gateway.app import create_app
from trainyard_gateway.deps import GatewayDeps
from trainyard_gateway.http_metrics import DURATIONS
from trainyard_gateway.rate_limit import TokenBuckets
from trainyard_gateway.view_fast_path import TEMPLATE, ViewFastPath

from .view_support import Deployment, deployment, reasons_written

REVISION = "X-Trainyard-Revision"
SPEC: dict[str, Any] = {"name": "train", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}
# What a client reads besides the status and the body.
COMPARED_HEADERS = ("content-type", "content-length", "www-authenticate", "retry-after", "allow",
                    REVISION.lower())


@pytest.fixture
async def live(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path,
               pki_dir: Path) -> AsyncIterator[Deployment]:
    async with deployment(etcd_settings, key_prefix + "fast", tmp_path, pki_dir) as d:
        yield d


def _deps(d: Deployment, **changes: Any) -> GatewayDeps:
    deps = d.gateway.app.app.state.deps  # type: ignore[union-attr]
    assert isinstance(deps, GatewayDeps)
    return dataclasses.replace(deps, **changes)


def _apps(deps: GatewayDeps) -> tuple[FastAPI, FastAPI]:
    """The app as the gateway serves it, and the same app without the fast path."""
    fast = create_app(deps, traced=False)
    routed = create_app(deps, traced=False)
    before = len(routed.user_middleware)
    routed.user_middleware = [m for m in routed.user_middleware if m.cls is not ViewFastPath]
    assert len(routed.user_middleware) == before - 1, "create_app installs the fast path"
    return fast, routed


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def _answer(reply: httpx.Response) -> tuple[int, Any, dict[str, str]]:
    try:
        body: Any = reply.json()
    except ValueError:
        body = reply.content
    return reply.status_code, body, {h: reply.headers[h] for h in COMPARED_HEADERS if h in reply.headers}


async def _both(fast: httpx.AsyncClient, routed: httpx.AsyncClient, path: str,
                headers: list[tuple[str, str]], method: str = "GET") -> tuple[int, Any, dict[str, str]]:
    got = _answer(await fast.request(method, path, headers=headers))
    want = _answer(await routed.request(method, path, headers=headers))
    assert got == want, f"{method} {path} {[h for h, _ in headers]}"
    return got


async def test_every_answer_is_the_routes(live: Deployment) -> None:
    alice = await live.gateway.create_token("vision", "alice")
    bob = await live.gateway.create_token("nlp", "bob")
    logs_only = await live.gateway.create_token("vision", "carol", scopes=["jobs:write"])
    async with live.gateway.client(alice) as http:
        created = await http.post("/v1/jobs", json=SPEC)
        assert created.status_code == 201, created.text
        await reasons_written(http, [created.json()["id"]])  # the job as it stays: both apps see the same
    job_id = created.json()["id"]
    written = int(created.headers[REVISION])
    fast, routed = _apps(_deps(live, limiter=TokenBuckets(1000.0, 1000)))

    def auth(token: str) -> list[tuple[str, str]]:
        return [("Authorization", f"Bearer {token}")]

    async with _client(fast) as f, _client(routed) as r:
        own = await _both(f, r, f"/v1/jobs/{job_id}", auth(alice))
        assert own[0] == 200 and own[1]["id"] == job_id and REVISION.lower() in own[2]
        view_revision = own[2][REVISION.lower()]
        assert (await _both(f, r, f"/v1/jobs/{job_id}", auth(live.gateway.admin_token)))[0] == 200
        assert (await _both(f, r, f"/v1/jobs/{job_id}", auth(bob)))[0] == 404  # another team's job
        assert (await _both(f, r, "/v1/jobs/job-never-submitted", auth(alice)))[0] == 404  # the scheduler's
        refusals = DURATIONS.series("GET", TEMPLATE, "401")
        counted = sum(refusals.counts)
        assert (await _both(f, r, f"/v1/jobs/{job_id}", []))[0] == 401
        assert sum(refusals.counts) == counted + 2, "both refusals counted under the route's template"
        assert (await _both(f, r, f"/v1/jobs/{job_id}", [("Authorization", "Bearer ty_not-a-token-at-all-x")]))[0] \
            == 401
        assert (await _both(f, r, f"/v1/jobs/{job_id}", [("Authorization", "Basic YWxpY2U6eA==")]))[0] == 401
        assert (await _both(f, r, f"/v1/jobs/{job_id}", auth(logs_only)))[0] == 403
        assert (await _both(f, r, "/v1/jobs/Not_An_Id", auth(alice)))[0] == 400
        assert (await _both(f, r, f"/v1/jobs/{job_id}?verbose=1", auth(alice)))[0] == 200
        assert (await _both(f, r, f"/v1/jobs/{job_id}", auth(alice), method="HEAD"))[0] == 405
        # What the route parses its own way (surrounding spaces, a sign) is left to it.
        assert (await _both(f, r, f"/v1/jobs/{job_id}", [*auth(alice), (REVISION, " 7")]))[0] == 200
        assert (await _both(f, r, f"/v1/jobs/{job_id}", [*auth(alice), (REVISION, "+7")]))[0] in (200, 400)
        for revision in ("abc", "-1", "9" * 20, str(2**63)):
            answer = await _both(f, r, f"/v1/jobs/{job_id}", [*auth(alice), (REVISION, revision)])
            assert answer[0] == 400, revision
        for revision in (str(written), view_revision, "0", "00"):
            answer = await _both(f, r, f"/v1/jobs/{job_id}", [*auth(alice), (REVISION, revision)])
            assert answer[0] == 200 and answer[1] == own[1], revision
        twice = await _both(f, r, f"/v1/jobs/{job_id}", [*auth(alice), (REVISION, "1"), (REVISION, "2")])
        assert twice[0] == 200
        # A revision the view does not reach: it waits its job_view_wait_s, then the scheduler answers.
        later = await _both(f, r, f"/v1/jobs/{job_id}", [*auth(alice), (REVISION, str(2**62))])
        assert later[0] == 200 and later[1] == own[1]


async def test_a_token_out_of_requests_is_refused_alike_and_spends_one_request_per_read(live: Deployment) -> None:
    """Burst 2, a refill in 1000 s: a read the view answers spends one request, and so does one it hands to the route
    (the scheduler answers a job that is not live), which finds the caller authenticated: the third read is the
    first refused."""
    alice = await live.gateway.create_token("vision", "alice")
    async with live.gateway.client(alice) as http:
        job_id = (await http.post("/v1/jobs", json=SPEC)).json()["id"]
        await reasons_written(http, [job_id])
    answers = []
    headers = {"Authorization": f"Bearer {alice}"}
    # Each app with a bucket of its own.
    fast_app = _apps(_deps(live, limiter=TokenBuckets(0.001, 2)))[0]
    routed_app = _apps(_deps(live, limiter=TokenBuckets(0.001, 2)))[1]
    for app in (fast_app, routed_app):
        async with _client(app) as client:
            answers.append([_answer(await client.get(f"/v1/jobs/{job_id}", headers=headers)),
                            _answer(await client.get("/v1/jobs/job-never-submitted", headers=headers)),
                            _answer(await client.get(f"/v1/jobs/{job_id}", headers=headers))])
    fast, routed = answers
    assert fast == routed
    assert [status for status, _, _ in fast] == [200, 404, 429]
    assert fast[2][1]["error"]["code"] == "resource_exhausted" and "retry-after" in fast[2][2]


class Direct:
    """The middleware alone, over an app that records the paths that reach it and answers 299; `request` sends it
    a GET as uvicorn would, for the FastAPI `app` the scope names, and returns the scope as the request left it."""

    def __init__(self) -> None:
        self.reached: list[str] = []
        self.sent: list[Message] = []
        self.middleware = ViewFastPath(self._inner)

    async def _inner(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reached.append(str(scope["path"]))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def request(self, app: FastAPI, path: str, token: str, query: bytes = b"") -> Scope:
        scope: Scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                        "query_string": query, "root_path": "", "app": app, "state": {},
                        "headers": [(b"authorization", f"Bearer {token}".encode())]}

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            self.sent.append(message)

        await self.middleware(scope, receive, send)
        return scope


async def test_only_what_the_view_cannot_answer_reaches_the_route(live: Deployment) -> None:
    """A live job is answered without the app behind, and what the router sets for the requests it serves is
    set (the route object and the path parameters, which the metrics, the access log and the trace name the
    request by)."""
    alice = await live.gateway.create_token("vision", "alice")
    async with live.gateway.client(alice) as http:
        job_id = (await http.post("/v1/jobs", json=SPEC)).json()["id"]
    gateway = create_app(_deps(live), traced=False)
    direct = Direct()
    served = await direct.request(gateway, f"/v1/jobs/{job_id}", alice)
    assert direct.reached == [] and direct.sent[0]["status"] == 200
    assert json.loads(direct.sent[1]["body"])["id"] == job_id
    assert served["route"].path == TEMPLATE and served["path_params"] == {"job_id": job_id}
    direct.sent.clear()
    refused = await direct.request(gateway, f"/v1/jobs/{job_id}", "ty_not-a-token-at-all-x")
    assert direct.reached == [] and direct.sent[0]["status"] == 401
    assert refused["route"].path == TEMPLATE and refused["path_params"] == {"job_id": job_id}
    # Not live: the route asks the scheduler (it would set the same route, as the router matched it).
    assert (await direct.request(gateway, "/v1/jobs/job-never-submitted", alice))["route"].path == TEMPLATE
    assert direct.reached == ["/v1/jobs/job-never-submitted"]
    for path, query in ((f"/v1/jobs/{job_id}", b"x=1"), (f"/v1/jobs/{job_id}/logs", b""), ("/v1/jobs", b"")):
        passed = await direct.request(gateway, path, alice, query)
        assert direct.reached[-1] == path and "route" not in passed, path


async def test_an_app_without_the_route_is_left_alone(live: Deployment) -> None:
    """The same deps behind an app that does not serve GET /v1/jobs/{id}: the request is that app's."""
    alice = await live.gateway.create_token("vision", "alice")
    async with live.gateway.client(alice) as http:
        job_id = (await http.post("/v1/jobs", json=SPEC)).json()["id"]
    other = FastAPI()
    other.state.deps = _deps(live)
    direct = Direct()
    path = f"/v1/jobs/{job_id}"
    await direct.request(other, path, alice)
    assert direct.reached == [path] and direct.sent[0]["status"] == 299
