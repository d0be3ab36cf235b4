"""`trainyard nodes get|cordon|uncordon|set-health` against a real gateway and scheduler with a real agent on
simulated GPUs: what each prints, that the scheduler acted on it (a cordoned node gets no new gang, an
unhealthy GPU is not free), and the refusals (a member token, an unknown node, a missing --reason)."""

from __future__ import annotations

import json
from typing import Any

from tests.gateway.support import Cluster, RunningGateway
from trainyard.common.v1 import types_pb2
from trainyard_core.testing.wait import eventually


async def cordoned(scheduler: Cluster, node_id: str) -> bool:
    """Whether the scheduler holds the node cordoned (what it places by)."""
    (node,) = [n for n in await scheduler.list_nodes() if n.node_id == node_id]
    return bool(node.cordoned)


async def gpu_health(scheduler: Cluster, index: int, health: str) -> bool:
    (node,) = [n for n in await scheduler.list_nodes() if n.node_id == "node-a"]
    (gpu,) = [g for g in node.gpus if g.index == index]
    return bool(types_pb2.GpuHealth.Name(gpu.health) == f"GPU_HEALTH_{health.upper()}")


async def test_get_shows_the_node_and_its_gpus(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    r = await cli("nodes", "get", "node-a")
    assert r.rc == 0, r.err
    fields = dict(line.split(":", 1) for line in r.out.splitlines() if ":" in line and not line.startswith(" "))
    assert fields["node"].strip() == "node-a" and fields["gpus free"].strip() == "4 of 4"
    gpu_rows = [line.split() for line in r.out.splitlines()[r.out.splitlines().index("gpus:") + 2:]]
    assert [row[0] for row in gpu_rows] == ["0", "1", "2", "3"]
    assert {row[1] for row in gpu_rows} == {"A100-SXM4-40GB"} and {row[3] for row in gpu_rows} == {"healthy"}
    r = await cli("nodes", "get", "node-a", "--json")
    assert json.loads(r.out)["node_id"] == "node-a"
    r = await cli("nodes", "get", "node-zz")
    assert r.rc == 1 and r.err.startswith("error: ") and "node-zz" in r.err


async def test_cordon_and_uncordon(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    r = await cli("nodes", "cordon", "node-a", "--reason", "replacing a fan")
    assert (r.rc, r.out.strip()) == (0, "node node-a cordoned (replacing a fan): no new placement; what runs there "
                                        "goes on"), r.err
    assert await cordoned(scheduler, "node-a")
    r = await cli("nodes")
    assert r.out.splitlines()[1].split()[:2] in (["node-a", "cordoned"], ["node-a", "ready,cordoned"])
    job = await scheduler.submit(["true"], gpus=1)
    r = await cli("status", job.id)
    assert "state:     pending" in r.out  # nowhere to go while the only node is cordoned
    r = await cli("nodes", "uncordon", "node-a")
    assert r.rc == 0 and r.out.startswith("node node-a uncordoned"), r.err
    await scheduler.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    r = await cli("nodes", "cordon", "node-a", "--json")
    assert r.rc == 0 and json.loads(r.out)["cordoned"] is True


async def test_set_health_takes_a_gpu_out_and_back(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    r = await cli("nodes", "set-health", "node-a", "2", "--unhealthy", "--reason", "xid 79 by hand")
    assert r.rc == 0 and r.out.startswith("node node-a GPU 2 set unhealthy (xid 79 by hand)"), r.err
    await eventually(lambda: gpu_health(scheduler, 2, "unhealthy"), what="the agent to report GPU 2 unhealthy")
    r = await cli("nodes", "-o", "wide")
    header, row = r.out.splitlines()
    assert "UNHEALTHY GPUS" in header and row.split()[2:5] == ["3/4", "A100-SXM4-40GB", "2"]
    r = await cli("nodes", "set-health", "node-a", "2", "--healthy", "--reason", "replaced")
    assert r.rc == 0 and r.out.startswith("node node-a GPU 2 set healthy (replaced)"), r.err
    await eventually(lambda: gpu_health(scheduler, 2, "healthy"), what="the agent to report GPU 2 healthy")
    r = await cli("nodes")
    assert r.out.splitlines()[1].split()[2] == "4/4"
    r = await cli("nodes", "set-health", "node-a", "2", "--healthy")
    assert r.rc == 2 and "--reason" in r.err
    r = await cli("nodes", "set-health", "node-a", "2", "--reason", "x")
    assert r.rc == 2 and "--healthy" in r.err


async def test_a_member_may_read_nodes_but_not_act_on_them(cli: Any, gateway: RunningGateway,
                                                           scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    r = await cli("tokens", "create", "--team", "vision", "--user", "alice", "--json")
    secret = json.loads(r.out)["secret"]
    r = await cli("nodes", "get", "node-a", "--token", secret)
    assert r.rc == 0, r.err
    for argv in (("cordon", "node-a"), ("uncordon", "node-a"), ("set-health", "node-a", "0", "--unhealthy",
                                                                "--reason", "x")):
        r = await cli("nodes", *argv, "--token", secret)
        assert r.rc == 1 and "operator" in r.err, (argv, r.err)
    assert not await cordoned(scheduler, "node-a")
