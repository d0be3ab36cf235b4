"""/v1/whoami: who the bearer token is, and the actions of the role table (`roles.RULES`) it allows."""

from __future__ import annotations

from fastapi import APIRouter

from .. import convert, roles
from ..auth import Principal
from ..schemas.common import error_responses
from ..schemas.whoami import Whoami

router = APIRouter(prefix="/v1/whoami", tags=["tokens"])


@router.get("", response_model=Whoami, summary="The caller's token and the actions it allows",
            description="Any valid token may ask. `actions` lists what the token's role and scopes allow, in the "
                        "role table's order; team-scoped actions act on the caller's own team (operators: every "
                        "team).",
            responses=error_responses(401, 429, 503))
async def whoami(principal: Principal) -> Whoami:
    return Whoami(token=convert.token_to_schema(principal),
                  actions=[a.value for a in roles.Action if roles.allows(principal, a)])
