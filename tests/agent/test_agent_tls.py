"""The node agent and the scheduler over mTLS: real in-process apps on the session's etcd, certificates from a
development PKI. A node registers and heartbeats only as the node its certificate names; only the scheduler
launches or stops workers (the calls that carry a leader epoch, which raises the agent's fence)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.agent.agent_kit import Scheduler, agent_settings
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent import cli as agent_cli
from trainyard_agent.app import AgentApp
from trainyard_core.rpc.server import insecure_channel, secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.pki import CertFiles
from trainyard_core.security.tls import ClientTls
from trainyard_core.service import check_transport
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

NODE_1, NODE_2, OPS = identity.node("node-1"), identity.node("node-2"), identity.tool("ops")




def channel(pki_dir: Path, caller: Principal, address: str, expected: Principal) -> grpc.aio.Channel:
    return secure_channel(address, ClientTls(pki.files_for(pki_dir, caller)), expected)


@pytest.fixture
async def tls_scheduler(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> AsyncIterator[Scheduler]:
    # agent_kit.Scheduler's own stubs are plaintext: the tests below read through `ops` channels or etcd.
    sched = Scheduler(etcd_settings, key_prefix, **pki.files_for(pki_dir, identity.SCHEDULER).settings())
    await sched.start()
    try:
        yield sched
    finally:
        await sched.stop()


async def start_agent(tmp_path: Path, scheduler_address: str, node_id: str, files: CertFiles) -> AgentApp:
    app = AgentApp(agent_settings(tmp_path / f"state-{node_id}", scheduler_address, node_id=node_id,
                                  **files.settings()))
    await app.start()
    return app


async def get_node(pki_dir: Path, scheduler: Scheduler, node_id: str) -> types_pb2.Node | None:
    async with channel(pki_dir, OPS, scheduler.address, identity.SCHEDULER) as ch:
        try:
            got: scheduler_pb2.GetNodeResponse = await scheduler_pb2_grpc.NodeServiceStub(ch).GetNode(
                scheduler_pb2.GetNodeRequest(node_id=node_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return got.node


async def test_agent_registers_and_heartbeats_with_a_tls_scheduler(tmp_path: Path, pki_dir: Path,
                                                                  tls_scheduler: Scheduler) -> None:
    app = await start_agent(tmp_path, tls_scheduler.address, "node-1", pki.files_for(pki_dir, NODE_1))
    try:
        reporter = app.reporter
        assert reporter is not None

        async def beating() -> bool:
            return reporter.registrations >= 1 and reporter.acked_seq >= 2

        await eventually(beating, timeout=10, what="node-1 to register and have heartbeats acknowledged")
        node = await get_node(pki_dir, tls_scheduler, "node-1")
        assert node is not None and len(node.gpus) == 8
        # The epoch of the leader's answers raised the fence, and came over the channel that verified the
        # scheduler's certificate.
        assert app.fence.highest == tls_scheduler.epoch > 0
        # Plaintext is not served on a TLS port.
        async with insecure_channel(tls_scheduler.address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await scheduler_pb2_grpc.NodeServiceStub(plain).GetNode(
                    scheduler_pb2.GetNodeRequest(node_id="node-1"), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.stop(kill_workers=True)


async def test_agent_holding_another_nodes_certificate_is_refused(tmp_path: Path, pki_dir: Path,
                                                                  tls_scheduler: Scheduler,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    node_1 = pki.files_for(pki_dir, NODE_1)
    # A real process stops before it listens: its certificate names another node.
    settings = agent_settings(tmp_path / "state", tls_scheduler.address, node_id="node-2", **node_1.settings())
    problem = check_transport(settings)
    assert "names trainyard://node/node-1, but this service is trainyard://node/node-2" in problem

    # The scheduler refuses it too: a node speaks only for itself.
    async with channel(pki_dir, NODE_1, tls_scheduler.address, identity.SCHEDULER) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.NodeServiceStub(ch).RegisterNode(scheduler_pb2.RegisterNodeRequest(
                node=types_pb2.Node(node_id="node-2", agent_address="127.0.0.1:1")), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "node-2" in (info.value.details() or "")

    # An app started in-process (no check_transport) keeps being refused and never registers.
    caplog.set_level(logging.WARNING, logger="trainyard_agent.report")
    app = await start_agent(tmp_path, tls_scheduler.address, "node-2", node_1)
    try:
        async def refused() -> bool:
            return any("PERMISSION_DENIED" in r.getMessage() for r in caplog.records)

        await eventually(refused, timeout=10, what="the agent's registration to be refused")
        assert app.reporter is not None and app.reporter.registrations == 0
        assert await get_node(pki_dir, tls_scheduler, "node-2") is None
    finally:
        await app.stop(kill_workers=True)


async def test_only_the_scheduler_launches_or_stops_on_a_tls_agent(tmp_path: Path, pki_dir: Path) -> None:
    # No scheduler is needed: the agent serves while its reporter retries in the background.
    app = await start_agent(tmp_path, f"127.0.0.1:{free_port()}", "node-2", pki.files_for(pki_dir, NODE_2))
    address = f"127.0.0.1:{app.grpc_port}"
    try:
        launch = agent_pb2.LaunchWorkersRequest(job_id="job-x", attempt=1, leader_epoch=10**9)
        stop = agent_pb2.StopWorkersRequest(job_id="job-x", attempt=1, leader_epoch=10**9)
        for caller in (NODE_1, OPS):
            async with channel(pki_dir, caller, address, NODE_2) as ch:
                stub = agent_pb2_grpc.AgentServiceStub(ch)
                for call in (stub.LaunchWorkers(launch, timeout=5), stub.StopWorkers(stop, timeout=5)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, caller
        assert app.fence.highest == 0  # no refused epoch reached the fence

        # A tool may list workers (ListWorkers carries no epoch); the scheduler may stop.
        async with channel(pki_dir, OPS, address, NODE_2) as ch:
            listed = await agent_pb2_grpc.AgentServiceStub(ch).ListWorkers(agent_pb2.ListWorkersRequest(), timeout=5)
            assert list(listed.workers) == []
        async with channel(pki_dir, identity.SCHEDULER, address, NODE_2) as ch:
            stopped = await agent_pb2_grpc.AgentServiceStub(ch).StopWorkers(
                agent_pb2.StopWorkersRequest(job_id="job-x", attempt=1, leader_epoch=7), timeout=5)
            assert stopped.stopped == 0
        assert app.fence.highest == 7

        # The client verifies the server: expecting node-1 at node-2's address fails the handshake.
        async with channel(pki_dir, identity.SCHEDULER, address, NODE_1) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await agent_pb2_grpc.AgentServiceStub(ch).ListWorkers(agent_pb2.ListWorkersRequest(), timeout=3)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.stop(kill_workers=True)


async def test_operator_cli_over_mtls(tmp_path: Path, pki_dir: Path) -> None:
    app = await start_agent(tmp_path, f"127.0.0.1:{free_port()}", "node-2", pki.files_for(pki_dir, NODE_2))
    address = f"127.0.0.1:{app.grpc_port}"
    ops = pki.files_for(pki_dir, OPS)
    tls_flags = ["--tls-cert", str(ops.cert), "--tls-key", str(ops.key), "--tls-ca", str(ops.ca)]
    health = ["set-health", "--agent", address, "--gpu", "3", "--unhealthy", "--operator", "alice", "--reason", "r"]
    try:
        code, out, err = await cli(*health, "--node-id", "node-2", *tls_flags)
        assert (code, err) == (0, "") and out.startswith("GPU 3 (") and "unhealthy" in out
        # Plaintext against a TLS agent, or the certificate of another node than the one expected: refused.
        code, _, err = await cli(*health, "--timeout", "2")
        assert code == 1 and "UNAVAILABLE" in err
        code, _, err = await cli(*health, "--node-id", "node-1", "--timeout", "2", *tls_flags)
        assert code == 1 and "UNAVAILABLE" in err
    finally:
        await app.stop(kill_workers=True)


@pytest.mark.parametrize("extra,message", [
    (["--tls-cert", "c.pem"], "--tls-cert, --tls-key and --tls-ca go together"),
    (["--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"], "--node-id is required with"),
    (["--node-id", "node-1"], "--node-id is only used with"),
    (["--node-id", "Node_1", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"], "argument --node-id"),
])
def test_operator_cli_tls_flags(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_cli.main(["inject", "--agent", "127.0.0.1:1", "--gpu", "0", "--xid", "79", *extra])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_operator_cli_unusable_certificate(pki_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ops = pki.files_for(pki_dir, OPS)
    code = agent_cli.main(["inject", "--agent", "127.0.0.1:1", "--gpu", "0", "--xid", "79", "--node-id", "node-1",
                           "--tls-cert", str(ops.cert), "--tls-key", str(pki.files_for(pki_dir, NODE_1).key),
                           "--tls-ca", str(ops.ca)])
    assert code == 2 and "is not the private key of" in capsys.readouterr().err


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "trainyard_agent.main", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode().strip(), err.decode().strip()


def test_agent_certificate_names_its_node(tmp_path: Path, pki_dir: Path) -> None:
    files = pki.files_for(pki_dir, NODE_1)
    settings = agent_settings(tmp_path / "s", "127.0.0.1:1", node_id="node-1", **files.settings())
    assert settings.principal() == NODE_1 and check_transport(settings) == ""
    # The contract allows a node id no certificate can name (a trailing '-'): refused with TLS, not without.
    with pytest.raises(ValueError, match="cannot be named by a certificate"):
        agent_settings(tmp_path / "s", "127.0.0.1:1", node_id="node-", **files.settings())
    assert agent_settings(tmp_path / "s", "127.0.0.1:1", node_id="node-").tls is None
