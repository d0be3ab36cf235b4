"""Gateway roles and scopes: the one table (trainyard_gateway.roles) on its own, and every route against a
real gateway and a real scheduler, for a token of each role."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainyard.common.v1 import types_pb2
from trainyard_core.contract import ROLES, Role, Scope
from trainyard_core.errors import PermissionDenied
from trainyard_core.security import identity, pki
from trainyard_core.testing.wait import eventually
from trainyard_gateway import roles
from trainyard_gateway.roles import RULES, Action
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

from .support import Cluster, RunningGateway, python, running_gateway


@dataclass(frozen=True)
class Caller:
    team: str = "vision"
    user: str = "alice"
    role: Role = Role.MEMBER
    scopes: tuple[Scope, ...] = ()


# --- the table, directly ------------------------------------------------------------------------------

@pytest.mark.parametrize("action", list(Action))
def test_each_action_needs_its_role_and_its_scope(action: Action) -> None:
    rule = RULES[action]
    for role in Role:
        assert roles.allows(Caller(role=role), action) is role.at_least(rule.role), (action, role)
    top = Caller(role=Role.OPERATOR)
    assert roles.allows(Caller(role=Role.OPERATOR, scopes=(rule.scope,)), action)
    others = tuple(s for s in Scope if s is not rule.scope)
    narrowed = Caller(role=top.role, scopes=others)
    assert not roles.allows(narrowed, action)
    assert rule.scope.value in roles.refusal(narrowed, action)


def test_every_action_has_a_rule_and_roles_are_ordered() -> None:
    assert set(RULES) == set(Action)
    assert [r.value for r in sorted(Role, key=lambda r: r.rank)] == list(ROLES) == [
        "viewer", "member", "admin", "operator"]


def test_team_filter_confines_everyone_but_operators() -> None:
    assert roles.team_filter(Caller(role=Role.ADMIN), Action.JOBS_READ) == "vision"
    assert roles.team_filter(Caller(role=Role.OPERATOR), Action.JOBS_READ) == ""
    assert roles.team_filter(Caller(role=Role.VIEWER), Action.NODES_READ) == ""  # cluster-wide
    assert roles.sees_team(Caller(role=Role.VIEWER), Action.QUOTAS_READ, "vision")
    assert not roles.sees_team(Caller(role=Role.ADMIN), Action.QUOTAS_READ, "nlp")


def test_cancel_of_a_teammates_job_needs_a_team_admin() -> None:
    roles.check_cancel(Caller(role=Role.MEMBER), "alice")
    with pytest.raises(PermissionDenied, match="only the job's submitter or a team admin may cancel it"):
        roles.check_cancel(Caller(role=Role.MEMBER), "bob")
    roles.check_cancel(Caller(role=Role.ADMIN), "bob")
    with pytest.raises(PermissionDenied):  # an admin whose scopes leave out jobs:write
        roles.check_cancel(Caller(role=Role.ADMIN, scopes=(Scope.JOBS_READ,)), "bob")


@pytest.mark.parametrize(("creator", "team", "role", "scopes", "refused"), [
    (Caller(role=Role.ADMIN), "vision", Role.ADMIN, (), ""),
    (Caller(role=Role.ADMIN), "nlp", Role.VIEWER, (), "only for its own team"),
    (Caller(role=Role.ADMIN), "vision", Role.OPERATOR, (), "up to admin"),
    (Caller(role=Role.OPERATOR, team="ops"), "nlp", Role.OPERATOR, (), ""),
    (Caller(role=Role.ADMIN, scopes=(Scope.TOKENS_WRITE, Scope.JOBS_READ)), "vision", Role.VIEWER,
     (Scope.JOBS_READ,), ""),
    (Caller(role=Role.ADMIN, scopes=(Scope.TOKENS_WRITE,)), "vision", Role.MEMBER, (Scope.JOBS_WRITE,),
     "within those scopes"),
    (Caller(role=Role.ADMIN, scopes=(Scope.TOKENS_WRITE,)), "vision", Role.MEMBER, (), "no scopes"),
])
def test_who_may_grant_what(creator: Caller, team: str, role: Role, scopes: tuple[Scope, ...],
                            refused: str) -> None:
    if not refused:
        roles.check_grant(creator, team=team, role=role, scopes=scopes)
        return
    with pytest.raises(PermissionDenied, match=refused):
        roles.check_grant(creator, team=team, role=role, scopes=scopes)


# --- every route, through the gateway -------------------------------------------------------------------

# (method, path, body, action): the action each route checks. A route the gateway has and this table lacks
# fails test_every_route_is_in_the_table.
ROUTES: list[tuple[str, str, Any, Action]] = [
    ("POST", "/v1/jobs", {"name": "t", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}},
     Action.JOBS_SUBMIT),
    ("GET", "/v1/jobs", None, Action.JOBS_READ),
    ("GET", "/v1/jobs/job-missing", None, Action.JOBS_READ),
    ("POST", "/v1/jobs/job-missing:cancel", None, Action.JOBS_CANCEL),
    ("POST", "/v1/jobs/job-missing:hold", None, Action.JOBS_UPDATE),
    ("POST", "/v1/jobs/job-missing:release", None, Action.JOBS_UPDATE),
    ("POST", "/v1/jobs/job-missing:requeue", None, Action.JOBS_UPDATE),
    ("PATCH", "/v1/jobs/job-missing", {"priority": 1}, Action.JOBS_UPDATE),
    ("POST", "/v1/jobs/job-missing:resubmit", None, Action.JOBS_SUBMIT),
    ("GET", "/v1/jobs/job-missing/logs", None, Action.JOBS_READ),
    ("GET", "/v1/jobs/job-missing/events", None, Action.JOBS_READ),
    ("GET", "/v1/pending", None, Action.JOBS_READ),
    ("GET", "/v1/jobs/job-missing/checkpoints", None, Action.CHECKPOINTS_READ),
    ("GET", "/v1/jobs/job-missing/checkpoints/ckpt-missing", None, Action.CHECKPOINTS_READ),
    ("GET", "/v1/jobs/job-missing/checkpoints/ckpt-missing/manifest", None, Action.CHECKPOINTS_READ),
    ("PUT", "/v1/jobs/job-missing/checkpoints/ckpt-missing/tags/best", None, Action.CHECKPOINTS_WRITE),
    ("DELETE", "/v1/jobs/job-missing/checkpoints/ckpt-missing/tags/best", None, Action.CHECKPOINTS_WRITE),
    ("DELETE", "/v1/jobs/job-missing/checkpoints/ckpt-missing", None, Action.CHECKPOINTS_WRITE),
    ("GET", "/v1/nodes", None, Action.NODES_READ),
    ("GET", "/v1/nodes/node-missing", None, Action.NODES_READ),
    ("GET", "/v1/nodes/node-missing/metrics", None, Action.NODES_READ),
    ("GET", "/v1/fleet/metrics", None, Action.NODES_READ),
    ("POST", "/v1/nodes/node-missing:cordon", None, Action.NODES_WRITE),
    ("POST", "/v1/nodes/node-missing:uncordon", None, Action.NODES_WRITE),
    ("POST", "/v1/nodes/node-missing/gpus/0:set-health", {"healthy": True, "reason": "repaired"},
     Action.NODES_WRITE),
    ("GET", "/v1/queues", None, Action.QUEUES_READ),
    ("PUT", "/v1/queues/batch", {"tier": 1}, Action.QUEUES_WRITE),
    ("DELETE", "/v1/queues/missing", None, Action.QUEUES_WRITE),
    ("GET", "/v1/quotas", None, Action.QUOTAS_READ),
    ("GET", "/v1/quotas/{team}", None, Action.QUOTAS_READ),
    ("PUT", "/v1/quotas/{team}", {"limits": {"*": {"nominal": 8}}}, Action.QUOTAS_WRITE),
    ("DELETE", "/v1/quotas/missing", None, Action.QUOTAS_WRITE),
    ("POST", "/v1/tokens", {"team": "{team}", "user": "new", "role": "viewer"}, Action.TOKENS_WRITE),
    ("GET", "/v1/tokens", None, Action.TOKENS_READ),
    ("DELETE", "/v1/tokens/tok-missing", None, Action.TOKENS_WRITE),
    ("GET", "/v1/audit", None, Action.AUDIT_READ),
    ("GET", "/v1/usage", None, Action.USAGE_READ),
]
UNAUTHENTICATED_ROUTES = {("GET", "/healthz")}
# Any valid token, whatever its role and scopes (tests/gateway/test_console_api.py).
ANY_TOKEN_ROUTES = {("GET", "/v1/whoami")}


def _fill(value: Any, team: str) -> Any:
    if isinstance(value, str):
        return value.replace("{team}", team)
    if isinstance(value, dict):
        return {k: _fill(v, team) for k, v in value.items()}
    return value


def test_every_route_is_in_the_table(gateway: RunningGateway) -> None:
    assert gateway.app.app is not None
    paths = gateway.app.app.openapi()["paths"]
    documented = {(method.upper(), path) for path, operations in paths.items() for method in operations}
    listed = {(method, path.replace("job-missing", "{job_id}").replace("node-missing", "{node_id}")
               .replace("ckpt-missing", "{checkpoint_id}").replace("/tags/best", "/tags/{tag}")
               .replace("tok-missing", "{token_id}").replace("/gpus/0", "/gpus/{gpu_index}")
               .replace("/batch", "/{name}").replace("/queues/missing", "/queues/{name}")
               .replace("/quotas/missing", "/quotas/{team}")) for method, path, _, _ in ROUTES}
    assert documented - UNAUTHENTICATED_ROUTES - ANY_TOKEN_ROUTES == listed


async def _tokens(gw: RunningGateway) -> dict[Role, str]:
    return {role: await gw.create_token("ops" if role is Role.OPERATOR else "vision", f"u-{role.value}",
                                        role=role.value) for role in Role}


async def test_each_route_refuses_the_roles_below_its_rule(live_gateway: RunningGateway) -> None:
    tokens = await _tokens(live_gateway)
    problems: list[str] = []
    for role, secret in tokens.items():
        team = "ops" if role is Role.OPERATOR else "vision"
        async with live_gateway.client(secret) as http:
            for method, path, body, action in ROUTES:
                reply = await http.request(method, _fill(path, team), json=_fill(body, team))
                should_pass = role.at_least(RULES[action].role)
                if should_pass and reply.status_code in (401, 403, 500):
                    problems.append(f"{role} {method} {path}: {reply.status_code} {reply.text}")
                if not should_pass and (reply.status_code != 403 or RULES[action].role.value
                                        not in reply.json()["error"]["message"]):
                    problems.append(f"{role} {method} {path}: expected 403, got {reply.status_code} {reply.text}")
    assert not problems, "\n".join(problems)


async def test_scopes_narrow_what_a_token_may_do(live_gateway: RunningGateway) -> None:
    reader = await live_gateway.create_token("vision", "carol", role="admin", scopes=["jobs:read"])
    spec = ROUTES[0][2]
    async with live_gateway.client(reader) as http:
        assert (await http.get("/v1/jobs")).status_code == 200
        submit = await http.post("/v1/jobs", json=spec)
        assert submit.status_code == 403 and "jobs:write" in submit.json()["error"]["message"]
        assert (await http.get("/v1/quotas")).status_code == 403  # admin role, but no quotas:read
        listed = await http.get("/v1/tokens")
        assert listed.status_code == 403 and "tokens:read" in listed.json()["error"]["message"]


async def test_viewer_cannot_submit(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    viewer = await live_gateway.create_token("vision", "vic", role="viewer")
    async with live_gateway.client(viewer) as http:
        reply = await http.post("/v1/jobs", json=ROUTES[0][2])
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"] == {
            "code": "permission_denied",
            "message": "jobs.submit needs the member role or higher; the token of vic (team vision) has the viewer "
                       "role"}
        assert (await http.get("/v1/jobs")).status_code == 200
    assert scheduler.calls.submits() == []  # refused before the scheduler was asked


async def test_member_cancels_only_its_own_jobs_and_the_cancel_names_its_user(
        live_gateway: RunningGateway, scheduler: Cluster) -> None:
    alices = await scheduler.submit(["true"], name="alices", team="vision", user="alice")
    bobs = await scheduler.submit(["true"], name="bobs", team="vision", user="bob")
    alice = await live_gateway.create_token("vision", "alice", role="member")
    scheduler.calls.clear()
    async with live_gateway.client(alice) as http:
        refused = await http.post(f"/v1/jobs/{bobs.id}:cancel")
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["message"].startswith(
            "only the job's submitter or a team admin may cancel it")
        assert "CancelJob" not in scheduler.calls.methods
        assert (await scheduler.job(bobs.id)).state == types_pb2.JOB_STATE_PENDING

        mine = await http.post(f"/v1/jobs/{alices.id}:cancel")
        assert mine.status_code == 200, mine.text
        assert mine.json()["state"] == "cancelled" and mine.json()["cancelled_by"] == "alice"
        assert mine.json()["message"] == "cancelled by alice"
    stored = await scheduler.job(alices.id)
    assert stored.cancelled_by == "alice" and stored.state == types_pb2.JOB_STATE_CANCELLED
    assert [r.user for r in scheduler.calls.requests("CancelJob")] == ["alice"]


async def test_team_admin_cancels_its_teams_jobs_and_sees_no_other_teams(
        live_gateway: RunningGateway, scheduler: Cluster) -> None:
    bobs = await scheduler.submit(["true"], name="bobs", team="vision", user="bob")
    nlps = await scheduler.submit(["true"], name="nlps", team="nlp", user="nora")
    admin = await live_gateway.create_token("vision", "ada", role="admin")
    async with live_gateway.client(admin) as http:
        cancelled = await http.post(f"/v1/jobs/{bobs.id}:cancel")
        assert cancelled.status_code == 200 and cancelled.json()["cancelled_by"] == "ada"
        for method, path in [("GET", f"/v1/jobs/{nlps.id}"), ("POST", f"/v1/jobs/{nlps.id}:cancel"),
                             ("GET", f"/v1/jobs/{nlps.id}/logs")]:
            reply = await http.request(method, path)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", (path, reply.text)
        assert [j["id"] for j in (await http.get("/v1/jobs")).json()["jobs"]] == [bobs.id]
    assert (await scheduler.job(nlps.id)).state == types_pb2.JOB_STATE_PENDING


async def test_team_admin_manages_only_its_teams_tokens(live_gateway: RunningGateway) -> None:
    admin = await live_gateway.create_token("vision", "ada", role="admin")
    other = await live_gateway.create_token("nlp", "nora", role="member")
    async with live_gateway.client(admin) as http, live_gateway.client(live_gateway.admin_token) as op:
        made = await http.post("/v1/tokens", json={"team": "vision", "user": "vic", "role": "viewer",
                                                   "ttl": "7d", "scopes": ["jobs:read"]})
        assert made.status_code == 201, made.text
        assert (made.json()["token"]["role"], made.json()["token"]["scopes"]) == ("viewer", ["jobs:read"])
        for body, words in [({"team": "nlp", "user": "x"}, "own team"),
                            ({"team": "vision", "user": "x", "role": "operator"}, "up to admin")]:
            reply = await http.post("/v1/tokens", json=body)
            assert reply.status_code == 403 and words in reply.json()["error"]["message"], reply.text
        listed = (await http.get("/v1/tokens")).json()["tokens"]
        assert {t["team"] for t in listed} == {"vision"} and {t["user"] for t in listed} == {"ada", "vic"}
        assert (await http.get("/v1/tokens", params={"team": "nlp"})).status_code == 403
        nlp_id = next(t["token_id"] for t in (await op.get("/v1/tokens", params={"team": "nlp"})).json()["tokens"])
        assert (await http.delete(f"/v1/tokens/{nlp_id}")).status_code == 404
        assert (await op.get("/v1/tokens", params={"team": "nlp"})).json()["tokens"][0]["token_id"] == nlp_id
    async with live_gateway.client(other) as http:
        assert (await http.get("/v1/jobs")).status_code == 200  # not revoked


async def test_team_admin_reads_its_quota_and_only_operators_set_quotas(live_gateway: RunningGateway) -> None:
    admin = await live_gateway.create_token("vision", "ada", role="admin")
    quota = {"limits": {"*": {"nominal": 8}}}
    async with live_gateway.client(admin) as http, live_gateway.client(live_gateway.admin_token) as op:
        assert (await http.put("/v1/quotas/vision", json=quota)).status_code == 403
        assert (await op.put("/v1/quotas/vision", json=quota)).status_code == 201
        assert (await op.put("/v1/quotas/nlp", json=quota)).status_code == 201
        assert (await http.get("/v1/quotas/vision")).json()["limits"]["*"]["nominal"] == 8
        assert (await http.get("/v1/quotas/nlp")).status_code == 403
        assert [q["team"] for q in (await http.get("/v1/quotas")).json()["quotas"]] == ["vision"]
        assert {q["team"] for q in (await op.get("/v1/quotas")).json()["quotas"]} == {"vision", "nlp"}


async def test_only_operators_see_where_nodes_are_and_cordon_them(cluster: Cluster,
                                                                 cluster_gateway: RunningGateway) -> None:
    tokens = await _tokens(cluster_gateway)
    for role, secret in tokens.items():
        async with cluster_gateway.client(secret) as http:
            nodes = (await http.get("/v1/nodes")).json()["nodes"]
            one = (await http.get("/v1/nodes/node-a")).json()
            cordon = await http.post("/v1/nodes/node-a:cordon", json={"reason": f"by {role.value}"})
            if role is Role.OPERATOR:
                address = f"127.0.0.1:{cluster.agents['node-a'].grpc_port}"
                assert {n["node_id"]: n["agent_address"] for n in nodes}["node-a"] == address
                assert one["agent_address"] == address and one["hostname"]
                assert cordon.status_code == 200 and cordon.json()["cordoned"]
            else:
                assert [(n["hostname"], n["agent_address"]) for n in nodes] == [(None, None)] * 2, role
                assert (one["hostname"], one["agent_address"]) == (None, None)
                assert one["gpus_total"] == 4  # the rest of the node is shown
                assert cordon.status_code == 403, (role, cordon.text)
    cordoned = [n for n in await cluster.list_nodes() if n.cordoned]
    assert [(n.node_id, n.cordon_reason) for n in cordoned] == [("node-a", "by operator")]


async def test_logs_of_an_unreachable_node_do_not_show_its_address(cluster: Cluster,
                                                                   cluster_gateway: RunningGateway) -> None:
    job = await cluster.submit(python("print('hi')"), nodes=2, gpus=1, team="vision", user="alice")
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    address = f"127.0.0.1:{cluster.agents['node-b'].grpc_port}"
    await cluster.stop_agent("node-b")
    member = await cluster_gateway.create_token("vision", "alice", role="member")
    async with cluster_gateway.client(member) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200, reply.text
    assert "[gateway] no logs for ranks 1 on node node-b: the node agent of node-b is unavailable" in reply.text
    assert address not in reply.text and "127.0.0.1" not in reply.text


async def test_roles_over_mtls_against_the_real_scheduler(etcd_settings: dict[str, str], key_prefix: str,
                                                          pki_dir: Path) -> None:
    """The whole path with TLS on, as deployed: the gateway's certificate is what makes the scheduler take the
    team and the user (submitter, canceller) the gateway names for its tokens."""
    prefix = key_prefix.rstrip("/")
    scheduler = SchedulerApp(SchedulerSettings.model_validate(dict(
        **etcd_settings, etcd_prefix=prefix + "/scheduler", listen_port=0, leader_ttl_s=2,
        reconcile_interval_s=0.2, **pki.files_for(pki_dir, identity.SCHEDULER).settings())))
    await scheduler.start()
    try:
        async def leads() -> bool:
            return scheduler.leadership.is_leader

        await eventually(leads, what="the scheduler to lead")
        async with running_gateway(etcd=etcd_settings, etcd_prefix=prefix,
                                   scheduler_address=f"127.0.0.1:{scheduler.grpc_port}",
                                   **pki.files_for(pki_dir, identity.GATEWAY).settings()) as gw:
            alice = await gw.create_token("vision", "alice", role="member")
            bob = await gw.create_token("vision", "bob", role="member")
            ada = await gw.create_token("vision", "ada", role="admin")
            spec = ROUTES[0][2]
            async with gw.client(alice) as a, gw.client(bob) as b, gw.client(ada) as admin:
                first = (await a.post("/v1/jobs", json=spec)).json()
                second = (await a.post("/v1/jobs", json=spec)).json()
                assert (first["team"], first["user"]) == ("vision", "alice")
                refused = await b.post(f"/v1/jobs/{first['id']}:cancel")
                assert refused.status_code == 403, refused.text
                own = await a.post(f"/v1/jobs/{first['id']}:cancel")
                assert (own.status_code, own.json()["cancelled_by"]) == (200, "alice")
                by_admin = await admin.post(f"/v1/jobs/{second['id']}:cancel")
                assert (by_admin.status_code, by_admin.json()["cancelled_by"]) == (200, "ada")
    finally:
        await scheduler.stop()
