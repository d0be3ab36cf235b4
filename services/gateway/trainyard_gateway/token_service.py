"""TokenService (internal gRPC): a thin adapter over TokenStore, with the HTTP API's rules (roles.RULES and
check_grant): every call needs a token in the `authorization` metadata (`Bearer ty_...`) of a team admin
(its own team's tokens, roles up to admin) or an operator. Domain errors become status codes in the shared
interceptor (UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT, NOT_FOUND)."""

from __future__ import annotations

import grpc.aio

from trainyard.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from trainyard_core import audit, contract
from trainyard_core.errors import InvalidArgument, PermissionDenied, Unauthenticated

from . import convert, roles
from .roles import Action
from .tokens import TokenRecord, TokenStore

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["TokenService"].full_name


class TokenServicer(gateway_pb2_grpc.TokenServiceServicer):
    def __init__(self, tokens: TokenStore) -> None:
        self._tokens = tokens

    async def _caller(self, context: grpc.aio.ServicerContext, action: Action) -> TokenRecord:
        header = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                header = value
        if not header:
            raise Unauthenticated("missing token: send the metadata 'authorization: Bearer <token>'")
        scheme, _sep, secret = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        record = await self._tokens.authenticate(secret.strip())
        # The audit entry names the token's user beside the calling tool's certificate, refusals included.
        audit.acting_user.set((f"{record.team}/{record.user}", record.role.value))
        roles.check(record, action)
        return record

    async def CreateToken(self, request: gateway_pb2.CreateTokenRequest,
                          context: grpc.aio.ServicerContext) -> gateway_pb2.CreateTokenResponse:
        caller = await self._caller(context, Action.TOKENS_WRITE)
        if request.admin:
            raise InvalidArgument("admin is replaced by role: send role \"operator\" (or admin, member, viewer)")
        role = roles.parse_role(request.role or contract.DEFAULT_ROLE.value)
        scopes = roles.parse_scopes(list(request.scopes))
        roles.check_grant(caller, team=request.team, role=role, scopes=scopes)
        record, secret = await self._tokens.create(team=request.team, user=request.user, role=role,
                                                   ttl=request.ttl or None, scopes=scopes,
                                                   description=request.description)
        return gateway_pb2.CreateTokenResponse(token=convert.token_to_pb(record), secret=secret)

    async def ListTokens(self, request: gateway_pb2.ListTokensRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListTokensResponse:
        caller = await self._caller(context, Action.TOKENS_READ)
        own = roles.team_filter(caller, Action.TOKENS_READ)
        if own and request.team and request.team != own:
            raise PermissionDenied(f"a team admin lists only its own team's tokens ({own}), not {request.team}'s")
        records = await self._tokens.list(request.team or own or None)
        return gateway_pb2.ListTokensResponse(tokens=[convert.token_to_pb(r) for r in records])

    async def RevokeToken(self, request: gateway_pb2.RevokeTokenRequest,
                          context: grpc.aio.ServicerContext) -> gateway_pb2.RevokeTokenResponse:
        caller = await self._caller(context, Action.TOKENS_WRITE)
        await self._tokens.revoke(request.token_id, team=roles.team_filter(caller, Action.TOKENS_WRITE))
        return gateway_pb2.RevokeTokenResponse()
