"""etcd loses one of its three members to SIGKILL — its raft leader, or a follower — and the control plane
keeps working on the two that remain: a job that was running keeps its workers (same pids, same attempt)
and finishes; a job submitted through the gateway right after the kill runs to SUCCEEDED. The member is
then started again on its data and catches up with what was written while it was down.

The member killed is the one the services' etcd clients are on, so they must move to another: m1
(127.0.0.1, every client's first endpoint) as the leader, then m2 as a follower (a client moves to its
next endpoint on a failure). The raft role it has when killed is set beforehand with `etcdctl
move-leader`, so both cases are deterministic.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from trainyard_cli.local import LocalCluster
from trainyard_core.testing.etcd import restart

from .support import KEYS, Agents, Etcd, Gateway, assert_ran_once, hold_spec, leader_ready_nodes, release, until

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("role", ["leader", "follower"])
def test_services_survive_the_loss_of_an_etcd_member(role: str, cluster: LocalCluster, gateway: Gateway,
                                                      agents: Agents, etcd: Etcd, tmp_path: Path) -> None:
    m1, m2, m3 = cluster.etcd_cluster
    victim, other = (m1, m2) if role == "leader" else (m2, m3)
    etcd.move_leader(victim if role == "leader" else other)

    running = gateway.submit(hold_spec(f"before-etcd-{role}-loss", tmp_path))
    gateway.wait_state(running["id"], {"running"})
    workers = until(lambda: agents.running(running["id"]), 20, "the running job's worker on its agent")

    killed_at = time.monotonic()
    victim.kill()
    during = gateway.submit_retrying(hold_spec(f"during-etcd-{role}-loss", tmp_path, hold=False))
    lead = until(etcd.leader, 10, "a leader of the two remaining members")
    accepted_s = time.monotonic() - killed_at
    assert lead is not victim
    if role == "follower":
        assert lead is other, "losing a follower must not move the raft leadership"

    done = gateway.wait_state(during["id"], {"succeeded"}, timeout=30)
    succeeded_s = time.monotonic() - killed_at
    assert_ran_once(tmp_path, done)
    assert agents.running(running["id"]) == workers, "the running job's workers changed while etcd lost a member"
    assert leader_ready_nodes(etcd, cluster) == {n for n, _ in cluster.nodes}, "the scheduler declared a node lost"

    release(tmp_path, running["id"])
    finished = gateway.wait_state(running["id"], {"succeeded"}, timeout=30)
    assert_ran_once(tmp_path, finished)

    # The member comes back on its own data and replicates what the others wrote meanwhile.
    down_s = time.monotonic() - killed_at
    restart(victim, cluster.etcd_cluster)
    restarted_at = time.monotonic()
    key, value = f"/controlplane-test/rejoin/{uuid.uuid4().hex}", "written after the rejoin"
    etcd.put(key, value)
    until(lambda: etcd.get_local(victim, key) == value.encode(), 20,
          f"{victim.name} to replicate a write made after it restarted")
    until(lambda: etcd.leader() is not None and len(etcd.statuses()) == 3, 20,
          "all three members answering and agreeing on a leader")
    # Its own copy also has the jobs the services wrote while it was down.
    until(lambda: etcd.get_local(victim, KEYS.job(during["id"])) is not None, 20,
          f"{victim.name} to have the job submitted while it was down")
    print(f"\netcd {role} loss: job submitted and etcd leader known {accepted_s:.2f}s after the kill, the job "
          f"submitted during the loss succeeded after {succeeded_s:.2f}s; member down {down_s:.2f}s, caught up "
          f"{time.monotonic() - restarted_at:.2f}s after its restart")
