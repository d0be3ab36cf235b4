"""API tokens: creation request, public record (never the secret, except once at creation)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .common import ApiModel


class TokenCreate(ApiModel):
    team: str = Field(max_length=63, description="team the token acts for", examples=["vision"])
    user: str = Field(max_length=128, description="user the token acts for", examples=["alice"])
    admin: bool = Field(False, description="admin tokens see every team's jobs and manage tokens")
    description: str = Field("", max_length=256)


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
