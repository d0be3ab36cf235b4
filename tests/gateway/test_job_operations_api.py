"""Hold, release, requeue, priority (PATCH) and resubmit through the real gateway and the real scheduler (gRPC on
port 0, real etcd; no agents, so jobs stay pending unless a test adds them): who may do what (404 for another
team's job, 403 for a teammate's when a member, a hold lifted only by its holder or an admin), 409 for the
wrong state, 400 for a bad body, and resubmit's merge, label, caller and idempotency key, also of a job that
has left etcd for the history store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainyard.common.v1 import types_pb2
from trainyard_core.contract import Role
from trainyard_core.errors import PermissionDenied
from trainyard_core.testing.wait import eventually
from trainyard_gateway import roles

from .support import Cluster, RunningGateway, running_cluster, running_gateway
from .test_roles import Caller

SPEC: dict[str, Any] = {"name": "train-1", "command": ["python", "train.py"], "env": {"LR": "0.1", "SEED": "1"},
                        "labels": {"project": "atlas"}, "resources": {"nodes": 1, "gpus_per_node": 2}}
OPS = ("hold", "release", "requeue")


def test_updating_a_teammates_job_needs_a_team_admin_and_so_does_lifting_their_hold() -> None:
    roles.check_update(Caller(role=Role.MEMBER), "alice", "hold")
    with pytest.raises(PermissionDenied, match="only the job's submitter or a team admin may hold it"):
        roles.check_update(Caller(role=Role.MEMBER), "bob", "hold")
    roles.check_update(Caller(role=Role.ADMIN), "bob", "requeue")
    roles.check_release(Caller(role=Role.MEMBER), "alice", "alice")
    with pytest.raises(PermissionDenied, match="held by ada: only they or a team admin may release it"):
        roles.check_release(Caller(role=Role.MEMBER), "alice", "ada")
    roles.check_release(Caller(role=Role.ADMIN, user="ada2"), "alice", "ada")


async def test_hold_and_release_of_ones_own_job(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    alice = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(alice) as http:
        job = (await http.post("/v1/jobs", json=SPEC)).json()
        held = await http.post(f"/v1/jobs/{job['id']}:hold", json={"reason": "dataset not ready"})
        assert held.status_code == 200, held.text
        body = held.json()
        assert (body["state"], body["held_by"], body["hold_reason"]) == ("pending", "alice", "dataset not ready")
        assert body["message"] == "held by alice: dataset not ready; not placed until released"
        again = (await http.post(f"/v1/jobs/{job['id']}:hold")).json()
        assert again["updated_at"] == body["updated_at"]  # idempotent
        released = (await http.post(f"/v1/jobs/{job['id']}:release")).json()
        assert (released["held_by"], released["queued_at"]) == ("", job["queued_at"])
        assert [e["kind"] for e in released["events"]][-2:] == ["held", "released"]
        assert (await http.post(f"/v1/jobs/{job['id']}:release")).status_code == 200  # not held: unchanged
    assert [r.user for r in scheduler.calls.requests("HoldJob")] == ["alice", "alice"]


async def test_who_may_act_on_whose_job(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    bobs = await scheduler.submit(["true"], name="bobs", team="vision", user="bob")
    nlps = await scheduler.submit(["true"], name="nlps", team="nlp", user="nora")
    alice = await live_gateway.create_token("vision", "alice", role="member")
    ada = await live_gateway.create_token("vision", "ada", role="admin")
    viewer = await live_gateway.create_token("vision", "vic", role="viewer")
    scheduler.calls.clear()
    async with live_gateway.client(alice) as member, live_gateway.client(ada) as admin, \
            live_gateway.client(viewer) as vic:
        for op in OPS:
            refused = await member.post(f"/v1/jobs/{bobs.id}:{op}")
            assert refused.status_code == 403, (op, refused.text)
            assert "only the job's submitter or a team admin" in refused.json()["error"]["message"]
            assert (await admin.post(f"/v1/jobs/{nlps.id}:{op}")).status_code == 404, op
            assert (await vic.post(f"/v1/jobs/{bobs.id}:{op}")).status_code == 403, op
        assert (await member.patch(f"/v1/jobs/{bobs.id}", json={"priority": 5})).status_code == 403
        assert (await admin.patch(f"/v1/jobs/{nlps.id}", json={"priority": 5})).status_code == 404
        assert (await admin.post(f"/v1/jobs/{nlps.id}:resubmit")).status_code == 404
        # Nothing reached the scheduler's operations.
        assert not {"HoldJob", "ReleaseJob", "RequeueJob", "SetJobPriority", "SubmitJob",
                    "SubmitJobs"} & set(scheduler.calls.methods)

        held = await admin.post(f"/v1/jobs/{bobs.id}:hold", json={"reason": "over budget"})
        assert held.status_code == 200 and held.json()["held_by"] == "ada"
        raised = await admin.patch(f"/v1/jobs/{bobs.id}", json={"priority": 50})
        assert raised.status_code == 200 and raised.json()["spec"]["priority"] == 50
        assert raised.json()["events"][-1]["message"] == "priority 0 -> 50 by ada"
    # A member's own job held by the team admin stays held until an admin lifts it.
    alices = await scheduler.submit(["true"], name="alices", team="vision", user="alice")
    async with live_gateway.client(ada) as admin, live_gateway.client(alice) as member:
        assert (await admin.post(f"/v1/jobs/{alices.id}:hold")).status_code == 200
        refused = await member.post(f"/v1/jobs/{alices.id}:release")
        assert refused.status_code == 403 and "held by ada" in refused.json()["error"]["message"], refused.text
        assert (await admin.post(f"/v1/jobs/{alices.id}:release")).json()["held_by"] == ""


async def test_wrong_states_and_bad_bodies(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    alice = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(alice) as http:
        job = (await http.post("/v1/jobs", json=SPEC)).json()
        requeue = await http.post(f"/v1/jobs/{job['id']}:requeue")
        assert requeue.status_code == 409, requeue.text
        assert requeue.json()["error"] == {
            "code": "failed_precondition",
            "message": f"job {job['id']} is pending: only an admitted or running job can be requeued"}
        for body, words in [({"priority": 1001}, "priority"), ({}, "priority: required"),
                            ({"priority": "high"}, "priority"), ({"priority": 1, "x": 2}, "x: unknown field")]:
            reply = await http.patch(f"/v1/jobs/{job['id']}", json=body)
            assert reply.status_code == 400 and words in reply.json()["error"]["message"], (body, reply.text)
        reason = await http.post(f"/v1/jobs/{job['id']}:hold", json={"reason": "x" * 1025})
        assert reason.status_code == 400 and "reason" in reason.json()["error"]["message"]
        assert (await http.post("/v1/jobs/Not-An-Id:hold")).status_code == 400
        await http.post(f"/v1/jobs/{job['id']}:cancel")
        for method, path, body in [("POST", f"/v1/jobs/{job['id']}:hold", None),
                                   ("POST", f"/v1/jobs/{job['id']}:release", None),
                                   ("PATCH", f"/v1/jobs/{job['id']}", {"priority": 3})]:
            reply = await http.request(method, path, json=body)
            assert reply.status_code == 409 and reply.json()["error"]["code"] == "failed_precondition", path
        assert (await http.post("/v1/jobs/job-nope:hold")).status_code == 404


async def test_resubmit_merges_the_overrides_and_submits_as_the_caller(live_gateway: RunningGateway,
                                                                        scheduler: Cluster) -> None:
    alice = await live_gateway.create_token("vision", "alice")
    bob = await live_gateway.create_token("vision", "bob")
    async with live_gateway.client(alice) as a, live_gateway.client(bob) as b:
        original = (await a.post("/v1/jobs", json=SPEC)).json()
        overrides = {"resources": {"nodes": 2}, "env": {"LR": "0.01", "SEED": None}, "priority": 7,
                     "labels": {"try": "2"}}
        reply = await b.post(f"/v1/jobs/{original['id']}:resubmit", json={"overrides": overrides})
        assert reply.status_code == 201, reply.text
        again = reply.json()
        assert again["id"] != original["id"] and (again["user"], again["team"], again["state"]) == (
            "bob", "vision", "pending")
        spec = again["spec"]
        assert (spec["resources"]["nodes"], spec["resources"]["gpus_per_node"], spec["priority"]) == (2, 2, 7)
        assert spec["env"] == {"LR": "0.01"} and spec["command"] == SPEC["command"]
        assert spec["labels"] == {"project": "atlas", "try": "2", "resubmitted_from": original["id"]}
        # No body: the same spec again.
        plain = (await a.post(f"/v1/jobs/{original['id']}:resubmit")).json()
        assert plain["spec"]["env"] == SPEC["env"] and plain["spec"]["labels"]["resubmitted_from"] == original["id"]
        # The patch is checked against its schema (400); the merged spec as a submit (409: a well-formed patch
        # that does not make a job with this one's spec).
        for body, status, words in [
                ({"overrides": {"resources": {"nodes": 0}}}, 400, "overrides.resources.nodes"),
                ({"overrides": {"nope": 1}}, 400, "overrides.nope: unknown field"),
                ({"overrides": {"resources": {"accelerator": "A100", "accelerators": ["H100"]}}}, 409,
                 "either accelerator"),
                ({"overrides": {"topology": {"wait_s": 60}}}, 409, "topology: wait_s needs tier"),
                ({"overrides": {"name": None}}, 409, "name: required")]:
            bad = await a.post(f"/v1/jobs/{original['id']}:resubmit", json=body)
            assert bad.status_code == status and words in bad.json()["error"]["message"], (body, bad.text)
        # An idempotency key: the retry answers 200 with the first job.
        key = {"Idempotency-Key": "resubmit-1"}
        first = await a.post(f"/v1/jobs/{original['id']}:resubmit", json={"overrides": {"priority": 1}}, headers=key)
        retry = await a.post(f"/v1/jobs/{original['id']}:resubmit", json={"overrides": {"priority": 1}}, headers=key)
        assert (first.status_code, retry.status_code, retry.json()["id"]) == (201, 200, first.json()["id"])
        reused = await a.post(f"/v1/jobs/{original['id']}:resubmit", json={"overrides": {"priority": 2}}, headers=key)
        assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"
    viewer = await live_gateway.create_token("vision", "vic", role="viewer")
    async with live_gateway.client(viewer) as v:
        assert (await v.post(f"/v1/jobs/{original['id']}:resubmit")).status_code == 403


async def test_resubmit_of_a_job_that_has_left_etcd_for_the_history_store(
        etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> None:
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "hist", state_root=tmp_path / "nodes",
                               history_url=f"sqlite+aiosqlite:///{tmp_path / 'history.db'}", job_ttl_s=1) as cluster, \
            running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                            scheduler_address=cluster.address) as gw:
        alice = await gw.create_token("vision", "alice")
        async with gw.client(alice) as http:
            original = (await http.post("/v1/jobs", json=SPEC)).json()
            await http.post(f"/v1/jobs/{original['id']}:cancel")
            store, keys = cluster.scheduler.store, cluster.scheduler.keys

            async def gone() -> bool:
                return await store.get(keys.job(original["id"])) is None

            await eventually(gone, timeout=30, what="the cancelled job to leave etcd for the history store")
            reply = await http.post(f"/v1/jobs/{original['id']}:resubmit",
                                    json={"overrides": {"env": {"LR": "0.2"}}})
            assert reply.status_code == 201, reply.text
            spec = reply.json()["spec"]
            # The history keeps the environment's names, not their values: SEED comes back empty.
            assert spec["env"] == {"LR": "0.2", "SEED": ""}
            assert spec["labels"]["resubmitted_from"] == original["id"] and spec["name"] == SPEC["name"]
            # A finished job's operations are refused as for any finished job.
            assert (await http.patch(f"/v1/jobs/{original['id']}", json={"priority": 1})).status_code == 409
        assert (await cluster.job(reply.json()["id"])).state == types_pb2.JOB_STATE_PENDING


async def test_requeue_of_a_running_job_through_the_gateway(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    alice = await cluster_gateway.create_token("vision", "alice")
    sleeper = {"name": "sleeper", "command": ["python", "-c", "import time; time.sleep(600)"],
               "resources": {"nodes": 1, "gpus_per_node": 1}, "preemption": {"grace_s": 2}}
    async with cluster_gateway.client(alice) as http:
        job = (await http.post("/v1/jobs", json=sleeper)).json()
        await cluster.wait_state(job["id"], types_pb2.JOB_STATE_RUNNING)
        asked = await http.post(f"/v1/jobs/{job['id']}:requeue", json={"reason": "new code"})
        assert asked.status_code == 200, asked.text
        assert asked.json()["requeue_requested_by"] == "alice"

        async def second_attempt() -> dict[str, Any] | None:
            now = (await http.get(f"/v1/jobs/{job['id']}")).json()
            return now if now["attempt"] == 2 and now["state"] in ("admitted", "running") else None

        again = await eventually(second_attempt, timeout=30, what="attempt 2 to be placed")
        assert (again["restarts"], again["requeue_requested_by"]) == (0, "")
        assert [(a["attempt"], a["outcome"], a["reason"]) for a in again["attempts"]] == [
            (1, "pending", "requeued by alice")]
        await http.post(f"/v1/jobs/{job['id']}:cancel")
