"""The SDK's methods for the rest of the API against a real gateway (with both clients): health, nodes (a real
scheduler and two real agents on simulated GPUs), queues, quotas, tokens, usage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.gateway.support import Cluster, RunningGateway
from trainyard_core.testing.wait import eventually
from trainyard_gateway.schemas.nodes import Node
from trainyard_gateway.schemas.quotas import QuotaPut
from trainyard_sdk import FailedPrecondition, Health, NotFound, PendingList, PermissionDenied, Unauthenticated

from .support import Sdk


async def test_health(sdk: Sdk, live_gateway: RunningGateway, gateway: RunningGateway) -> None:
    ok = await sdk(live_gateway.url)(lambda c: c.health())  # no token needed
    assert isinstance(ok, Health) and ok.status == "ok" and ok.scheduler.reachable
    degraded = await sdk(gateway.url)(lambda c: c.health())  # 503, with the same body: an answer, not an error
    assert degraded.status == "degraded" and not degraded.scheduler.reachable and degraded.scheduler.detail


async def test_nodes(sdk: Sdk, cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    operator = sdk(cluster_gateway.url, await cluster_gateway.create_token("ops", "root", role="operator"))
    member = sdk(cluster_gateway.url, await cluster_gateway.create_token("vision", "alice"))
    nodes = await operator(lambda c: c.list_nodes())
    assert [n.node_id for n in nodes] == ["node-a", "node-b"] and all(isinstance(n, Node) for n in nodes)
    assert nodes[0].agent_address and nodes[0].gpus_total == 4
    seen = await member(lambda c: c.get_node("node-a"))
    assert (seen.node_id, seen.agent_address, seen.hostname) == ("node-a", None, None)  # operators only

    cordoned = await operator(lambda c: c.cordon_node("node-a", reason="replacing a fan"))
    assert (cordoned.state, cordoned.cordon_reason) == ("cordoned", "replacing a fan")
    assert (await operator(lambda c: c.cordon_node("node-b"))).cordon_reason == "cordoned by root"
    assert (await operator(lambda c: c.uncordon_node("node-a"))).cordoned is False
    with pytest.raises(NotFound):
        await operator(lambda c: c.get_node("node-zz"))

    out = await operator(lambda c: c.set_gpu_health("node-a", 0, healthy=False, reason="ECC errors"))
    assert out.node_id == "node-a"
    assert [r.healthy for r in cluster.agent_calls["node-a"].requests("SetGpuHealth")] == [False]

    async def unhealthy() -> bool:
        node = await operator(lambda c: c.get_node("node-a"))
        return bool(node.gpus[0].health == "unhealthy")

    await eventually(unhealthy, timeout=5, what="GPU 0 of node-a unhealthy at the scheduler")
    with pytest.raises(TypeError):
        await operator(lambda c: c.set_gpu_health("node-a", True, healthy=True, reason="x"))


async def test_queues_and_quotas(sdk: Sdk, live_gateway: RunningGateway) -> None:
    operator = sdk(live_gateway.url, live_gateway.admin_token)
    member = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    queue = await operator(lambda c: c.put_queue("research", {"tier": 10, "max_gpus": 256,
                                                               "node_labels": {"pool": "reserved"}}))
    assert (queue.name, queue.tier, queue.max_gpus, queue.node_labels) == ("research", 10, 256, {"pool": "reserved"})
    assert sorted(q.name for q in await member(lambda c: c.list_queues())) == ["default", "research"]
    assert (await operator(lambda c: c.delete_queue("research"))).name == "research"
    with pytest.raises(FailedPrecondition):
        await operator(lambda c: c.delete_queue("default"))

    limits = {"A100-SXM4-80GB": {"nominal": 8, "borrow_limit": 4}, "*": {"nominal": 2}}
    quota = await operator(lambda c: c.put_quota("vision", QuotaPut.model_validate({"weight": 2, "limits": limits})))
    assert (quota.team, quota.weight, quota.limits["A100-SXM4-80GB"].borrow_limit) == ("vision", 2.0, 4)
    assert quota.limits["*"].borrow_limit is None
    assert (await member(lambda c: c.get_quota("vision"))).limits == quota.limits  # its own team's
    assert [q.team for q in await member(lambda c: c.list_quotas())] == ["vision"]
    assert (await operator(lambda c: c.delete_quota("vision"))).team == "vision"
    with pytest.raises(NotFound):
        await operator(lambda c: c.get_quota("vision"))


async def test_tokens(sdk: Sdk, gateway: RunningGateway) -> None:
    operator = sdk(gateway.url, gateway.admin_token)
    scopes = ["jobs:read", "tokens:read", "tokens:write"]
    made = await operator(lambda c: c.create_token("vision", "ada", role="admin", ttl="30d", scopes=scopes,
                                                   description="ci"))
    assert (made.token.team, made.token.user, made.token.role, made.token.scopes) == (
        "vision", "ada", "admin", scopes)
    assert made.token.expires_at is not None and made.secret
    ada = sdk(gateway.url, made.secret)
    bot = await ada(lambda c: c.create_token("vision", "bot", role="viewer", scopes=["jobs:read"]))
    assert sorted(t.user for t in await ada(lambda c: c.list_tokens())) == ["ada", "bot"]
    assert {t.team for t in await operator(lambda c: c.list_tokens(team="vision"))} == {"vision"}
    revoked = await ada(lambda c: c.revoke_token(bot.token.token_id))
    assert revoked.token_id == bot.token.token_id
    with pytest.raises(Unauthenticated):
        await sdk(gateway.url, bot.secret)(lambda c: c.list_jobs_page())
    with pytest.raises(FailedPrecondition, match="is the one this request is made with"):
        await ada(lambda c: c.revoke_token(made.token.token_id))


async def test_usage(sdk: Sdk, live_gateway: RunningGateway) -> None:
    member = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))
    end = datetime.now(UTC)
    report = await member(lambda c: c.usage(from_=end - timedelta(days=1), to=end, group_by="user"))
    assert (report.group_by, report.team, report.rows, report.total.gpu_hours) == ("user", "vision", [], 0.0)
    assert report.from_ == end - timedelta(days=1) and report.to == end
    assert report.currency


async def test_list_pending(sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster) -> None:
    job = await scheduler.submit(["true"], name="waits", team="vision", user="alice")  # no nodes: it waits
    member = sdk(live_gateway.url, await live_gateway.create_token("vision", "alice"))

    async def listed() -> PendingList | None:
        found = await member(lambda c: c.list_pending(job_id=job.id))
        return found if found.jobs else None

    found = await eventually(listed, timeout=20, what="the job in the leader's order")
    assert isinstance(found, PendingList) and found.total == 1 and found.as_of is not None
    entry = found.jobs[0]
    assert (entry.job_id, entry.position, entry.queue_length, entry.queue, entry.held) == (job.id, 1, 1, "default",
                                                                                           False)
    with pytest.raises(PermissionDenied):
        await member(lambda c: c.list_pending(team="nlp"))
