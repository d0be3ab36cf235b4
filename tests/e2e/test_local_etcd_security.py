"""The local cluster's etcd as production runs it: TLS only, client certificates required, auth on, and the
services logged in as `trainyard`, whose role covers /trainyard/ only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from trainyard_cli.local import ETCD_PREFIX, ETCD_USER, LocalCluster
from trainyard_core.errors import PermissionDenied
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_check import StartupCheckFailed, check_access
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_scheduler.state.keys import Keys

from .conftest import local_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "etcd-security", nodes=[("node-1", "h100x8")]) as c:
        yield c


def test_every_etcd_backed_service_reached_etcd_over_tls(cluster: LocalCluster) -> None:
    for name in ("scheduler", "gateway", "checkpoint-store"):
        log = (cluster.workdir / "logs" / f"{name}.log").read_text()
        assert "etcd over TLS" in log and "PLAINTEXT etcd" not in log, name


async def test_the_services_user_reads_and_writes_its_prefix_only(cluster: LocalCluster) -> None:
    store = EtcdStore.from_options(cluster.etcd_options(ETCD_USER))
    try:
        await check_access(store, ETCD_PREFIX)
        deadline = time.monotonic() + 20
        while await store.get(Keys(ETCD_PREFIX).leader) is None:  # the scheduler leads through this user
            assert time.monotonic() < deadline, "no scheduler leader key in etcd after 20s"
            await asyncio.sleep(0.1)
        with pytest.raises(PermissionDenied, match=f"its user {ETCD_USER} may not"):
            await store.put("/not-trainyard/key", b"x")
    finally:
        await store.close()


async def test_plaintext_is_refused(cluster: LocalCluster) -> None:
    store = EtcdStore.from_options(EtcdOptions(endpoints=cluster.etcd_endpoints), timeout=2.0)
    try:
        with pytest.raises(StartupCheckFailed, match="closed the plaintext connection"):
            await check_access(store, ETCD_PREFIX)
    finally:
        await store.close()
