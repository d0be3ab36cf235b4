"""Bearer-token authentication of HTTP requests, and the team a caller may see.

Every route but /healthz depends on `current_principal`. A missing header, another scheme, or a token
that is unknown or revoked is answered 401 with `WWW-Authenticate: Bearer`; the token never appears in
a message or a log line. Non-admin callers are confined to their own team: routers pass `team_scope`
to the scheduler, which then answers NOT_FOUND for other teams' jobs. Admin tokens see every team.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from trainyard_core.errors import PermissionDenied, Unauthenticated

from .deps import GatewayDeps, get_deps
from .http_errors import InvalidToken
from .tokens import TokenRecord

# Declares the scheme in the OpenAPI document; the header itself is parsed below for precise messages.
bearer_scheme = HTTPBearer(auto_error=False, scheme_name="bearerToken",
                           description="An API token: `Authorization: Bearer ty_...`")

MISSING_TOKEN = ("missing bearer token: send the header 'Authorization: Bearer <token>' "
                 "(an admin creates tokens with `trainyard tokens create`)")


async def current_principal(
    request: Request,
    deps: Annotated[GatewayDeps, Depends(get_deps)],
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> TokenRecord:
    header = request.headers.get("authorization", "")
    if not header.strip():
        raise Unauthenticated(MISSING_TOKEN)
    scheme, _sep, secret = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise InvalidToken("the Authorization header must be 'Bearer <token>'")
    try:
        principal = await deps.tokens.authenticate(secret.strip())
    except Unauthenticated as exc:
        raise InvalidToken(exc.message) from None
    request.state.principal = principal  # for the access log: team and user, never the token
    return principal


async def admin_principal(principal: Annotated[TokenRecord, Depends(current_principal)]) -> TokenRecord:
    if not principal.admin:
        raise PermissionDenied(f"this needs an admin token; the token of {principal.user} (team "
                               f"{principal.team}) is not one")
    return principal


def team_scope(principal: TokenRecord) -> str:
    """The team filter to pass to the scheduler: '' (every team) for admins, else the caller's team."""
    return "" if principal.admin else principal.team


Principal = Annotated[TokenRecord, Depends(current_principal)]
AdminPrincipal = Annotated[TokenRecord, Depends(admin_principal)]
# The cluster operator (every team, nodes, queues, quotas, audit): what the audit router depends on.
OperatorPrincipal = Annotated[TokenRecord, Depends(admin_principal)]
Deps = Annotated[GatewayDeps, Depends(get_deps)]
