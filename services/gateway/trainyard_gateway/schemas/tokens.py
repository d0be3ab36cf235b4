"""API tokens: creation request, public record (never the secret, except once at creation)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, field_validator

from trainyard_core import contract as c

from .common import ApiModel, OneOf

RoleName = Annotated[str, OneOf(c.ROLES)]
ScopeName = Annotated[str, OneOf(c.SCOPES)]


class TokenCreate(ApiModel):
    team: str = Field(pattern=c.TEAM.pattern, description=f"team the token acts for: {c.TEAM.rule} (the rule "
                                                          "every team name follows, in jobs and quotas too)",
                      examples=["vision"])
    user: str = Field(pattern=c.USER.pattern, description=f"user the token acts for: {c.USER.rule}",
                      examples=["alice"])
    role: RoleName = Field(c.DEFAULT_ROLE.value, description=(
        "viewer (reads the team's jobs, logs, quota, the queues and nodes), member (also submits and cancels "
        "its own jobs), admin (also cancels any of the team's jobs and manages the team's tokens, up to admin), "
        "operator (the whole cluster; only an operator grants it)"))
    ttl: str | None = Field(None, pattern=c.TTL.pattern, description=(
        f"lifetime: {c.TTL.rule}; default the gateway's token_default_ttl_s ({c.DEFAULT_TOKEN_TTL} unless "
        "configured), at most its token_max_ttl_s"), examples=["30d"])
    scopes: list[ScopeName] = Field(default_factory=list, max_length=len(c.SCOPES), json_schema_extra={
        "uniqueItems": True}, description="only these kinds of action (and only those the role allows); empty: "
                                          "everything the role allows")
    description: str = Field("", max_length=c.MAX_TOKEN_DESCRIPTION)

    @field_validator("scopes")
    @classmethod
    def _each_once(cls, scopes: list[str]) -> list[str]:  # the schema's uniqueItems
        twice = sorted({s for s in scopes if scopes.count(s) > 1})
        if twice:
            raise ValueError(f"each scope at most once ({', '.join(twice)} given more than once)")
        return scopes


class Token(ApiModel):
    token_id: str = Field(description="public id (not the secret); used to revoke the token")
    team: str
    user: str
    role: RoleName
    created_at: datetime
    expires_at: datetime | None = Field(description="null: never (the local cluster's bootstrap token and "
                                                     "legacy tokens)")
    scopes: list[ScopeName] = Field(description="empty: limited by the role alone")
    description: str
    legacy: bool = Field(description="stored before roles and expiry existed (an admin one is an operator "
                                     "token); replace it")


class TokenCreated(ApiModel):
    token: Token
    secret: str = Field(description="the bearer token; shown only in this answer, store it now")


class TokenList(ApiModel):
    tokens: list[Token]
