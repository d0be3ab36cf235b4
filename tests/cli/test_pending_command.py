"""`trainyard pending` against a real gateway and a real scheduler without nodes (every job waits): the table in
queue order with places and reasons, one job, JSON, a team's token, and the usage errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway
from trainyard_core.testing.wait import eventually


async def test_the_queue_as_a_table_one_job_and_json(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    older = await scheduler.submit(["true"], name="older", team="vision", user="alice")
    newer = await scheduler.submit(["true"], name="newer", team="vision", user="bob")

    async def listed() -> bool:
        r = await cli("pending")
        return r.rc == 0 and "2 pending" in r.out

    await eventually(listed, timeout=20, what="both jobs in the leader's order")
    r = await cli("pending")
    header, *rows, footer = r.out.splitlines()
    assert header.split()[:6] == ["JOB", "QUEUE", "PLACE", "TEAM", "USER", "WAITING"]
    assert [row.split()[:5] for row in rows] == [[older.id, "default", "1/2", "vision", "alice"],
                                                [newer.id, "default", "2/2", "vision", "bob"]]
    assert all("no accelerator in the fleet matches" in row for row in rows), r.out
    assert footer.startswith("2 pending; as of ")

    r = await cli("pending", "--job", newer.id)
    assert r.rc == 0 and [row.split()[0] for row in r.out.splitlines()[1:-1]] == [newer.id]
    r = await cli("pending", "--json", "--limit", "1")
    body = json.loads(r.out)
    assert [e["job_id"] for e in body["jobs"]] == [older.id] and body["total"] == 2


async def test_a_team_token_sees_its_own_team(cli: Any, gateway: RunningGateway, scheduler: Cluster,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    await scheduler.submit(["true"], name="theirs", team="nlp", user="nora")
    mine = await scheduler.submit(["true"], name="mine", team="vision", user="alice")
    monkeypatch.setenv("TRAINYARD_TOKEN", await gateway.create_token("vision", "alice"))

    async def listed() -> bool:
        return "1 pending" in (await cli("pending")).out

    await eventually(listed, timeout=20, what="the team's job in the leader's order")
    rows = (await cli("pending")).out.splitlines()[1:-1]
    assert [row.split()[:3] for row in rows] == [[mine.id, "default", "2/2"]]  # nlp's job is ahead of it
    r = await cli("pending", "--team", "nlp")
    assert r.rc != 0 and "only that team's jobs" in r.err


@pytest.mark.parametrize("limit", ["0", "1001"])
async def test_a_limit_out_of_range_is_a_usage_error(cli: Any, limit: str) -> None:
    r = await cli("pending", "--limit", limit)
    assert r.rc == 2 and "--limit must be from 1 to 1000" in r.err
