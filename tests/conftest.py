"""Shared fixtures: a real etcd per test session (free ports, data on tmpfs), a clean prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing import etcd as etcd_proc


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[etcd_proc.EtcdProcess]:
    member = etcd_proc.start_single()
    try:
        yield member
    finally:
        etcd_proc.stop_and_clean(member)


@pytest.fixture
def etcd_endpoint(etcd_server: etcd_proc.EtcdProcess) -> str:
    return etcd_server.endpoint


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test uses, so tests sharing the session's etcd never see each other's keys."""
    return f"/t-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
async def etcd_store(etcd_endpoint: str) -> AsyncIterator[EtcdStore]:
    store = EtcdStore(etcd_endpoint)
    try:
        yield store
    finally:
        await store.close()
