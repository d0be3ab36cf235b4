"""TokenService (internal gRPC): a thin adapter over TokenStore. Every call needs an admin token in the
`authorization` metadata (`Bearer ty_...`); domain errors become status codes in the shared interceptor
(UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT, NOT_FOUND)."""

from __future__ import annotations

import grpc.aio

from trainyard.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from trainyard_core.errors import PermissionDenied, Unauthenticated

from . import convert
from .tokens import TokenRecord, TokenStore

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["TokenService"].full_name


class TokenServicer(gateway_pb2_grpc.TokenServiceServicer):
    def __init__(self, tokens: TokenStore) -> None:
        self._tokens = tokens

    async def _admin(self, context: grpc.aio.ServicerContext) -> TokenRecord:
        header = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                header = value
        if not header:
            raise Unauthenticated("missing admin token: send the metadata 'authorization: Bearer <token>'")
        scheme, _sep, secret = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        record = await self._tokens.authenticate(secret.strip())
        if not record.admin:
            raise PermissionDenied("managing tokens needs an admin token")
        return record

    async def CreateToken(self, request: gateway_pb2.CreateTokenRequest,
                          context: grpc.aio.ServicerContext) -> gateway_pb2.CreateTokenResponse:
        await self._admin(context)
        record, secret = await self._tokens.create(team=request.team, user=request.user, admin=request.admin,
                                                   description=request.description)
        return gateway_pb2.CreateTokenResponse(token=convert.token_to_pb(record), secret=secret)

    async def ListTokens(self, request: gateway_pb2.ListTokensRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListTokensResponse:
        await self._admin(context)
        records = await self._tokens.list(request.team or None)
        return gateway_pb2.ListTokensResponse(tokens=[convert.token_to_pb(r) for r in records])

    async def RevokeToken(self, request: gateway_pb2.RevokeTokenRequest,
                          context: grpc.aio.ServicerContext) -> gateway_pb2.RevokeTokenResponse:
        await self._admin(context)
        await self._tokens.revoke(request.token_id)
        return gateway_pb2.RevokeTokenResponse()
