"""`trainyard audit` against a real gateway and scheduler: filters, paging up to --limit, JSON output, usage
errors, and the operator-only refusal."""

from __future__ import annotations

import json
from typing import Any

from tests.gateway.support import RunningGateway

JOB = {"name": "audited", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}


async def test_audit_shows_who_did_what(cli: Any, gateway: RunningGateway) -> None:
    alice = await gateway.create_token("vision", "alice", role="member")
    async with gateway.client(alice) as http:
        job_ids = [(await http.post("/v1/jobs", json=JOB)).json()["id"] for _ in range(3)]
        assert (await http.post(f"/v1/jobs/{job_ids[0]}:cancel")).status_code == 200

    r = await cli("audit", "--user", "alice", "--since", "1h")
    assert r.rc == 0, r.err
    header, *rows = r.out.splitlines()
    assert header.split() == ["TIME", "PRINCIPAL", "ROLE", "ACTION", "TARGET", "RESULT", "REQUEST", "ID"]
    assert len(rows) == 4
    assert "POST /v1/jobs/{job_id}:cancel" in rows[0] and f"job/{job_ids[0]}" in rows[0]
    assert all("user:vision/alice" in row and " ok " in row for row in rows)

    r = await cli("audit", "--user", "alice", "--action", "POST /v1/jobs", "--limit", "2", "--output", "json")
    assert r.rc == 0, r.err
    entries = json.loads(r.out)["entries"]
    assert [e["target"] for e in entries] == [f"job/{job_ids[2]}", f"job/{job_ids[1]}"]

    r = await cli("audit", "--target", f"job/{job_ids[0]}", "--json")
    # Both services' entries of the job: the gateway's HTTP routes and the scheduler's RPCs they called.
    assert {e["action"] for e in json.loads(r.out)["entries"]} == {
        "POST /v1/jobs", "POST /v1/jobs/{job_id}:cancel", "/trainyard.scheduler.v1.JobService/SubmitJob",
        "/trainyard.scheduler.v1.JobService/CancelJob"}

    async with gateway.client(alice) as http:
        reply = await http.post("/v1/jobs", json=JOB, headers={"X-Request-Id": "req-cli-1"})
    r = await cli("audit", "--request-id", "req-cli-1", "--json")
    assert sorted((e["service"], e["request_id"]) for e in json.loads(r.out)["entries"]) == [
        ("gateway", "req-cli-1"), ("scheduler", "req-cli-1")], "every service the request reached"
    assert reply.status_code == 201

    r = await cli("audit", "--user", "nobody")
    assert (r.rc, r.out.strip()) == (0, "no audit entries match")


async def test_audit_usage_errors_and_refusal(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("audit", "--since", "yesterday")
    assert r.rc == 2 and "expected a duration like 1h" in r.err
    r = await cli("audit", "--limit", "0")
    assert r.rc == 2 and "--limit must be at least 1" in r.err
    alice = await gateway.create_token("vision", "alice", role="member")
    r = await cli("audit", "--token", alice)
    assert r.rc == 1 and r.err.startswith("error:")
