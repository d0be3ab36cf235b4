"""`trainyard usage` against a real gateway and a real scheduler with a real SQLite history holding the scripted
day of tests/scheduler/test_usage: the table, CSV and JSON, --by, --limit, a team's token, usage errors."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, running_cluster
from tests.gateway.test_usage_api import PRICES, at, expected, finished_day
from trainyard_scheduler.archive import archived
from trainyard_scheduler.history.store import HistoryStore

DAY = ("--since", at(0), "--until", at(6))


@pytest.fixture
async def scheduler(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """The CLI's scheduler (conftest), with the scripted day in its history and prices in EUR."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"
    store = await HistoryStore.open(url)
    try:
        await store.archive([archived(job) for job in finished_day()])
    finally:
        await store.close()
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "scheduler", state_root=tmp_path / "nodes",
                               history_url=url, usage_prices=PRICES, usage_currency="EUR") as cluster:
        yield cluster


async def test_a_table_by_team_with_the_total_and_what_has_no_price(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("usage", *DAY)
    assert r.rc == 0, r.err
    title, header, *rows, footnote = r.out.splitlines()
    assert title.startswith("usage from ") and title.endswith(", by team")
    assert header.split() == ["TEAM", "GPU-HOURS", "CPU-HOURS", "COST", "(EUR)"]
    assert [row.split() for row in rows] == [["nlp", "66.00", "32.00", "160.00"],
                                             ["vision", "52.00", "288.00", "100.00"],
                                             ["TOTAL", "118.00", "320.00", "260.00"]]
    assert footnote.startswith("no price for A100+H100, L40S: 10.00 GPU-hours counted at cost 0")


async def test_csv_has_one_row_per_group_at_full_precision(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("usage", *DAY, "--by", "project", "--output", "csv")
    assert r.rc == 0, r.err
    header, *records = list(csv.reader(io.StringIO(r.out)))
    assert header == ["project", "gpu_hours", "cpu_hours", "cost", "currency", "unpriced_gpu_hours"]
    want = expected(0, 6, "project")
    assert {g: {"gpu_hours": float(gh), "cpu_hours": float(ch), "cost": float(cost), "unpriced_gpu_hours": float(u)}
            for g, gh, ch, cost, cur, u in records} == want
    assert {rec[4] for rec in records} == {"EUR"}


async def test_json_is_the_apis_answer(cli: Any, gateway: RunningGateway) -> None:
    async with gateway.client(gateway.admin_token) as http:
        api = (await http.get("/v1/usage", params={"from": at(1), "to": at(5), "group_by": "model"})).json()
    for flag in (("--output", "json"), ("--json",)):
        r = await cli("usage", "--since", at(1), "--until", at(5), "--by", "model", *flag)
        assert r.rc == 0, r.err
        body = json.loads(r.out)
        assert {k: v for k, v in body.items() if k != "computed_at"} == \
            {k: v for k, v in api.items() if k != "computed_at"}


async def test_limit_and_a_teams_token(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("usage", *DAY, "--by", "job", "--limit", "2")
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert [line.split()[0] for line in lines[2:5]] == ["job-c", "job-a", "TOTAL"]
    assert "the 2 largest of 6 groups (--limit); TOTAL covers all" in r.out
    alice = await gateway.create_token("vision", "alice", role="viewer")
    r = await cli("usage", *DAY, "--by", "user", "--token", alice)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[0].startswith("usage of team vision from ")
    assert [line.split()[0] for line in r.out.splitlines()[2:5]] == ["alice", "bob", "TOTAL"]
    r = await cli("usage", "--team", "nlp", "--token", alice)
    assert r.rc == 1 and r.err.strip() == "error: a token of team vision may read only that team's usage, not nlp's"


async def test_an_empty_window_and_usage_errors(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("usage", "--since", at(-10), "--until", at(-9))
    assert r.rc == 0 and r.out.splitlines()[-1] == "no use in this window"
    for argv, message in [(("--since", "yesterday"), "expected a duration like 1h"),
                          (("--by", "account"), "invalid choice: 'account'"),
                          (("--output", "yaml"), "invalid choice: 'yaml'"),
                          (("--limit", "0"), "--limit must be from 1 to 10000"),
                          (("--since", "1h", "--until", "2h"), "is after --until")]:
        r = await cli("usage", *argv)
        assert r.rc == 2 and message in r.err, (argv, r.err)
