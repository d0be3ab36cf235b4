"""The OpenAPI document, as the gateway answers: FastAPI's generation, less what this API never sends.

FastAPI documents a 422 `HTTPValidationError` body for every route with parameters; this API answers
validation errors with 400 and the ErrorBody of `http_errors`, which each route declares. The generated 422s
(and their component schemas) are removed, so the document lists exactly the statuses each route answers.
Every route that authenticates (a dependency of `auth` marked AUTHENTICATES) requires the bearer scheme.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from .auth import AUTHENTICATES, bearer_scheme

_FASTAPI_VALIDATION = "#/components/schemas/HTTPValidationError"


def _is_fastapi_validation(response: dict[str, Any]) -> bool:
    content = response.get("content", {})
    return any(media.get("schema", {}).get("$ref") == _FASTAPI_VALIDATION for media in content.values())


def _authenticates(dependant: Dependant) -> bool:
    return bool(getattr(dependant.call, AUTHENTICATES, False)) or any(_authenticates(d) for d in
                                                                        dependant.dependencies)


def _require_bearer(routers: Sequence[APIRouter], doc: dict[str, Any]) -> None:
    name = bearer_scheme.scheme_name
    doc.setdefault("components", {}).setdefault("securitySchemes", {})[name] = \
        bearer_scheme.model.model_dump(mode="json", by_alias=True, exclude_none=True)
    for route in (r for router in routers for r in router.routes):
        if isinstance(route, APIRoute) and route.include_in_schema and _authenticates(route.dependant):
            for method in route.methods or ():
                operation = doc.get("paths", {}).get(route.path_format, {}).get(method.lower())
                if operation is not None:
                    operation["security"] = [{name: []}]


def document(app: FastAPI, routers: Sequence[APIRouter] = ()) -> dict[str, Any]:
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                          description=app.description, routes=app.routes)
        for item in doc.get("paths", {}).values():
            for operation in item.values():
                responses = operation.get("responses", {})
                if _is_fastapi_validation(responses.get("422", {})):
                    del responses["422"]
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _require_bearer(routers, doc)
        app.openapi_schema = doc
    return app.openapi_schema


def install(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """`routers`: those the app includes (each route that authenticates gets the bearer requirement)."""
    app.openapi = lambda: document(app, routers)  # type: ignore[method-assign]
