"""One local cluster for the whole control-plane package: a 3-member etcd on 127.0.0.1/.2/.3, a leader
and a standby scheduler, the checkpoint-store, the gateway on a fixed port (so its URL outlives a restart)
and two simulated nodes. Every test leaves it as it found it; `healthy` checks that before each test and
puts back whatever a failed test left killed."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainyard_cli.local import LocalCluster
from trainyard_core.testing.etcd import free_port, restart

from .support import Agents, Etcd, Gateway, leader_ready_nodes, until


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(Path(tmp_path_factory.mktemp("controlplane")), gateway_port=free_port(), etcd_members=3,
                     schedulers=2, stop_grace_s=2.0, log_format="text")
    try:
        c.start()
        yield c
    finally:
        # stop() removes the etcd members' directories; keep their logs with the services'.
        for m in c.etcd_cluster:
            with contextlib.suppress(OSError):
                shutil.copyfile(m.log_path, c.workdir / "logs" / f"etcd-{m.name}.log")
        c.stop()


@pytest.fixture(scope="package")
def gateway(cluster: LocalCluster) -> Iterator[Gateway]:
    g = Gateway(cluster)
    yield g
    g.http.close()


@pytest.fixture(scope="package")
def agents(cluster: LocalCluster) -> Iterator[Agents]:
    a = Agents(cluster)
    yield a
    a.close()


@pytest.fixture(scope="package")
def etcd(cluster: LocalCluster) -> Etcd:
    return Etcd(cluster.etcd_cluster)


def _restore(cluster: LocalCluster, etcd: Etcd) -> None:
    for m in cluster.etcd_cluster:
        if m.proc is None or m.proc.poll() is not None:
            restart(m, cluster.etcd_cluster)
    for name, proc in cluster.procs.items():
        if proc.popen is None or proc.popen.poll() is not None:
            cluster.restart(name)


@pytest.fixture(autouse=True)
def healthy(cluster: LocalCluster, gateway: Gateway, etcd: Etcd) -> Iterator[None]:
    """Before each test: every process runs, etcd has a leader all members agree on, a scheduler leads and
    holds both nodes ready (asked directly: see test_gateway_node_view.py for why not through the
    gateway), and no job is left running. After it: killed processes are started again."""
    _restore(cluster, etcd)
    gateway.wait_answering()
    until(etcd.leader, 20, "an etcd leader every member agrees on")
    until(etcd.scheduler_leader, 20, "a scheduler leader")
    nodes = {n for n, _ in cluster.nodes}
    until(lambda: leader_ready_nodes(etcd, cluster) == nodes, 30, f"the scheduler leader to hold {sorted(nodes)} ready")
    gateway.cancel_unfinished()
    yield
    _restore(cluster, etcd)
