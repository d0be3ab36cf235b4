"""`submit --wait`: the real CLI waits for the job to run, printing where it stands while it waits (state, time
queued, the scheduler's reason, a hold), against a real gateway and scheduler that gets its node only once the
CLI is watching; and the progress line itself (`output.progress`, pure)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, python
from trainyard_cli import commands
from trainyard_cli.output import ordinal, progress, queue_place
from trainyard_core.testing.wait import eventually

SLEEP = python("import time; time.sleep(120)")


async def test_submit_wait_prints_progress_until_the_job_runs(cli: Any, gateway: RunningGateway,
                                                              scheduler: Cluster,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The node comes only once the CLI has been told the job's place: with it any sooner, a fast leader can
    # place the job between the cycle that ordered the queue and the CLI's GET /v1/pending (which then
    # rightly has no place to show), and the line this test looks for would never be printed.
    places: list[str] = []
    real = commands._queue_place

    def recorded(api: Any, job_id: str) -> str:
        places.append(real(api, job_id))
        return places[-1]

    monkeypatch.setattr(commands, "_queue_place", recorded)
    wait = asyncio.create_task(cli("submit", "--wait", "--name", "waits", "--", *SLEEP))

    async def told_its_place() -> bool:
        return "1st of 1 in queue default" in places

    await eventually(told_its_place, what="submit --wait to be told the job's place in the queue")
    assert scheduler.calls.stream_requests("WatchJob")
    await scheduler.add_agent("node-a")
    r = await asyncio.wait_for(wait, 30)
    assert r.rc == 0, r.err
    assert r.out.startswith("submitted job ") and r.out.strip().endswith(": pending")
    job_id = r.out.split()[2]
    notes = [line for line in r.err.splitlines() if line.startswith(f"[trainyard] job {job_id} ")]
    assert notes[0].startswith(f"[trainyard] job {job_id} pending for "), r.err
    # Once the leader's cycle has ordered the queue (it writes why the job waits: no node yet), its place shows.
    assert any(n.endswith("(1st of 1 in queue default)") for n in notes), r.err
    assert notes[-1].startswith(f"[trainyard] job {job_id} running"), r.err
    r = await cli("submit", "--wait", "--json", "--name", "x", "--", "true")
    assert r.rc == 2 and "--wait" in r.err


def test_the_progress_line() -> None:
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    job = {"state": "pending", "queued_at": "2026-12-02T11:58:00Z", "created_at": "2026-12-02T11:00:00Z",
           "message": "no node has 8 free GPUs", "held_by": "", "hold_reason": "", "not_before": None}
    assert progress(job, now) == "pending for 2m: no node has 8 free GPUs"
    held = {**job, "held_by": "vision/alice", "hold_reason": "after the demo", "message": ""}
    assert progress(held, now) == "pending for 2m, held by vision/alice (after the demo)"
    restarting = {**job, "state": "restarting", "queued_at": None, "not_before": "2026-12-02T12:00:30Z",
                  "message": ""}
    assert progress(restarting, now).startswith("restarting for 1h, not placed again before 2026-12-02 ")


def test_the_place_in_the_queue() -> None:
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]
    entry = {"position": 3, "queue_length": 12, "queue": "gpu"}
    assert queue_place(entry) == "3rd of 12 in queue gpu"
    assert queue_place({**entry, "position": 0}) == ""  # held: no place
