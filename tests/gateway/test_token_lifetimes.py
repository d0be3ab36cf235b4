"""Token records with role, expiry and scopes: expiry against an injected clock, records from before roles,
TTL bounds, the gRPC TokenService's new fields, and the offline `tokens_admin` bootstrap."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from pydantic import SecretStr

from trainyard.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from trainyard_core.clock import ManualClock
from trainyard_core.contract import DAY_S, Role, Scope
from trainyard_core.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.etcd_secure import as_flags
from trainyard_gateway import tokens_admin
from trainyard_gateway.app import GatewayApp
from trainyard_gateway.settings import GatewaySettings
from trainyard_gateway.tokens import TokenStore, hash_secret, new_secret

from .support import RunningGateway

ROOT = Path(__file__).resolve().parents[2]


async def test_a_token_expires_at_its_ttl(etcd_store: EtcdStore, key_prefix: str) -> None:
    clock = ManualClock(start=1_800_000_000.0)
    tokens = TokenStore(etcd_store, key_prefix, clock=clock, cache_ttl_s=60.0)
    record, secret = await tokens.create(team="vision", user="alice", role=Role.VIEWER, ttl="2h")
    assert record.expires_at == 1_800_000_000.0 + 7200
    clock.advance(7199)
    assert (await tokens.authenticate(secret)).token_id == record.token_id  # cached from here on
    clock.advance(1)
    with pytest.raises(Unauthenticated, match=r"token expired at 2027-01-15T10:00:00Z"):
        await tokens.authenticate(secret)  # the cache does not outlive the expiry


async def test_ttl_defaults_and_bounds(etcd_store: EtcdStore, key_prefix: str) -> None:
    clock = ManualClock()
    tokens = TokenStore(etcd_store, key_prefix, clock=clock, default_ttl_s=30 * DAY_S, max_ttl_s=60 * DAY_S)
    record, _ = await tokens.create(team="vision", user="alice")
    assert (record.role, record.expires_at) == (Role.MEMBER, clock.now() + 30 * DAY_S)
    with pytest.raises(FailedPrecondition, match="longer than this gateway allows"):
        await tokens.create(team="vision", user="alice", ttl="61d")
    with pytest.raises(InvalidArgument, match="ttl must be"):
        await tokens.create(team="vision", user="alice", ttl="1w")
    assert not (await etcd_store.range(key_prefix + "gateway/tokens/")).kvs[1:]  # only the first was stored


async def test_an_expired_token_is_refused_over_http(etcd_settings: dict[str, str], key_prefix: str) -> None:
    clock = ManualClock(start=1_800_000_000.0)
    admin = new_secret()
    settings = GatewaySettings(**etcd_settings, etcd_prefix=key_prefix.rstrip("/"), http_port=0,
                               grpc_port=0, scheduler_address=f"127.0.0.1:{free_port()}",
                               bootstrap_admin_token=SecretStr(admin), token_cache_ttl_s=0)
    app = GatewayApp(settings, clock=clock)
    await app.start()
    try:
        gw = RunningGateway(app=app, admin_token=admin)
        secret = await gw.create_token("vision", "alice", ttl="1d")
        async with gw.client(secret) as http:
            assert (await http.get("/v1/nodes")).status_code == 503  # authenticated (no scheduler behind)
            clock.advance(DAY_S)
            reply = await http.get("/v1/nodes")
            assert reply.status_code == 401, reply.text
            assert reply.json()["error"]["message"].startswith("token expired at 2027-01-16T08:00:00Z")
            assert 'error="invalid_token"' in reply.headers["www-authenticate"]
        async with gw.client(admin) as http:  # the bootstrap operator token does not expire
            listed = (await http.get("/v1/tokens")).json()["tokens"]
            assert (await http.get("/v1/nodes")).status_code == 503
        bootstrap = next(t for t in listed if t["user"] == "admin")
        assert (bootstrap["role"], bootstrap["expires_at"]) == ("operator", None)
    finally:
        await app.stop()


@pytest.mark.parametrize(("stored", "role"), [({"admin": True}, "operator"), ({"admin": False}, "member")])
async def test_records_from_before_roles_still_load(gateway: RunningGateway, etcd_store: EtcdStore,
                                                    key_prefix: str, stored: dict[str, bool], role: str) -> None:
    secret = new_secret()
    digest = hash_secret(secret)
    old = {"token_id": "tok-legacy-1", "team": "vision", "user": "old", "created_at": 1_700_000_000.0,
           "description": "from 2025", **stored}
    await etcd_store.put(f"{key_prefix}gateway/tokens/{digest}", json.dumps(old).encode())
    await etcd_store.put(f"{key_prefix}gateway/token-ids/tok-legacy-1", digest.encode())
    async with gateway.client(secret) as http:
        tokens_route = await http.get("/v1/tokens")
        assert tokens_route.status_code == (200 if role == "operator" else 403), tokens_route.text
    async with gateway.client(gateway.admin_token) as admin:
        listed = {t["token_id"]: t for t in (await admin.get("/v1/tokens")).json()["tokens"]}
    assert {k: listed["tok-legacy-1"][k] for k in ("role", "expires_at", "scopes", "legacy", "description")} == {
        "role": role, "expires_at": None, "scopes": [], "legacy": True, "description": "from 2025"}


async def test_bad_creation_requests_are_400(gateway: RunningGateway) -> None:
    async with gateway.client(gateway.admin_token) as admin:
        for body, field in [({"team": "vision", "user": "a", "ttl": "forever"}, "ttl"),
                            ({"team": "vision", "user": "a", "ttl": "0d"}, "ttl"),
                            ({"team": "vision", "user": "a", "scopes": ["jobs:delete"]}, "scopes[0]"),
                            ({"team": "vision", "user": "a", "admin": True}, "admin: unknown field")]:
            reply = await admin.post("/v1/tokens", json=body)
            assert reply.status_code == 400 and field in reply.json()["error"]["message"], (body, reply.text)
        too_long = await admin.post("/v1/tokens", json={"team": "vision", "user": "a", "ttl": "366d"})
        assert too_long.status_code == 409 and "token_max_ttl_s" in too_long.json()["error"]["message"]
        listed = (await admin.get("/v1/tokens", params={"team": "vision"})).json()["tokens"]
    assert listed == []


@pytest.fixture
async def stub(gateway: RunningGateway) -> AsyncIterator[gateway_pb2_grpc.TokenServiceAsyncStub]:
    channel = insecure_channel(f"127.0.0.1:{gateway.app.grpc_port}")
    try:
        yield gateway_pb2_grpc.TokenServiceStub(channel)  # type: ignore[misc]
    finally:
        await channel.close()


async def test_token_service_carries_role_expiry_and_scopes(
        gateway: RunningGateway, stub: gateway_pb2_grpc.TokenServiceAsyncStub) -> None:
    operator = (("authorization", f"Bearer {gateway.admin_token}"),)
    created = await stub.CreateToken(gateway_pb2.CreateTokenRequest(
        team="nlp", user="bob", role="admin", ttl="12h", scopes=["jobs:read", "tokens:write"]), metadata=operator)
    token = created.token
    assert (token.role, list(token.scopes), token.admin, token.legacy) == (
        "admin", ["jobs:read", "tokens:write"], False, False)
    assert token.expires_at.seconds - token.created_at.seconds == 12 * 3600
    team_admin = (("authorization", f"Bearer {created.secret}"),)
    # Within its scopes and its team: a viewer limited to jobs:read.
    viewer = await stub.CreateToken(gateway_pb2.CreateTokenRequest(team="nlp", user="vic", role="viewer",
                                                                   scopes=["jobs:read"]), metadata=team_admin)
    assert viewer.token.role == "viewer"
    for request, code in [
        (gateway_pb2.CreateTokenRequest(team="nlp", user="x", role="operator", scopes=["jobs:read"]),
         grpc.StatusCode.PERMISSION_DENIED),
        (gateway_pb2.CreateTokenRequest(team="vision", user="x", scopes=["jobs:read"]),
         grpc.StatusCode.PERMISSION_DENIED),
        (gateway_pb2.CreateTokenRequest(team="nlp", user="x"), grpc.StatusCode.PERMISSION_DENIED),  # unscoped
        (gateway_pb2.CreateTokenRequest(team="nlp", user="x", role="root", scopes=["jobs:read"]),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateToken(request, metadata=team_admin)
        assert info.value.code() == code, (request, info.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.CreateToken(gateway_pb2.CreateTokenRequest(team="nlp", user="x", admin=True), metadata=operator)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in (info.value.details() or "")


def test_deploy_configs_do_not_set_the_bootstrap_token() -> None:
    for path in sorted((ROOT / "deploy" / "config").glob("*.yaml")):
        settings = [line.split(":", 1)[0].strip() for line in path.read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
        assert "bootstrap_admin_token" not in settings, path


def test_tokens_admin_creates_a_token_offline(etcd_settings: dict[str, str], etcd_options: EtcdOptions,
                                              key_prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = key_prefix.rstrip("/")
    settings = [*as_flags(etcd_settings), "--etcd-prefix", prefix]
    code = tokens_admin.main(["create", "--team", "ops", "--user", "alice", "--role", "operator", "--ttl", "30d",
                              "--scope", "nodes:write", "--scope", "nodes:read", *settings], env={})
    out, err = capsys.readouterr()
    assert code == 0, err
    secret = out.strip()
    assert secret.startswith("ty_") and "\n" not in secret and secret not in err
    assert "operator" in err and "nodes:read,nodes:write" in err

    async def check() -> None:
        store = EtcdStore.from_options(etcd_options)
        try:
            record = await TokenStore(store, prefix).authenticate(secret)
        finally:
            await store.close()
        assert (record.team, record.user, record.role) == ("ops", "alice", Role.OPERATOR)
        assert record.scopes == (Scope.NODES_READ, Scope.NODES_WRITE)
        assert record.expires_at is not None and record.expires_at - record.created_at == 30 * DAY_S

    asyncio.run(check())
    assert tokens_admin.main(["list", "--team", "ops", *settings], env={}) == 0
    listed = capsys.readouterr().out
    assert "alice" in listed and secret not in listed

    assert tokens_admin.main(["create", "--team", "ops", "--user", "bob", "--ttl", "5y", *settings], env={}) == 1
    assert "ttl must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # a flag that is no gateway setting: argparse's usage error
        tokens_admin.main(["create", "--team", "ops", "--user", "bob", "--no-such-setting", "1"], env={})
    assert usage.value.code == 2


async def test_an_unreadable_record_is_refused_cleanly(gateway: RunningGateway, etcd_store: EtcdStore,
                                                       key_prefix: str) -> None:
    """A record this version cannot read (a role from a newer gateway): 401 for its token, left out of the
    listing, a 409 naming why for its revocation; never a 500."""
    secret = new_secret()
    digest = hash_secret(secret)
    future = {"token_id": "tok-future-1", "team": "vision", "user": "new", "role": "auditor",
              "created_at": 1_800_000_000.0, "expires_at": None, "scopes": [], "description": ""}
    await etcd_store.put(f"{key_prefix}gateway/tokens/{digest}", json.dumps(future).encode())
    await etcd_store.put(f"{key_prefix}gateway/token-ids/tok-future-1", digest.encode())
    async with gateway.client(secret) as http:
        reply = await http.get("/v1/jobs")
    assert reply.status_code == 401 and "cannot be read" in reply.json()["error"]["message"]
    async with gateway.client(gateway.admin_token) as admin:
        listed = await admin.get("/v1/tokens")
        assert listed.status_code == 200 and "tok-future-1" not in listed.text
        revoke = await admin.delete("/v1/tokens/tok-future-1")
        assert revoke.status_code == 409 and "cannot be read" in revoke.json()["error"]["message"]
        duplicated = await admin.post("/v1/tokens", json={"team": "vision", "user": "a",
                                                          "scopes": ["jobs:read", "jobs:read"]})
        assert duplicated.status_code == 400 and "jobs:read given more than once" in duplicated.text
