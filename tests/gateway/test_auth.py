"""Bearer-token authentication of the HTTP API, token storage (hashed only) and the token routes."""

from __future__ import annotations

import hashlib
import logging

import httpx
import pytest

from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually
from trainyard_gateway.tokens import new_secret

from .support import RunningGateway, running_gateway


def _assert_401(reply: httpx.Response, *, invalid: bool) -> str:
    assert reply.status_code == 401, reply.text
    body = reply.json()
    assert body["error"]["code"] == "unauthenticated"
    assert reply.headers["www-authenticate"].startswith("Bearer")
    assert ('error="invalid_token"' in reply.headers["www-authenticate"]) is invalid
    return str(body["error"]["message"])


async def test_missing_token_is_401_with_a_clear_message(gateway: RunningGateway) -> None:
    async with gateway.client() as http:
        for method, path in [("GET", "/v1/jobs"), ("GET", "/v1/jobs/job-abc"), ("POST", "/v1/jobs/job-abc:cancel"),
                             ("GET", "/v1/jobs/job-abc/logs"), ("GET", "/v1/nodes"), ("GET", "/v1/tokens")]:
            reply = await http.request(method, path)
            message = _assert_401(reply, invalid=False)
            assert "Authorization: Bearer" in message, (path, message)
        reply = await http.post("/v1/jobs", json={"name": "x", "command": ["true"],
                                                  "resources": {"nodes": 1, "gpus_per_node": 1}})
        _assert_401(reply, invalid=False)


@pytest.mark.parametrize("header", [
    "Basic dXNlcjpwYXNz",
    "Bearer",
    "Bearer not-a-trainyard-token",
    "Bearer ty_" + "A" * 43,  # well formed, never issued
])
async def test_invalid_tokens_are_401(gateway: RunningGateway, header: str) -> None:
    async with gateway.client() as http:
        reply = await http.get("/v1/jobs", headers={"Authorization": header})
    message = _assert_401(reply, invalid=True)
    assert "ty_" + "A" * 43 not in message


async def test_revoked_token_is_refused_at_once(gateway: RunningGateway) -> None:
    secret = await gateway.create_token("vision", "alice")
    async with gateway.client(gateway.admin_token) as admin, gateway.client(secret) as alice:
        # Valid: the request gets past authentication (and fails later, on the unreachable scheduler).
        assert (await alice.get("/v1/nodes")).status_code == 503
        listed = (await admin.get("/v1/tokens", params={"team": "vision"})).json()["tokens"]
        assert [t["user"] for t in listed] == ["alice"]
        reply = await admin.delete(f"/v1/tokens/{listed[0]['token_id']}")
        assert reply.status_code == 200 and reply.json()["token_id"] == listed[0]["token_id"]
        _assert_401(await alice.get("/v1/nodes"), invalid=True)
        assert (await admin.delete(f"/v1/tokens/{listed[0]['token_id']}")).status_code == 404


async def test_revocation_through_another_gateway_takes_effect_within_the_cache_ttl(
        etcd_settings: dict[str, str], key_prefix: str) -> None:
    prefix = key_prefix.rstrip("/")
    scheduler = f"127.0.0.1:{free_port()}"
    async with running_gateway(etcd=etcd_settings, etcd_prefix=prefix, scheduler_address=scheduler,
                               token_cache_ttl_s=0.3) as one, \
            running_gateway(etcd=etcd_settings, etcd_prefix=prefix, scheduler_address=scheduler,
                            token_cache_ttl_s=0.3) as two:
        secret = await one.create_token("vision", "bob")
        async with one.client(secret) as bob_one, one.client(one.admin_token) as admin_one:
            assert (await bob_one.get("/v1/nodes")).status_code == 503  # authenticated, now cached in `one`
            token_id = (await admin_one.get("/v1/tokens")).json()["tokens"][-1]["token_id"]
        async with two.client(two.admin_token) as admin_two:
            assert (await admin_two.delete(f"/v1/tokens/{token_id}")).status_code == 200

        async def refused() -> bool:
            async with one.client(secret) as http:
                return (await http.get("/v1/nodes")).status_code == 401

        await eventually(refused, timeout=5.0, what="gateway one to refuse the token revoked through two")


async def test_tokens_are_stored_only_as_sha256(gateway: RunningGateway, etcd_store: EtcdStore,
                                                key_prefix: str) -> None:
    secret = await gateway.create_token("vision", "carol")
    everything = await etcd_store.range(key_prefix)
    blobs = [kv.key.encode() + b"\0" + kv.value for kv in everything.kvs]
    for s in (secret, gateway.admin_token):
        assert not any(s.encode() in blob for blob in blobs), "a token secret is stored in etcd"
        digest = hashlib.sha256(s.encode()).hexdigest()
        assert await etcd_store.get(f"{key_prefix}gateway/tokens/{digest}") is not None


async def test_token_routes_need_an_admin(gateway: RunningGateway) -> None:
    secret = await gateway.create_token("vision", "dave")
    async with gateway.client(secret) as dave:
        for method, path, body in [("GET", "/v1/tokens", None), ("DELETE", "/v1/tokens/tok-x", None),
                                   ("POST", "/v1/tokens", {"team": "vision", "user": "eve"})]:
            reply = await dave.request(method, path, json=body)
            assert reply.status_code == 403, (path, reply.text)
            assert reply.json()["error"]["code"] == "permission_denied"


@pytest.mark.parametrize(("body", "field"), [
    ({"team": "Vision Team", "user": "a"}, "team"),
    ({"team": "vision", "user": ""}, "user"),
    ({"team": "vision", "user": "a", "role": "root"}, "role"),
])
async def test_token_creation_validates_team_and_user(gateway: RunningGateway, body: dict[str, str],
                                                      field: str) -> None:
    async with gateway.client(gateway.admin_token) as admin:
        reply = await admin.post("/v1/tokens", json=body)
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"]


async def test_no_secret_reaches_the_logs(gateway: RunningGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = await gateway.create_token("vision", "frank")
    forged = new_secret()
    async with gateway.client(secret) as http:
        await http.get("/v1/jobs")
        await http.get("/v1/nodes")
    async with gateway.client(forged) as http:
        await http.get("/v1/jobs")
    logged = caplog.text + "".join(repr(r.__dict__) for r in caplog.records)
    assert "/v1/jobs" in logged  # the access log did run
    for s in (secret, forged, gateway.admin_token):
        assert s not in logged


async def test_bootstrap_token_is_idempotent_across_restarts(etcd_settings: dict[str, str], key_prefix: str,
                                                             etcd_store: EtcdStore) -> None:
    from pydantic import SecretStr

    from trainyard_gateway.app import GatewayApp
    from trainyard_gateway.settings import GatewaySettings

    secret = new_secret()
    settings = GatewaySettings(**etcd_settings, etcd_prefix=key_prefix.rstrip("/"), http_port=0,
                               grpc_port=0, scheduler_address=f"127.0.0.1:{free_port()}",
                               bootstrap_admin_token=SecretStr(secret))
    for _ in range(2):
        app = GatewayApp(settings)
        await app.start()
        await app.stop()
    stored = await etcd_store.range(f"{key_prefix}gateway/tokens/")
    assert len(stored.kvs) == 1
