"""The gateway's own behaviour over a stub scheduler (real gRPC): what it sends the scheduler (team scoping,
idempotency key, pagination), how jobs and nodes look in JSON, the `:cancel` route, /healthz, OpenAPI."""

from __future__ import annotations

from datetime import datetime

import httpx

from trainyard.common.v1 import types_pb2
from trainyard_gateway.testing import RunningGateway, StubScheduler

SPEC = {"name": "train-1", "command": ["python", "train.py"], "env": {"LR": "0.1"},
        "resources": {"nodes": 2, "gpus_per_node": 4, "accelerator": "H100-SXM5-80GB"},
        "labels": {"project": "llm"}}
JOB_KEYS = {"id", "name", "state", "team", "user", "spec", "attempt", "exit_code", "message", "cancel_requested",
            "placement", "exits", "events", "created_at", "updated_at", "started_at", "finished_at"}


async def test_submit_passes_team_user_and_idempotency_key(stub_gateway: RunningGateway,
                                                           stub_scheduler: StubScheduler) -> None:
    secret = await stub_gateway.create_token("vision", "alice")
    async with stub_gateway.client(secret) as http:
        first = await http.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "abc-1"})
        again = await http.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "abc-1"})
    assert first.status_code == 201, first.text
    job = first.json()
    assert again.json()["id"] == job["id"]
    assert set(job) == JOB_KEYS
    assert (job["state"], job["team"], job["user"], job["name"]) == ("pending", "vision", "alice", "train-1")
    assert job["spec"] == {**SPEC, "working_dir": "", "queue": "", "priority": 0, "max_restarts": 0}
    assert job["exit_code"] is None and job["placement"] == [] and job["finished_at"] is None
    assert datetime.fromisoformat(job["created_at"]).tzinfo is not None
    _, request = stub_scheduler.calls[0]
    assert (request.team, request.user, request.idempotency_key) == ("vision", "alice", "abc-1")
    assert request.spec.resources.gpus_per_node == 4 and dict(request.spec.env) == {"LR": "0.1"}


async def test_teams_see_only_their_jobs_and_admins_see_all(stub_gateway: RunningGateway,
                                                            stub_scheduler: StubScheduler) -> None:
    mine = stub_scheduler.add_job(team="vision", name="mine")
    theirs = stub_scheduler.add_job(team="nlp", name="theirs")
    alice = await stub_gateway.create_token("vision", "alice")
    async with stub_gateway.client(alice) as http, stub_gateway.client(stub_gateway.admin_token) as admin:
        assert (await http.get(f"/v1/jobs/{mine.id}")).status_code == 200
        other = await http.get(f"/v1/jobs/{theirs.id}")
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
        assert (await http.post(f"/v1/jobs/{theirs.id}:cancel")).status_code == 404
        assert (await http.get(f"/v1/jobs/{theirs.id}/logs")).status_code == 404
        assert [j["id"] for j in (await http.get("/v1/jobs")).json()["jobs"]] == [mine.id]
        assert (await admin.get(f"/v1/jobs/{theirs.id}")).status_code == 200
        assert {j["id"] for j in (await admin.get("/v1/jobs")).json()["jobs"]} == {mine.id, theirs.id}
    teams = {(name, getattr(req, "team", None)) for name, req in stub_scheduler.calls}
    assert ("GetJob", "vision") in teams and ("GetJob", "") in teams and ("CancelJob", "vision") in teams
    assert theirs.state == types_pb2.JOB_STATE_PENDING  # the refused cancel changed nothing


async def test_cancel_route_with_a_colon(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    job = stub_scheduler.add_job(team="vision")
    alice = await stub_gateway.create_token("vision", "alice")
    async with stub_gateway.client(alice) as http:
        reply = await http.post(f"/v1/jobs/{job.id}:cancel", json={"reason": "wrong data"})
        again = await http.post(f"/v1/jobs/{job.id}:cancel")
        plain = await http.get(f"/v1/jobs/{job.id}:cancel")
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "cancelled" and reply.json()["cancel_requested"] is True
    assert again.status_code == 200 and again.json()["state"] == "cancelled"
    assert plain.status_code == 400  # GET on the cancel path is a (bad) job id, not a cancel
    cancels = [req for name, req in stub_scheduler.calls if name == "CancelJob"]
    assert [(c.job_id, c.team, c.reason) for c in cancels] == [(job.id, "vision", "wrong data"),
                                                                (job.id, "vision", "")]


async def test_list_pages_through_every_job(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    ids = [stub_scheduler.add_job(team="vision", job_id=f"job-{i:03d}").id for i in range(5)]
    stub_scheduler.add_job(team="vision", job_id="job-run", state=types_pb2.JOB_STATE_RUNNING)
    seen: list[str] = []
    token = ""
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        while True:
            page = (await http.get("/v1/jobs", params={"page_size": 2, "page_token": token,
                                                       "state": "pending"})).json()
            assert len(page["jobs"]) <= 2
            seen += [j["id"] for j in page["jobs"]]
            token = page["next_page_token"]
            if not token:
                break
        both = await http.get("/v1/jobs", params=[("state", "pending"), ("state", "running")])
    assert seen == ids
    assert len(both.json()["jobs"]) == 6
    lists = [req for name, req in stub_scheduler.calls if name == "ListJobs"]
    assert list(lists[0].states) == [types_pb2.JOB_STATE_PENDING] and lists[0].page_size == 2
    assert list(lists[-1].states) == [types_pb2.JOB_STATE_PENDING, types_pb2.JOB_STATE_RUNNING]


async def test_job_json_of_a_finished_job(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    job = stub_scheduler.add_job(
        team="vision", state=types_pb2.JOB_STATE_FAILED, exit_code=3, message="rank 1 exited with 3",
        placement=[types_pb2.NodeAssignment(node_id="node-a", node_rank=0, gpu_indices=[0, 1], ranks=[0, 1])],
        exits=[types_pb2.WorkerExit(rank=1, node_id="node-a", exit_code=3)],
        events=[types_pb2.JobEvent(kind="failed", message="rank 1 exited with 3")])
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        body = (await http.get(f"/v1/jobs/{job.id}")).json()
    assert (body["state"], body["exit_code"], body["message"]) == ("failed", 3, "rank 1 exited with 3")
    assert body["placement"] == [{"node_id": "node-a", "node_rank": 0, "gpu_indices": [0, 1], "ranks": [0, 1]}]
    assert body["exits"] == [{"rank": 1, "node_id": "node-a", "exit_code": 3, "signal": 0, "exited_at": None}]
    assert body["events"] == [{"at": None, "kind": "failed", "message": "rank 1 exited with 3"}]


def _node(node_id: str, *, gpus: int, allocated: list[int], state: int = types_pb2.NODE_STATE_READY,
          unhealthy: tuple[int, ...] = ()) -> types_pb2.Node:
    return types_pb2.Node(
        node_id=node_id, hostname=node_id, agent_address="127.0.0.1:1", state=state,  # type: ignore[arg-type]
        gpus=[types_pb2.Gpu(index=i, model="H100-SXM5-80GB", vendor="nvidia",
                            health=types_pb2.GPU_HEALTH_UNHEALTHY if i in unhealthy else types_pb2.GPU_HEALTH_HEALTHY)
              for i in range(gpus)],
        allocated_gpus=allocated, simulated=True)


async def test_nodes(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    stub_scheduler.nodes = [_node("node-a", gpus=8, allocated=[0, 1], unhealthy=(7,)),
                            _node("node-b", gpus=4, allocated=[], state=types_pb2.NODE_STATE_NOT_READY)]
    secret = await stub_gateway.create_token("vision", "alice")
    async with stub_gateway.client(secret) as http:
        nodes = (await http.get("/v1/nodes")).json()["nodes"]
    summary = [(n["node_id"], n["state"], n["gpus_free"], n["gpus_total"], n["models"]) for n in nodes]
    assert summary == [("node-a", "ready", 5, 8, ["H100-SXM5-80GB"]), ("node-b", "not_ready", 0, 4, ["H100-SXM5-80GB"])]
    assert nodes[0]["gpus"][7]["health"] == "unhealthy" and nodes[0]["gpus"][0]["allocated"] is True


async def test_healthz_needs_no_token(stub_gateway: RunningGateway, gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=stub_gateway.url) as http:
        ok = await http.get("/healthz")
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        down = await http.get("/healthz")
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    assert down.status_code == 503
    assert down.json()["status"] == "degraded" and not down.json()["scheduler"]["reachable"]
    assert down.json()["etcd"]["reachable"]


async def test_openapi_document(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        doc = (await http.get("/openapi.json")).json()
    paths = doc["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}:cancel", "/v1/jobs/{job_id}/logs", "/v1/nodes",
            "/healthz", "/v1/tokens", "/v1/tokens/{token_id}"} <= set(paths)
    assert set(paths["/v1/jobs"]) == {"get", "post"}
    assert "post" in paths["/v1/jobs/{job_id}:cancel"]
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # validation errors use ErrorBody with 400, never 422
    submit = paths["/v1/jobs"]["post"]
    assert submit["responses"]["201"]["content"]["application/json"]["schema"]["$ref"].endswith("/Job")
    assert submit["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "text/plain" in paths["/v1/jobs/{job_id}/logs"]["get"]["responses"]["200"]["content"]
    assert "pending" in str(schemas["Job"]["properties"]["state"])
    assert doc["components"]["securitySchemes"]["bearerToken"]["scheme"].lower() == "bearer"
    assert "security" not in paths["/healthz"]["get"]
    assert paths["/v1/nodes"]["get"]["security"]
