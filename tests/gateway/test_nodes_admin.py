"""Node administration through the gateway, against the real scheduler and real agents (simulated GPUs):
cordon/uncordon, GPU faults and what they do to jobs and nodes, the operator's GPU health override."""

from __future__ import annotations

from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway, python


async def test_cordon_needs_admin_and_keeps_jobs_off_the_node(cluster: Cluster,
                                                              cluster_gateway: RunningGateway) -> None:
    user = await cluster_gateway.create_token("vision", "alice")
    admin = await cluster_gateway.create_token("ops", "root", admin=True)
    async with cluster_gateway.client(user) as http:
        refused = await http.post("/v1/nodes/node-a:cordon", json={"reason": "x"})
        assert refused.status_code == 403, refused.text
        assert (await http.get("/v1/nodes/node-a")).json()["cordoned"] is False
        bad = await http.get("/v1/nodes/NOT_VALID")
        assert bad.status_code == 400 and "node id" in bad.json()["error"]["message"]
    async with cluster_gateway.client(admin) as http:
        r = await http.post("/v1/nodes/node-a:cordon", json={"reason": "replacing a fan"})
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["cordon_reason"]) == ("cordoned", "replacing a fan")
        assert (await http.post("/v1/nodes/node-b:cordon")).json()["cordon_reason"] == "cordoned by root"
        missing = await http.post("/v1/nodes/node-zz:cordon")
        assert missing.status_code == 404
    async with cluster_gateway.client(user) as http:
        job = (await http.post("/v1/jobs", json={"name": "waits", "command": python("pass"),
                                                 "resources": {"nodes": 1, "gpus_per_node": 1}})).json()
        got = (await http.get(f"/v1/jobs/{job['id']}")).json()
        assert got["state"] == "pending"
    async with cluster_gateway.client(admin) as http:
        r = await http.post("/v1/nodes/node-a:uncordon")
        assert r.status_code == 200 and r.json()["cordoned"] is False and r.json()["cordon_reason"] == ""
        assert (await http.get("/v1/nodes/node-b")).json()["cordoned"] is True
    async with cluster_gateway.client(user) as http:
        async def done() -> bool:
            return (await http.get(f"/v1/jobs/{job['id']}")).json()["state"] == "succeeded"

        await eventually(done, timeout=30, what="the job to run once the node is back")
