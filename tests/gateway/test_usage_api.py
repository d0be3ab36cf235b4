"""GET /v1/usage against a real gateway and a real scheduler (a real agent on simulated GPUs, a real SQLite
history store) (issue 15): the scripted day of tests/scheduler/test_usage in the history, a job running on the
agent; what each role sees, the defaults, what is sent to the scheduler, and every refusal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from trainyard.common.v1 import types_pb2
from trainyard_core import contract as c
from trainyard_core.testing.etcd import free_port
from trainyard_scheduler.archive import archived, usage_of
from trainyard_scheduler.domain.usage import Pricing, Window, summarize
from trainyard_scheduler.history.store import HistoryStore
from trainyard_scheduler.usage_report import interval_of

from ..scheduler.test_usage import T0, H, day
from .support import Cluster, RunningGateway, python, running_cluster, running_gateway

PRICES = {"H100": 2.5, "A100": 1.25, "A100-SXM4-40GB": 1.5}
SLEEP = python("import time; time.sleep(120)")
ROW_KEYS = {"group", "gpu_hours", "cpu_hours", "cost", "unpriced_gpu_hours"}


def at(hours: float) -> str:
    return datetime.fromtimestamp(T0 + hours * H, UTC).isoformat()


def finished_day() -> list[Any]:
    """The day's jobs as the archiver writes them: every finished attempt (job-b's first; its second is not
    in this history)."""
    s = day()
    return [replace(job, finished_at=job.updated_at) for job in s.jobs.values()]


def expected(start_h: float, end_h: float, group_by: str, team: str = "") -> dict[str, dict[str, float]]:
    intervals = [interval_of(r) for job in finished_day() for r in usage_of(job) if not team or job.team == team]
    report = summarize(intervals, Window(T0 + start_h * H, T0 + end_h * H), group_by, Pricing.of(PRICES, "EUR"),
                       T0 + 6 * H)
    return {r.group: {"gpu_hours": r.amount.gpu_hours, "cpu_hours": r.amount.cpu_hours, "cost": r.amount.cost_value,
                      "unpriced_gpu_hours": r.amount.unpriced_gpu_hours} for r in report.rows}


def rows(body: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {r["group"]: {k: v for k, v in r.items() if k != "group"} for r in body["rows"]}


@pytest.fixture
async def cluster(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"
    store = await HistoryStore.open(url)
    try:
        await store.archive([archived(job) for job in finished_day()])
    finally:
        await store.close()
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "usage", state_root=tmp_path / "nodes",
                               agents={"node-a": "a100x4"}, history_url=url, usage_prices=PRICES,
                               usage_currency="EUR") as cl:
        yield cl


@pytest.fixture
async def gw(etcd_settings: dict[str, str], key_prefix: str, cluster: Cluster) -> AsyncIterator[RunningGateway]:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=cluster.address) as g:
        yield g


async def test_operators_see_every_team_and_the_numbers_are_the_domains(gw: RunningGateway, cluster: Cluster) -> None:
    async with gw.client(gw.admin_token) as op:
        reply = await op.get("/v1/usage", params={"from": at(0), "to": at(6)})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert set(body) == {"from", "to", "group_by", "team", "currency", "prices", "rows", "groups", "total",
                             "unpriced_models", "computed_at"}
        assert all(set(r) == ROW_KEYS for r in body["rows"])
        assert rows(body) == expected(0, 6, "team")
        assert rows(body)["vision"] == {"gpu_hours": 52.0, "cpu_hours": 288.0, "cost": 100.0,
                                        "unpriced_gpu_hours": 8.0}
        assert (body["group_by"], body["team"], body["currency"], body["prices"], body["groups"]) == \
            ("team", "", "EUR", PRICES, 2)
        assert body["unpriced_models"] == ["A100+H100", "L40S"]
        assert body["total"] == {"gpu_hours": 118.0, "cpu_hours": 320.0, "cost": 260.0, "unpriced_gpu_hours": 10.0}
        assert datetime.fromisoformat(body["from"]) == datetime.fromtimestamp(T0, UTC)
        assert datetime.fromisoformat(body["to"]) == datetime.fromtimestamp(T0 + 6 * H, UTC)
        for group_by in c.USAGE_GROUPS:
            got = (await op.get("/v1/usage", params={"from": at(0.75), "to": at(4.2), "group_by": group_by})).json()
            assert rows(got) == expected(0.75, 4.2, group_by), group_by
        narrowed = (await op.get("/v1/usage", params={"from": at(0), "to": at(6), "team": "nlp",
                                                      "group_by": "user"})).json()
        assert rows(narrowed) == expected(0, 6, "user", team="nlp") and narrowed["team"] == "nlp"
    sent = cluster.calls.requests("GetUsage")
    assert [(r.team, r.group_by) for r in sent[:2]] == [("", "team"), ("", "team")]
    assert (sent[0].since.seconds, sent[0].until.seconds, sent[0].limit) == (T0, T0 + 6 * H, c.DEFAULT_USAGE_ROWS)
    assert sent[-1].team == "nlp"


async def test_a_boundary_splits_the_day_and_the_halves_add_up(gw: RunningGateway) -> None:
    async with gw.client(gw.admin_token) as op:
        whole, first, second = [(await op.get("/v1/usage", params={"from": at(a), "to": at(b), "group_by": "job"}))
                                .json() for a, b in [(0, 6), (0, 3), (3, 6)]]
    # job-c ran 0.5h-4.5h on 16 H100.
    assert (rows(first)["job-c"]["gpu_hours"], rows(second)["job-c"]["gpu_hours"]) == (40.0, 24.0)
    for key in ("gpu_hours", "cpu_hours", "cost", "unpriced_gpu_hours"):
        assert first["total"][key] + second["total"][key] == pytest.approx(whole["total"][key], rel=1e-12)
        assert sum(r[key] for r in whole["rows"]) == pytest.approx(whole["total"][key], rel=1e-12)


async def test_a_team_sees_only_its_own_use_whatever_its_role(gw: RunningGateway, cluster: Cluster) -> None:
    for role in ("viewer", "member", "admin"):
        token = await gw.create_token("vision", f"v-{role}", role=role)
        async with gw.client(token) as http:
            mine = (await http.get("/v1/usage", params={"from": at(0), "to": at(6)})).json()
            assert rows(mine) == expected(0, 6, "team", team="vision") and mine["team"] == "vision", role
            assert list(rows(mine)) == ["vision"]
            by_user = await http.get("/v1/usage", params={"from": at(0), "to": at(6), "group_by": "user",
                                                          "team": "vision"})
            assert rows(by_user.json()) == expected(0, 6, "user", team="vision")
            other = await http.get("/v1/usage", params={"team": "nlp"})
            assert other.status_code == 403 and "only that team's usage, not nlp's" in other.json()["error"]["message"]
    assert {r.team for r in cluster.calls.requests("GetUsage")} == {"vision"}


async def test_scopes_narrow_usage_like_everything_else(gw: RunningGateway) -> None:
    narrow = await gw.create_token("vision", "ci", role="admin", scopes=["jobs:read"])
    allowed = await gw.create_token("vision", "finance", role="viewer", scopes=["usage:read"])
    async with gw.client(narrow) as http:
        refused = await http.get("/v1/usage")
        assert refused.status_code == 403 and "usage:read" in refused.json()["error"]["message"]
    async with gw.client(allowed) as http:
        assert (await http.get("/v1/usage")).status_code == 200
        assert (await http.get("/v1/jobs")).status_code == 403


async def test_the_default_window_is_the_last_30_days_and_a_running_gang_counts(gw: RunningGateway,
                                                                                 cluster: Cluster) -> None:
    job = await cluster.submit(SLEEP, team="nlp", gpus=2)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_RUNNING)
    before = datetime.now(UTC)
    async with gw.client(gw.admin_token) as op:
        body = (await op.get("/v1/usage", params={"group_by": "job"})).json()
    after = datetime.now(UTC)
    start, end = datetime.fromisoformat(body["from"]), datetime.fromisoformat(body["to"])
    assert before <= end <= after and end - start == timedelta(days=c.DEFAULT_USAGE_WINDOW_DAYS)
    assert list(rows(body)) == [job.id], "the scripted day is years ago; the running job is all there is"
    live = rows(body)[job.id]
    assert live["gpu_hours"] > 0 and live["cost"] == pytest.approx(live["gpu_hours"] * 1.5)
    assert live["unpriced_gpu_hours"] == 0 and body["unpriced_models"] == []
    assert datetime.fromisoformat(body["computed_at"]) <= after + timedelta(seconds=1)
    # A window that ends when the job was submitted (before its gang was placed) holds none of it.
    submitted = job.created_at.ToDatetime(tzinfo=UTC)
    async with gw.client(gw.admin_token) as op:
        earlier = (await op.get("/v1/usage", params={"to": submitted.isoformat(), "group_by": "job"})).json()
    assert earlier["rows"] == []


async def test_a_window_that_ends_before_it_starts_holds_nothing(gw: RunningGateway, cluster: Cluster) -> None:
    async with gw.client(gw.admin_token) as op:
        reply = await op.get("/v1/usage", params={"from": at(6), "to": at(0)})
    body = reply.json()
    assert reply.status_code == 200 and body["rows"] == [] and body["groups"] == 0
    assert body["total"] == {"gpu_hours": 0.0, "cpu_hours": 0.0, "cost": 0.0, "unpriced_gpu_hours": 0.0}
    assert (datetime.fromisoformat(body["from"]), datetime.fromisoformat(body["to"])) == \
        (datetime.fromtimestamp(T0 + 6 * H, UTC), datetime.fromtimestamp(T0, UTC))
    assert body["currency"] == "EUR"
    (sent,) = cluster.calls.requests("GetUsage")
    assert sent.since == sent.until  # the empty window at its start


async def test_the_limit_keeps_the_largest_groups_and_every_total(gw: RunningGateway) -> None:
    async with gw.client(gw.admin_token) as op:
        body = (await op.get("/v1/usage", params={"from": at(0), "to": at(6), "group_by": "job", "limit": 2})).json()
    assert [r["group"] for r in body["rows"]] == ["job-c", "job-a"] and body["groups"] == 6
    assert body["total"]["gpu_hours"] == 118.0


@pytest.mark.parametrize(("params", "field"), [
    ({"from": "2026-01-31T12:00:00"}, "from"),  # no time zone
    ({"to": "yesterday"}, "to"),
    ({"from": "1700000000"}, "from"),  # a number is no RFC 3339 time
    ({"to": "2026-02-30T00:00:00Z"}, "to"),
    ({"group_by": "account"}, "group_by"),
    ({"group_by": ""}, "group_by"),
    ({"team": "Not_A_Team"}, "team"),
    ({"limit": "0"}, "limit"),
    ({"limit": str(c.MAX_USAGE_ROWS + 1)}, "limit"),
    ({"limit": "ten"}, "limit"),
])
async def test_malformed_requests_are_refused_with_400_naming_the_field(gw: RunningGateway, cluster: Cluster,
                                                                        params: dict[str, str], field: str) -> None:
    async with gw.client(gw.admin_token) as op:
        reply = await op.get("/v1/usage", params=params)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_argument" and field in error["message"]
    assert cluster.calls.requests("GetUsage") == [], "refused before the scheduler is asked"


async def test_without_a_token_401_and_without_a_scheduler_503(etcd_settings: dict[str, str],
                                                               key_prefix: str) -> None:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}") as g:
        async with g.client() as anonymous:
            assert (await anonymous.get("/v1/usage")).status_code == 401
        async with g.client(g.admin_token) as op:
            down = await op.get("/v1/usage")
        assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable"
