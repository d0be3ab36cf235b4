"""Pieces of requests: path segments, query values and bodies, checked before anything is sent.

A body is validated into the gateway's own request model (`trainyard_gateway.schemas`), from a model instance
or a plain dict, so a spec the gateway would refuse is refused here, with the message the gateway gives
(`InvalidArgument`, status 400, code invalid_argument, no request id: nothing was sent). The dict goes through
JSON first, as it would on the wire, and is validated as the gateway validates a parsed body. What is sent
is the model's fields that were given (`exclude_unset`), so a merge patch keeps its nulls and a submit stays
the body the caller wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from .errors import InvalidArgument

M = TypeVar("M", bound=BaseModel)
Time = datetime | str
Params = list[tuple[str, str]]


def invalid(message: str) -> InvalidArgument:
    return InvalidArgument(400, "invalid_argument", message)


def segment(name: str, value: object) -> str:
    """A path parameter, quoted; an empty one would name another route, so it is refused here."""
    if not isinstance(value, str) or not value:
        raise invalid(f"path parameter {name}: required (got {value!r})")
    return quote(value, safe="")


def time_value(name: str, value: Time) -> str:
    """An RFC 3339 time with its zone: a datetime must be aware (the gateway refuses a time without a zone)."""
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise invalid(f"query parameter {name}: a datetime with a time zone is required (got {value!r})")
        return value.isoformat()
    return str(value)


def query(**values: object) -> Params:
    """Query parameters from keyword arguments: None and "" are left out, a sequence is repeated, a datetime is
    RFC 3339, a bool is true/false. A trailing underscore is dropped (`from_` is `from`)."""
    out: Params = []
    for key, value in values.items():
        name = key.rstrip("_")
        for item in _items(value):
            if isinstance(item, datetime):
                out.append((name, time_value(name, item)))
            elif isinstance(item, bool):
                out.append((name, "true" if item else "false"))
            else:
                out.append((name, str(item)))
    return out


def _items(value: object) -> Iterable[object]:
    if value is None or value == "":
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return (value,)
    return value


def labels(value: Mapping[str, str] | Sequence[str] | None) -> list[str]:
    """`label` query values (key=value) from a mapping or a sequence of key=value strings."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [f"{k}={v}" for k, v in value.items()]
    return [str(v) for v in value]


def body(cls: type[M], value: M | Mapping[str, Any]) -> Any:
    """The JSON body for `cls` from an instance of it or a mapping; InvalidArgument with the gateway's message
    when the gateway would refuse it."""
    if isinstance(value, cls):
        return value.model_dump(mode="json", exclude_unset=True, by_alias=True)
    if isinstance(value, BaseModel):  # another model: what it holds, validated as this one
        value = value.model_dump(mode="json", exclude_unset=True, by_alias=True)
    try:
        data = json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    try:
        validated = cls.model_validate(data)
    except ValidationError as exc:
        raise invalid(describe(exc)) from None
    return validated.model_dump(mode="json", exclude_unset=True, by_alias=True)


def describe(exc: ValidationError) -> str:
    """The gateway's 400 message for these problems of a request body (its `describe_validation_errors`, over
    the same locations: `body`, then the field path)."""
    # Imported here: the gateway's error module brings FastAPI and grpc (half a second), needed only on a refusal.
    from trainyard_gateway.http_errors import describe_validation_errors

    problems = [{**err, "loc": ("body", *err.get("loc", ()))} for err in exc.errors()]
    return describe_validation_errors(problems)


def optional_body(cls: type[M], value: M | Mapping[str, Any] | None) -> Any:
    return None if value is None else body(cls, value)
