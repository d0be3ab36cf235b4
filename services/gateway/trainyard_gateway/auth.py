"""Bearer-token authentication of HTTP requests, the rate limit per token, and the role check of each route.

Every route but /healthz depends on `current_principal`. A missing header, another scheme, or a token that
is unknown, revoked or expired is answered 401 with `WWW-Authenticate: Bearer`; the token never appears in
a message or a log line. An authenticated request then spends one request of its token's bucket (429 with
Retry-After when empty). Routes declare what they do with one of the dependencies below, each the check
of one action of `roles.RULES` (403 naming the role or scope missing); `team_scope` is the team filter to
pass to the scheduler, which answers NOT_FOUND for other teams' jobs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from trainyard_core.errors import Unauthenticated

from . import roles
from .deps import GatewayDeps, get_deps
from .http_errors import InvalidToken
from .roles import Action
from .tokens import TokenRecord

# The scheme the OpenAPI document declares for every route that authenticates (openapi.py finds them by
# AUTHENTICATES). Not a FastAPI dependency: each dependency level costs a request more than the work it does
# (bench/gateway), and the header is parsed below anyway, for precise messages.
bearer_scheme = HTTPBearer(auto_error=False, scheme_name="bearerToken",
                           description="An API token: `Authorization: Bearer ty_...`")
AUTHENTICATES = "__trainyard_authenticates__"

MISSING_TOKEN = ("missing bearer token: send the header 'Authorization: Bearer <token>' "
                 "(a team admin or an operator creates tokens with `trainyard tokens create`)")


async def _authenticate(request: Request) -> TokenRecord:
    """The caller's token record; once per request (a second dependency asking gets the first answer, and the
    rate limit is spent once)."""
    # The scope's state dict, not getattr(request.state, ...): Starlette's State raises (and getattr catches)
    # AttributeError for a name not set yet, which is every request's first ask.
    found = request.scope.get("state", {}).get("principal")
    if isinstance(found, TokenRecord):
        return found
    header = request.headers.get("authorization", "")
    if not header.strip():
        raise Unauthenticated(MISSING_TOKEN)
    scheme, _sep, secret = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise InvalidToken("the Authorization header must be 'Bearer <token>'")
    deps = await get_deps(request)
    try:
        principal = await deps.tokens.authenticate(secret.strip())
    except Unauthenticated as exc:
        raise InvalidToken(exc.message) from None
    request.state.principal = principal  # for the access log: team and user, never the token
    deps.limiter.check(principal.token_id, principal.user)
    return principal


async def current_principal(request: Request) -> TokenRecord:
    return await _authenticate(request)


setattr(current_principal, AUTHENTICATES, True)


async def authorize(request: Request, action: Action) -> TokenRecord:
    """The caller, authenticated (once per request) and allowed `action`: what every route's dependency below
    does, and the view's fast path of GET /v1/jobs/{id} (view_fast_path.py) too."""
    principal = await _authenticate(request)
    roles.check(principal, action)
    return principal


def _requiring(action: Action) -> Callable[[Request], Awaitable[TokenRecord]]:
    """One dependency that authenticates and checks `action` (not two chained: see bearer_scheme)."""
    async def allowed(request: Request) -> TokenRecord:
        return await authorize(request, action)

    allowed.__name__ = f"requires_{action.name.lower()}"
    setattr(allowed, AUTHENTICATES, True)
    return allowed


def team_scope(principal: TokenRecord, action: Action = Action.JOBS_READ) -> str:
    """The team filter to pass to the scheduler: '' (every team) for operators, else the caller's team."""
    return roles.team_filter(principal, action)


Principal = Annotated[TokenRecord, Depends(current_principal)]
JobReader = Annotated[TokenRecord, Depends(_requiring(Action.JOBS_READ))]
JobSubmitter = Annotated[TokenRecord, Depends(_requiring(Action.JOBS_SUBMIT))]
JobCanceller = Annotated[TokenRecord, Depends(_requiring(Action.JOBS_CANCEL))]
JobUpdater = Annotated[TokenRecord, Depends(_requiring(Action.JOBS_UPDATE))]
CheckpointReader = Annotated[TokenRecord, Depends(_requiring(Action.CHECKPOINTS_READ))]
CheckpointWriter = Annotated[TokenRecord, Depends(_requiring(Action.CHECKPOINTS_WRITE))]
NodeReader = Annotated[TokenRecord, Depends(_requiring(Action.NODES_READ))]
NodeWriter = Annotated[TokenRecord, Depends(_requiring(Action.NODES_WRITE))]
QueueReader = Annotated[TokenRecord, Depends(_requiring(Action.QUEUES_READ))]
QueueWriter = Annotated[TokenRecord, Depends(_requiring(Action.QUEUES_WRITE))]
QuotaReader = Annotated[TokenRecord, Depends(_requiring(Action.QUOTAS_READ))]
QuotaWriter = Annotated[TokenRecord, Depends(_requiring(Action.QUOTAS_WRITE))]
TokenReader = Annotated[TokenRecord, Depends(_requiring(Action.TOKENS_READ))]
TokenWriter = Annotated[TokenRecord, Depends(_requiring(Action.TOKENS_WRITE))]
UsageReader = Annotated[TokenRecord, Depends(_requiring(Action.USAGE_READ))]
# The cluster operator's reads of the audit log (operator role; audit:read where the token has scopes):
# what the audit router depends on.
OperatorPrincipal = Annotated[TokenRecord, Depends(_requiring(Action.AUDIT_READ))]
Deps = Annotated[GatewayDeps, Depends(get_deps)]
