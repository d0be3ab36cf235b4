"""mTLS and the authorization table against real grpc.aio servers and clients (no fakes): who can connect,
who may call what, a node speaking only for itself, certificates rotated on disk without a restart, and
the table covering every RPC of every service."""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.checkpoint.v1 import checkpoint_pb2
from trainyard.gateway.v1 import gateway_pb2
from trainyard.scheduler.v1 import policy_pb2, scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.errors import PermissionDenied, Unauthenticated
from trainyard_core.files import atomic_write_bytes
from trainyard_core.rpc.server import CHANNEL_OPTIONS, GrpcServer, secure_channel, start_grpc_server
from trainyard_core.security import authz, identity, pki
from trainyard_core.security.identity import InvalidPrincipal, Principal
from trainyard_core.security.tls import ClientTls, TlsConfigError, load, target_name_option


class Nodes(scheduler_pb2_grpc.NodeServiceServicer):  # type: ignore[misc]
    async def RegisterNode(self, request: Any, context: Any) -> Any:
        return scheduler_pb2.RegisterNodeResponse(node_id=request.node.node_id)

    async def Heartbeat(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for req in requests:
            yield scheduler_pb2.HeartbeatResponse(ack_seq=req.seq)


class Agent(agent_pb2_grpc.AgentServiceServicer):  # type: ignore[misc]
    async def LaunchWorkers(self, request: Any, context: Any) -> Any:
        # The servicer sees the verified caller: the scheduler, answered with a marker pid.
        return agent_pb2.LaunchWorkersResponse(pids=[1] if authz.current_principal.get() == identity.SCHEDULER
                                               else [])



async def _serve(files: pki.CertFiles) -> GrpcServer:
    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_NodeServiceServicer_to_server(Nodes(), server)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(Agent(), server)
    return await start_grpc_server(host="127.0.0.1", port=0, register=register, tls=files,
                                   service_names=["trainyard.scheduler.v1.NodeService",
                                                  "trainyard.agent.v1.AgentService"])


def _channel(server: GrpcServer, directory: Path, me: Principal, expected: Principal) -> grpc.aio.Channel:
    return secure_channel(f"127.0.0.1:{server.port}", ClientTls(pki.files_for(directory, me)), expected)


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_pki_is_idempotent_names_principals_and_keeps_keys_private(pki_dir: Path) -> None:
    files = pki.files_for(pki_dir, identity.node("node-1"))
    before = files.cert.read_bytes()
    pki.ensure(pki_dir, [identity.node("node-1")])
    assert files.cert.read_bytes() == before  # a valid leaf is never touched
    assert load(files).principal == identity.node("node-1")
    assert oct(os.stat(files.key).st_mode & 0o777) == "0o600"
    assert oct(os.stat(pki_dir / "ca.key").st_mode & 0o777) == "0o600"


def test_pki_reissues_a_leaf_of_another_ca(pki_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    pki.ensure(other, [identity.SCHEDULER])
    (pki_dir / "scheduler.pem").write_bytes((other / "scheduler.pem").read_bytes())
    (pki_dir / "scheduler.key").write_bytes((other / "scheduler.key").read_bytes())
    with pytest.raises(TlsConfigError, match="not signed by any CA"):
        load(pki.files_for(pki_dir, identity.SCHEDULER))
    pki.ensure(pki_dir, [identity.SCHEDULER])
    assert load(pki.files_for(pki_dir, identity.SCHEDULER)).principal == identity.SCHEDULER


@pytest.mark.parametrize("uri", ["trainyard://node", "trainyard://scheduler/x", "trainyard://node/Bad_Name",
                                 "spiffe://node/node-1", "trainyard://pirate/x", "trainyard://node/a/b"])
def test_malformed_principals_are_refused(uri: str) -> None:
    with pytest.raises(InvalidPrincipal):
        Principal.parse(uri)


def test_a_key_that_is_not_the_certificates_is_refused_with_the_file_named(pki_dir: Path) -> None:
    files = pki.files_for(pki_dir, identity.SCHEDULER)
    wrong = pki.CertFiles(cert=files.cert, key=pki_dir / "gateway.key", ca=files.ca)
    with pytest.raises(TlsConfigError, match=r"gateway\.key is not the private key of"):
        load(wrong)


async def test_only_clients_with_a_certificate_of_this_ca_connect(pki_dir: Path, tmp_path: Path) -> None:
    server = await _serve(pki.files_for(pki_dir, identity.SCHEDULER))
    try:
        # No client certificate at all: the handshake fails.
        ca = (pki_dir / "ca.pem").read_bytes()
        bare = grpc.aio.secure_channel(f"127.0.0.1:{server.port}", grpc.ssl_channel_credentials(ca),
                                       options=[*CHANNEL_OPTIONS, target_name_option(identity.SCHEDULER)])
        health = health_pb2_grpc.HealthStub(bare)
        assert await _code(health.Check(health_pb2.HealthCheckRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
        await bare.close()
        # Plaintext: refused.
        plain = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        assert await _code(health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)) \
            == grpc.StatusCode.UNAVAILABLE
        await plain.close()
        # A certificate of another CA (that trusts ours, even): refused.
        other = tmp_path / "other"
        pki.ensure(other, [identity.node("node-1")])
        (other / "ca.pem").write_bytes((other / "ca.pem").read_bytes() + ca)
        foreign = _channel(server, other, identity.node("node-1"), identity.SCHEDULER)
        assert await _code(health_pb2_grpc.HealthStub(foreign).Check(health_pb2.HealthCheckRequest(), timeout=5)) \
            == grpc.StatusCode.UNAVAILABLE
        await foreign.close()
        # Ours: served.
        good = _channel(server, pki_dir, identity.node("node-1"), identity.SCHEDULER)
        reply = await health_pb2_grpc.HealthStub(good).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await good.close()
    finally:
        await server.stop(0)


async def test_a_client_refuses_a_server_that_is_not_the_principal_it_expects(pki_dir: Path) -> None:
    """The scheduler dials node-2's address, but node-1's agent answers there: the handshake fails."""
    server = await _serve(pki.files_for(pki_dir, identity.node("node-1")))
    try:
        channel = _channel(server, pki_dir, identity.SCHEDULER, identity.node("node-2"))
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        assert await _code(stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(job_id="j"), timeout=5)) \
            == grpc.StatusCode.UNAVAILABLE
        await channel.close()
        channel = _channel(server, pki_dir, identity.SCHEDULER, identity.node("node-1"))
        reply = await agent_pb2_grpc.AgentServiceStub(channel).LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(job_id="j"), timeout=5)
        assert list(reply.pids) == [1]  # the servicer saw the verified caller
        await channel.close()
    finally:
        await server.stop(0)


async def test_agents_take_launches_only_from_the_scheduler(pki_dir: Path) -> None:
    server = await _serve(pki.files_for(pki_dir, identity.node("node-1")))
    try:
        for caller in (identity.node("node-2"), identity.GATEWAY, identity.tool("ops")):
            channel = _channel(server, pki_dir, caller, identity.node("node-1"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent_pb2_grpc.AgentServiceStub(channel).LaunchWorkers(
                    agent_pb2.LaunchWorkersRequest(job_id="j", command=["sh", "-c", "id"]), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert str(caller) in (err.value.details() or "")
            assert "/trainyard.agent.v1.AgentService/LaunchWorkers" in (err.value.details() or "")
            await channel.close()
    finally:
        await server.stop(0)


async def test_a_node_registers_and_heartbeats_only_as_itself(pki_dir: Path) -> None:
    server = await _serve(pki.files_for(pki_dir, identity.SCHEDULER))
    try:
        channel = _channel(server, pki_dir, identity.node("node-1"), identity.SCHEDULER)
        stub = scheduler_pb2_grpc.NodeServiceStub(channel)
        ok = await stub.RegisterNode(scheduler_pb2.RegisterNodeRequest(node={"node_id": "node-1"}), timeout=5)
        assert ok.node_id == "node-1"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterNode(scheduler_pb2.RegisterNodeRequest(node={"node_id": "node-2"}), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "trainyard://node/node-1" in (err.value.details() or "") and "node-2" in (err.value.details() or "")
        # A stream: the first beat as itself is answered, a later one as another node ends the stream.
        beats: asyncio.Queue[Any] = asyncio.Queue()

        async def requests() -> AsyncIterator[Any]:
            while (item := await beats.get()) is not None:
                yield item
        call = stub.Heartbeat(requests(), timeout=10)
        await beats.put(scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=1))
        assert (await call.read()).ack_seq == 1
        await beats.put(scheduler_pb2.HeartbeatRequest(node_id="node-2", seq=2))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await channel.close()
        # The gateway is no node: it may not register one at all.
        channel = _channel(server, pki_dir, identity.GATEWAY, identity.SCHEDULER)
        assert await _code(scheduler_pb2_grpc.NodeServiceStub(channel).RegisterNode(
            scheduler_pb2.RegisterNodeRequest(node={"node_id": "node-1"}), timeout=5)) \
            == grpc.StatusCode.PERMISSION_DENIED
        await channel.close()
    finally:
        await server.stop(0)


async def test_a_rotated_server_certificate_is_served_without_a_restart(pki_dir: Path, tmp_path: Path) -> None:
    """The server's files are replaced by a leaf of a new CA: clients that trust only the new CA fail
    before and connect after, on the same server; clients of the old CA keep working on their connection."""
    served = tmp_path / "served"
    served.mkdir()
    for name in ("scheduler.pem", "scheduler.key", "ca.pem"):
        (served / name).write_bytes((pki_dir / name).read_bytes())
    files = pki.CertFiles(cert=served / "scheduler.pem", key=served / "scheduler.key", ca=served / "ca.pem")
    server = await _serve(files)
    new = tmp_path / "new"
    pki.ensure(new, [identity.SCHEDULER, identity.node("node-1")])
    try:
        old_client = _channel(server, pki_dir, identity.node("node-1"), identity.SCHEDULER)
        await health_pb2_grpc.HealthStub(old_client).Check(health_pb2.HealthCheckRequest(), timeout=5)
        before = _channel(server, new, identity.node("node-1"), identity.SCHEDULER)
        assert await _code(health_pb2_grpc.HealthStub(before).Check(health_pb2.HealthCheckRequest(), timeout=5)) \
            == grpc.StatusCode.UNAVAILABLE
        await before.close()
        # Rotate: the new CA joins the bundle first, then the new leaf replaces the old one (key first).
        pki_files_new = pki.files_for(new, identity.SCHEDULER)
        atomic_write_bytes(files.ca, (pki_dir / "ca.pem").read_bytes() + (new / "ca.pem").read_bytes())
        atomic_write_bytes(files.key, pki_files_new.key.read_bytes(), mode=0o600)
        atomic_write_bytes(files.cert, pki_files_new.cert.read_bytes())
        after = _channel(server, new, identity.node("node-1"), identity.SCHEDULER)
        reply = await health_pb2_grpc.HealthStub(after).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await after.close()
        # The connection made before the rotation still serves calls.
        await health_pb2_grpc.HealthStub(old_client).Check(health_pb2.HealthCheckRequest(), timeout=5)
        await old_client.close()
    finally:
        await server.stop(0)


def test_a_client_certificate_rotated_on_disk_gives_new_credentials(pki_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("node-node-1.pem", "node-node-1.key", "ca.pem"):
        (mine / name).write_bytes((pki_dir / name).read_bytes())
    tls = ClientTls(pki.files_for(mine, identity.node("node-1")))
    tls.CHECK_EVERY_S = 0.0  # look at the files on every call (a pool looks once a second)
    first, gen = tls.credentials(), tls.generation
    assert tls.credentials() is first
    reissued_cert, reissued_key = pki.issue(*pki._load_ca(pki_dir), identity.node("node-1"))
    atomic_write_bytes(mine / "node-node-1.key", reissued_key, mode=0o600)
    atomic_write_bytes(mine / "node-node-1.pem", reissued_cert)
    assert tls.generation == gen + 1
    assert tls.credentials() is not first
    # A half-done rotation (a certificate whose key is not there yet) keeps the working set.
    other_cert, _ = pki.issue(*pki._load_ca(pki_dir), identity.node("node-1"))
    atomic_write_bytes(mine / "node-node-1.pem", other_cert)
    assert tls.generation == gen + 1


PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"


def _proto_modules() -> list[Any]:
    """The generated module of every .proto file under proto/ (a new file is held to the table at once)."""
    return [importlib.import_module(".".join(p.relative_to(PROTO_ROOT).with_suffix("").parts) + "_pb2")
            for p in sorted(PROTO_ROOT.rglob("*.proto"))]


def _all_methods() -> set[str]:
    out = set()
    modules = _proto_modules()
    assert {agent_pb2, scheduler_pb2, policy_pb2, checkpoint_pb2, gateway_pb2} <= set(modules)
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_the_table_has_a_rule_for_every_rpc_and_none_for_a_method_that_does_not_exist() -> None:
    methods = _all_methods()
    missing = methods - set(authz.RULES)
    assert not missing, f"no authorization rule for {sorted(missing)}"
    extra = {m for m in authz.RULES if not m.startswith(("/grpc.health", "/grpc.reflection"))} - methods
    assert not extra, f"rules for methods that do not exist: {sorted(extra)}"


def test_an_unknown_method_is_denied_by_default() -> None:
    with pytest.raises(PermissionDenied, match="no rule"):
        authz.check(identity.SCHEDULER, "/trainyard.agent.v1.AgentService/Nope")
    with pytest.raises(Unauthenticated):
        authz.check(None, "/trainyard.agent.v1.AgentService/LaunchWorkers")
