"""Gateway fixtures: a real GatewayApp on free ports against the session's etcd, with the scheduler
either unreachable (nothing listens at its address) or a stub served over real gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trainyard_core.testing.etcd import free_port
from trainyard_gateway.testing import RunningGateway, StubScheduler, running_gateway


@pytest.fixture
async def stub_scheduler() -> AsyncIterator[StubScheduler]:
    stub = StubScheduler()
    await stub.start()
    try:
        yield stub
    finally:
        await stub.stop()


@pytest.fixture
async def gateway(etcd_endpoint: str, key_prefix: str) -> AsyncIterator[RunningGateway]:
    """Scheduler unreachable: anything that gets past validation and auth answers 503."""
    async with running_gateway(etcd_endpoints=etcd_endpoint, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}") as gw:
        yield gw


@pytest.fixture
async def stub_gateway(etcd_endpoint: str, key_prefix: str,
                       stub_scheduler: StubScheduler) -> AsyncIterator[RunningGateway]:
    async with running_gateway(etcd_endpoints=etcd_endpoint, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=stub_scheduler.address) as gw:
        yield gw
