"""The internal gRPC TokenService: admin bearer token in the `authorization` metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from trainyard.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from trainyard_core.rpc.server import insecure_channel

from .support import RunningGateway


@pytest.fixture
async def stub(gateway: RunningGateway) -> AsyncIterator[gateway_pb2_grpc.TokenServiceAsyncStub]:
    channel = insecure_channel(f"127.0.0.1:{gateway.app.grpc_port}")
    try:
        yield gateway_pb2_grpc.TokenServiceStub(channel)  # type: ignore[misc]
    finally:
        await channel.close()


def _bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code()


async def test_needs_a_token(stub: gateway_pb2_grpc.TokenServiceAsyncStub) -> None:
    request = gateway_pb2.ListTokensRequest()
    assert await _code(stub.ListTokens(request)) == grpc.StatusCode.UNAUTHENTICATED
    assert await _code(stub.ListTokens(request, metadata=_bearer("ty_" + "x" * 40))) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert await _code(stub.ListTokens(request, metadata=(("authorization", "Basic abc"),))) == \
        grpc.StatusCode.UNAUTHENTICATED


async def test_needs_an_admin_token(gateway: RunningGateway, stub: gateway_pb2_grpc.TokenServiceAsyncStub) -> None:
    secret = await gateway.create_token("vision", "alice")
    create = gateway_pb2.CreateTokenRequest(team="vision", user="mallory", admin=True)
    assert await _code(stub.CreateToken(create, metadata=_bearer(secret))) == grpc.StatusCode.PERMISSION_DENIED


async def test_create_list_revoke(gateway: RunningGateway, stub: gateway_pb2_grpc.TokenServiceAsyncStub) -> None:
    admin = _bearer(gateway.admin_token)
    created = await stub.CreateToken(gateway_pb2.CreateTokenRequest(team="nlp", user="bob", description="ci"),
                                     metadata=admin)
    assert created.secret.startswith("ty_") and created.token.team == "nlp" and not created.token.admin
    assert created.token.created_at.seconds > 0
    async with gateway.client(created.secret) as http:  # the new token works over HTTP
        assert (await http.get("/v1/nodes")).status_code != 401

    listed = await stub.ListTokens(gateway_pb2.ListTokensRequest(team="nlp"), metadata=admin)
    assert [(t.token_id, t.user, t.description) for t in listed.tokens] == [(created.token.token_id, "bob", "ci")]
    assert created.secret not in str(listed)

    await stub.RevokeToken(gateway_pb2.RevokeTokenRequest(token_id=created.token.token_id), metadata=admin)
    assert await _code(stub.RevokeToken(gateway_pb2.RevokeTokenRequest(token_id=created.token.token_id),
                                        metadata=admin)) == grpc.StatusCode.NOT_FOUND
    async with gateway.client(created.secret) as http:
        assert (await http.get("/v1/nodes")).status_code == 401


async def test_bad_team_is_invalid_argument(gateway: RunningGateway,
                                            stub: gateway_pb2_grpc.TokenServiceAsyncStub) -> None:
    request = gateway_pb2.CreateTokenRequest(team="", user="bob")
    assert await _code(stub.CreateToken(request, metadata=_bearer(gateway.admin_token))) == \
        grpc.StatusCode.INVALID_ARGUMENT
