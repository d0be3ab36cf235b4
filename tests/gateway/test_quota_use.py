"""Quotas show what their team holds now: a real scheduler with two real agents (4 simulated A100s each),
gangs placed within the quota and on borrowed capacity, read through the gateway as the team and as an
operator; the use falls back once a gang's allocation is gone."""

from __future__ import annotations

from trainyard.common.v1 import types_pb2
from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway, python

SLEEP = python("import time; time.sleep(120)")
A100 = "A100-SXM4-40GB"


async def test_quota_use_counts_guaranteed_and_borrowed_gangs(cluster: Cluster,
                                                              cluster_gateway: RunningGateway) -> None:
    gw = cluster_gateway
    alice = await gw.create_token("vision", "alice")
    async with gw.client(gw.admin_token) as admin, gw.client(alice) as user:
        put = await admin.put("/v1/quotas/vision", json={"limits": {A100: {"nominal": 2, "borrow_limit": 4}}})
        assert put.status_code == 201 and put.json()["use"] == {}, put.text
        nlp = await admin.put("/v1/quotas/nlp", json={"limits": {"*": {"nominal": 4}}})
        assert nlp.status_code == 201, nlp.text

        within = await cluster.submit(SLEEP, name="within", gpus=2)
        await cluster.wait_state(within.id, types_pb2.JOB_STATE_RUNNING)
        above = await cluster.submit(SLEEP, name="above", gpus=2)  # 2 held + 2 > nominal 2: borrowed
        await cluster.wait_state(above.id, types_pb2.JOB_STATE_RUNNING)
        other = await cluster.submit(SLEEP, name="nlp", gpus=1, team="nlp", user="bob")  # under nlp's "*"
        await cluster.wait_state(other.id, types_pb2.JOB_STATE_RUNNING)

        mine = await user.get("/v1/quotas/vision")
        assert mine.status_code == 200, mine.text
        assert mine.json()["use"] == {A100: {"in_use": 4, "borrowed": 2}}
        assert mine.json()["limits"] == {A100: {"nominal": 2, "borrow_limit": 4}}
        listed = {q["team"]: q["use"] for q in (await admin.get("/v1/quotas")).json()["quotas"]}
        assert listed == {"vision": {A100: {"in_use": 4, "borrowed": 2}}, "nlp": {"*": {"in_use": 1, "borrowed": 0}}}
        assert [q["team"] for q in (await user.get("/v1/quotas")).json()["quotas"]] == ["vision"]

        cancelled = await user.post(f"/v1/jobs/{above.id}:cancel")
        assert cancelled.status_code == 200, cancelled.text
        await cluster.wait_state(above.id, types_pb2.JOB_STATE_CANCELLED)

        async def released() -> dict[str, object] | None:
            use: dict[str, object] = (await user.get("/v1/quotas/vision")).json()["use"]
            return use if use == {A100: {"in_use": 2, "borrowed": 0}} else None

        await eventually(released, timeout=30, what="the cancelled gang's GPUs to leave vision's use")
