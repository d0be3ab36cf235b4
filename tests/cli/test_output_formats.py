"""`--output table|wide|json|yaml` (`-o`) on the listing and get commands, against a real gateway: json and yaml
are the same value (the gateway's answer; `--json` is `-o json`), wide is the table with more columns."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.gateway.support import Cluster, RunningGateway
from trainyard.common.v1 import types_pb2


async def test_json_and_yaml_are_the_same_answer(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    job = await scheduler.submit(["true"], team="vision", user="alice", name="formats")
    # Compared once it has ended: a job still moving (admitted, running, done) reads differently between reads.
    await scheduler.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    assert (await cli("quotas", "set", "vision", "--limit", "*=8")).rc == 0
    for argv in (("jobs",), ("status", job.id), ("queues",), ("queues", "list"), ("quotas",), ("quotas", "get",
                 "vision"), ("tokens", "list"), ("nodes", "get", "node-a")):
        as_json = await cli(*argv, "-o", "json")
        as_yaml = await cli(*argv, "--output", "yaml")
        legacy = await cli(*argv, "--json")
        assert as_json.rc == as_yaml.rc == legacy.rc == 0, (argv, as_json.err, as_yaml.err)
        answers = [yaml.safe_load(as_yaml.out), json.loads(as_json.out), json.loads(legacy.out)]
        if argv[0] == "nodes":  # the heartbeat's time moves between the reads; the rest must not
            for node in answers:
                assert node.pop("last_heartbeat")
        assert answers[0] == answers[1] == answers[2], argv
    assert json.loads((await cli("status", job.id, "-o", "json")).out)["name"] == "formats"


async def test_wide_adds_columns(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    job = await scheduler.submit(["true"], team="vision", user="alice", name="wide")
    plain = (await cli("jobs")).out.splitlines()
    wide = (await cli("jobs", "-o", "wide")).out.splitlines()
    assert plain[0].split() == ["ID", "NAME", "STATE", "GPUS", "TEAM/USER", "AGE"]
    assert wide[0].split() == [*plain[0].split(), "QUEUE", "PRIORITY", "ATTEMPT", "NODES", "MESSAGE"]
    assert wide[1].split()[:2] == [job.id, "wide"] and wide[1].split()[6:8] == ["default", "0"]
    # The two node listings are compared column by column: the job must not hold a GPU in one and not the other.
    await scheduler.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    plain = (await cli("nodes")).out.splitlines()
    wide = (await cli("nodes", "list", "--output", "wide")).out.splitlines()
    assert wide[0].startswith(plain[0]) and "HEARTBEAT" in wide[0] and "CORDON REASON" in wide[0]
    assert wide[1].split()[:4] == plain[1].split() and wide[1].split()[4:7] == ["-", *wide[1].split()[5:7]]


@pytest.mark.parametrize("argv", [("jobs", "-o", "xml"), ("nodes", "--output", "csv")])
async def test_an_unknown_format_is_a_usage_error(cli: Any, argv: tuple[str, ...]) -> None:
    r = await cli(*argv)
    assert r.rc == 2 and "invalid choice" in r.err


def test_quota_table_shows_use_beside_the_limits() -> None:
    from io import StringIO

    from trainyard_cli.output import quotas_table

    out = StringIO()
    quotas_table([{"team": "vision", "weight": 1.0, "limits": {"A100": {"nominal": 2, "borrow_limit": None}},
                   "use": {"A100": {"in_use": 4, "borrowed": 2}, "L40S": {"in_use": 1, "borrowed": 1}}},
                  {"team": "nlp", "weight": 2.0, "limits": {}, "use": {}}], out)
    assert out.getvalue().splitlines() == [
        "TEAM    WEIGHT  MODEL  NOMINAL  BORROW LIMIT  IN USE  BORROWED",
        "vision  1       A100   2        unlimited     4       2",
        "vision  1       L40S   -        -             1       1",
        "nlp     2       -      -        -             0       0"]
