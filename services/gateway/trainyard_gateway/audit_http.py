"""The gateway's HTTP audit: one audit entry per request on /v1/... other than GET, HEAD and OPTIONS.

The middleware sits outermost (outside the catch-all that turns a crash into a 500), holds the answer
back until the entry is written (so a caller never hears of an action that the log does not hold; a
failed write is logged and counted, and the caller still gets the true answer), and reads:
- who: the token's record that `auth.current_principal` left in `request.state.principal`
  (`user:<team>/<user>` and its role); `anonymous` when authentication failed (result unauthenticated);
- what: the method and the route template (`POST /v1/jobs/{job_id}:cancel`), the raw path when no route
  matched;
- on what: the path parameters (`job/j-...`, `node/gpu-01/gpu/3`, `queue/batch`, `team/vision`,
  `token/t-...`; `checkpoint/ckpt-...` as the checkpoint-store's entries name it, its job and tag in the
  detail), or for a create the new object's id from the answer (a job's `id`, a token's `token_id`; a
  resubmit's new job, the job it came from in the detail, or that job when the resubmit failed). The
  answer's `team`, when it has one, is the entry's team (an operator cancelling team vision's job, or tagging
  its checkpoint, is recorded under vision). The body of a request is never read, nor a token's secret kept;
- the result: `ok` below 400, else the error body's code (`permission_denied`, `not_found`, ...).

A submit's entry is not written by this middleware at all when the scheduler stored it: the gateway's
scheduler client forwards the entry with the `SubmitJob` call (`Forwarding`), the scheduler puts it into
the job's own create transaction, and says so in its answer (docs/architecture.md). Any other outcome (a
replay, a refusal, an error) is written here as usual.

Every audited answer carries `X-Request-Id`: the caller's, when it sent a valid one, else a fresh one; the
gateway's gRPC calls made for the request carry it as `x-request-id` metadata, so the scheduler's entry of
the same action has the same request id.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainyard_core.audit import (
    ANONYMOUS,
    GATEWAY_SERVICE,
    REQUEST_ID_HEADER,
    RESULT_OK,
    AuditEntry,
    AuditLog,
    current_request_id,
    record,
    request_id_or_new,
    user_principal,
)
from trainyard_core.clock import Clock, SystemClock

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SERVICE = GATEWAY_SERVICE
# Creates whose scheduler call may carry the gateway's entry in the action's own transaction (Forwarding).
FORWARDED_ROUTES = frozenset({("POST", "/v1/jobs")})
# Path parameter → the kind of thing it names. A GPU is named within its node.
_PARAM_KINDS: Mapping[str, str] = {"job_id": "job", "node_id": "node", "token_id": "token", "team": "team",
                                   "name": "queue"}
# Creates: the new object's id is in the answer (kind, path into the JSON body).
_CREATED: Mapping[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("POST", "/v1/jobs"): ("job", ("id",)),
    ("POST", "/v1/jobs/{job_id}:resubmit"): ("job", ("id",)),
    ("POST", "/v1/tokens"): ("token", ("token", "token_id")),
}
# Small fields of the answer worth keeping: a new token's owner and role, a job's name. Never the secret.
_ANSWER_DETAIL: Mapping[tuple[str, str], Mapping[str, tuple[str, ...]]] = {
    ("POST", "/v1/jobs"): {"name": ("name",), "user": ("user",)},
    ("POST", "/v1/jobs/{job_id}:resubmit"): {"name": ("name",), "user": ("user",),
                                             "resubmitted_from": ("spec", "labels", "resubmitted_from")},
    ("POST", "/v1/tokens"): {"user": ("token", "user"), "role": ("token", "role")},
}


def _dig(body: Any, path: tuple[str, ...]) -> str:
    for part in path:
        if not isinstance(body, dict):
            return ""
        body = body.get(part)
    return str(body) if isinstance(body, str | int | float | bool) else ""


def target_of(path_params: Mapping[str, Any], created: tuple[str, tuple[str, ...]] | None, body: Any) -> str:
    if created is not None:
        value = _dig(body, created[1])
        if value or not path_params:
            return f"{created[0]}/{value}" if value else ""
        # A create under another object (a resubmit) that failed: the object it was asked on.
    if "gpu_index" in path_params and "node_id" in path_params:
        return f"node/{path_params['node_id']}/gpu/{path_params['gpu_index']}"
    if "checkpoint_id" in path_params:  # as the checkpoint-store's own entries name it
        return f"checkpoint/{path_params['checkpoint_id']}"
    for param, kind in _PARAM_KINDS.items():
        if param in path_params:
            return f"{kind}/{path_params[param]}"
    return ""


def result_of(status: int, body: Any) -> tuple[str, str]:
    if status < 400:
        return RESULT_OK, ""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        return str(error["code"]), str(error.get("message", ""))
    # No error body: the request crashed before an answer began (the server then sends its own 500).
    return ("internal", "") if status == 500 else (f"http_{status}", "")


def _json_body(chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> Any:
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    if not content_type.startswith(b"application/json"):
        return None
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return None


@dataclass
class Forwarding:
    """The request being served, for a scheduler call that may carry the gateway's entry of it in the action's
    own transaction (trainyard_core.audit.InlineAudit): `entry` is the entry as this middleware would write it
    for a success, without the new object's id (the scheduler fills it in); `carried` is set once the
    scheduler said it stored it, and the middleware then writes nothing."""

    audit: HttpAudit
    scope: Scope
    request_id: str
    carried: bool = False

    def entry(self, answer: Mapping[str, str]) -> AuditEntry | None:
        """The entry of a success whose answer will hold `answer`'s fields; None for a route not forwarded."""
        route = self.scope.get("route")
        key = (str(self.scope.get("method", "")), str(getattr(route, "path", "")))
        if key not in FORWARDED_ROUTES:
            return None
        return self.audit.entry(self.scope, 201, dict(answer), self.request_id)


# The audited request being served (set by HttpAudit for the handler and the clients it calls).
forwarding: contextvars.ContextVar[Forwarding | None] = contextvars.ContextVar("forwarding", default=None)


class HttpAudit:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, sink: AuditLog | None, clock: Clock | None = None) -> None:
        self.app = app
        self._sink = sink
        self._clock = clock or SystemClock()

    def entry(self, scope: Scope, status: int, body: Any, request_id: str) -> AuditEntry:
        method = str(scope.get("method", ""))
        route = scope.get("route")
        template = str(getattr(route, "path", "") or scope.get("path", ""))
        principal = scope.get("state", {}).get("principal")
        team = str(getattr(principal, "team", "") or "")
        who = user_principal(team, str(getattr(principal, "user", ""))) if principal is not None else ANONYMOUS
        role = getattr(principal, "role", None)
        if role is None and principal is not None:
            role = "admin" if getattr(principal, "admin", False) else ""
        path_params = (scope.get("path_params") or {}) if route is not None else {}
        key = (method, template)
        result, message = result_of(status, body)
        detail: dict[str, object] = {"http_status": status}
        if "checkpoint_id" in path_params:  # the target names the checkpoint; its job and the tag go beside it
            detail.update({name: str(path_params[p]) for p, name in (("job_id", "job"), ("tag", "tag"))
                           if p in path_params})
        if status < 400:
            detail.update({name: v for name, path in _ANSWER_DETAIL.get(key, {}).items() if (v := _dig(body, path))})
        return AuditEntry.make(
            time=self._clock.now(), principal=who, role=str(role or ""), service=SERVICE,
            action=f"{method} {template}", target=target_of(path_params, _CREATED.get(key), body),
            result=result, message=message, request_id=request_id,
            team=_dig(body, ("team",)) or _dig(body, ("token", "team")) or str(path_params.get("team", "")) or team,
            detail=detail)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in READ_METHODS or not str(scope.get("path", "")) \
                .startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode())
        request_id = request_id_or_new(sent.decode("latin-1") if sent else None)
        current_request_id.set(request_id)
        forward = Forwarding(self, scope, request_id)
        forwarding.set(forward)
        held: list[Message] = []
        start: Message | None = None
        chunks: list[bytes] = []
        done = False

        async def flush(status: int) -> None:
            nonlocal done
            done = True
            if forward.carried and status < 400:
                return  # the scheduler stored this entry with the action itself
            headers = list(start["headers"]) if start is not None else []
            await record(self._sink, self.entry(scope, status, _json_body(chunks, headers), request_id))

        async def holding_send(message: Message) -> None:
            nonlocal start
            if done:
                await send(message)
                return
            if message["type"] == "http.response.start":
                start = {**message, "headers": [*message.get("headers", ()),
                                                (b"x-request-id", request_id.encode())]}
                return
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                held.append(message)
                if message.get("more_body", False):
                    return
                assert start is not None
                await flush(int(start["status"]))
                await send(start)
                for m in held:
                    await send(m)
                return
            await send(message)

        try:
            await self.app(scope, receive, holding_send)
        except BaseException:
            if not done:
                await flush(500)
            raise


def install(app: FastAPI, sink: AuditLog | None, clock: Clock | None = None) -> None:
    """Outermost middleware: call after every other `add_middleware` (http_errors.install included)."""
    app.add_middleware(HttpAudit, sink=sink, clock=clock)
