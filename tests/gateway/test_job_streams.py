"""GET /v1/jobs/{id}/logs (read once, capped fairly, or followed as server-sent events and resumed) and GET
/v1/jobs/{id}/events (recorded, or watched): the pure pieces with tables, then every parameter and error path
against a real gateway, a real scheduler and real agents on simulated GPUs running real worker processes.

Where a test must know that a stream has reached a point, it waits on what the real services recorded (the
agents' and the scheduler's call logs count their open streams), never on time."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainyard.common.v1 import types_pb2
from trainyard_agent.workers import logwriter
from trainyard_core.testing.wait import eventually
from trainyard_gateway.joblogs import NodeLogs, attempt_shares, fair_shares, rank_ranges, render, unix_ms
from trainyard_gateway.logstream import (
    POSITIONS_PATTERN,
    PositionIds,
    decode_positions,
    encode_positions,
)
from trainyard_gateway.schemas.jobs import NodeAssignment
from trainyard_gateway.schemas.logs import LogLine

from .support import Cluster, RunningGateway, python, running_gateway, wait_for_file

# --- the pure pieces --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("counts", "cap", "keep"), [
    ({0: 10, 1: 10}, 100, {0: 10, 1: 10}),            # everything fits
    ({0: 10, 1: 10}, 6, {0: 3, 1: 3}),                # equal shares
    ({0: 100, 1: 2, 2: 50}, 30, {0: 14, 1: 2, 2: 14}),  # a small rank keeps all; its unused share goes on
    ({0: 9, 1: 9, 2: 9}, 7, {0: 3, 1: 2, 2: 2}),      # the remainder: one each, lowest ranks first
    ({0: 1000, 1: 1}, 2, {0: 1, 1: 1}),               # rank 0 does not crowd rank 1 out
    ({0: 5, 1: 5}, 0, {0: 0, 1: 0}),
    ({}, 10, {}),
])
def test_fair_shares(counts: dict[int, int], cap: int, keep: dict[int, int]) -> None:
    assert fair_shares(counts, cap) == keep
    assert sum(keep.values()) == min(cap, sum(counts.values()))


def _lines(rank: int, n: int, attempt: int = 1) -> list[LogLine]:
    return [LogLine(rank, attempt, "stdout", f"r{rank} {i}") for i in range(n)]


def test_render_keeps_every_ranks_newest_lines_and_says_what_it_left_out() -> None:
    share = NodeAssignment(node_id="n", node_rank=0, gpu_indices=[0, 1, 2], ranks=[0, 1, 2], model="", cpus=0)
    lines = _lines(0, 100) + _lines(1, 2) + _lines(2, 50)
    out = render([NodeLogs(share, lines)], max_lines=30).splitlines()
    assert out[0] == ("[gateway] 122 earlier lines left out (at most 30 lines per answer, shared by the 3 ranks, "
                      "each keeping its newest; rank 0: 86, rank 2: 36); use ?tail=N for the last N lines of each "
                      "rank, or ?rank=R")
    assert out[1:] == ([f"[rank 0] r0 {i}" for i in range(86, 100)] + ["[rank 1] r1 0", "[rank 1] r1 1"]
                       + [f"[rank 2] r2 {i}" for i in range(36, 50)])
    same = render([NodeLogs(share, _lines(0, 9) + _lines(1, 9) + _lines(2, 9))], max_lines=7).splitlines()
    assert same[0].startswith("[gateway] 20 earlier lines left out") and "rank 0: 6, ranks 1-2: 7 each" in same[0]


def test_rank_ranges() -> None:
    assert rank_ranges([7, 0, 1, 2, 3, 9, 10]) == "0-3,7,9-10"
    assert rank_ranges([]) == ""


@pytest.mark.parametrize("positions", [
    {}, {(1, 0): 12}, {(1, 0): 12, (1, 1): 15, (1, 2): 3, (2, 4): 9, (2, 5): 1},
    {(3, 0): 1, (3, 2): 2, (3, 7): 10**12},
])
def test_positions_round_trip(positions: dict[tuple[int, int], int]) -> None:
    import re

    text = encode_positions(positions)
    assert re.match(POSITIONS_PATTERN, text)
    assert decode_positions(text) == positions
    ids = PositionIds()
    for key, seq in positions.items():
        for step in range(1, min(seq, 5) + 1):  # the id changes as lines are sent
            ids.set(key, step)
        ids.set(key, seq)
    assert ids.text() == text


def test_positions_text_is_runs_of_ranks() -> None:
    assert encode_positions({(1, 0): 12, (1, 1): 15, (1, 2): 3, (2, 4): 9, (1, 5): 0}) == "1:0=12,15,3;2:4=9"
    assert encode_positions({(1, 0): 1, (1, 2): 2}) == "1:0=1;1:2=2"
    for bad in ("x", "1:0", "1:0=", "1:0=1,", ";1:0=1", "1:0=1;;"):
        with pytest.raises(ValueError):
            decode_positions(bad)


def test_since_is_compared_to_the_millisecond() -> None:
    at = datetime(2026, 12, 2, 14, 0, 0, 123_999, tzinfo=UTC)
    assert unix_ms(at) == int(at.replace(microsecond=0).timestamp()) * 1000 + 123
    assert unix_ms(at.replace(microsecond=0)) == int(at.replace(microsecond=0).timestamp()) * 1000
    assert unix_ms(None) == 0


def test_attempt_shares_of_ended_attempts_follow_placement_ranks() -> None:
    from trainyard_gateway.schemas.jobs import Job

    job = Job.model_validate({
        "id": "j", "name": "n", "state": "running", "team": "t", "user": "u", "attempt": 2, "exit_code": None,
        "message": "", "cancel_requested": False, "exits": [], "events": [], "created_at": None,
        "updated_at": None, "started_at": None, "finished_at": None,
        "spec": {"name": "n", "command": ["x"], "env": {}, "labels": {}, "working_dir": "", "queue": "default",
                 "priority": 0, "priority_class": "normal", "max_restarts": 1, "restart_backoff_s": 1.0,
                 "time_limit_s": 0.0,
                 "resources": {"nodes": 2, "gpus_per_node": 2, "accelerator": "", "accelerators": [],
                               "min_memory_gb": 0, "min_compute_capability": "", "vendor": "", "allow_mixed": False,
                               "cpus_per_node": 0, "speed_hints": {}},
                 "topology": {"tier": "", "required": False, "wait_s": 0.0},
                 "preemption": {"signal": "SIGTERM", "grace_s": 30.0},
                 "checkpoint": {"every_steps": 0, "interval_s": 0.0, "keep_last": 0}},
        "placement": [{"node_id": "c", "node_rank": 1, "gpu_indices": [0, 1], "ranks": [2, 3]},
                      {"node_id": "d", "node_rank": 0, "gpu_indices": [0, 1], "ranks": [0, 1]}],
        "attempts": [{"attempt": 1, "started_at": None, "ended_at": None, "nodes": ["a", "b"], "gpus": 4, "cpus": 0,
                      "model": "", "outcome": "restarting", "reason": ""}],
    })
    shares = attempt_shares(job)
    assert [(s.node_id, s.ranks) for s in shares[1]] == [("a", [0, 1]), ("b", [2, 3])]
    assert [(s.node_id, s.ranks) for s in shares[2]] == [("d", [0, 1]), ("c", [2, 3])]


# --- helpers ----------------------------------------------------------------------------------------------

async def sse(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The events of a text/event-stream answer, as {event, data (parsed), id}; comments skipped."""
    event: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line:
            if event:
                event["data"] = json.loads(event.get("data", "null"))
                yield event
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            event[name] = value.removeprefix(" ")


async def read_stream(http: httpx.AsyncClient, path: str, *, params: Any = None, headers: Any = None,
                      stop_after_lines: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(status, events) of one stream, read to its end or until `stop_after_lines` line events (the
    connection is then closed by the client)."""
    events: list[dict[str, Any]] = []
    async with http.stream("GET", path, params=params, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.json()]
        assert response.headers["content-type"].startswith("text/event-stream")
        async for event in sse(response):
            events.append(event)
            if stop_after_lines is not None and sum(e["event"] == "line" for e in events) >= stop_after_lines:
                break
    return 200, events


def texts(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(e["data"]["rank"], e["data"]["text"]) for e in events if e["event"] == "line"]


@pytest.fixture
async def capped_gateway(etcd_settings: dict[str, str], cluster: Cluster) -> AsyncIterator[RunningGateway]:
    """The cluster's gateway with a line cap of 6 and a rate limit of bursts of 4 requests per token."""
    async with running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                               scheduler_address=cluster.address, max_log_lines=6, rate_limit_per_s=0.001,
                               rate_limit_burst=4) as gw:
        yield gw


PRINT_RANKS = """
    import os
    rank = int(os.environ["RANK"])
    for i in range({n}):
        print(f"r{{rank}} line{{i}}")
"""


# --- the plain read ---------------------------------------------------------------------------------------

async def test_the_cap_is_shared_by_the_ranks_through_the_route(capped_gateway: RunningGateway,
                                                                 cluster: Cluster) -> None:
    job = await cluster.submit(python("""
        import os
        rank = int(os.environ["RANK"])
        for i in range(20 if rank == 0 else 2):
            print(f"r{rank} line{i}")
    """), gpus=2)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    async with capped_gateway.client(capped_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    lines = reply.text.splitlines()
    assert lines[0].startswith("[gateway] 16 earlier lines left out (at most 6 lines per answer, shared by the 2 "
                               "ranks, each keeping its newest; rank 0: 16)")
    assert lines[1:] == [f"[rank 0] r0 line{i}" for i in range(16, 20)] + ["[rank 1] r1 line0", "[rank 1] r1 line1"]


async def test_rank_tail_and_attempt_filters(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    job = await cluster.submit(python(PRINT_RANKS.format(n=3)), nodes=2, gpus=2)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    cluster.agent_calls["node-a"].clear()
    cluster.agent_calls["node-b"].clear()
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        one = await http.get(f"/v1/jobs/{job.id}/logs", params=[("rank", 3), ("rank", 0), ("tail", 2)])
        none = await http.get(f"/v1/jobs/{job.id}/logs", params={"attempt": 7})
        unknown_rank = await http.get(f"/v1/jobs/{job.id}/logs", params={"rank": 99})
        bad = await http.get(f"/v1/jobs/{job.id}/logs", params={"rank": -1})
        bad_since = await http.get(f"/v1/jobs/{job.id}/logs", params={"since": "yesterday"})
    assert one.text.splitlines() == ["[rank 0] r0 line1", "[rank 0] r0 line2", "[rank 3] r3 line1", "[rank 3] r3 line2"]
    assert none.status_code == 200 and none.text == ""  # an attempt the job never had: no lines
    assert unknown_rank.status_code == 200 and unknown_rank.text == ""  # and no node holds rank 99: none asked
    assert bad.status_code == 400 and "query parameter rank" in bad.json()["error"]["message"]
    assert bad_since.status_code == 400 and "RFC 3339" in bad_since.json()["error"]["message"]
    # Both nodes hold one of ranks 0 and 3: both were asked, each once, for the tail.
    assert [c.tail_lines for c in cluster.agent_calls["node-a"].requests("GetWorkerLogs")] == [2]
    assert [c.tail_lines for c in cluster.agent_calls["node-b"].requests("GetWorkerLogs")] == [2]


async def test_an_earlier_attempt_on_another_node(cluster_gateway: RunningGateway, cluster: Cluster,
                                                  tmp_path: Path) -> None:
    """Attempt 1 runs on one node and fails; that node is cordoned, so attempt 2 runs on the other. Attempt 1's
    lines are still read from the first node's agent, by the plain read and by a follow."""
    fail = tmp_path / "fail"
    spec = {"name": "twice", "max_restarts": 1, "restart_backoff_s": 0.1, "resources": {"nodes": 1, "gpus_per_node": 1},
            "command": python("""
                import os, sys
                attempt = int(os.environ["TRAINYARD_ATTEMPT"])
                print(f"attempt {attempt} says hello")
            """, f"""
                if attempt == 1:
                    import pathlib, time
                    while not pathlib.Path({str(fail)!r}).exists():
                        time.sleep(0.02)
                    print("attempt 1 fails")
                    sys.exit(1)
            """)}
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        created = await http.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        first = await cluster.wait_state(job_id, types_pb2.JOB_STATE_RUNNING)
        (node_1,) = [a.node_id for a in first.placement]
        assert (await http.post(f"/v1/nodes/{node_1}:cordon", json={"reason": "test"})).status_code == 200
        fail.touch()
        done = await cluster.wait_state(job_id, types_pb2.JOB_STATE_SUCCEEDED)
        (node_2,) = [a.node_id for a in done.placement]
        assert done.attempt == 2 and node_2 != node_1
        earlier = await http.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 1})
        current = await http.get(f"/v1/jobs/{job_id}/logs")
        every = await http.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 0})
        ended_1 = done.attempts[0].ended_at.ToDatetime(tzinfo=UTC)
        since = (ended_1 + timedelta(milliseconds=1)).isoformat()
        recent = await http.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 0, "since": since})
        status, followed = await read_stream(http, f"/v1/jobs/{job_id}/logs", params={"follow": "true", "attempt": 0})
    assert earlier.text.splitlines() == ["[rank 0] attempt 1 says hello", "[rank 0] attempt 1 fails"]
    assert current.text.splitlines() == ["[rank 0] attempt 2 says hello"]
    assert every.text.splitlines() == ["[rank 0] attempt 1 says hello", "[rank 0] attempt 1 fails",
                                       "[rank 0] attempt 2 says hello"]
    assert recent.text.splitlines() == ["[rank 0] attempt 2 says hello"]  # attempt 1 ended before `since`
    assert status == 200
    lines = [(e["data"]["attempt"], e["data"]["node"], e["data"]["text"]) for e in followed if e["event"] == "line"]
    assert sorted(lines) == [(1, node_1, "attempt 1 fails"), (1, node_1, "attempt 1 says hello"),
                             (2, node_2, "attempt 2 says hello")]
    assert [ln for ln in lines if ln[0] == 1] == [(1, node_1, "attempt 1 says hello"), (1, node_1, "attempt 1 fails")]
    assert followed[-1]["event"] == "end" and followed[-1]["data"]["state"] == "succeeded"


# --- following --------------------------------------------------------------------------------------------

async def test_follow_streams_lines_as_they_come_and_ends_with_the_job(
        cluster_gateway: RunningGateway, cluster: Cluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    before = datetime.now(UTC)
    job = await cluster.submit(python(PRINT_RANKS.format(n=2), wait_for_file(go), """
        print(f"r{rank} late")
    """), nodes=2, gpus=1)
    alice = await cluster_gateway.create_token("vision", "alice")
    async with cluster_gateway.client(alice) as http, \
            http.stream("GET", f"/v1/jobs/{job.id}/logs", params={"follow": "true"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events = aiter(sse(response))
        early = [await anext(events) for _ in range(4)]  # the two lines of each rank, written before `go`
        go.touch()
        rest = [event async for event in events]
        after_go = datetime.now(UTC)
    assert sorted(texts(early)) == [(0, "r0 line0"), (0, "r0 line1"), (1, "r1 line0"), (1, "r1 line1")]
    assert sorted(texts(rest)) == [(0, "r0 late"), (1, "r1 late")]
    assert rest[-1]["event"] == "end" and rest[-1]["data"] == {"state": "succeeded", "exit_code": 0,
                                                                 "message": rest[-1]["data"]["message"]}
    line = early[0]["data"]
    assert set(line) == {"rank", "attempt", "node", "stream", "time", "text"}
    assert (line["attempt"], line["stream"]) == (1, "stdout")
    # When the worker wrote it: after the job was submitted, before the late lines were written.
    written = [datetime.fromisoformat(e["data"]["time"]) for e in early + rest if e["event"] == "line"]
    assert all(before - timedelta(milliseconds=1) <= t <= after_go for t in written)
    assert max(datetime.fromisoformat(e["data"]["time"]) for e in early) <= min(
        datetime.fromisoformat(e["data"]["time"]) for e in rest if e["event"] == "line")
    assert line["node"] == ("node-a" if line["rank"] == 0 else "node-b")
    # Every line event's id is every rank's last line sent so far; the last one has both ranks at their 3rd.
    assert decode_positions(rest[-2]["id"]) == {(1, 0): 3, (1, 1): 3}


async def test_a_reconnect_resumes_exactly_after_the_last_event(
        cluster_gateway: RunningGateway, cluster: Cluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = await cluster.submit(python(PRINT_RANKS.format(n=10), wait_for_file(go), """
        for i in range(10, 15):
            print(f"r{rank} line{i}")
    """), gpus=2)
    expected = {(r, f"r{r} line{i}") for r in (0, 1) for i in range(15)}
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        async def all_written() -> bool:
            return (await http.get(f"/v1/jobs/{job.id}/logs")).text.count("\n") == 20

        await eventually(all_written, what="the first 10 lines of each rank")
        _, first = await read_stream(http, f"/v1/jobs/{job.id}/logs", params={"follow": "true"}, stop_after_lines=7)
        last_id = first[-1]["id"]
        # The header, then the query parameter (for clients that cannot set headers) from where that one left.
        _, second = await read_stream(http, f"/v1/jobs/{job.id}/logs", params={"follow": "true"},
                                      headers={"Last-Event-ID": last_id}, stop_after_lines=6)
        go.touch()
        _, third = await read_stream(http, f"/v1/jobs/{job.id}/logs",
                                     params={"follow": "true", "last_event_id": second[-1]["id"]})
    seen = texts(first) + texts(second) + texts(third)
    assert len(seen) == len(set(seen)) == 30  # nothing twice
    assert set(seen) == expected              # nothing left out
    for rank in (0, 1):                       # and each rank in its order
        assert [t for r, t in seen if r == rank] == [f"r{rank} line{i}" for i in range(15)]
    assert third[-1]["event"] == "end"


async def test_since_selects_lines_by_the_time_they_were_written(cluster_gateway: RunningGateway, cluster: Cluster,
                                                                 tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = await cluster.submit(python(PRINT_RANKS.format(n=2), wait_for_file(go), """
        print(f"r{rank} late")
    """), gpus=2)
    path = f"/v1/jobs/{job.id}/logs"
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        async def early_written() -> bool:
            return (await http.get(path)).text.count("\n") == 4

        await eventually(early_written, what="the early lines of both ranks")
        cut = datetime.now(UTC)  # after the early lines were written (we read them), before the late ones
        go.touch()
        await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
        later = await http.get(path, params={"since": cut.isoformat()})
        tail = await http.get(path, params={"since": (cut - timedelta(hours=1)).isoformat(), "tail": 1})
        _, followed = await read_stream(http, path, params={"follow": "true", "since": cut.isoformat()})
        _, tailed = await read_stream(http, path, params={"follow": "true", "since": cut.isoformat(), "tail": 5})
    assert later.text.splitlines() == ["[rank 0] r0 late", "[rank 1] r1 late"]
    assert tail.text.splitlines() == ["[rank 0] r0 late", "[rank 1] r1 late"]
    assert sorted(texts(followed)) == sorted(texts(tailed)) == [(0, "r0 late"), (1, "r1 late")]
    cut_ms = cut.replace(microsecond=cut.microsecond // 1000 * 1000)
    assert all(datetime.fromisoformat(e["data"]["time"]) >= cut_ms for e in followed if e["event"] == "line")
    assert followed[-1]["event"] == "end"


async def test_a_resume_after_rotation_dropped_a_file_skips_nothing(cluster_gateway: RunningGateway,
                                                                    cluster: Cluster) -> None:
    """A client has the first 5 lines of a rank; then rotation drops the file that held them (and the rest of
    the worker's lines). Its resume gets every line still retained, from the oldest: lines after its last seq,
    not "the retained lines less the 5 it had", which would skip 5 it never saw."""
    job = await cluster.submit(python(PRINT_RANKS.format(n=10)), gpus=1)
    done = await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    path = f"/v1/jobs/{job.id}/logs"
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        _, first = await read_stream(http, path, params={"follow": "true"}, stop_after_lines=5)
        assert texts(first) == [(0, f"r0 line{i}") for i in range(5)]
        assert decode_positions(first[-1]["id"]) == {(1, 0): 5}
        # More output to the rank's log, rotating it twice with one backup: every line of the worker is gone.
        agent = cluster.agents[done.placement[0].node_id]
        assert agent.supervisor is not None
        rank_log = logwriter.RankLog(agent.supervisor.jobs_root / job.id / "attempt-1" / "rank-0.log",
                                     max_bytes=4096, backups=1)
        for i in range(12):
            rank_log.write("stdout", f"more {i:02d} ".encode() + b"x" * 900)
        rank_log.close()
        retained = (await http.get(path)).text.splitlines()
        assert "[rank 0] r0 line0" not in retained and len(retained) == 8
        _, resumed = await read_stream(http, path, params={"follow": "true"},
                                       headers={"Last-Event-ID": first[-1]["id"]})
    assert [f"[rank {r}] {t}" for r, t in texts(resumed)] == retained
    assert decode_positions(resumed[-1]["id"]) == {(1, 0): 22}  # 10 lines of the worker, 12 more
    assert resumed[-1]["event"] == "end"


async def test_follow_with_tail_and_rank_on_a_finished_job_ends(cluster_gateway: RunningGateway,
                                                                 cluster: Cluster) -> None:
    job = await cluster.submit(python(PRINT_RANKS.format(n=5)), gpus=3)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        status, events = await read_stream(http, f"/v1/jobs/{job.id}/logs",
                                           params=[("follow", "true"), ("tail", 2), ("rank", 0), ("rank", 2)])
        assert status == 200
        # The tail's start is part of the ids: resuming from the first event goes on from there, not from 0.
        _, resumed = await read_stream(http, f"/v1/jobs/{job.id}/logs", params=[("follow", "true"), ("rank", 0),
                                                                                ("rank", 2)],
                                       headers={"Last-Event-ID": events[0]["id"]})
    assert sorted(texts(events)) == [(0, "r0 line3"), (0, "r0 line4"), (2, "r2 line3"), (2, "r2 line4")]
    assert events[-1]["event"] == "end" and events[-1]["data"]["state"] == "succeeded"
    first = texts(events)[0]
    assert sorted(texts(resumed)) == sorted(set(texts(events)) - {first})
    assert resumed[-1]["event"] == "end"


async def test_follow_of_a_pending_job_waits_for_it(live_gateway: RunningGateway, scheduler: Cluster,
                                                    tmp_path: Path) -> None:
    """No node yet: the stream holds (keepalives only) until a node joins and the job runs, then ends."""
    job = await scheduler.submit(python("print('finally')"))
    async def watching() -> bool:
        return scheduler.calls.open_streams["WatchJob"] == 1

    async with live_gateway.client(live_gateway.admin_token) as http, \
            http.stream("GET", f"/v1/jobs/{job.id}/logs", params={"follow": "true"}) as response:
        events = aiter(sse(response))
        await eventually(watching, what="the follow to watch the job")
        await scheduler.add_agent("node-a", state_dir=tmp_path / "node-a")
        got = [event async for event in events]
    assert texts(got) == [(0, "finally")] and got[-1]["event"] == "end"


async def test_closing_the_connection_ends_every_stream_behind_it(cluster_gateway: RunningGateway,
                                                                  cluster: Cluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = await cluster.submit(python(PRINT_RANKS.format(n=1), wait_for_file(go)), nodes=2, gpus=1)
    agents = [cluster.agent_calls["node-a"], cluster.agent_calls["node-b"]]

    async def streams_open(count: int) -> bool:
        return (all(a.open_streams["StreamWorkerLogs"] == count for a in agents)
                and cluster.calls.open_streams["WatchJob"] == count)

    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        for _ in range(2):  # twice: the second time over a connection the first one did not leave behind
            async with http.stream("GET", f"/v1/jobs/{job.id}/logs", params={"follow": "true"}) as response:
                events = aiter(sse(response))
                assert {(await anext(events))["event"] for _ in range(2)} == {"line"}
                await eventually(lambda: streams_open(1), what="one log stream per node and one job watch")
            await eventually(lambda: streams_open(0), what="every stream closed after the client left")
    go.touch()
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)


async def test_an_unreachable_node_is_a_warning_without_its_address(cluster_gateway: RunningGateway,
                                                                    cluster: Cluster) -> None:
    job = await cluster.submit(python(PRINT_RANKS.format(n=1)), nodes=2, gpus=2)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    await cluster.stop_agent("node-b")
    alice = await cluster_gateway.create_token("vision", "alice")
    async with cluster_gateway.client(alice) as http:
        _, member = await read_stream(http, f"/v1/jobs/{job.id}/logs", params={"follow": "true"})
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        _, operator = await read_stream(http, f"/v1/jobs/{job.id}/logs", params={"follow": "true"})
    for events in (member, operator):
        assert sorted(texts(events)) == [(0, "r0 line0"), (1, "r1 line0")]
        # (Only node-b's: on a loaded machine the scheduler's leadership may lapse, and a node's address cannot
        # be looked up meanwhile, which is a warning of its own.)
        warnings = [e for e in events if e["event"] == "warning" and e["data"]["node"] == "node-b"]
        assert len(warnings) == 1, events  # once per run of failures, not per retry
        (warning,) = warnings
        assert (warning["data"]["node"], warning["data"]["attempt"], warning["data"]["ranks"]) == ("node-b", 1, [2, 3])
        assert events[-1]["event"] == "end"  # the job has ended: the node is given up after a few tries
    def node_b(events: list[dict[str, Any]]) -> str:
        return str(next(e for e in events if e["event"] == "warning" and e["data"]["node"] == "node-b")["data"][
            "message"])

    assert "the node agent of node-b is unavailable" in node_b(member)
    assert "127.0.0.1" not in json.dumps(member)
    assert "127.0.0.1" in node_b(operator)


async def test_streams_refuse_like_job_reads_before_any_stream(capped_gateway: RunningGateway,
                                                               cluster: Cluster) -> None:
    job = await cluster.submit(python("print(1)"), team="vision")
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    bob = await capped_gateway.create_token("nlp", "bob")
    async with capped_gateway.client(bob) as http:
        for path, params in [("logs", {"follow": "true"}), ("logs", {}), ("events", {"watch": "true"}),
                             ("events", {})]:
            reply = await http.get(f"/v1/jobs/{job.id}/{path}", params=params)
            assert reply.status_code == 404, (path, params, reply.text)
            assert reply.headers["content-type"] == "application/json"
            assert reply.json()["error"]["code"] == "not_found"
    async with httpx.AsyncClient(base_url=capped_gateway.url) as http:
        assert (await http.get(f"/v1/jobs/{job.id}/logs", params={"follow": "true"})).status_code == 401
    eve = await capped_gateway.create_token("vision", "eve")
    async with capped_gateway.client(eve) as http:
        bad = await http.get(f"/v1/jobs/{job.id}/logs", params={"follow": "true"},
                             headers={"Last-Event-ID": "not an id"})
        assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]
        bad = await http.get(f"/v1/jobs/{job.id}/events", params={"watch": "true", "last_event_id": "zz"})
        assert bad.status_code == 400
    vic = await capped_gateway.create_token("vision", "vic", role="viewer")
    async with capped_gateway.client(vic) as http:
        # An id of positions this job never had (another job's, say) is a valid id: nothing to skip.
        _, events = await read_stream(http, f"/v1/jobs/{job.id}/logs", params={"follow": "true"},
                                      headers={"Last-Event-ID": "9:0=5"})
        assert texts(events) == [(0, "1")]
        for path in ("logs", "events", "events?watch=true"):
            async with http.stream("GET", f"/v1/jobs/{job.id}/{path}") as response:
                assert response.status_code == 200
        # The token's bursts of 4 are spent: opening a stream is rate limited like any request.
        limited = await http.get(f"/v1/jobs/{job.id}/logs", params={"follow": "true"})
        assert limited.status_code == 429 and limited.headers["retry-after"]
        assert limited.headers["content-type"] == "application/json"


# --- events -----------------------------------------------------------------------------------------------

async def test_events_and_watching_a_job(live_gateway: RunningGateway, scheduler: Cluster,
                                         tmp_path: Path) -> None:
    job = await scheduler.submit(python("print('x')"), team="vision")
    alice = await live_gateway.create_token("vision", "alice", role="viewer")
    async with live_gateway.client(alice) as http:
        recorded = await http.get(f"/v1/jobs/{job.id}/events")
        assert recorded.status_code == 200 and recorded.headers["content-type"] == "application/json"
        body = recorded.json()
        assert (body["job_id"], body["state"]) == (job.id, "pending")
        assert [e["kind"] for e in body["events"]] == [e.kind for e in job.events]
        async with http.stream("GET", f"/v1/jobs/{job.id}/events", params={"watch": "true"}) as response:
            events = aiter(sse(response))
            now = await anext(events)
            assert now["event"] == "job" and now["data"]["state"] == "pending" and now["data"]["id"] == job.id
            await scheduler.add_agent("node-a", state_dir=tmp_path / "node-a")
            rest = [event async for event in events]
    states = [e["data"]["state"] for e in rest if e["event"] == "job"]
    assert states[-1] == "succeeded" and "pending" not in states  # each change once (quick ones fold together)
    end = rest[-1]
    assert end["event"] == "end" and end["data"]["state"] == "succeeded" and end["data"]["exit_code"] == 0
    assert len({e["id"] for e in [now, *rest]}) == len(rest)  # each job event its own id; the end repeats the last
    async with live_gateway.client(alice) as http:
        # Resuming from the last job event: the job has not changed since, so only the end comes.
        _, resumed = await read_stream(http, f"/v1/jobs/{job.id}/events", params={"watch": "true"},
                                       headers={"Last-Event-ID": end["id"]})
        # From an older one: the job as it is now, then the end.
        _, older = await read_stream(http, f"/v1/jobs/{job.id}/events", params={"watch": "true"},
                                     headers={"Last-Event-ID": now["id"]})
    assert [e["event"] for e in resumed] == ["end"]
    assert [e["event"] for e in older] == ["job", "end"] and older[0]["data"]["state"] == "succeeded"


async def test_the_openapi_document_describes_the_streams(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        doc = (await http.get("/openapi.json")).json()
    logs = doc["paths"]["/v1/jobs/{job_id}/logs"]["get"]
    assert set(logs["responses"]["200"]["content"]) == {"text/plain", "text/event-stream"}
    event = logs["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert event["properties"]["event"]["enum"] == ["line", "warning", "end"]
    assert {p["name"] for p in logs["parameters"]} >= {"follow", "tail", "attempt", "rank", "since", "last_event_id",
                                                       "Last-Event-ID"}
    events = doc["paths"]["/v1/jobs/{job_id}/events"]["get"]
    assert set(events["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert events["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobEvents")
    for operation in (logs, events):
        assert set(operation["responses"]["404"]["content"]) == {"application/json"}
