"""Every admin write that logs, through the gateway to the real scheduler (and agents), with logging as in
production: INFO, each record formatted by the JSON formatter (tests/conftest.py). Issue 11: PUT
/v1/queues/{name} and PUT /v1/quotas/{team} answered 503 while the write was stored, because the
scheduler's "queue stored" line passed `extra={"created": ...}` (a LogRecord attribute) and the standard
library raised KeyError from inside the handler; with the tests' root level at WARNING, info() never built
the record, so no test saw it."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from trainyard_core.logs import JsonFormatter

from .support import Cluster, RunningGateway

QUOTA: dict[str, Any] = {"weight": 2.0, "limits": {"*": {"nominal": 8, "borrow_limit": 4}}}


def json_lines(caplog: pytest.LogCaptureFixture, msg: str) -> list[dict[str, Any]]:
    formatter = JsonFormatter("test")
    return [json.loads(formatter.format(r)) for r in caplog.records if r.getMessage() == msg]


async def test_queue_and_quota_writes_answer_and_log_at_info(live_gateway: RunningGateway,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    assert logging.getLogger().getEffectiveLevel() <= logging.INFO  # what hid the bug when it was WARNING
    async with live_gateway.client(live_gateway.admin_token) as admin:
        created = await admin.put("/v1/queues/batch", json={"tier": 1, "max_gpus": 8})
        assert created.status_code == 201, created.text
        replaced = await admin.put("/v1/queues/batch", json={"tier": 2})
        assert replaced.status_code == 200, replaced.text
        queues = {q["name"]: q for q in (await admin.get("/v1/queues")).json()["queues"]}
        assert queues["batch"] == {"name": "batch", "tier": 2, "max_gpus": 0, "node_labels": {}, "description": ""}

        created = await admin.put("/v1/quotas/vision", json=QUOTA)
        assert created.status_code == 201, created.text
        replaced = await admin.put("/v1/quotas/vision", json={**QUOTA, "weight": 3.0})
        assert replaced.status_code == 200, replaced.text
        stored = await admin.get("/v1/quotas/vision")
        assert stored.status_code == 200 and stored.json()["weight"] == 3.0, stored.text
        assert stored.json()["limits"] == {"*": {"nominal": 8, "borrow_limit": 4}}

        assert (await admin.delete("/v1/queues/batch")).status_code == 200
        assert (await admin.delete("/v1/quotas/vision")).status_code == 200
        assert (await admin.get("/v1/quotas/vision")).status_code == 404

    # Both the gateway's and the scheduler's line for each write, created then replaced.
    for msg, name_key, name in (("queue stored", "queue", "batch"), ("quota stored", "team", "vision")):
        lines = json_lines(caplog, msg)
        by_logger: dict[str, list[bool]] = {}
        for line in lines:
            assert line[name_key] == name and line["level"] == "info", line
            by_logger.setdefault(line["logger"].split(".")[0], []).append(line["was_created"])
        assert by_logger == {"trainyard_gateway": [True, False], "trainyard_scheduler": [True, False]}, lines
    for msg in ("queue deleted", "quota deleted"):
        assert {line["logger"].split(".")[0] for line in json_lines(caplog, msg)} == {
            "trainyard_gateway", "trainyard_scheduler"}


async def test_node_admin_writes_answer_and_log_at_info(cluster: Cluster, cluster_gateway: RunningGateway,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    async with cluster_gateway.client(cluster_gateway.admin_token) as admin:
        cordoned = await admin.post("/v1/nodes/node-a:cordon", json={"reason": "replacing a fan"})
        assert cordoned.status_code == 200 and cordoned.json()["cordoned"] is True, cordoned.text
        uncordoned = await admin.post("/v1/nodes/node-a:uncordon")
        assert uncordoned.status_code == 200 and uncordoned.json()["cordoned"] is False, uncordoned.text
        health = await admin.post("/v1/nodes/node-b/gpus/1:set-health", json={"healthy": False, "reason": "test"})
        assert health.status_code == 200, health.text
        assert (await admin.get("/v1/nodes/node-b")).json()["gpus"][1]["health"] != "healthy"

    (line,) = json_lines(caplog, "node cordoned")
    assert (line["node_id"], line["reason"]) == ("node-a", "replacing a fan")
    assert [line["node_id"] for line in json_lines(caplog, "node uncordoned")] == ["node-a"]
    (line,) = json_lines(caplog, "GPU health set by operator")
    assert (line["node_id"], line["gpu"], line["healthy"]) == ("node-b", 1, False)
