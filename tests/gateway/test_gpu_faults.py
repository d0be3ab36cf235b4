"""GPU faults end to end through the gateway, the real scheduler and real agents (simulated GPUs): the
health policy's verdict reaches the scheduler within 2 s, the job on the GPU is stopped, the node is
cordoned for drain-class faults, application-class XIDs change nothing; the operator's override."""

from __future__ import annotations

import time

import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway, python


async def _inject(cluster: Cluster, node_id: str, gpu: int, xid: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.agents[node_id].grpc_port}") as channel:
        await agent_pb2_grpc.AgentServiceStub(channel).InjectFault(
            agent_pb2.InjectFaultRequest(gpu_index=gpu, kind="xid", xid=xid))


async def test_xid_79_stops_the_job_on_that_gpu_and_cordons_the_node(cluster: Cluster,
                                                                      cluster_gateway: RunningGateway) -> None:
    admin = await cluster_gateway.create_token("ops", "root", role="operator")
    async with cluster_gateway.client(admin) as http:
        job = (await http.post("/v1/jobs", json={"name": "victim", "command": python("import time; time.sleep(600)"),
                                                 "resources": {"nodes": 1, "gpus_per_node": 4}})).json()

        async def running() -> bool:
            return (await http.get(f"/v1/jobs/{job['id']}")).json()["state"] == "running"

        await eventually(running, timeout=30, what="job running")
        (where,) = [a["node_id"] for a in (await http.get(f"/v1/jobs/{job['id']}")).json()["placement"]]

        # XID 13 is an application error: nothing is drained, the job keeps running.
        await _inject(cluster, where, 2, 13)
        node = (await http.get(f"/v1/nodes/{where}")).json()
        assert node["cordoned"] is False and node["gpus"][2]["health"] == "healthy"

        injected = time.monotonic()
        await _inject(cluster, where, 3, 79)

        async def gpu_unhealthy() -> dict | None:  # type: ignore[type-arg]
            n = (await http.get(f"/v1/nodes/{where}")).json()
            return n if n["gpus"][3]["health"] == "unhealthy" else None

        node = await eventually(gpu_unhealthy, timeout=2.0, interval=0.02, what="GPU 3 unhealthy at the scheduler")
        assert time.monotonic() - injected <= 2.0
        assert node["cordoned"] is True and "GPU 3" in node["cordon_reason"]

        async def evacuated() -> dict | None:  # type: ignore[type-arg]
            j = (await http.get(f"/v1/jobs/{job['id']}")).json()
            return j if j["infra_restarts"] == 1 and j["state"] == "running" and j["attempt"] == 2 else None

        # An infrastructure failure: the job restarts elsewhere without using its restart budget
        # (max_restarts is 0 here), and the event names the GPU.
        moved = await eventually(evacuated, timeout=20, what="the job restarted off the cordoned node")
        assert moved["restarts"] == 0
        assert [a["node_id"] for a in moved["placement"]] != [where]
        restarting = [e for e in moved["events"] if e["kind"] == "restarting"]
        assert restarting and f"GPU 3 on {where} became unhealthy" in restarting[-1]["message"], moved["events"]
        assert "not counted against max_restarts" in restarting[-1]["message"]
        supervisor = cluster.agents[where].supervisor
        assert supervisor is not None and not any(w.running for w in supervisor.list_workers())
        assert (await http.post(f"/v1/jobs/{job['id']}:cancel")).status_code in (200, 202)

        # After repair the operator puts the GPU back; the node stays cordoned until uncordoned.
        r = await http.post(f"/v1/nodes/{where}/gpus/3:set-health", json={"healthy": True, "reason": "reseated"})
        assert r.status_code == 200, r.text

        async def healthy_again() -> bool:
            return (await http.get(f"/v1/nodes/{where}")).json()["gpus"][3]["health"] == "healthy"

        await eventually(healthy_again, timeout=5, what="GPU 3 healthy again")
        assert (await http.get(f"/v1/nodes/{where}")).json()["cordoned"] is True
        bad = await http.post(f"/v1/nodes/{where}/gpus/9:set-health", json={"healthy": True, "reason": "x"})
        assert bad.status_code == 404
        no_reason = await http.post(f"/v1/nodes/{where}/gpus/3:set-health", json={"healthy": True, "reason": ""})
        assert no_reason.status_code == 400
