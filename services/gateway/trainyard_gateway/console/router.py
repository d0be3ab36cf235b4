"""/console: the web console's files, served from this package (`static/`), outside the API's OpenAPI document.

The files are read once, when the router is made, and answered from memory with an ETag (a reload after an
upgrade gets the new files; an unchanged file answers 304). Only names of the package's own files are served;
anything else is 404, so no path leads out of the directory. Every answer carries a Content-Security-Policy
that lets the page load only its own scripts and styles and talk only to this origin: the token the user logs
in with stays in the tab's sessionStorage and goes out only as the Authorization header of the API's requests.

The pages need no authentication of their own (they hold no data); every request they make to /v1 does.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from trainyard_core.errors import NotFound

STATIC = Path(__file__).parent / "static"
PREFIX = "/console"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\.(html|js|css|svg)$")
_TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
          "css": "text/css; charset=utf-8", "svg": "image/svg+xml"}
HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    etag: str


def load(directory: Path = STATIC) -> dict[str, _File]:
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and _NAME.match(path.name):
            body = path.read_bytes()
            files[path.name] = _File(body, _TYPES[path.suffix[1:]], '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    if "index.html" not in files:
        raise FileNotFoundError(f"the console's index.html is missing from {directory}: the package is incomplete")
    return files


def make_router(directory: Path = STATIC, *, prometheus_url: str = "") -> APIRouter:
    """`prometheus_url`: where the console links to (the console_prometheus_url setting; empty: no link),
    answered as /console/config.json."""
    files = load(directory)
    config = json.dumps({"prometheus_url": prometheus_url}).encode()
    router = APIRouter(prefix=PREFIX, include_in_schema=False)

    def answer(request: Request, name: str) -> Response:
        found = files.get(name)
        if found is None:
            raise NotFound(f"the console has no file {name[:80]!r}")
        headers = {**HEADERS, "ETag": found.etag}
        if request.headers.get("if-none-match") == found.etag:
            return Response(status_code=304, headers=headers)
        return Response(found.body, media_type=found.media_type, headers=headers)

    @router.get("")
    async def root() -> RedirectResponse:
        return RedirectResponse(PREFIX + "/", status_code=307)

    @router.get("/")
    async def index(request: Request) -> Response:
        return answer(request, "index.html")

    @router.get("/config.json")
    async def settings() -> Response:
        return Response(config, media_type="application/json", headers=HEADERS)

    @router.get("/{name}")
    async def static_file(name: str, request: Request) -> Response:
        return answer(request, name)

    return router
