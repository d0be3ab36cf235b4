"""/v1/queues and /v1/quotas end to end: gateway → real scheduler servicers (gRPC) → real etcd. Who may do
what (admins change, everyone lists queues, teams read only their own quota), round trips, 4xx with the
field named for bad bodies, and nothing stored for them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_core.store.etcd import EtcdStore

from .policy_support import policy_endpoint
from .support import Cluster, RunningGateway, running_gateway

SPEC: dict[str, Any] = {"name": "train-1", "command": ["python", "train.py"],
                        "resources": {"nodes": 1, "gpus_per_node": 1}}
VISION_QUOTA: dict[str, Any] = {"weight": 1.0, "limits": {"H100-80GB-HBM3": {"nominal": 64, "borrow_limit": 32},
                                                          "*": {"nominal": 8}}}


@pytest.fixture
async def gw(etcd_settings: dict[str, str], key_prefix: str, scheduler: Cluster) -> AsyncIterator[RunningGateway]:
    async with policy_endpoint(scheduler) as address, running_gateway(
            etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"), scheduler_address=address) as gateway:
        yield gateway


async def test_queues_round_trip_and_only_admins_change_them(gw: RunningGateway) -> None:
    alice = await gw.create_token("vision", "alice")
    async with gw.client(alice) as user, gw.client(gw.admin_token) as admin:
        listed = await user.get("/v1/queues")
        assert listed.status_code == 200, listed.text
        assert listed.json() == {"queues": [{"name": "default", "tier": 0, "max_gpus": 0, "node_labels": {},
                                             "description": ""}]}
        for reply in (await user.put("/v1/queues/batch", json={"tier": 1}), await user.delete("/v1/queues/batch")):
            assert reply.status_code == 403 and reply.json()["error"]["code"] == "permission_denied", reply.text

        body = {"tier": -5, "max_gpus": 16, "node_labels": {"pool": "spot"}, "description": "cheap"}
        created = await admin.put("/v1/queues/batch", json=body)
        assert created.status_code == 201, created.text
        assert created.json() == {"name": "batch", **body}
        replaced = await admin.put("/v1/queues/batch", json={"tier": 2})
        assert replaced.status_code == 200 and replaced.json()["node_labels"] == {}  # a PUT replaces it all
        assert [q["name"] for q in (await user.get("/v1/queues")).json()["queues"]] == ["batch", "default"]

        job = (await user.post("/v1/jobs", json={**SPEC, "queue": "batch"})).json()
        assert job["spec"]["queue"] == "batch", job
        busy = await admin.delete("/v1/queues/batch")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "failed_precondition"
        assert "used by 1 unfinished job" in busy.json()["error"]["message"]
        default = await admin.delete("/v1/queues/default")
        assert default.status_code == 409 and '"default" cannot be deleted' in default.json()["error"]["message"]

        assert (await user.post(f"/v1/jobs/{job['id']}:cancel")).json()["state"] == "cancelled"
        deleted = await admin.delete("/v1/queues/batch")
        assert deleted.status_code == 200 and deleted.json()["tier"] == 2
        gone = await admin.delete("/v1/queues/batch")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
        refused = await user.post("/v1/jobs", json={**SPEC, "queue": "batch"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "failed_precondition"
        assert "queue 'batch' does not exist; queues: default" in refused.json()["error"]["message"]


async def test_quotas_round_trip_and_team_isolation(gw: RunningGateway) -> None:
    alice = await gw.create_token("vision", "alice")
    async with gw.client(alice) as user, gw.client(gw.admin_token) as admin:
        assert (await user.get("/v1/quotas")).json() == {"quotas": []}
        created = await admin.put("/v1/quotas/vision", json=VISION_QUOTA)
        assert created.status_code == 201, created.text
        assert created.json() == {"team": "vision", "weight": 1.0, "limits": {
            "H100-80GB-HBM3": {"nominal": 64, "borrow_limit": 32}, "*": {"nominal": 8, "borrow_limit": None}},
            "use": {}}
        nlp = await admin.put("/v1/quotas/nlp", json={"limits": {"*": {"nominal": 4, "borrow_limit": 0}}})
        assert nlp.status_code == 201 and nlp.json()["weight"] == 1.0
        assert nlp.json()["limits"]["*"]["borrow_limit"] == 0  # 0 (never borrow) is not "no limit"

        mine = await user.get("/v1/quotas")
        assert [q["team"] for q in mine.json()["quotas"]] == ["vision"]
        assert (await user.get("/v1/quotas/vision")).json() == created.json()
        other = await user.get("/v1/quotas/nlp")
        assert other.status_code == 403 and "only that team's quota" in other.json()["error"]["message"]
        for reply in (await user.put("/v1/quotas/vision", json=VISION_QUOTA), await user.delete("/v1/quotas/nlp")):
            assert reply.status_code == 403, reply.text

        assert [q["team"] for q in (await admin.get("/v1/quotas")).json()["quotas"]] == ["nlp", "vision"]
        assert (await admin.get("/v1/quotas/nlp")).json()["limits"] == {"*": {"nominal": 4, "borrow_limit": 0}}
        missing = await admin.get("/v1/quotas/robotics")
        assert missing.status_code == 404 and "team robotics has no quota" in missing.json()["error"]["message"]

        replaced = await admin.put("/v1/quotas/vision", json={"weight": 3.5})
        assert replaced.status_code == 200
        assert replaced.json() == {"team": "vision", "weight": 3.5, "limits": {}, "use": {}}
        assert (await admin.delete("/v1/quotas/nlp")).status_code == 200
        assert (await admin.get("/v1/quotas/nlp")).status_code == 404
        assert (await admin.delete("/v1/quotas/nlp")).status_code == 404


BAD_QUEUES: list[tuple[str, dict[str, Any], str]] = [
    ("batch", {"tier": 5000}, "tier"),
    ("batch", {"tier": "1"}, "tier"),
    ("batch", {"max_gpus": -1}, "max_gpus"),
    ("batch", {"max_gpus": 2**40}, "max_gpus"),
    ("batch", {"priority": 1}, "priority: unknown field"),
    ("batch", {"node_labels": {f"k{i}": "v" for i in range(17)}}, "node_labels"),
    ("batch", {"node_labels": {"bad key!": "v"}}, "node_labels.bad key!"),  # the scheduler's rule, in the schema
    ("batch", {"node_labels": {"k": "v" * 64}}, "node_labels.k"),
    ("batch", {"description": "d" * 513}, "description"),
    ("Batch", {}, "path parameter name: must be 1-63 lower-case letters"),
    ("b" * 64, {}, "path parameter name: must be"),
]
BAD_QUOTAS: list[tuple[str, dict[str, Any], str]] = [
    ("vision", {"weight": 0}, "weight"),
    ("vision", {"weight": "2"}, "weight"),
    ("vision", {"weight": 1001}, "weight"),
    ("vision", {"limits": {"H100": {"nominal": -1}}}, "limits.H100.nominal"),
    ("vision", {"limits": {"H100": {}}}, "limits.H100.nominal: required"),
    ("vision", {"limits": {"H100": {"nominal": 1, "borrow_limit": -1}}}, "borrow_limit"),
    ("vision", {"limits": {"H100": {"nominal": 1.5}}}, "nominal"),
    ("vision", {"limits": {"H100": 8}}, "limits.H100"),
    ("vision", {"limits": {"": {"nominal": 1}}}, "limits..[key]: must be 1-64 characters"),
    ("vision", {"limits": {"m" * 65: {"nominal": 1}}}, "limits"),
    ("vision", {"team": "nlp"}, "team: unknown field"),
    ("Vision", VISION_QUOTA, "path parameter team: must be 1-63 lower-case letters, digits or '-'"),
    ("ml_team", VISION_QUOTA, "path parameter team"),  # the one team rule, tokens' too
]


async def test_bad_bodies_are_4xx_naming_the_field_and_store_nothing(gw: RunningGateway, scheduler: Cluster,
                                                                     etcd_store: EtcdStore) -> None:
    prefix = scheduler.settings.etcd_prefix
    async with gw.client(gw.admin_token) as admin:
        cases = [(f"/v1/queues/{name}", body, needle) for name, body, needle in BAD_QUEUES]
        cases += [(f"/v1/quotas/{team}", body, needle) for team, body, needle in BAD_QUOTAS]
        for path, body, needle in cases:
            reply = await admin.put(path, json=body)
            assert reply.status_code == 400, (path, body, reply.text)
            assert needle in reply.json()["error"]["message"], (path, body, reply.text)
        not_json = await admin.put("/v1/quotas/vision", content=b'{"weight": ',
                                   headers={"Content-Type": "application/json"})
        assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
        for path in ("/v1/quotas/Vision", "/v1/queues/a.b"):
            assert (await admin.get(path) if "quotas" in path else await admin.delete(path)).status_code == 400
    for sub in ("/queues/", "/quotas/"):
        assert (await etcd_store.range(prefix + sub)).kvs == [], sub


async def test_openapi_documents_the_new_routes_and_fields(gw: RunningGateway) -> None:
    async with gw.client() as http:
        doc = (await http.get("/openapi.json")).json()
    assert {"/v1/queues", "/v1/queues/{name}", "/v1/quotas", "/v1/quotas/{team}"} <= set(doc["paths"])
    resources = doc["components"]["schemas"]["ResourcesRequest"]["properties"]
    assert "fastest" in resources["accelerators"]["description"]
    assert "nominal" in doc["components"]["schemas"]["QuotaLimitRequest"]["properties"]
