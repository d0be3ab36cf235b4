"""/v1/tokens: API tokens, for team admins (their own team's, roles up to admin) and operators (any). The
secret is returned once, at creation; another team's tokens answer 404 to a team admin."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_core import contract as c
from trainyard_core.errors import FailedPrecondition, PermissionDenied

from .. import convert, roles
from ..auth import Deps, TokenReader, TokenWriter, team_scope
from ..schemas.common import error_responses
from ..schemas.tokens import Token, TokenCreate, TokenCreated, TokenList
from .params import TokenId

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=201, response_model=TokenCreated, summary="Create a token (team admin, operator)",
             description="A team admin creates tokens for its own team with a role up to admin; an operator for "
                         "any team and role. A token with scopes creates only tokens within its scopes.",
             responses=error_responses(400, 401, 403, 409, 429, 503))
async def create_token(body: TokenCreate, principal: TokenWriter, deps: Deps) -> TokenCreated:
    role, scopes = roles.parse_role(body.role), roles.parse_scopes(body.scopes)
    roles.check_grant(principal, team=body.team, role=role, scopes=scopes)
    record, secret = await deps.tokens.create(team=body.team, user=body.user, role=role, ttl=body.ttl,
                                              scopes=scopes, description=body.description)
    return TokenCreated(token=convert.token_to_schema(record), secret=secret)


@router.get("", response_model=TokenList, summary="List tokens (team admin: its team's; operator: every team's)",
            responses=error_responses(400, 401, 403, 429, 503))
async def list_tokens(principal: TokenReader, deps: Deps,
                      team: Annotated[str, Query(pattern=c.TEAM.or_empty.pattern,
                                                 description="only this team's")] = "") -> TokenList:
    own = team_scope(principal, roles.Action.TOKENS_READ)
    if own and team and team != own:
        raise PermissionDenied(f"a team admin lists only its own team's tokens ({own}), not {team}'s")
    return TokenList(tokens=[convert.token_to_schema(r) for r in await deps.tokens.list(team or own or None)])


@router.delete("/{token_id}", response_model=Token, summary="Revoke a token (team admin: its team's; operator)",
               description="409 failed_precondition for the token the request is made with: revoke it with "
                           "another token, so no caller locks itself out mid-session.",
               responses=error_responses(400, 401, 403, 404, 409, 429, 503))
async def revoke_token(token_id: TokenId, principal: TokenWriter, deps: Deps) -> Token:
    if token_id == principal.token_id:
        raise FailedPrecondition(f"token {token_id} is the one this request is made with; revoke it with another "
                                 "token")
    record = await deps.tokens.revoke(token_id, team=team_scope(principal, roles.Action.TOKENS_WRITE))
    return convert.token_to_schema(record)
