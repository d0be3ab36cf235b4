"""GET /v1/whoami: the caller's token and what it may do, so a client (the web console) shows only the controls
the caller's role and scopes allow."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..roles import Action
from .common import ApiModel, OneOf
from .tokens import Token

ActionName = Annotated[str, OneOf(tuple(a.value for a in Action))]


class Whoami(ApiModel):
    token: Token = Field(description="the token the request was made with (never its secret)")
    actions: list[ActionName] = Field(description=(
        "the actions its role and scopes allow (jobs.cancel: the caller's own jobs; jobs.cancel_any: its team's "
        "too; operators act on every team). The server checks each request all the same"))
