"""The gateway's own behaviour over the real scheduler (and real agents where jobs must run): what it sends
the scheduler (team scoping, idempotency key, pagination), how jobs and nodes look in JSON, the `:cancel`
route, /healthz, OpenAPI."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import httpx

from trainyard.common.v1 import types_pb2
from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway, python, running_cluster, running_gateway

SPEC = {"name": "train-1", "command": ["python", "train.py"], "env": {"LR": "0.1"},
        "resources": {"nodes": 2, "gpus_per_node": 4, "accelerator": "H100-80GB-HBM3"},
        "labels": {"project": "llm"}}
JOB_KEYS = {"id", "name", "state", "team", "user", "spec", "attempt", "exit_code", "message", "cancel_requested",
            "placement", "exits", "events", "created_at", "updated_at", "started_at", "finished_at", "restarts",
            "infra_restarts",
            "queued_at", "not_before", "preempted_by", "last_checkpoint_at", "cancelled_by", "attempts",
            "held_by", "hold_reason", "requeue_requested_by"}
# What the API shows for the spec fields a submit leaves out.
SPEC_DEFAULTS = {"working_dir": "", "queue": "default", "priority": 0, "max_restarts": 0, "priority_class": "",
                 "topology": {"tier": "", "required": False, "wait_s": 0.0},
                 "preemption": {"signal": "SIGTERM", "grace_s": 0.0}, "restart_backoff_s": 10.0, "time_limit_s": 0.0,
                 "checkpoint": {"every_steps": 0, "interval_s": 0.0, "keep_last": 0}}
RESOURCES_DEFAULTS = {"accelerators": [], "min_memory_gb": 0, "min_compute_capability": "", "vendor": "",
                      "allow_mixed": False, "cpus_per_node": 0, "speed_hints": {}}
SLEEP = python("import time; time.sleep(120)")


async def test_submit_passes_team_user_and_idempotency_key(live_gateway: RunningGateway,
                                                           scheduler: Cluster) -> None:
    secret = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(secret) as http:
        first = await http.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "abc-1"})
        again = await http.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "abc-1"})
    assert first.status_code == 201, first.text
    job = first.json()
    assert again.json()["id"] == job["id"]
    assert set(job) == JOB_KEYS
    assert (job["state"], job["team"], job["user"], job["name"]) == ("pending", "vision", "alice", "train-1")
    # The scheduler files a job without a queue under "default".
    assert job["spec"] == {**SPEC, **SPEC_DEFAULTS, "resources": {**SPEC["resources"], **RESOURCES_DEFAULTS}}
    assert job["exit_code"] is None and job["placement"] == [] and job["finished_at"] is None
    assert datetime.fromisoformat(job["created_at"]).tzinfo is not None
    # The gateway's submits go as SubmitJobs batches (one item each here: nothing else was in flight).
    assert scheduler.calls.methods[0] == "SubmitJobs" and len(scheduler.calls.calls[0][1].items) == 1
    request = scheduler.calls.submits()[0]
    assert (request.team, request.user, request.idempotency_key) == ("vision", "alice", "abc-1")
    assert request.spec.resources.gpus_per_node == 4 and dict(request.spec.env) == {"LR": "0.1"}


async def test_teams_see_only_their_jobs_and_admins_see_all(live_gateway: RunningGateway,
                                                            scheduler: Cluster) -> None:
    mine = await scheduler.submit(["true"], name="mine", team="vision")
    theirs = await scheduler.submit(["true"], name="theirs", team="nlp")
    alice = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(alice) as http, live_gateway.client(live_gateway.admin_token) as admin:
        assert (await http.get(f"/v1/jobs/{mine.id}")).status_code == 200
        other = await http.get(f"/v1/jobs/{theirs.id}")
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
        assert (await http.post(f"/v1/jobs/{theirs.id}:cancel")).status_code == 404
        assert (await http.get(f"/v1/jobs/{theirs.id}/logs")).status_code == 404
        assert [j["id"] for j in (await http.get("/v1/jobs")).json()["jobs"]] == [mine.id]
        assert (await admin.get(f"/v1/jobs/{theirs.id}")).status_code == 200
        assert {j["id"] for j in (await admin.get("/v1/jobs")).json()["jobs"]} == {mine.id, theirs.id}
    teams = {(name, getattr(req, "team", None)) for name, req in scheduler.calls.calls}
    # The cancel's team-scoped check reaches the scheduler; reads of live jobs are the gateway's view's
    # (tests/gateway/test_job_view.py), so the admin's GET sends nothing.
    assert ("GetJob", "vision") in teams and ("GetJob", "") not in teams
    # The cancel of another team's job ends at its team-scoped GetJob (404): no CancelJob is sent.
    assert "CancelJob" not in scheduler.calls.methods
    assert (await scheduler.job(theirs.id)).state == types_pb2.JOB_STATE_PENDING  # the refused cancel changed nothing


async def test_cancel_route_with_a_colon(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    job = await cluster.submit(SLEEP, team="vision")
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_RUNNING)
    alice = await cluster_gateway.create_token("vision", "alice")
    async with cluster_gateway.client(alice) as http:
        reply = await http.post(f"/v1/jobs/{job.id}:cancel", json={"reason": "wrong data"})
        stopped = await cluster.wait_state(job.id, types_pb2.JOB_STATE_CANCELLED)
        again = await http.post(f"/v1/jobs/{job.id}:cancel")
        plain = await http.get(f"/v1/jobs/{job.id}:cancel")
    assert reply.status_code == 200, reply.text
    # A running job is cancelled once its workers have stopped; the first answer says a cancel is under way.
    assert reply.json()["state"] == "running" and reply.json()["cancel_requested"] is True
    assert ("cancel_requested", "wrong data") in [(e.kind, e.message) for e in stopped.events]
    assert again.status_code == 200 and again.json()["state"] == "cancelled"
    assert again.json()["cancel_requested"] is True
    # GET on the cancel path is not a cancel: the path names the cancel operation, which takes POST only.
    assert plain.status_code == 405 and plain.headers["allow"] == "POST, OPTIONS"
    assert plain.json()["error"]["code"] == "method_not_allowed"
    cancels = cluster.calls.requests("CancelJob")
    assert [(c.job_id, c.team, c.reason) for c in cancels] == [(job.id, "vision", "wrong data"),
                                                                (job.id, "vision", "")]


async def test_list_pages_through_every_job(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    # One job takes all 8 GPUs, so the 5 submitted after it wait.
    running = await cluster.submit(SLEEP, nodes=2, gpus=4, team="vision")
    await cluster.wait_state(running.id, types_pb2.JOB_STATE_RUNNING)
    ids = [(await cluster.submit(["true"], name=f"job{i}", team="vision")).id for i in range(5)]
    seen: list[str] = []
    token = ""
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        while True:
            page = (await http.get("/v1/jobs", params={"page_size": 2, "page_token": token,
                                                       "state": "pending"})).json()
            assert len(page["jobs"]) <= 2
            seen += [j["id"] for j in page["jobs"]]
            token = page["next_page_token"]
            if not token:
                break
        both = await http.get("/v1/jobs", params=[("state", "pending"), ("state", "running")])
    assert seen == ids[::-1], "newest first"
    assert len(both.json()["jobs"]) == 6
    # Pages of live jobs only (no history store here) are the gateway's view's (tests/gateway/test_job_view.py).
    assert "ListJobs" not in cluster.calls.methods


async def test_list_filters_reach_the_scheduler_and_tokens_keep_their_filters(live_gateway: RunningGateway,
                                                                              scheduler: Cluster) -> None:
    alice = await live_gateway.create_token("vision", "alice")
    bob = await live_gateway.create_token("vision", "bob")
    async with live_gateway.client(alice) as a, live_gateway.client(bob) as b, \
            live_gateway.client(live_gateway.admin_token) as admin:
        first = (await a.post("/v1/jobs", json={**SPEC, "name": "sweep-1", "labels": {"project": "atlas"}})).json()
        middle = (await b.post("/v1/jobs", json={**SPEC, "name": "sweep-2", "labels": {"project": "atlas"}})).json()
        (await a.post("/v1/jobs", json={**SPEC, "name": "train-1", "labels": {"project": "zeus"}})).json()
        other_team = await scheduler.submit(["true"], name="sweep-3", team="nlp")

        async def listed(http: httpx.AsyncClient, params: object) -> list[str]:
            reply = await http.get("/v1/jobs", params=params)  # type: ignore[arg-type]
            assert reply.status_code == 200, reply.text
            return [j["id"] for j in reply.json()["jobs"]]

        assert await listed(a, {"user": "bob"}) == [middle["id"]]
        assert await listed(a, {"label": "project=atlas", "name_prefix": "sweep-"}) == [middle["id"], first["id"]]
        assert await listed(admin, {"name_prefix": "sweep-"}) == [other_team.id, middle["id"], first["id"]]
        assert await listed(admin, {"name_prefix": "sweep-", "team": "nlp"}) == [other_team.id]
        assert await listed(a, {"team": "nlp"}) == [], "another team's listing is empty for a team member"
        at = datetime.fromisoformat(middle["created_at"])
        assert await listed(a, {"submitted_after": at.isoformat(), "label": "project=atlas"}) == [middle["id"]]
        assert await listed(a, {"submitted_before": at.isoformat(), "label": "project=atlas"}) == [first["id"]]
        assert await listed(a, {"finished_after": at.isoformat()}) == [], "pending jobs have not finished"

        page = (await a.get("/v1/jobs", params={"page_size": 1, "label": "project=atlas"})).json()
        rest = await a.get("/v1/jobs", params={"page_size": 1, "label": "project=atlas",
                                               "page_token": page["next_page_token"]})
        assert [j["id"] for j in rest.json()["jobs"]] == [first["id"]]
        moved = await a.get("/v1/jobs", params={"page_size": 1, "page_token": page["next_page_token"]})
        assert moved.status_code == 422 and "other filters" in moved.json()["error"]["message"]
        assert moved.json()["error"]["code"] == "invalid_page_token"
        forged = await a.get("/v1/jobs", params={"page_token": "bm90LW91cnM"})  # well formed, not ours
        assert (forged.status_code, forged.json()["error"]["code"]) == (422, "invalid_page_token")
        # Filters nothing can match are empty pages, not errors: the schema calls them valid.
        assert await listed(a, {"label": ["project=atlas", "project=zeus"]}) == []
        backwards = {"submitted_after": "2026-02-01T00:00:00Z", "submitted_before": "2026-01-01T00:00:00Z"}
        assert await listed(a, backwards) == []
        for bad in ({"label": "project"}, {"page_token": "not a token"}, {"submitted_before": "0.5"},
                    {"submitted_after": "2026-01-01T00:00:00"}, {"user": "a b"}, {"name_prefix": "a\x00"},
                    {"label": "k=" + "v" * 254}, {"label": [f"k{i}=v" for i in range(65)]}):
            reply = await a.get("/v1/jobs", params=bad)
            assert reply.status_code == 400, (bad, reply.text)
            assert reply.json()["error"]["code"] == "invalid_argument", bad
    # Listings with time bounds are the scheduler's (the gateway's view answers the others: test_job_view.py).
    request = next(r for r in scheduler.calls.requests("ListJobs") if r.HasField("submitted_after"))
    assert (request.team, dict(request.labels)) == ("vision", {"project": "atlas"})


async def test_job_json_of_a_finished_job(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    job = await cluster.submit(python("""
        import os, sys
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """), gpus=2, team="vision")
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_FAILED)
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        body = (await http.get(f"/v1/jobs/{job.id}")).json()
    node = body["placement"][0]["node_id"]
    assert node in cluster.agents
    assert (body["state"], body["exit_code"], body["message"]) == ("failed", 3, f"rank 1 on {node} exited with code 3")
    assert body["placement"] == [{"node_id": node, "node_rank": 0, "gpu_indices": [0, 1], "ranks": [0, 1],
                                  "model": "A100-SXM4-40GB", "cpus": 0}]
    assert [e["rank"] for e in body["exits"]] == [0, 1]
    failed = body["exits"][1]
    assert datetime.fromisoformat(failed.pop("exited_at")).tzinfo is not None
    assert failed == {"rank": 1, "node_id": node, "exit_code": 3, "signal": 0}
    assert body["events"][0]["kind"] == "admitted"
    last = body["events"][-1]
    assert datetime.fromisoformat(last.pop("at")).tzinfo is not None
    assert last == {"kind": "failed", "message": f"rank 1 on {node} exited with code 3"}
    assert datetime.fromisoformat(body["finished_at"]) >= datetime.fromisoformat(body["created_at"])


async def test_nodes(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> None:
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "nodes", state_root=tmp_path,
                               agents={"node-a": "h100x8", "node-b": "a100x4"}, node_timeout_s=2.5) as cluster, \
            running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                            scheduler_address=cluster.address) as gw:
        # node-a: GPU 7 unhealthy (XID 48, double-bit ECC: the policy resets the GPU, it does not drain the
        # node), GPUs 0 and 1 held by a job; node-b: its agent gone.
        await cluster.inject_fault("node-a", 7, "xid", xid=48)
        job = await cluster.submit(SLEEP, gpus=2, accelerator="H100-80GB-HBM3")
        await cluster.wait_state(job.id, types_pb2.JOB_STATE_RUNNING)
        await cluster.stop_agent("node-b")

        async def settled() -> bool:
            a, b = await cluster.list_nodes()
            return a.gpus[7].health == types_pb2.GPU_HEALTH_UNHEALTHY and b.state == types_pb2.NODE_STATE_NOT_READY

        await eventually(settled, what="GPU 7 of node-a unhealthy and node-b not ready")
        assert not (await cluster.list_nodes())[0].cordoned
        assert (await cluster.job(job.id)).state == types_pb2.JOB_STATE_RUNNING
        secret = await gw.create_token("vision", "alice")
        async with gw.client(secret) as http:
            nodes = (await http.get("/v1/nodes")).json()["nodes"]
    summary = [(n["node_id"], n["state"], n["gpus_free"], n["gpus_total"], n["models"]) for n in nodes]
    assert summary == [("node-a", "ready", 5, 8, ["H100-80GB-HBM3"]), ("node-b", "not_ready", 0, 4, ["A100-SXM4-40GB"])]
    assert nodes[0]["gpus"][7]["health"] == "unhealthy" and nodes[0]["gpus"][0]["allocated"] is True


async def test_healthz_needs_no_token(live_gateway: RunningGateway, scheduler: Cluster,
                                      gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=live_gateway.url) as http:
        ok = await http.get("/healthz")
        await scheduler.stop_scheduler()
        stopped = await http.get("/healthz")
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        down = await http.get("/healthz")
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    for reply in (stopped, down):  # the scheduler stopped, or never there
        assert reply.status_code == 503
        assert reply.json()["status"] == "degraded" and not reply.json()["scheduler"]["reachable"]
        assert reply.json()["etcd"]["reachable"]


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
    for item in paths.values():
        for operation in item.values():
            # Exactly the statuses each route answers: no FastAPI 422 (only the submit's and resubmit's own, for a
            # reused idempotency key, and the listing's, for a page token of other filters, with the ErrorBody),
            # no 4XX/5XX catch-alls.
            if "422" in operation["responses"]:
                assert operation["operationId"] in (submit["operationId"], paths["/v1/jobs"]["get"]["operationId"],
                                                    paths["/v1/jobs/{job_id}:resubmit"]["post"]["operationId"])
                assert operation["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorBody")
            assert not {"4XX", "5XX"} & set(operation["responses"])
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    assert set(response["content"]) == {"application/json"}, (status, operation["operationId"])
    # Issue 11: the logs route's errors were documented as text/plain, which they are not.
    logs = paths["/v1/jobs/{job_id}/logs"]["get"]["responses"]
    assert set(logs["200"]["content"]) == {"text/plain", "text/event-stream"}  # the latter with follow=true
    assert set(logs["404"]["content"]) == {"application/json"}


async def test_options_and_405_carry_allow(gateway: RunningGateway) -> None:
    """RFC 9110: a 405 carries `Allow`. OPTIONS answers 204 with it, without a token; both list the methods
    the OpenAPI document gives the path (issue 11: 405 without `Allow`, or `Allow: GET` on the cancel path)."""
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for path, allow in [("/v1/jobs", "GET, POST, OPTIONS"), ("/v1/jobs/job-abc", "GET, PATCH, OPTIONS"),
                            ("/v1/jobs/job-abc:cancel", "POST, OPTIONS"), ("/v1/jobs/job-abc/logs", "GET, OPTIONS"),
                            ("/v1/nodes/node-1:cordon", "POST, OPTIONS"), ("/v1/queues/batch", "DELETE, PUT, OPTIONS"),
                            ("/v1/quotas/vision", "DELETE, GET, PUT, OPTIONS"), ("/v1/tokens", "GET, POST, OPTIONS"),
                            ("/healthz", "GET, OPTIONS")]:
            reply = await http.options(path)
            assert reply.status_code == 204 and reply.headers["allow"] == allow, (path, reply.headers)
            assert reply.content == b""
        for method, path, allow in [("PATCH", "/v1/jobs", "GET, POST, OPTIONS"),
                                    ("DELETE", "/v1/jobs/job-abc:cancel", "POST, OPTIONS"),
                                    ("PUT", "/v1/tokens/tok-abc", "DELETE, OPTIONS"),
                                    ("POST", "/v1/queues", "GET, OPTIONS")]:
            reply = await http.request(method, path, headers={"Authorization": f"Bearer {gateway.admin_token}"})
            assert reply.status_code == 405 and reply.headers["allow"] == allow, (method, path, reply.headers)
            assert reply.json()["error"]["code"] == "method_not_allowed"
            assert method in reply.json()["error"]["message"]
        assert (await http.options("/v1/no-such-route")).status_code == 404


def test_the_index_of_templates_answers_as_trying_every_one() -> None:
    from trainyard_gateway.app import create_app
    from trainyard_gateway.http_methods import Templates, _templates

    everything = _templates(create_app(None).openapi())  # type: ignore[arg-type]  # the document needs no deps
    indexed = Templates(everything)

    def brute(path: str) -> frozenset[str] | None:
        matching = [t for t in everything if t.regex.match(path)]
        if not matching:
            return None
        best = max(t.literal for t in matching)
        return frozenset().union(*(t.methods for t in matching if t.literal == best))

    paths = [p.replace("{job_id}", "job-1").replace("{checkpoint_id}", "ckpt-1").replace("{tag}", "best")
             .replace("{node_id}", "n-1").replace("{gpu_index}", "0").replace("{name}", "q").replace("{team}", "t")
             .replace("{token_id}", "tok-1") for p in {t.regex.pattern for t in everything}]
    paths = [p.strip("^$").replace("\\", "").replace("[^/]+", "x") for p in paths]
    paths += ["/v1/jobs/x:cancel", "/v1/jobs/x/logs", "/v1/nowhere", "/", "/healthz", "/v1/jobs/a/b/c/d/e"]
    assert len(paths) > 30
    for path in paths:
        assert indexed.allowed_methods(path) == brute(path), path
    assert indexed.allowed_methods("/v1/jobs/x:cancel") == frozenset({"POST"})
    assert indexed.allowed_methods("/v1/nowhere") is None
