"""GET /v1/pending through the real gateway, scheduler (leader) and two real agents of 4 GPUs each: the queue in
the leader's order, places per queue, reasons, held jobs last, team scoping (places still count other teams'
jobs), the operator's view, and the 4xx answers; the CLI's `submit --wait` progress line names the place."""

from __future__ import annotations

import sys

import httpx
import pytest

from trainyard_core.testing.wait import eventually

from .support import Cluster, RunningGateway

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _spec(name: str, *, priority: int = 0) -> dict[str, object]:
    return {"name": name, "command": SLEEP, "priority": priority, "resources": {"nodes": 1, "gpus_per_node": 4}}


async def test_the_queue_in_order_with_places_reasons_and_scopes(cluster_gateway: RunningGateway,
                                                                  cluster: Cluster) -> None:
    alice = await cluster_gateway.create_token("vision", "alice", role="admin")
    nora = await cluster_gateway.create_token("nlp", "nora")
    ops = cluster_gateway.admin_token  # the bootstrap operator token
    async with cluster_gateway.client(alice) as vision, cluster_gateway.client(nora) as nlp, \
            cluster_gateway.client(ops) as operator:
        running = [(await vision.post("/v1/jobs", json=_spec(f"run-{i}"))).json()["id"] for i in range(2)]
        for job_id in running:  # both nodes full
            await eventually(lambda j=job_id: _in_state(vision, j, "running"), timeout=60, what=f"{job_id} running")
        first = (await vision.post("/v1/jobs", json=_spec("first"))).json()["id"]
        theirs = (await nlp.post("/v1/jobs", json=_spec("theirs"))).json()["id"]
        urgent = (await vision.post("/v1/jobs", json=_spec("urgent", priority=9))).json()["id"]
        held = (await vision.post("/v1/jobs", json=_spec("held"))).json()["id"]
        assert (await vision.post(f"/v1/jobs/{held}:hold", json={"reason": "data"})).status_code == 200

        seen: list[object] = []

        async def ordered(expected: list[str]) -> bool:
            answer = await operator.get("/v1/pending")
            seen[:] = [answer.status_code, answer.json()]
            return [e["job_id"] for e in answer.json().get("jobs", [])] == expected
        # The priority job first; then fair share: team nlp holds no GPU, vision holds both nodes, so nlp's job
        # goes before vision's older one; the held job last, with no place.
        try:
            await eventually(lambda: ordered([urgent, theirs, first, held]), timeout=30, what="the queue's order")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last answer: {seen}") from None

        everyone = (await operator.get("/v1/pending")).json()
        assert everyone["total"] == 4 and everyone["as_of"]
        by_id = {e["job_id"]: e for e in everyone["jobs"]}
        assert [by_id[j]["position"] for j in (urgent, theirs, first, held)] == [1, 2, 3, 0]
        assert {e["queue_length"] for e in everyone["jobs"]} == {3}
        assert "4 free" in by_id[first]["reason"], by_id[first]["reason"]
        assert by_id[held]["held"] and "held by alice" in by_id[held]["reason"]
        assert (by_id[theirs]["team"], by_id[theirs]["user"], by_id[theirs]["queue"]) == ("nlp", "nora", "default")

        # A team sees its own jobs; their places count the other team's jobs ahead.
        mine = (await nlp.get("/v1/pending")).json()
        assert [(e["job_id"], e["position"]) for e in mine["jobs"]] == [(theirs, 2)] and mine["total"] == 1
        refused = await nlp.get("/v1/pending", params={"team": "vision"})
        assert refused.status_code == 403 and "only that team's jobs" in refused.json()["error"]["message"]
        one = (await vision.get("/v1/pending", params={"job_id": first})).json()
        assert [e["job_id"] for e in one["jobs"]] == [first]
        page = (await operator.get("/v1/pending", params={"limit": 2, "team": "vision"})).json()
        assert [e["job_id"] for e in page["jobs"]] == [urgent, first] and page["total"] == 3
        assert (await operator.get("/v1/pending", params={"queue": "other"})).json()["jobs"] == []

        # Placed jobs leave it: cancel a running job, and the first in line takes its node.
        assert (await vision.post(f"/v1/jobs/{running[0]}:cancel")).status_code == 200
        await eventually(lambda: ordered([theirs, first, held]), timeout=60, what="the first in line placed")
        assert await _in_state(vision, urgent, "running") or await _in_state(vision, urgent, "admitted")


@pytest.mark.parametrize(("params", "field"), [({"limit": 0}, "limit"), ({"limit": 1001}, "limit"),
                                                ({"queue": "Bad Queue"}, "queue"), ({"job_id": "../x"}, "job_id"),
                                                ({"team": "UPPER"}, "team")])
async def test_bad_parameters_are_refused_with_the_field_named(live_gateway: RunningGateway, params: dict[str, object],
                                                               field: str) -> None:
    token = await live_gateway.create_token("vision", "alice")
    async with live_gateway.client(token) as http:
        answer = await http.get("/v1/pending", params=params)
    assert answer.status_code == 400, answer.text
    assert field in answer.text


async def test_without_a_token_the_queue_is_not_shown(live_gateway: RunningGateway) -> None:
    async with live_gateway.client(None) as http:
        assert (await http.get("/v1/pending")).status_code == 401


async def _in_state(http: httpx.AsyncClient, job_id: str, state: str) -> bool:
    return bool((await http.get(f"/v1/jobs/{job_id}")).json()["state"] == state)
