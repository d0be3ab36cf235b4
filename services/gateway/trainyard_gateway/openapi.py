"""The OpenAPI document, as the gateway answers: FastAPI's generation, less what this API never sends.

FastAPI documents a 422 `HTTPValidationError` body for every route with parameters; this API answers
validation errors with 400 and the ErrorBody of `http_errors`, which each route declares. The generated 422s
(and their component schemas) are removed, so the document lists exactly the statuses each route answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_FASTAPI_VALIDATION = "#/components/schemas/HTTPValidationError"


def _is_fastapi_validation(response: dict[str, Any]) -> bool:
    content = response.get("content", {})
    return any(media.get("schema", {}).get("$ref") == _FASTAPI_VALIDATION for media in content.values())


def document(app: FastAPI) -> dict[str, Any]:
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
        app.openapi_schema = doc
    return app.openapi_schema


def install(app: FastAPI) -> None:
    app.openapi = lambda: document(app)  # type: ignore[method-assign]
