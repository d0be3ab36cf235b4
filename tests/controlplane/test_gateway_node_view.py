"""The gateway reaches the scheduler through one pick_first channel over every replica
(GatewaySettings.scheduler_target): it talks to the first replica it can reach, which may be the standby.
Job calls work on any replica (they read and write etcd), but node calls must not depend on which replica
answers: the node view (ready or not, last heartbeat, free GPUs) and cordoning must be the leader's.

Here the gateway is deliberately left connected to the standby — the state a cluster is in whenever the
second replica wins the election at start-up, or after a failover to it and a gateway restart.
"""

from __future__ import annotations

import pytest

from trainyard_cli.local import LocalCluster

from .support import Etcd, Gateway, leader_ready_nodes, new_scheduler_leader, until

pytestmark = pytest.mark.e2e


def test_the_gateway_shows_and_cordons_nodes_as_the_leader_does_while_connected_to_the_standby(
        cluster: LocalCluster, gateway: Gateway, etcd: Etcd) -> None:
    first = cluster.scheduler_names[0]
    by_address = dict(zip(cluster.scheduler_addresses, cluster.scheduler_names, strict=True))
    identity, _ = until(etcd.scheduler_leader, 10, "a scheduler leader")
    if by_address[identity] == first:
        # Move the lead to the second replica; the first comes back as the standby.
        cluster.procs[first].kill()
        until(lambda: new_scheduler_leader(etcd, identity), 15, "the second replica to take the lead")
        cluster.procs[first].start()
        cluster.procs[first].wait_ready()
    # A new gateway process: its channel picks the first replica that answers, the standby.
    cluster.restart("gateway")
    gateway.wait_answering()
    nodes = {n for n, _ in cluster.nodes}
    # Heard, not only held ready: after the failover above the new leader shows the nodes ready before
    # their agents have found it, and the view below must carry its heartbeats.
    until(lambda: leader_ready_nodes(etcd, cluster, heard=True) == nodes, 30,
          "the leader to hold every node ready and to have heard from each")

    listed = gateway.http.get("/v1/nodes")
    cordon = gateway.http.post("/v1/nodes/node-2:cordon", json={"reason": "control-plane test"})
    if cordon.status_code == 200:
        uncordon = gateway.http.post("/v1/nodes/node-2:uncordon")
        assert uncordon.status_code == 200, uncordon.text
    assert listed.status_code == 200, listed.text
    shown = {n["node_id"]: (n["state"], n["last_heartbeat"], n["gpus_free"]) for n in listed.json()["nodes"]}
    assert cordon.status_code == 200 and all(state == "ready" and beat for state, beat, _ in shown.values()), (
        f"through the gateway: cordon answered {cordon.status_code} {cordon.text}; nodes shown as "
        f"(state, last heartbeat, free GPUs) {shown}, while the leader holds {sorted(nodes)} ready")
