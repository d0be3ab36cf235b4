"""`trainyard queues`, `trainyard quotas` and the new submit flags against a real gateway and real scheduler
servicers (gRPC) over a real etcd: tables, --json, exit codes and the API's refusals."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.gateway.policy_support import policy_endpoint
from tests.gateway.support import Cluster, RunningGateway, running_gateway


@pytest.fixture
async def policy_gateway(etcd_settings: dict[str, str], key_prefix: str, scheduler: Cluster,
                         monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunningGateway]:
    async with policy_endpoint(scheduler) as address, running_gateway(
            etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"), scheduler_address=address) as gw:
        monkeypatch.setenv("TRAINYARD_URL", gw.url)
        monkeypatch.setenv("TRAINYARD_TOKEN", gw.admin_token)
        yield gw


async def test_queues(cli: Any, policy_gateway: RunningGateway) -> None:
    r = await cli("queues")
    assert r.rc == 0, r.err
    assert r.out.splitlines() == ["QUEUE    TIER  MAX GPUS  NODE LABELS  DESCRIPTION", "default  0     -         -"]
    r = await cli("queues", "set", "batch", "--tier", "-10", "--max-gpus", "64", "--node-label", "pool=spot",
                  "--node-label", "zone=a", "--description", "cheap")
    assert r.rc == 0, r.err
    assert r.out.splitlines()[1].split() == ["batch", "-10", "64", "pool=spot,zone=a", "cheap"]
    r = await cli("queues", "list", "--json")
    assert [q["name"] for q in json.loads(r.out)["queues"]] == ["batch", "default"]

    r = await cli("submit", "--name", "q", "--queue", "batch", "--", "true")
    assert r.rc == 0, r.err
    r = await cli("queues", "delete", "batch")
    assert r.rc == 1 and "queue batch is used by 1 unfinished job" in r.err
    r = await cli("queues", "delete", "default")
    assert r.rc == 1 and '"default" cannot be deleted' in r.err

    alice = await policy_gateway.create_token("vision", "alice")
    r = await cli("queues", "set", "mine", "--token", alice)
    assert r.rc == 1 and "queues.write needs the operator role" in r.err
    r = await cli("queues", "--token", alice)
    assert r.rc == 0 and "batch" in r.out  # anyone may list them


async def test_quotas(cli: Any, policy_gateway: RunningGateway) -> None:
    r = await cli("quotas")
    assert r.rc == 0 and r.out.startswith("no quotas")
    r = await cli("quotas", "set", "vision", "--limit", "H100-80GB-HBM3=64:32", "--limit", "*=8", "--weight", "2")
    assert r.rc == 0, r.err
    assert r.out.splitlines() == [
        "TEAM    WEIGHT  MODEL           NOMINAL  BORROW LIMIT  IN USE  BORROWED",
        "vision  2       H100-80GB-HBM3  64       32            0       0",
        "vision  2       * (any)         8        unlimited     0       0"]
    r = await cli("quotas", "set", "nlp", "--json")
    assert r.rc == 0 and json.loads(r.out) == {"team": "nlp", "weight": 1.0, "limits": {}, "use": {}}
    r = await cli("quotas", "--json")
    assert [q["team"] for q in json.loads(r.out)["quotas"]] == ["nlp", "vision"]

    alice = await policy_gateway.create_token("vision", "alice")
    r = await cli("quotas", "--token", alice, "--json")
    assert [q["team"] for q in json.loads(r.out)["quotas"]] == ["vision"]
    r = await cli("quotas", "get", "nlp", "--token", alice)
    assert r.rc == 1 and "only that team's quota" in r.err
    r = await cli("quotas", "set", "vision", "--weight", "9", "--token", alice)
    assert r.rc == 1 and "quotas.write needs the operator role" in r.err

    r = await cli("quotas", "set", "vision", "--weight", "0")
    assert r.rc == 1 and r.err.startswith("error: weight:")
    r = await cli("quotas", "delete", "nlp")
    assert (r.rc, r.out.strip()) == (0, "deleted the quota of team nlp")
    r = await cli("quotas", "get", "nlp")
    assert r.rc == 1 and "team nlp has no quota" in r.err


async def test_submit_with_the_new_flags_round_trips(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    r = await cli("submit", "--name", "big", "--nodes", "2", "--gpus-per-node", "4",
                  "--accelerators", "H100-80GB-HBM3,A100-SXM4-80GB", "--min-cc", "8.0", "--allow-mixed",
                  "--priority-class", "high", "--topology-tier", "leaf", "--topology-required",
                  "--preempt-signal", "SIGUSR1", "--preempt-grace", "1m", "--restart-backoff", "0",
                  "--time-limit", "1h30m", "--max-restarts", "2", "--json", "--", "python", "train.py")
    assert r.rc == 0, r.err
    job = json.loads(r.out)
    (stored,) = await scheduler.list_jobs()
    assert list(stored.spec.resources.accelerators) == ["H100-80GB-HBM3", "A100-SXM4-80GB"]
    assert (stored.spec.topology.tier, stored.spec.topology.required, stored.spec.preemption.signal,
            stored.spec.preemption.grace_s, stored.spec.time_limit_s) == ("leaf", True, "SIGUSR1", 60.0, 5400.0)
    assert stored.spec.HasField("restart_backoff_s") and stored.spec.restart_backoff_s == 0.0

    r = await cli("status", job["id"])
    assert r.rc == 0, r.err
    lines = dict(line.split(":", 1) for line in r.out.splitlines() if ":" in line and not line.startswith(" "))
    assert lines["resources"].strip() == ("2 node(s) x 4 GPU(s) of H100-80GB-HBM3 or A100-SXM4-80GB, "
                                          "cc >= 8.0, models may mix")
    assert lines["queue"].strip() == "default, class high"
    assert lines["topology"].strip() == "within one leaf (required)"
    assert (lines["limit"].strip(), lines["restarts"].strip()) == ("1h30m per attempt", "0 of 2")

    r = await cli("submit", "--name", "bad", "--priority-class", "vip", "--", "true")
    assert r.rc == 1 and "priority_class 'vip' is not defined" in r.err
