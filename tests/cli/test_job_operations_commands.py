"""`trainyard hold|release|requeue|priority|resubmit` against a real gateway and scheduler (and, to requeue a
running job, a real agent on simulated GPUs): output, --json, exit codes, and how `--set`/`--unset` become the
merge patch the gateway applies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, python
from trainyard.common.v1 import types_pb2
from trainyard_cli.errors import UsageError
from trainyard_cli.jobops import build_overrides
from trainyard_core.testing.wait import eventually

SLEEP = python("import time; time.sleep(120)")


def test_set_and_unset_become_a_merge_patch_of_the_spec() -> None:
    patch = build_overrides(
        ["nodes=4", "gpus-per-node=2", "resources.accelerators=H100-80GB-HBM3, A100-SXM4-80GB", "env.LR=1e-4",
         "labels.team.x/y=z", "time_limit_s=1h30m", "topology.tier=leaf", "topology.required=true",
         "preemption.signal=usr1", "resources.speed_hints.H100-80GB-HBM3=2.5", "command=python train.py --lr 3",
         "priority=-5"],
        ["env.DEBUG", "checkpoint.keep_last"])
    assert patch == {
        "resources": {"nodes": 4, "gpus_per_node": 2, "accelerators": ["H100-80GB-HBM3", "A100-SXM4-80GB"],
                      "speed_hints": {"H100-80GB-HBM3": 2.5}},
        "env": {"LR": "1e-4", "DEBUG": None}, "labels": {"team.x/y": "z"}, "time_limit_s": 5400.0,
        "topology": {"tier": "leaf", "required": True}, "preemption": {"signal": "SIGUSR1"},
        "command": ["python", "train.py", "--lr", "3"], "priority": -5, "checkpoint": {"keep_last": None}}


@pytest.mark.parametrize(("sets", "unsets", "words"), [
    (["color=blue"], [], "unknown key 'color'"),
    (["nodes"], [], "--set expects KEY=VALUE"),
    (["nodes=four"], [], "--set resources.nodes: invalid literal"),
    (["topology.required=maybe"], [], "expected true or false"),
    (["time_limit_s=soon"], [], "expected seconds or a duration"),
    ([], ["env."], "unknown key 'env.'"),
])
def test_bad_set_items_are_usage_errors(sets: list[str], unsets: list[str], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        build_overrides(sets, unsets)


async def test_hold_release_priority_and_resubmit(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    r = await cli("submit", "--name", "base", "--env", "LR=0.1", "--env", "DEBUG=1", "--", "python", "train.py")
    assert r.rc == 0, r.err
    (job,) = await scheduler.list_jobs()

    r = await cli("hold", job.id, "--reason", "waiting for data")
    assert (r.rc, r.out.strip()) == (0, f"job {job.id} held by admin: not placed until `trainyard release {job.id}`")
    assert (await scheduler.job(job.id)).hold_reason == "waiting for data"
    r = await cli("status", job.id)
    assert any(line.startswith("held by") and line.endswith("admin: waiting for data") for line in r.out.splitlines())
    r = await cli("release", job.id, "--json")
    assert r.rc == 0 and json.loads(r.out)["held_by"] == ""
    r = await cli("priority", job.id, "42")
    assert (r.rc, r.out.strip()) == (0, f"job {job.id} (pending): priority 42")

    r = await cli("resubmit", job.id, "--set", "nodes=2", "--set", "env.LR=0.01", "--unset", "env.DEBUG",
                  "--set", "name=base-2", "--json")
    assert r.rc == 0, r.err
    again = json.loads(r.out)
    assert (again["name"], again["spec"]["resources"]["nodes"], again["spec"]["env"], again["spec"]["priority"]) == (
        "base-2", 2, {"LR": "0.01"}, 42)
    assert again["spec"]["labels"] == {"resubmitted_from": job.id}
    r = await cli("resubmit", job.id)
    assert r.rc == 0 and r.out.startswith(f"resubmitted {job.id} as job ") and r.out.strip().endswith(": pending")
    r = await cli("status", again["id"])
    assert any(line.startswith("resubmitted from") and line.endswith(job.id) for line in r.out.splitlines())

    # Refusals are one-line errors with exit 1; a bad --set is a usage error, exit 2.
    r = await cli("requeue", job.id)
    assert (r.rc, r.err.strip()) == (1, f"error: job {job.id} is pending: only an admitted or running job can be "
                                        "requeued")
    r = await cli("priority", job.id, "5000")
    assert r.rc == 1 and "priority" in r.err and len(r.err.strip().splitlines()) == 1
    r = await cli("resubmit", job.id, "--set", "colour=blue")
    assert r.rc == 2 and r.err.startswith("error: --set/--unset: unknown key 'colour'")
    r = await cli("hold", "job-nope")
    assert (r.rc, r.err.strip()) == (1, "error: job job-nope not found")


async def test_requeue_of_a_running_job(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a")
    r = await cli("submit", "--name", "sleeper", "--preempt-grace", "2", "--", *SLEEP)
    assert r.rc == 0, r.err
    (job,) = await scheduler.list_jobs()
    await scheduler.wait_state(job.id, types_pb2.JOB_STATE_RUNNING)
    r = await cli("requeue", job.id, "--reason", "new code")
    assert r.rc == 0, r.err
    assert r.out.startswith(f"requeueing job {job.id} (state running): its workers are being stopped")

    async def second() -> types_pb2.Job | None:
        now = await scheduler.job(job.id)
        return now if now.attempt == 2 and now.state in (types_pb2.JOB_STATE_ADMITTED,
                                                         types_pb2.JOB_STATE_RUNNING) else None

    again = await eventually(second, timeout=30, what="attempt 2 to be placed")
    assert again.restarts == 0 and [a.reason for a in again.attempts] == ["requeued by admin"]
    assert (await cli("cancel", job.id)).rc == 0
