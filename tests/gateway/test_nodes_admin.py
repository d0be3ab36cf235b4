"""Node administration through the gateway, against the real scheduler and real agents (simulated GPUs):
cordon/uncordon, GPU faults and what they do to jobs and nodes, the operator's GPU health override."""

from __future__ import annotations

from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway, python


async def test_cordon_needs_admin_and_keeps_jobs_off_the_node(cluster: Cluster,
                                                              cluster_gateway: RunningGateway) -> None:
    user = await cluster_gateway.create_token("vision", "alice")
    admin = await cluster_gateway.create_token("ops", "root", role="operator")
    async with cluster_gateway.client(user) as http:
        refused = await http.post("/v1/nodes/node-a:cordon", json={"reason": "x"})
        assert refused.status_code == 403, refused.text
        assert (await http.get("/v1/nodes/node-a")).json()["cordoned"] is False
        bad = await http.get("/v1/nodes/NOT_VALID")
        assert bad.status_code == 400 and "node_id" in bad.json()["error"]["message"]
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


async def test_gpu_health_takes_only_a_json_boolean(cluster: Cluster, cluster_gateway: RunningGateway) -> None:
    """Issue 11: `{"healthy": 0}` took a GPU out of service (lax bool coercion). Anything but true/false is
    refused with 400 naming the field, and the agent is never asked."""
    admin = await cluster_gateway.create_token("ops", "root", role="operator")
    async with cluster_gateway.client(admin) as http:
        for healthy in (0, 1, "false", "true", None, 0.0):
            cluster.agent_calls["node-a"].clear()
            r = await http.post("/v1/nodes/node-a/gpus/0:set-health", json={"healthy": healthy, "reason": "x"})
            assert r.status_code == 400, (healthy, r.text)
            assert r.json()["error"]["message"].startswith("healthy: Input should be a valid boolean"), r.text
            assert cluster.agent_calls["node-a"].requests("SetGpuHealth") == []
        node = (await http.get("/v1/nodes/node-a")).json()
        assert node["gpus"][0]["health"] == "healthy"
        # The agent's audit log takes one line of printable ASCII, at most 500 characters: so does the schema.
        for reason in ("", " ", "two\nlines", "x" * 501, "caf\u00e9"):
            r = await http.post("/v1/nodes/node-a/gpus/0:set-health", json={"healthy": False, "reason": reason})
            assert r.status_code == 400 and "reason" in r.json()["error"]["message"], (reason, r.text)
        assert cluster.agent_calls["node-a"].requests("SetGpuHealth") == []
        r = await http.post("/v1/nodes/node-a/gpus/0:set-health", json={"healthy": False, "reason": "x" * 500})
        assert r.status_code == 200, r.text
        assert [req.healthy for req in cluster.agent_calls["node-a"].requests("SetGpuHealth")] == [False]

        async def unhealthy() -> bool:  # the agent tells the scheduler with its next report
            return (await http.get("/v1/nodes/node-a")).json()["gpus"][0]["health"] == "unhealthy"

        await eventually(unhealthy, timeout=5, what="GPU 0 of node-a unhealthy at the scheduler")
