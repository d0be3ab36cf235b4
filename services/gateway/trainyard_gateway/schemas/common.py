"""The one error body every failure of the API answers with, the base of every model, and the strict types
request bodies are built from.

Requests are validated as their OpenAPI schema reads, no more and no less: a body the schema calls valid is
not refused here (the bounds and name rules are `trainyard_core.contract`'s, the scheduler's own), and one it
calls invalid is not coerced into something acceptable. So an `integer()` field takes 3 and 3.0 (both are
integers to JSON Schema) but not "3", true or 3.5; `Bool` takes true and false only, never 0 or "yes".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler, Strict
from pydantic_core import PydanticUndefined, core_schema

from trainyard_core.contract import Name


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(ApiModel):
    code: str = Field(description="machine-readable: invalid_argument, unauthenticated, permission_denied, "
                                  "not_found, method_not_allowed, already_exists, conflict, failed_precondition, "
                                  "resource_exhausted, unavailable, internal")
    message: str = Field(description="what is wrong and, where it helps, how to fix it")


class ErrorBody(ApiModel):
    error: ErrorDetail


def _integral(value: Any) -> Any:
    # JSON Schema's "integer" is any number without a fraction, 3.0 included; pydantic's strict int is not.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(default: Any = PydanticUndefined, **constraints: Any) -> Any:
    """`Field(...)` of an int (or `int | None`) field: strict, and 3.0 taken as 3. The bounds go into the
    int schema itself, so the document says minimum/maximum; a validator wrapped around an `Annotated` int
    would leave them outside it (pydantic then writes "ge"/"le", which JSON Schema does not know)."""
    info: Any = Field(default, strict=True, **constraints)
    info.metadata.append(BeforeValidator(_integral))
    return info


Bool = Annotated[bool, Strict()]
# Strict floats still take integers (JSON Schema's "number" includes them), never booleans or strings.
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


@dataclass(frozen=True)
class OneOf:
    """`Annotated[str, OneOf(choices)]`: exactly one of these strings, documented as an `enum`."""

    choices: Sequence[str]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.literal_schema(list(self.choices))


def matching(name: Name) -> AfterValidator:
    """A validator for strings that pydantic would document badly with `pattern=` (dictionary keys: pydantic
    writes `patternProperties`, which leaves every other key unconstrained). Pair it with `keys_matching`."""

    def check(value: str) -> str:
        if not name.matches(value):
            raise ValueError(f"must be {name.rule} (got {value[:80]!r})")
        return value

    return AfterValidator(check)


def keys_matching(name: Name, **more: Any) -> dict[str, Any]:
    """`json_schema_extra` of a dictionary field whose keys are `Annotated[str, matching(name)]`."""
    return {"propertyNames": {"type": "string", "pattern": name.pattern, **more}}


def with_rules(*rules: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """`json_schema_extra` of a model whose fields constrain each other: JSON Schema `allOf` rules, checked
    again by the model's own validator (the schema documents them; it does not enforce anything)."""

    def add(schema: dict[str, Any]) -> None:
        schema["allOf"] = list(rules)

    return add


DESCRIBED = {400: "Invalid request: it breaks this schema (the message names the field)",
             401: "Missing or invalid token", 403: "Not allowed for this token",
             404: "Not found (or belongs to another team)",
             409: "Conflicts with the cluster's current state: `failed_precondition` (the request is well formed, "
                  "but the cluster cannot take it as it is: no node that large, no such queue or priority class, "
                  "a queue still in use; change the request or the cluster), `conflict` (a concurrent change won: "
                  "read again and retry) or `already_exists`",
             422: "Well formed, but not usable as meant: `idempotency_key_reused` (the Idempotency-Key was used "
                  "for another request; use a new key) or `invalid_page_token` (a page token not handed out for "
                  "these filters; start from the first page)",
             429: "Quota or rate limit reached",
             503: "A dependency (scheduler, agent, etcd) is unavailable; retry",
             507: "etcd is out of space (its NOSPACE alarm): the write was not applied; an operator must free "
                  "space"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route: the error statuses it answers, each with the ErrorBody model.

    Exactly these: a route declares every status it can answer, so a client (and a contract test) can rely
    on the list. FastAPI's default 422 body is never sent (validation errors are 400) and is removed from
    the document (`openapi.py`)."""
    return {s: {"model": ErrorBody, "description": DESCRIBED.get(s, "Error")} for s in statuses}
