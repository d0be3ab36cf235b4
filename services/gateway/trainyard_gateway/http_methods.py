"""OPTIONS and 405 Method Not Allowed, both with an `Allow` header (RFC 9110 §9.3.7 and §15.5.6: a 405
MUST carry `Allow`).

- OPTIONS on a path the API serves answers 204 with `Allow` listing that path's methods, OPTIONS included.
  No token is needed: it says what the API is, not what a caller may do.
- Any other method the path does not have answers 405 with the same `Allow` and the usual error body.
- Paths nothing serves fall through to the router (404).

The methods are those the OpenAPI document lists for the path (so `Allow` and the document cannot differ);
documentation routes outside it (/openapi.json, /docs) are left to the router. Two templates can match
one path, because a path parameter takes anything but '/': "/v1/jobs/x:cancel" matches both
"/v1/jobs/{job_id}" and "/v1/jobs/{job_id}:cancel". The template with more literal text wins (an id never
holds ':'), so `Allow` names the methods of the operation the path means; Starlette's own 405 took the first
route in order and answered `Allow: GET` there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .http_errors import error_response

_PARAM = re.compile(r"{[^}]*}")


@dataclass(frozen=True)
class _Template:
    regex: re.Pattern[str]
    literal: int  # characters of the template that are not parameters
    methods: frozenset[str]
    head: str
    exact: str | None  # the path itself, for a template without parameters


_HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _templates(document: dict[str, Any]) -> list[_Template]:
    out = []
    for path, item in document.get("paths", {}).items():
        # As Starlette compiles a route's path: a parameter takes anything but '/'. re.split with a group
        # alternates literal text (even places) and parameter names (odd places).
        parts = re.split(r"{([^}]*)}", path)
        pattern = "".join(re.escape(part) if i % 2 == 0 else "[^/]+" for i, part in enumerate(parts))
        regex = re.compile(f"^{pattern}$")
        methods = frozenset(m.upper() for m in item if m in _HTTP_METHODS)
        out.append(_Template(regex, len(_PARAM.sub("", path)), methods, _head(path), None if "{" in path else path))
    return out


def _head(path: str) -> str:
    """The first two segments of a path ("/v1/jobs" of "/v1/jobs/x:cancel"): a template whose head has no
    parameter can match only paths of the same head."""
    return "/".join(path.split("/", 3)[:3])


class Templates:
    """The templates by head, so a request is matched against its own resource's few, not every one."""

    def __init__(self, templates: list[_Template]) -> None:
        # A template without parameters that is the path itself has the most literal text of any that match it
        # (a parameter takes at least one character): its methods are the answer, found by one look-up.
        self._exact = {t.exact: t.methods for t in templates if t.exact is not None}
        self._by_head: dict[str, list[_Template]] = {}
        self._anywhere: list[_Template] = []  # a parameter in the head: tried for every path
        for t in templates:
            if "{" in t.head:
                self._anywhere.append(t)
            else:
                self._by_head.setdefault(t.head, []).append(t)

    def allowed_methods(self, path: str) -> frozenset[str] | None:
        """The methods of the operation `path` names, or None when no route serves it."""
        exact = self._exact.get(path)
        if exact is not None:
            return exact
        candidates = self._by_head.get(_head(path), [])
        matching = [t for t in (*candidates, *self._anywhere) if t.regex.match(path)]
        if not matching:
            return None
        best = max(t.literal for t in matching)
        return frozenset().union(*(t.methods for t in matching if t.literal == best))


class AllowedMethods:
    """ASGI middleware: answers OPTIONS and unsupported methods itself, passes everything else on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._templates: Templates | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._templates is None:  # routes are all added by the first request
            app = scope.get("app")
            self._templates = Templates(_templates(app.openapi()) if isinstance(app, FastAPI) else [])
        method = str(scope["method"]).upper()
        methods = self._templates.allowed_methods(str(scope["path"]))
        if methods is None or method in methods:
            await self.app(scope, receive, send)
            return
        allow = ", ".join([*sorted(methods), "OPTIONS"])
        if method == "OPTIONS":
            response: Response = Response(status_code=204, headers={"Allow": allow})
        else:
            response = error_response(405, "method_not_allowed",
                                      f"{method} is not allowed on {scope['path'][:200]}; allowed: {allow} (see "
                                      "/openapi.json)", headers={"Allow": allow})
        await response(scope, receive, send)


def install(app: FastAPI) -> None:
    app.add_middleware(AllowedMethods)
