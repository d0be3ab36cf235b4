"""The one error body every failure of the API answers with, and the base of every model."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(ApiModel):
    code: str = Field(description="machine-readable: invalid_argument, unauthenticated, permission_denied, "
                                  "not_found, already_exists, conflict, failed_precondition, "
                                  "resource_exhausted, unavailable, internal")
    message: str = Field(description="what is wrong and, where it helps, how to fix it")


class ErrorBody(ApiModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route: the listed statuses plus every other 4xx/5xx, all ErrorBody.

    Declaring 4XX also stops FastAPI from documenting its default 422 body, which this API never sends.
    """
    described = {400: "Invalid request (the message names the field)", 401: "Missing or invalid token",
                 403: "Not allowed for this token", 404: "Not found (or belongs to another team)",
                 409: "Conflicts with the current state", 429: "Quota or rate limit reached",
                 503: "A dependency (scheduler, agent, etcd) is unavailable; retry"}
    out: dict[int | str, dict[str, Any]] = {
        s: {"model": ErrorBody, "description": described.get(s, "Error")} for s in statuses}
    out["4XX"] = {"model": ErrorBody, "description": "Client error"}
    out["5XX"] = {"model": ErrorBody, "description": "Server error"}
    return out
