"""Gateway fixtures: a real GatewayApp on free ports against the session's etcd, and behind it either no
scheduler at all (nothing listens at its address), a real scheduler with no nodes (jobs stay pending), or
a real scheduler with two real node agents on simulated GPUs. The services are started per test: a
scheduler with two agents takes about 0.1 s, and a fresh one keeps "the admin sees every job" exact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trainyard_core.testing.etcd import free_port

from .support import Cluster, RunningGateway, running_cluster, running_gateway


@pytest.fixture
async def gateway(etcd_settings: dict[str, str], key_prefix: str) -> AsyncIterator[RunningGateway]:
    """No scheduler: anything that gets past validation and auth answers 503."""
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}") as gw:
        yield gw


@pytest.fixture
async def scheduler(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """A real scheduler without nodes: submitted jobs stay pending."""
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "scheduler",
                               state_root=tmp_path / "nodes") as cluster:
        yield cluster


@pytest.fixture
async def live_gateway(etcd_settings: dict[str, str], key_prefix: str,
                       scheduler: Cluster) -> AsyncIterator[RunningGateway]:
    # One deployment, one prefix: the gateway's audit entries are where the scheduler's AuditService reads.
    async with running_gateway(etcd=etcd_settings, etcd_prefix=scheduler.settings.etcd_prefix,
                               scheduler_address=scheduler.address) as gw:
        yield gw


@pytest.fixture
async def cluster(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """A real scheduler with two real agents, node-a and node-b, of 4 simulated A100s each."""
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "cluster",
                               state_root=tmp_path / "nodes", agents={"node-a": "a100x4", "node-b": "a100x4"}) as c:
        yield c


@pytest.fixture
async def cluster_gateway(etcd_settings: dict[str, str], key_prefix: str,
                          cluster: Cluster) -> AsyncIterator[RunningGateway]:
    # One deployment, one prefix: the gateway's audit entries are where the scheduler's AuditService reads.
    async with running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                               scheduler_address=cluster.address) as gw:
        yield gw
