"""The gateway's HTTP audit, against the real gateway, scheduler and agents: a table over every mutating
route (each answered call leaves exactly one entry with the token's user and role, the route template, the
target and the result), refusals (401 as `anonymous`, 403, 404) included, reads left out; the request id
shared with the scheduler's own entry; and GET /v1/audit with its filters, paging and operator-only access."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trainyard_core.audit import AuditFilter, AuditLog
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway

JOB = {"name": "audited", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}
QUOTA: dict[str, Any] = {"weight": 2.0, "limits": {"*": {"nominal": 8}}}


@dataclass(frozen=True)
class Call:
    method: str
    route: str  # the template, as recorded
    path: Callable[[dict[str, str]], str]
    token: str = "operator"  # which token makes the call: operator, member, none
    body: Any = None
    target: Callable[[dict[str, str]], str] = lambda _saved: ""
    result: str = "ok"
    save: Callable[[Any], tuple[str, str]] | None = None
    team: str | None = None  # the entry's team, where the row checks it


def fixed(text: str) -> Callable[[dict[str, str]], str]:
    return lambda _saved: text


CALLS: list[Call] = [
    Call("POST", "/v1/jobs", fixed("/v1/jobs"), token="member", body=JOB,
         target=lambda s: f"job/{s['job']}", save=lambda b: ("job", b["id"])),
    Call("POST", "/v1/jobs/{job_id}:cancel", lambda s: f"/v1/jobs/{s['job']}:cancel", token="member",
         target=lambda s: f"job/{s['job']}", team="vision"),
    Call("POST", "/v1/jobs/{job_id}:cancel", fixed("/v1/jobs/job-nope:cancel"), target=fixed("job/job-nope"),
         result="not_found"),
    # The job operations: each route once, with an answer that does not depend on how far the job has got.
    Call("PATCH", "/v1/jobs/{job_id}", lambda s: f"/v1/jobs/{s['job']}", token="member", body={"priority": 5000},
         target=lambda s: f"job/{s['job']}", result="invalid_argument"),
    Call("POST", "/v1/jobs/{job_id}:hold", fixed("/v1/jobs/job-nope:hold"), target=fixed("job/job-nope"),
         result="not_found"),
    Call("POST", "/v1/jobs/{job_id}:release", fixed("/v1/jobs/job-nope:release"), target=fixed("job/job-nope"),
         result="not_found"),
    Call("POST", "/v1/jobs/{job_id}:requeue", fixed("/v1/jobs/job-nope:requeue"), token="none",
         target=fixed("job/job-nope"), result="unauthenticated"),
    Call("POST", "/v1/jobs/{job_id}:resubmit", lambda s: f"/v1/jobs/{s['job']}:resubmit", token="member",
         body={"overrides": {"name": "audited-again"}}, target=lambda s: f"job/{s['again']}",
         save=lambda b: ("again", b["id"]), team="vision"),
    # Checkpoint routes (this gateway has no checkpoint-store: 503 once the job is found; test_checkpoints_api
    # audits them against a real one).
    Call("PUT", "/v1/jobs/{job_id}/checkpoints/{checkpoint_id}/tags/{tag}",
         lambda s: f"/v1/jobs/{s['job']}/checkpoints/ckpt-1/tags/best", token="member",
         target=fixed("checkpoint/ckpt-1"), result="unavailable", team="vision"),
    Call("DELETE", "/v1/jobs/{job_id}/checkpoints/{checkpoint_id}/tags/{tag}",
         fixed("/v1/jobs/job-nope/checkpoints/ckpt-1/tags/best"), target=fixed("checkpoint/ckpt-1"),
         result="not_found"),
    Call("DELETE", "/v1/jobs/{job_id}/checkpoints/{checkpoint_id}", fixed("/v1/jobs/job-nope/checkpoints/ckpt-1"),
         target=fixed("checkpoint/ckpt-1"), result="not_found"),
    Call("POST", "/v1/jobs", fixed("/v1/jobs"), token="none", body=JOB, result="unauthenticated"),
    Call("POST", "/v1/nodes/{node_id}:cordon", fixed("/v1/nodes/node-a:cordon"), token="member",
         target=fixed("node/node-a"), result="permission_denied"),
    Call("POST", "/v1/nodes/{node_id}:cordon", fixed("/v1/nodes/node-a:cordon"), target=fixed("node/node-a")),
    Call("POST", "/v1/nodes/{node_id}:uncordon", fixed("/v1/nodes/node-a:uncordon"), target=fixed("node/node-a")),
    Call("POST", "/v1/nodes/{node_id}/gpus/{gpu_index}:set-health", fixed("/v1/nodes/node-b/gpus/1:set-health"),
         body={"healthy": False, "reason": "audit test"}, target=fixed("node/node-b/gpu/1")),
    Call("PUT", "/v1/queues/{name}", fixed("/v1/queues/batch"), body={"tier": 1}, target=fixed("queue/batch")),
    Call("DELETE", "/v1/queues/{name}", fixed("/v1/queues/batch"), target=fixed("queue/batch")),
    Call("PUT", "/v1/quotas/{team}", fixed("/v1/quotas/vision"), body=QUOTA, target=fixed("team/vision"),
         team="vision"),
    Call("DELETE", "/v1/quotas/{team}", fixed("/v1/quotas/vision"), target=fixed("team/vision")),
    Call("POST", "/v1/tokens", fixed("/v1/tokens"), body={"team": "vision", "user": "carol", "role": "viewer"},
         target=lambda s: f"token/{s['token']}", save=lambda b: ("token", b["token"]["token_id"]), team="vision"),
    Call("DELETE", "/v1/tokens/{token_id}", lambda s: f"/v1/tokens/{s['token']}",
         target=lambda s: f"token/{s['token']}"),
]


def mutating_routes(gateway: RunningGateway) -> set[tuple[str, str]]:
    """Every (method, template) of the API that is not a read, from its OpenAPI document."""
    assert gateway.app.app is not None
    paths = gateway.app.app.openapi()["paths"]
    return {(m.upper(), path) for path, ops in paths.items() if path.startswith("/v1/")
            for m in ops if m.upper() not in ("GET", "HEAD", "OPTIONS")}


async def test_every_mutating_route_leaves_one_entry(cluster_gateway: RunningGateway, cluster: Cluster,
                                                     etcd_store: EtcdStore) -> None:
    assert mutating_routes(cluster_gateway) == {(c.method, c.route) for c in CALLS}
    assert cluster_gateway.app._store is not None
    log = AuditLog(cluster_gateway.app._store, cluster_gateway.app.settings.etcd_prefix)
    member = await cluster_gateway.create_token("vision", "alice", role="member")
    tokens = {"operator": cluster_gateway.admin_token, "member": member, "none": ""}
    saved: dict[str, str] = {}
    for call in CALLS:
        request_id = f"t-{uuid.uuid4().hex[:12]}"
        async with cluster_gateway.client(tokens[call.token] or None) as http:
            reply = await http.request(call.method, call.path(saved), json=call.body,
                                       headers={"X-Request-Id": request_id})
        assert reply.headers["x-request-id"] == request_id
        if reply.status_code < 400 and call.save is not None:
            name, value = call.save(reply.json())
            saved[name] = value
        entries = [e for e in (await log.query(AuditFilter(request_id=request_id))).entries if e.service == "gateway"]
        assert len(entries) == 1, (call.method, call.route, reply.status_code)
        e = entries[0]
        who = {"operator": ("user:admin/admin", "operator"), "member": ("user:vision/alice", "member"),
               "none": ("anonymous", "")}[call.token]
        assert (e.principal, e.role, e.action, e.target, e.result) == \
            (*who, f"{call.method} {call.route}", call.target(saved), call.result), reply.text
        assert e.detail["http_status"] == str(reply.status_code)
        assert call.team is None or e.team == call.team, (call.route, e.team)
        if call.route.endswith(":set-health"):  # the agent's own entry of the call carries the same request id
            [agent_side] = [x for x in cluster.agents["node-b"].audit.entries() if x.request_id == request_id]
            assert (agent_side.action, agent_side.target, agent_side.result) == \
                ("/trainyard.agent.v1.AgentService/SetGpuHealth", "gpu/1", "ok")
        assert "secret" not in e.to_json().decode()


async def test_the_scheduler_records_the_same_request(live_gateway: RunningGateway, scheduler: Cluster,
                                                      etcd_store: EtcdStore) -> None:
    token = await live_gateway.create_token("vision", "alice", role="member")
    async with live_gateway.client(token) as http:
        reply = await http.post("/v1/jobs", json=JOB, headers={"X-Request-Id": "req-shared-1"})
    assert reply.status_code == 201
    job_id = reply.json()["id"]
    scheduler_log = AuditLog(etcd_store, scheduler.settings.etcd_prefix)
    both = (await scheduler_log.query(AuditFilter(request_id="req-shared-1"))).entries
    assert sorted(e.service for e in both) == ["gateway", "scheduler"], "one request, one entry per service"
    [seen] = [e for e in both if e.service == "scheduler"]
    assert (seen.service, seen.action, seen.target, seen.team) == \
        ("scheduler", "/trainyard.scheduler.v1.JobService/SubmitJob", f"job/{job_id}", "vision")
    assert seen.detail["user"] == "alice"


async def test_a_submit_and_both_its_entries_are_one_transaction(live_gateway: RunningGateway, scheduler: Cluster,
                                                                 etcd_store: EtcdStore) -> None:
    """A submit's two entries (the gateway's, forwarded to the scheduler, and the scheduler's own) are stored by
    the job's create itself: one etcd revision for all three. A replay of its Idempotency-Key creates nothing,
    so the gateway writes its entry of the replay itself (result ok, HTTP 200)."""
    token = await live_gateway.create_token("vision", "alice", role="member")
    log = AuditLog(etcd_store, scheduler.settings.etcd_prefix)
    for request_id, status in (("req-one-txn", 201), ("req-one-txn-replay", 200)):
        async with live_gateway.client(token) as http:
            reply = await http.post("/v1/jobs", json=JOB, headers={"X-Request-Id": request_id,
                                                                  "Idempotency-Key": "one-txn"})
        assert reply.status_code == status, reply.text
        job_id = reply.json()["id"]
        found = (await log.query(AuditFilter(request_id=request_id))).entries
        assert sorted(e.service for e in found) == ["gateway", "scheduler"], "one entry per service, not two"
        entries = {e.service: e for e in found}
        gateway = entries["gateway"]
        assert (gateway.principal, gateway.action, gateway.target, gateway.result, gateway.team) == \
            ("user:vision/alice", "POST /v1/jobs", f"job/{job_id}", "ok", "vision")
        assert (gateway.detail["http_status"], gateway.detail["name"], gateway.detail["user"]) == \
            (str(status), "audited", "alice")
        keys = {"job": scheduler.scheduler.keys.job(job_id), **{e.service: log.key(e.id) for e in entries.values()}}
        revisions = {}
        for name, key in keys.items():
            kv = await etcd_store.get(key)
            assert kv is not None, name
            revisions[name] = kv.create_revision
        if status == 201:
            assert sorted(entries) == ["gateway", "scheduler"]
            assert len(set(revisions.values())) == 1, revisions
        else:  # the replay: the scheduler's entry and the gateway's, each its own write, after the job's
            assert revisions["gateway"] > revisions["job"], revisions


async def test_reads_and_unversioned_paths_leave_no_entry(live_gateway: RunningGateway) -> None:
    assert live_gateway.app._store is not None
    log = AuditLog(live_gateway.app._store, live_gateway.app.settings.etcd_prefix)
    before = len((await log.query(AuditFilter(), page_size=500)).entries)
    async with live_gateway.client(live_gateway.admin_token) as http:
        for method, path in [("GET", "/v1/jobs"), ("GET", "/v1/nodes"), ("HEAD", "/v1/jobs"), ("OPTIONS", "/v1/jobs"),
                             ("GET", "/v1/audit"), ("GET", "/v1/usage"), ("GET", "/healthz"),
                             ("POST", "/healthz")]:
            await http.request(method, path)
    assert len((await log.query(AuditFilter(), page_size=500)).entries) == before


async def test_get_audit_filters_pages_and_is_for_operators(live_gateway: RunningGateway) -> None:
    member = await live_gateway.create_token("vision", "alice", role="member")
    async with live_gateway.client(member) as alice:
        for _ in range(3):
            assert (await alice.post("/v1/jobs", json=JOB)).status_code == 201
        refused = await alice.get("/v1/audit")
        assert refused.status_code == 403
    async with live_gateway.client(live_gateway.admin_token) as op:
        page = (await op.get("/v1/audit", params={"user": "alice", "action": "POST /v1/jobs",
                                                  "page_size": 2})).json()
        assert [e["principal"] for e in page["entries"]] == ["user:vision/alice"] * 2
        assert page["entries"][0]["time"] >= page["entries"][1]["time"]
        rest = (await op.get("/v1/audit", params={"user": "alice", "action": "POST /v1/jobs", "page_size": 2,
                                                  "page_token": page["next_page_token"]})).json()
        assert len(rest["entries"]) == 1
        ids = {e["id"] for e in page["entries"] + rest["entries"]}
        assert len(ids) == 3
        # The operator's own token creation is there too, and the member's refused read of the log is not a
        # mutating call.
        created = (await op.get("/v1/audit", params={"action": "POST /v1/tokens", "result": "ok"})).json()
        assert any(e["detail"].get("user") == "alice" for e in created["entries"])
        cases: list[tuple[dict[str, Any], str]] = [
            ({"page_token": "garbage"}, "page_token"), ({"page_size": 0}, "page_size"),
            ({"since": "2026-01-01T00:00:00"}, "time zone"), ({"team": "Not A Team"}, "team")]
        empty = await op.get("/v1/audit", params={"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"})
        assert empty.json() == {"entries": [], "next_page_token": ""}
        for params, problem in cases:
            reply = await op.get("/v1/audit", params=params)
            assert reply.status_code == 400, params
            assert problem in reply.json()["error"]["message"], reply.text


async def test_an_unauthenticated_write_is_recorded_as_anonymous(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        reply = await http.delete("/v1/queues/batch", headers={"Authorization": "Bearer ty_not-a-token"})
    assert reply.status_code == 401
    assert gateway.app._store is not None
    log = AuditLog(gateway.app._store, gateway.app.settings.etcd_prefix)
    [e] = (await log.query(AuditFilter(request_id=reply.headers["x-request-id"]))).entries
    assert (e.principal, e.action, e.target, e.result) == \
        ("anonymous", "DELETE /v1/queues/{name}", "queue/batch", "unauthenticated")


async def test_a_rate_limited_write_is_recorded_with_its_token(etcd_settings: dict[str, str], key_prefix: str) -> None:
    from trainyard_core.testing.etcd import free_port

    from .support import running_gateway

    # The bootstrap token's own requests count too: a burst of 3 is its token creation, then alice's two.
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", rate_limit_burst=2,
                               rate_limit_per_s=0.001) as gw:
        alice = await gw.create_token("vision", "alice", role="member")
        async with gw.client(alice) as http:
            replies = [await http.delete("/v1/queues/batch") for _ in range(3)]
        assert [r.status_code for r in replies][-1] == 429
        assert gw.app._store is not None
        log = AuditLog(gw.app._store, gw.app.settings.etcd_prefix)
        [e] = (await log.query(AuditFilter(request_id=replies[-1].headers["x-request-id"]))).entries
        assert (e.principal, e.role, e.result, e.detail["http_status"]) == \
            ("user:vision/alice", "member", "resource_exhausted", "429")


async def test_a_refused_submit_keeps_no_env_value(live_gateway: RunningGateway) -> None:
    """The 400 names the field and quotes the value to its caller; the audit entry keeps the message without
    the value (it may be a secret)."""
    token = await live_gateway.create_token("vision", "alice", role="member")
    async with live_gateway.client(token) as http:
        reply = await http.post("/v1/jobs", json={**JOB, "env": {"API_KEY": "hunter2-very-secret\u0000"}})
    assert reply.status_code == 400 and "hunter2" in reply.json()["error"]["message"]
    assert live_gateway.app._store is not None
    log = AuditLog(live_gateway.app._store, live_gateway.app.settings.etcd_prefix)
    [e] = (await log.query(AuditFilter(request_id=reply.headers["x-request-id"]))).entries
    assert e.result == "invalid_argument" and "env.API_KEY" in e.message
    assert "hunter2" not in e.to_json().decode()


async def test_the_audit_log_leaves_etcd_and_reads_the_same(etcd_settings: dict[str, str], key_prefix: str,
                                                            tmp_path: Path, etcd_store: EtcdStore) -> None:
    """With a history store, the leader moves every entry out of etcd; GET /v1/audit answers as before, across
    the entries moved and those not moved yet."""
    from .support import running_cluster, running_gateway

    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "moved", state_root=tmp_path / "nodes",
                               history_url=f"sqlite+aiosqlite:///{tmp_path / 'history.db'}") as cluster, \
            running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                            scheduler_address=cluster.address) as gw:
        log = AuditLog(etcd_store, cluster.settings.etcd_prefix)
        member = await gw.create_token("vision", "alice", role="member")
        async with gw.client(member) as alice:
            ids = [(await alice.post("/v1/jobs", json=JOB)).json()["id"] for _ in range(4)]

        async def moved() -> bool:
            return not (await etcd_store.range(log.prefix)).kvs
        await eventually(moved, timeout=20, what="the leader moves the audit log out of etcd")
        async with gw.client(member) as alice:  # and one more, which may still be in etcd when read
            ids.append((await alice.post("/v1/jobs", json=JOB)).json()["id"])
        async with gw.client(gw.admin_token) as op:
            seen: list[dict[str, Any]] = []
            token = ""
            while True:
                page = (await op.get("/v1/audit", params={"team": "vision", "page_size": 2,
                                                          **({"page_token": token} if token else {})})).json()
                seen += page["entries"]
                token = page["next_page_token"]
                if not token:
                    break
        gateway_side = [e["target"] for e in seen if e["service"] == "gateway" and e["action"] == "POST /v1/jobs"]
        assert gateway_side == [f"job/{i}" for i in reversed(ids)], "each submit once, newest first"
        scheduler_side = [e["target"] for e in seen if e["service"] == "scheduler"]
        assert scheduler_side == [f"job/{i}" for i in reversed(ids)]
        assert len({e["id"] for e in seen}) == len(seen)
