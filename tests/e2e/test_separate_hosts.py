"""The local cluster with each node on a host of its own (a network namespace on a bridge, see
trainyard_core.testing.netns): the control plane reaches the agents, the agents the control plane, the workers one
another across hosts, and a node's certificate buys it nothing on another node. Needs root (we are, here and in
CI); elsewhere it is skipped with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainyard_cli.local import LocalCluster
from trainyard_core.security import identity, pki
from trainyard_core.testing import netns

from .conftest import Api, local_cluster

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]
PROGRAMS = Path(__file__).parent / "programs"

# Prints the address this rank's host uses to reach rank 0's host, after a gloo all-reduce across hosts.
WHERE_AM_I = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1); dist.all_reduce(t)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((os.environ["MASTER_ADDR"], 9))
print(f"rank {dist.get_rank()} from {s.getsockname()[0]} master {os.environ['MASTER_ADDR']} sum {t.item():g}")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "hosts", netns=True,
                       nodes=[("node-1", "h100x8"), ("node-2", "h100x8")]) as c:
        yield c


@pytest.fixture(scope="module")
def hosts_api(hosts: LocalCluster) -> Api:
    api = Api(hosts)
    api.wait_nodes_ready(2)
    return api


def test_nodes_register_from_their_own_hosts(hosts: LocalCluster, hosts_api: Api) -> None:
    assert hosts.network is not None
    nodes = {n["node_id"]: n for n in hosts_api.wait_nodes_ready(2)}
    for node_id in ("node-1", "node-2"):
        address = hosts.network.hosts[node_id].address
        assert nodes[node_id]["agent_address"].startswith(address + ":"), nodes[node_id]
    assert hosts.scheduler_address.startswith(hosts.network.bridge_address + ":")


def test_a_gang_spans_two_hosts(hosts: LocalCluster, hosts_api: Api) -> None:
    assert hosts.network is not None
    job = hosts_api.submit({"name": "hosts", "command": [sys.executable, "-c", WHERE_AM_I],
                            "resources": {"nodes": 2, "gpus_per_node": 1}})
    done = hosts_api.wait(job["id"], {"succeeded"}, timeout=120)
    rank0_node = next(a["node_id"] for a in done["placement"] if 0 in a["ranks"])
    master = hosts.network.hosts[rank0_node].address
    logs = hosts_api.http.get(f"/v1/jobs/{job['id']}/logs").text
    for a in done["placement"]:
        for rank in a["ranks"]:
            own = hosts.network.hosts[a["node_id"]].address
            assert f"[rank {rank}] rank {rank} from {own} master {master} sum 2" in logs, logs


def test_a_node_certificate_buys_nothing_on_another_host(hosts: LocalCluster, hosts_api: Api) -> None:
    """From node-1's host, with node-1's own certificate: launching on node-2's agent and registering as node-2
    are refused by the real services, and the control plane's etcd (its loopback) is out of reach."""
    assert hosts.network is not None and hosts.etcd is not None
    nodes = {n["node_id"]: n for n in hosts_api.wait_nodes_ready(2)}
    files = pki.files_for(hosts.pki_dir, identity.node("node-1"))
    cmd = [*hosts.network.exec_prefix("node-1"), sys.executable, str(PROGRAMS / "node_probe.py"),
           str(files.cert), str(files.key), str(files.ca), "node-1", "node-2", nodes["node-2"]["agent_address"],
           hosts.scheduler_addresses[0], str(hosts.etcd.client_port)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["launch_on_other"].startswith("PERMISSION_DENIED"), out
    assert "trainyard://node/node-1" in out["launch_on_other"]
    assert out["register_as_other"].startswith("PERMISSION_DENIED"), out
    assert "node-2" in out["register_as_other"]
    assert out["etcd_on_loopback"] == "ConnectionRefusedError", out
    # node-2 still holds its own registration: the refused impostor changed nothing.
    after = {n["node_id"]: n for n in hosts_api.wait_nodes_ready(2)}
    assert after["node-2"]["agent_address"] == nodes["node-2"]["agent_address"]


def test_stopping_the_cluster_removes_its_namespaces(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, gateway_port=0, stop_grace_s=1.0, log_format="text", netns=True,
                           nodes=[("node-1", "a100x4")])
    cluster.start()
    try:
        assert cluster.network is not None
        names = [h.netns for h in cluster.network.hosts.values()]
        bridge = cluster.network.bridge
    finally:
        cluster.stop()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names), listed
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert bridge not in links
