"""The jobs API end to end through the real scheduler (gRPC on port 0) and a real etcd; no node agents, so
jobs stay pending, unless a test starts real agents (simulated GPUs) to give the fleet a shape."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard_core.store.etcd import EtcdStore

from .support import Cluster, RunningGateway

SPEC: dict[str, Any] = {"name": "train-1", "command": ["python", "train.py"], "env": {"LR": "0.1"},
                        "resources": {"nodes": 1, "gpus_per_node": 2}}


@pytest.fixture
def gw(live_gateway: RunningGateway) -> RunningGateway:
    return live_gateway


async def test_submit_get_list_cancel(gw: RunningGateway) -> None:
    alice = await gw.create_token("vision", "alice")
    async with gw.client(alice) as http:
        submitted = await http.post("/v1/jobs", json=SPEC)
        assert submitted.status_code == 201, submitted.text
        job = submitted.json()
        assert (job["state"], job["team"], job["user"], job["spec"]["env"]) == ("pending", "vision", "alice",
                                                                                {"LR": "0.1"})
        got = (await http.get(f"/v1/jobs/{job['id']}")).json()
        assert got["id"] == job["id"] and got["created_at"] == job["created_at"]
        listed = (await http.get("/v1/jobs")).json()
        assert [j["id"] for j in listed["jobs"]] == [job["id"]] and listed["next_page_token"] == ""
        cancelled = await http.post(f"/v1/jobs/{job['id']}:cancel", json={"reason": "not needed"})
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["state"] == "cancelled"
        assert (await http.post(f"/v1/jobs/{job['id']}:cancel")).json()["state"] == "cancelled"  # idempotent
        assert (await http.get(f"/v1/jobs/{job['id']}")).json()["state"] == "cancelled"
        assert (await http.get("/v1/jobs", params={"state": "pending"})).json()["jobs"] == []
        logs = await http.get(f"/v1/jobs/{job['id']}/logs")
        assert logs.status_code == 200 and logs.text == ""


async def test_teams_are_isolated(gw: RunningGateway) -> None:
    alice = await gw.create_token("vision", "alice")
    bob = await gw.create_token("nlp", "bob")
    async with gw.client(alice) as a, gw.client(bob) as b, gw.client(gw.admin_token) as admin:
        job_a = (await a.post("/v1/jobs", json=SPEC)).json()
        job_b = (await b.post("/v1/jobs", json={**SPEC, "name": "bobs"})).json()
        for path in (f"/v1/jobs/{job_a['id']}", f"/v1/jobs/{job_a['id']}/logs"):
            reply = await b.get(path)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", path
        assert (await b.post(f"/v1/jobs/{job_a['id']}:cancel")).status_code == 404
        assert (await a.get(f"/v1/jobs/{job_a['id']}")).json()["state"] == "pending"
        assert [j["id"] for j in (await b.get("/v1/jobs")).json()["jobs"]] == [job_b["id"]]
        everything = (await admin.get("/v1/jobs")).json()["jobs"]
        assert {j["id"] for j in everything} == {job_a["id"], job_b["id"]}
        assert (await admin.get(f"/v1/jobs/{job_b['id']}")).status_code == 200


async def test_pagination_visits_every_job_once_newest_first(gw: RunningGateway) -> None:
    async with gw.client(gw.admin_token) as http:
        ids = [(await http.post("/v1/jobs", json={**SPEC, "name": f"job-{i}"})).json()["id"] for i in range(5)]
        seen: list[str] = []
        token = ""
        while True:
            page = (await http.get("/v1/jobs", params={"page_size": 2, "page_token": token})).json()
            assert len(page["jobs"]) <= 2
            seen += [j["id"] for j in page["jobs"]]
            token = page["next_page_token"]
            if not token:
                break
    assert seen == ids[::-1]


async def test_idempotency_key(gw: RunningGateway) -> None:
    bob = await gw.create_token("vision", "bob")
    alice = await gw.create_token("vision", "alice")
    async with gw.client(alice) as http, gw.client(bob) as other:
        first = await http.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "retry-1"})
        # The same body again, its maps in another order: the same request.
        reordered = {**SPEC, "resources": {"gpus_per_node": 2, "nodes": 1}}
        second = await http.post("/v1/jobs", json=reordered, headers={"Idempotency-Key": "retry-1"})
        changed = await http.post("/v1/jobs", json={**SPEC, "name": "train-2"}, headers={"Idempotency-Key": "retry-1"})
        teammate = await other.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "retry-1"})
        jobs = (await http.get("/v1/jobs")).json()["jobs"]
    assert (first.status_code, second.status_code) == (201, 200), "a retry answers 200 with the first job"
    assert first.json()["id"] == second.json()["id"] and len(jobs) == 1
    for refused in (changed, teammate):
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == "idempotency_key_reused" and "'retry-1'" in error["message"]
        assert first.json()["id"] in error["message"]


async def test_bad_input_changes_nothing_in_etcd(gw: RunningGateway, scheduler: Cluster,
                                                 etcd_store: EtcdStore) -> None:
    await scheduler.add_agent("node-a", "h100x8")
    prefix = scheduler.settings.etcd_prefix

    async def job_keys() -> list[tuple[str, int]]:
        out = []
        for sub in ("/jobs/", "/allocations/", "/idempotency/"):
            out += [(kv.key, kv.mod_revision) for kv in (await etcd_store.range(prefix + sub)).kvs]
        return out

    before = await job_keys()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"content": b'{"name": "x",', "headers": {"Content-Type": "application/json"}}, "not valid JSON"),
        ({"json": {**SPEC, "gpu": 1}}, "gpu: unknown field"),
        ({"json": {**SPEC, "resources": {"nodes": 0, "gpus_per_node": 1}}}, "resources.nodes"),
        ({"json": {**SPEC, "resources": {"nodes": 1, "gpus_per_node": -1}}}, "resources.gpus_per_node"),
        ({"json": {**SPEC, "resources": {"nodes": 1, "gpus_per_node": 64}}}, "gpus_per_node"),  # fleet max: 8
        ({"json": {**SPEC, "resources": {"nodes": 3, "gpus_per_node": 1}}}, "resources.nodes"),  # one node
        ({"json": {**SPEC, "resources": {"nodes": 1, "gpus_per_node": 1, "accelerator": "TPU-v5"}}},
         "accelerator"),
    ]
    async with gw.client(gw.admin_token) as http, gw.client() as anonymous:
        for request, needle in bad:
            reply = await http.post("/v1/jobs", **request)
            assert 400 <= reply.status_code < 500, (needle, reply.text)
            assert needle in reply.json()["error"]["message"], (needle, reply.text)
        missing = await anonymous.post("/v1/jobs", json=SPEC)
        assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]
    assert await job_keys() == before


async def test_nodes_and_health(gw: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    async with gw.client(gw.admin_token) as http:
        nodes = (await http.get("/v1/nodes")).json()["nodes"]
        health = await http.get("/healthz")
    assert [(n["node_id"], n["gpus_total"], n["models"]) for n in nodes] == [("node-a", 4, ["A100-SXM4-40GB"])]
    assert health.status_code == 200 and health.json()["status"] == "ok"


FULL_SPEC: dict[str, Any] = {
    **SPEC, "name": "policy-fields", "priority_class": "high", "time_limit_s": 5400, "restart_backoff_s": 0,
    "max_restarts": 3,
    "resources": {"nodes": 2, "gpus_per_node": 4, "accelerators": ["H100-80GB-HBM3", "A100-SXM4-80GB"],
                  "min_memory_gb": 40, "min_compute_capability": "8.0", "vendor": "nvidia", "allow_mixed": True,
                  "cpus_per_node": 16, "speed_hints": {"H100-80GB-HBM3": 2.5, "A100-SXM4-80GB": 1}},
    "topology": {"tier": "leaf", "wait_s": 600},
    "preemption": {"signal": "SIGUSR1", "grace_s": 60},
    "checkpoint": {"every_steps": 500, "interval_s": 1800, "keep_last": 3},
}


async def test_new_spec_fields_round_trip(gw: RunningGateway) -> None:
    async with gw.client(gw.admin_token) as http:
        submitted = await http.post("/v1/jobs", json=FULL_SPEC)
        assert submitted.status_code == 201, submitted.text
        got = (await http.get(f"/v1/jobs/{submitted.json()['id']}")).json()
        plain = (await http.post("/v1/jobs", json=SPEC)).json()
        cpu = await http.post("/v1/jobs", json={**SPEC, "resources": {"nodes": 2, "gpus_per_node": 0,
                                                                       "cpus_per_node": 8}})
    spec = got["spec"]
    assert spec["resources"] == {**FULL_SPEC["resources"], "accelerator": "",
                                 "speed_hints": {"H100-80GB-HBM3": 2.5, "A100-SXM4-80GB": 1.0}}
    assert spec["topology"] == {"tier": "leaf", "required": False, "wait_s": 600.0}
    assert spec["preemption"] == {"signal": "SIGUSR1", "grace_s": 60.0}
    assert spec["checkpoint"] == {"every_steps": 500, "interval_s": 1800.0, "keep_last": 3}
    assert (spec["priority_class"], spec["time_limit_s"], spec["restart_backoff_s"]) == ("high", 5400.0, 0.0)
    assert (got["restarts"], got["preempted_by"], got["not_before"], got["last_checkpoint_at"]) == (0, [], None, None)
    assert got["queued_at"] == got["created_at"] and got["spec"] == submitted.json()["spec"]
    # Absent fields get the scheduler's defaults.
    assert plain["spec"]["restart_backoff_s"] == 10.0 and plain["spec"]["preemption"] == {"signal": "SIGTERM",
                                                                                           "grace_s": 0.0}
    assert (plain["spec"]["queue"], plain["spec"]["priority_class"], plain["spec"]["topology"]["tier"]) == (
        "default", "", "")
    assert cpu.status_code == 201 and cpu.json()["spec"]["resources"]["gpus_per_node"] == 0  # no nodes yet: waits


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"topology": {"tier": "island"}}, "topology.tier"),
        ({"topology": {"tier": "leaf", "wait_s": -1}}, "topology.wait_s"),
        ({"topology": {"required": True}}, "topology: required needs tier"),
        ({"preemption": {"signal": "SIGKILL"}}, "preemption.signal"),
        ({"preemption": {"grace_s": 3601}}, "preemption.grace_s"),
        ({"time_limit_s": "1h"}, "time_limit_s"),
        ({"restart_backoff_s": 3601}, "restart_backoff_s"),
        ({"priority_class": "vip!"}, "priority_class"),
        ({"queue": "No_Such"}, "queue"),
        ({"resources": {"nodes": 1, "gpus_per_node": 1, "speed_hints": {"H100": 0}}}, "resources.speed_hints"),
        ({"resources": {"nodes": 1, "gpus_per_node": 1, "min_compute_capability": "9"}},
         "resources.min_compute_capability"),
        ({"resources": {"nodes": 1, "gpus_per_node": 1, "allow_mixed": "yes"}}, "resources.allow_mixed"),
        ({"resources": {"nodes": 1, "gpus_per_node": 1, "accelerators": ["a"] * 17}}, "resources.accelerators"),
        ({"resources": {"nodes": 1, "gpus_per_node": 1, "accelerator": "H100", "accelerators": ["A100"]}},
         "not both"),
        ({"resources": {"nodes": 1, "gpus_per_node": 0, "accelerator": "H100"}}, "CPU task"),
    ],
)
async def test_bad_new_fields_are_400_naming_the_field(gw: RunningGateway, change: dict[str, Any],
                                                       needle: str) -> None:
    async with gw.client(gw.admin_token) as http:
        reply = await http.post("/v1/jobs", json={**SPEC, **change})
        assert reply.status_code == 400, reply.text
        assert needle in reply.json()["error"]["message"], reply.text
        assert (await http.get("/v1/jobs")).json()["jobs"] == []


@pytest.mark.parametrize(("change", "needle"), [
    ({"priority_class": "vip"}, "priority_class 'vip' is not defined"),
    ({"queue": "nope"}, "queue 'nope' does not exist"),
])
async def test_valid_names_of_what_does_not_exist_are_409(gw: RunningGateway, change: dict[str, Any],
                                                           needle: str) -> None:
    """Well formed (the schema allows the name), but this cluster has no such class or queue: 409
    failed_precondition, never the 400 of a request that breaks the schema."""
    async with gw.client(gw.admin_token) as http:
        reply = await http.post("/v1/jobs", json={**SPEC, **change})
        assert reply.status_code == 409, reply.text
        assert reply.json()["error"]["code"] == "failed_precondition"
        assert needle in reply.json()["error"]["message"], reply.text
        assert (await http.get("/v1/jobs")).json()["jobs"] == []
