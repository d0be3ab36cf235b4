"""/v1/tokens: API tokens, for admins. The secret is returned once, at creation."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from .. import convert
from ..auth import AdminPrincipal, Deps
from ..schemas.common import error_responses
from ..schemas.tokens import Token, TokenCreate, TokenCreated, TokenList

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=201, response_model=TokenCreated, summary="Create a token (admin)",
             responses=error_responses(400, 401, 403, 503))
async def create_token(body: TokenCreate, _: AdminPrincipal, deps: Deps) -> TokenCreated:
    record, secret = await deps.tokens.create(team=body.team, user=body.user, admin=body.admin,
                                              description=body.description)
    return TokenCreated(token=convert.token_to_schema(record), secret=secret)


@router.get("", response_model=TokenList, summary="List tokens (admin)", responses=error_responses(401, 403, 503))
async def list_tokens(_: AdminPrincipal, deps: Deps,
                      team: Annotated[str, Query(max_length=63, description="only this team's")] = "") -> TokenList:
    return TokenList(tokens=[convert.token_to_schema(r) for r in await deps.tokens.list(team or None)])


@router.delete("/{token_id}", response_model=Token, summary="Revoke a token (admin)",
               responses=error_responses(401, 403, 404, 503))
async def revoke_token(token_id: str, _: AdminPrincipal, deps: Deps) -> Token:
    return convert.token_to_schema(await deps.tokens.revoke(token_id))
