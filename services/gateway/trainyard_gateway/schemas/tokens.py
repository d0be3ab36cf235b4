"""API tokens: creation request, public record (never the secret, except once at creation)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from trainyard_core import contract as c

from .common import ApiModel, Bool


class TokenCreate(ApiModel):
    team: str = Field(pattern=c.TEAM.pattern, description=f"team the token acts for: {c.TEAM.rule} (the rule "
                                                          "every team name follows, in jobs and quotas too)",
                      examples=["vision"])
    user: str = Field(pattern=c.USER.pattern, description=f"user the token acts for: {c.USER.rule}",
                      examples=["alice"])
    admin: Annotated[Bool, Field(description="admin tokens see every team's jobs and manage tokens")] = False
    description: str = Field("", max_length=c.MAX_TOKEN_DESCRIPTION)


class Token(ApiModel):
    token_id: str = Field(description="public id (not the secret); used to revoke the token")
    team: str
    user: str
    admin: bool
    created_at: datetime
    description: str


class TokenCreated(ApiModel):
    token: Token
    secret: str = Field(description="the bearer token; shown only in this answer, store it now")


class TokenList(ApiModel):
    tokens: list[Token]
