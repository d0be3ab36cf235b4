"""The gateway with mTLS on its gRPC side and HTTPS on its public side, against real grpc.aio servers.

Behind the gateway: small scheduler-like and agent-like servicers on `start_grpc_server(tls=...)` (the same
bootstrap, mTLS and authorization table as the real services), each holding the certificate the test
chooses, so a test can put the wrong principal where the gateway expects another. Every test starts its
own gateway on free ports against the session's etcd; none takes more than a fraction of a second.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.errors import NotLeader
from trainyard_core.rpc.server import CHANNEL_OPTIONS, GrpcServer, insecure_channel, secure_channel, start_grpc_server
from trainyard_core.security import authz, identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.tls import ClientTls, target_name_option
from trainyard_core.settings import SettingsError, load_settings
from trainyard_core.testing.etcd import free_port
from trainyard_gateway.settings import GatewaySettings

from .support import RunningGateway, running_gateway

NODE_1 = identity.node("node-1")
OPS = identity.tool("ops")




# --- a scheduler and an agent, as far as the gateway asks them ----------------------------------------

@dataclass
class FakeScheduler(scheduler_pb2_grpc.JobServiceServicer, scheduler_pb2_grpc.NodeServiceServicer):  # type: ignore[misc]
    """ListJobs answers no jobs; GetNode answers a node with one GPU at `agent_address`, or, with `leader`
    set, refuses as a standby naming that leader."""

    agent_address: str = ""
    leader: str = ""
    callers: list[tuple[str, Principal | None]] = field(default_factory=list)

    def _called(self, method: str) -> None:
        self.callers.append((method, authz.current_principal.get()))
        if self.leader:
            raise NotLeader("this replica is a standby", leader=self.leader)

    async def ListJobs(self, request: Any, context: Any) -> Any:
        self.callers.append(("ListJobs", authz.current_principal.get()))
        return scheduler_pb2.ListJobsResponse()

    async def GetNode(self, request: Any, context: Any) -> Any:
        self._called("GetNode")
        return scheduler_pb2.GetNodeResponse(node=types_pb2.Node(
            node_id=request.node_id, agent_address=self.agent_address, state=types_pb2.NODE_STATE_READY,
            gpus=[types_pb2.Gpu(index=0, model="A100")]))


@dataclass
class FakeAgent(agent_pb2_grpc.AgentServiceServicer):  # type: ignore[misc]
    callers: list[tuple[str, Principal | None]] = field(default_factory=list)

    async def SetGpuHealth(self, request: Any, context: Any) -> Any:
        self.callers.append(("SetGpuHealth", authz.current_principal.get()))
        return agent_pb2.SetGpuHealthResponse(gpu=types_pb2.Gpu(index=request.gpu_index))


@contextlib.asynccontextmanager
async def serving(servicer: Any, files: pki.CertFiles) -> AsyncIterator[GrpcServer]:
    def register(server: grpc.aio.Server) -> None:
        if isinstance(servicer, FakeScheduler):
            scheduler_pb2_grpc.add_JobServiceServicer_to_server(servicer, server)
            scheduler_pb2_grpc.add_NodeServiceServicer_to_server(servicer, server)
        else:
            agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)

    names = (["trainyard.scheduler.v1.JobService", "trainyard.scheduler.v1.NodeService"]
             if isinstance(servicer, FakeScheduler) else ["trainyard.agent.v1.AgentService"])
    server = await start_grpc_server(host="127.0.0.1", port=0, register=register, service_names=names, tls=files)
    try:
        yield server
    finally:
        await server.stop(grace=0)


def _address(server: GrpcServer) -> str:
    return f"127.0.0.1:{server.port}"


@contextlib.asynccontextmanager
async def tls_gateway(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path, *, scheduler_address: str = "",
                      **overrides: Any) -> AsyncIterator[RunningGateway]:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=scheduler_address or f"127.0.0.1:{free_port()}",
                               **pki.files_for(pki_dir, identity.GATEWAY).settings(), **overrides) as gw:
        yield gw


async def _set_health(gw: RunningGateway, node_id: str) -> httpx.Response:
    async with gw.client(gw.admin_token) as http:
        return await http.post(f"/v1/nodes/{node_id}/gpus/0:set-health",
                               json={"healthy": False, "reason": "drill"})


# --- the gateway's channels -----------------------------------------------------------------------------

def test_the_gateway_certificate_must_name_the_gateway() -> None:
    assert GatewaySettings().principal() == identity.GATEWAY


async def test_gateway_calls_a_tls_scheduler_follows_its_leader_and_reaches_the_nodes_agent(
        etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> None:
    scheduler_files = pki.files_for(pki_dir, identity.SCHEDULER)
    agent = FakeAgent()
    async with serving(agent, pki.files_for(pki_dir, NODE_1)) as agent_server, \
            serving(leader := FakeScheduler(agent_address=_address(agent_server)), scheduler_files) as lead, \
            serving(standby := FakeScheduler(leader=_address(lead)), scheduler_files) as stand, \
            tls_gateway(etcd_settings, key_prefix, pki_dir, scheduler_address=_address(stand)) as gw:
        async with gw.client(gw.admin_token) as http:
            health = await http.get("/healthz")
            assert health.json()["scheduler"] == {"reachable": True, "detail": ""}
            assert (await http.get("/v1/jobs")).status_code == 200
        # Node calls go to the leader the standby names, on a second mTLS channel; then to node-1's agent.
        reply = await _set_health(gw, "node-1")
        assert reply.status_code == 200, reply.text
    assert ("ListJobs", identity.GATEWAY) in standby.callers
    assert ("GetNode", identity.GATEWAY) in standby.callers
    assert ("GetNode", identity.GATEWAY) in leader.callers
    assert agent.callers == [("SetGpuHealth", identity.GATEWAY)]


async def test_gateway_refuses_a_scheduler_address_held_by_another_principal(
        etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> None:
    impostor = FakeScheduler()
    async with serving(impostor, pki.files_for(pki_dir, NODE_1)) as server, \
            tls_gateway(etcd_settings, key_prefix, pki_dir, scheduler_address=_address(server)) as gw, \
            gw.client(gw.admin_token) as http:
        health = await http.get("/healthz")
        assert health.status_code == 503
        assert health.json()["scheduler"]["reachable"] is False
        assert (await http.get("/v1/jobs")).status_code == 503
    assert impostor.callers == []  # no request got past the handshake


async def test_gateway_refuses_an_agent_that_is_not_the_node_of_the_record(
        etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> None:
    """The scheduler's record says node-2 is at an address whose agent holds node-1's certificate (the address
    moved to another node): the gateway must not set a GPU's health on the wrong node."""
    agent = FakeAgent()
    async with serving(agent, pki.files_for(pki_dir, NODE_1)) as agent_server, \
            serving(FakeScheduler(agent_address=_address(agent_server)),
                    pki.files_for(pki_dir, identity.SCHEDULER)) as sched, \
            tls_gateway(etcd_settings, key_prefix, pki_dir, scheduler_address=_address(sched)) as gw:
        reply = await _set_health(gw, "node-2")
        assert reply.status_code == 503, reply.text
        assert "node-2" in reply.json()["error"]["message"]
        assert (await _set_health(gw, "node-1")).status_code == 200
    assert agent.callers == [("SetGpuHealth", identity.GATEWAY)]


# --- the gateway's TokenService --------------------------------------------------------------------------

async def _list_tokens(channel: grpc.aio.Channel, token: str = "") -> grpc.StatusCode:
    stub = gateway_pb2_grpc.TokenServiceStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        await stub.ListTokens(gateway_pb2.ListTokensRequest(), metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()
    return grpc.StatusCode.OK


async def test_token_service_needs_mtls_and_a_tool_principal(etcd_settings: dict[str, str], key_prefix: str,
                                                             pki_dir: Path) -> None:
    async with tls_gateway(etcd_settings, key_prefix, pki_dir) as gw:
        address = f"127.0.0.1:{gw.app.grpc_port}"

        def as_(me: Principal) -> grpc.aio.Channel:
            return secure_channel(address, ClientTls(pki.files_for(pki_dir, me)), identity.GATEWAY)

        ca = (pki_dir / "ca.pem").read_bytes()
        no_cert = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca),
                                          options=[*CHANNEL_OPTIONS, target_name_option(identity.GATEWAY)])
        assert await _list_tokens(no_cert, gw.admin_token) == grpc.StatusCode.UNAVAILABLE
        assert await _list_tokens(insecure_channel(address), gw.admin_token) == grpc.StatusCode.UNAVAILABLE
        assert await _list_tokens(as_(identity.GATEWAY), gw.admin_token) == grpc.StatusCode.PERMISSION_DENIED
        assert await _list_tokens(as_(NODE_1), gw.admin_token) == grpc.StatusCode.PERMISSION_DENIED
        # A tool passes the table; the admin token is still required on top of it.
        assert await _list_tokens(as_(OPS)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _list_tokens(as_(OPS), gw.admin_token) == grpc.StatusCode.OK


# --- HTTPS -------------------------------------------------------------------------------------------------

def _https(pki_dir: Path) -> dict[str, str]:
    files = pki.files_for(pki_dir, identity.GATEWAY)
    return {"http_tls_cert_file": str(files.cert), "http_tls_key_file": str(files.key)}


async def test_https_with_http_tls_files(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> None:
    verify = ssl.create_default_context(cafile=str(pki_dir / "ca.pem"))
    async with tls_gateway(etcd_settings, key_prefix, pki_dir, **_https(pki_dir)) as gw:
        headers = {"Authorization": f"Bearer {gw.admin_token}"}
        for host in ("127.0.0.1", "localhost"):
            async with httpx.AsyncClient(base_url=f"https://{host}:{gw.app.http_port}", verify=verify,
                                         headers=headers, timeout=10) as http:
                reply = await http.get("/v1/tokens")
                assert reply.status_code == 200, reply.text
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.app.http_port}", timeout=10) as plain:
            with pytest.raises(httpx.TransportError):
                await plain.get("/v1/tokens", headers=headers)


async def test_http_stays_plain_without_http_tls_files(etcd_settings: dict[str, str], key_prefix: str,
                                                       pki_dir: Path) -> None:
    async with tls_gateway(etcd_settings, key_prefix, pki_dir) as gw, gw.client(gw.admin_token) as http:
        assert (await http.get("/v1/tokens")).status_code == 200


def test_http_tls_needs_both_files(pki_dir: Path) -> None:
    files = _https(pki_dir)
    with pytest.raises(SettingsError, match="http_tls_cert_file is set, http_tls_key_file is not"):
        load_settings(GatewaySettings, prog="trainyard-gateway", argv=["--http-tls-cert-file",
                                                                       files["http_tls_cert_file"]])
    with pytest.raises(SettingsError, match="http_tls_key_file is set, http_tls_cert_file is not"):
        load_settings(GatewaySettings, prog="trainyard-gateway", argv=[],
                      env={"TRAINYARD_GATEWAY_HTTP_TLS_KEY_FILE": files["http_tls_key_file"]})


async def test_unusable_http_tls_files_fail_the_start_naming_them(etcd_settings: dict[str, str], key_prefix: str,
                                                                  pki_dir: Path) -> None:
    wrong_key = {**_https(pki_dir), "http_tls_key_file": str(pki_dir / "scheduler.key")}
    with pytest.raises(OSError, match=r"http_tls_key_file .*scheduler\.key: cannot serve HTTPS"):
        async with tls_gateway(etcd_settings, key_prefix, pki_dir, **wrong_key):
            pass
