"""/v1/tokens: API tokens, for admins. The secret is returned once, at creation."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_core import contract as c
from trainyard_core.errors import FailedPrecondition

from .. import convert
from ..auth import AdminPrincipal, Deps
from ..schemas.common import error_responses
from ..schemas.tokens import Token, TokenCreate, TokenCreated, TokenList
from .params import TokenId

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=201, response_model=TokenCreated, summary="Create a token (admin)",
             responses=error_responses(400, 401, 403, 409, 503))
async def create_token(body: TokenCreate, _: AdminPrincipal, deps: Deps) -> TokenCreated:
    record, secret = await deps.tokens.create(team=body.team, user=body.user, admin=body.admin,
                                              description=body.description)
    return TokenCreated(token=convert.token_to_schema(record), secret=secret)


@router.get("", response_model=TokenList, summary="List tokens (admin)",
            responses=error_responses(400, 401, 403, 503))
async def list_tokens(_: AdminPrincipal, deps: Deps,
                      team: Annotated[str, Query(pattern=c.TEAM.or_empty.pattern,
                                                 description="only this team's")] = "") -> TokenList:
    return TokenList(tokens=[convert.token_to_schema(r) for r in await deps.tokens.list(team or None)])


@router.delete("/{token_id}", response_model=Token, summary="Revoke a token (admin)",
               description="409 failed_precondition for the token the request is made with: revoke it with "
                           "another admin token, so no caller locks itself out mid-session.",
               responses=error_responses(400, 401, 403, 404, 409, 503))
async def revoke_token(token_id: TokenId, principal: AdminPrincipal, deps: Deps) -> Token:
    if token_id == principal.token_id:
        raise FailedPrecondition(f"token {token_id} is the one this request is made with; revoke it with another "
                                 "admin token")
    return convert.token_to_schema(await deps.tokens.revoke(token_id))
