"""A job's whole story is readable after it has left etcd (issue 14), through the local cluster's real processes
(etcd, scheduler, checkpoint-store, gateway, one simulated node of four A100s, real workers):

alice submits a job whose first attempt fails (every rank exits 1) and which may restart once; its second attempt
runs until carol's higher-priority job preempts it; it is placed again once that one has finished, and bob, a team
admin, cancels it. After job_ttl_s the job leaves etcd; the gateway's GET /v1/jobs/{id}, its listing and the
scheduler's GetJob then answer from the history store with the same story: state, who submitted and who
cancelled, the restart, the preemptor, the events of every step. The history store's record holds each attempt
with its placement and how it ended, and one usage record per placed attempt.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controlplane.support import KEYS, Etcd
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import LocalCluster, Proc
from trainyard_core.security import identity
from trainyard_core.testing.wait import until
from trainyard_scheduler.history.store import ArchivedJob, HistoryStore, UsageRecord
from trainyard_scheduler.state.codec import decode_job

from .conftest import Api

pytestmark = pytest.mark.e2e
TEAM = "vision"
MODEL = "A100-SXM4-40GB"
JOB_TTL_S = 2.0
# Every rank records that it started; attempt 1 fails at once, later attempts run until they are stopped.
STORY = ("import os, pathlib, sys, time\n"
         "attempt, rank = os.environ['TRAINYARD_ATTEMPT'], os.environ['RANK']\n"
         "pathlib.Path(sys.argv[1], f'start.{attempt}.{rank}').touch()\n"
         "if attempt == '1':\n"
         "    sys.exit(1)\n"
         "time.sleep(3600)\n")


class StoryCluster(LocalCluster):
    """The local cluster with the scheduler settings this story needs: finished jobs leave etcd after JOB_TTL_S,
    a gang may be preempted as soon as it runs, and the cluster's tool (trainyard://tool/local) may read TEAM's
    jobs over gRPC."""

    def _proc(self, name: str, module: str, env_prefix: str, settings: dict[str, str]) -> Proc:
        if module == "trainyard_scheduler.main":
            settings = {**settings, "job_ttl_s": str(JOB_TTL_S), "preempt_exempt_s": "0",
                        "tool_teams": f"{self.tool.name}:{TEAM}"}
        return super()._proc(name, module, env_prefix, settings)


@pytest.fixture(scope="module")
def story_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoryCluster]:
    c = StoryCluster(Path(tmp_path_factory.mktemp("story")), gateway_port=0, nodes=[("node-1", "a100x4")],
                     stop_grace_s=2.0, log_format="text")
    try:
        c.start()
        yield c
    finally:
        c.stop()


class User(Api):
    """The gateway as one user, with a token of TEAM the operator created for them."""

    def __init__(self, cluster: LocalCluster, operator: Api, user: str, role: str) -> None:
        r = operator.http.post("/v1/tokens", json={"team": TEAM, "user": user, "role": role})
        assert r.status_code == 201, r.text
        super().__init__(cluster)
        self.http.headers["Authorization"] = f"Bearer {r.json()['secret']}"


def _started(records: Path, attempt: int) -> set[int]:
    return {int(p.name.split(".")[2]) for p in records.glob(f"start.{attempt}.*")}


def _without_exits(job: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in job.items() if k != "exits"}


def _history(cluster: LocalCluster, job_ids: list[str]) -> tuple[dict[str, ArchivedJob], list[UsageRecord]]:
    """The jobs' rows and TEAM's usage records, read from the cluster's history store (its SQLite file)."""
    async def read() -> tuple[dict[str, ArchivedJob], list[UsageRecord]]:
        store = await HistoryStore.open(f"sqlite+aiosqlite:///{cluster.workdir / 'history.db'}", migrate=False)
        try:
            rows = {j: row for j in job_ids if (row := await store.get(j)) is not None}
            return rows, list(await store.usage(team=TEAM))
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_jobs_whole_story_is_read_back_after_it_left_etcd(story_cluster: StoryCluster, tmp_path: Path) -> None:
    cluster = story_cluster
    operator = Api(cluster)
    operator.wait_nodes_ready(1)
    alice, carol = User(cluster, operator, "alice", "member"), User(cluster, operator, "carol", "member")
    bob = User(cluster, operator, "bob", "admin")
    etcd = Etcd(cluster.etcd_cluster)
    try:
        # Attempt 1 fails on every rank; the restart (max_restarts 1, no backoff) is attempt 2, which runs.
        story = alice.submit({"name": "story", "command": [sys.executable, "-c", STORY, str(tmp_path)],
                              "resources": {"nodes": 1, "gpus_per_node": 4}, "max_restarts": 1,
                              "restart_backoff_s": 0, "labels": {"project": "chronicle"}})
        until(lambda: _started(tmp_path, 2) == {0, 1, 2, 3}, 60, "every rank of attempt 2 to start")
        running = alice.wait(story["id"], {"running"})
        assert (running["attempt"], running["restarts"]) == (2, 1), running

        # carol's job outranks it and finds no free GPU: attempt 2 is preempted; carol's job runs and ends; the
        # story is placed again (attempt 3).
        preemptor = carol.submit({"name": "urgent", "command": [sys.executable, "-c", "pass"],
                                  "resources": {"nodes": 1, "gpus_per_node": 1}, "priority": 10})
        assert carol.wait(preemptor["id"], {"succeeded"}, timeout=60)["attempt"] == 1
        until(lambda: _started(tmp_path, 3) == {0, 1, 2, 3}, 60, "every rank of attempt 3 to start")
        running = alice.wait(story["id"], {"running"})
        assert (running["attempt"], running["preempted_by"]) == (3, [preemptor["id"]]), running

        # bob, a team admin, cancels alice's job.
        r = bob.http.post(f"/v1/jobs/{story['id']}:cancel")
        assert r.status_code == 200, r.text
        ended = alice.wait(story["id"], {"cancelled"}, timeout=60)

        # It leaves etcd job_ttl_s after it ended (once archived); from then on it is read from the history.
        key = KEYS.job(story["id"])
        until(lambda: not etcd.get_prefix(key), 30 + JOB_TTL_S, f"{key} to leave etcd")
        assert not etcd.get_prefix(KEYS.job(preemptor["id"])), "the preemptor finished first: it left etcd too"

        told = alice.job(story["id"])
        print(f"\nthe story as the history tells it: {[(e['kind'], e['message']) for e in told['events']]}")
        # The gateway shows the job from the history as it showed it from etcd. Exits apart: a rank's exit reported
        # after its gang was released is added to the finished job's record (state/exit_records.py), also after
        # the job was archived (the archiver writes it again), so the history has at least what etcd had when
        # the cancel was seen.
        assert _without_exits(told) == _without_exits(ended)
        assert {e["rank"] for e in ended["exits"]} <= {e["rank"] for e in told["exits"]} <= {0, 1, 2, 3}
        assert told["exits"]
        assert all(e["node_id"] == "node-1" and e["signal"] in (15, 9) for e in told["exits"]), told["exits"]
        assert (told["state"], told["user"], told["team"], told["cancelled_by"]) == ("cancelled", "alice", TEAM, "bob")
        assert (told["attempt"], told["restarts"], told["infra_restarts"]) == (3, 1, 0)
        assert told["preempted_by"] == [preemptor["id"]]
        assert told["finished_at"] is not None
        kinds = [e["kind"] for e in told["events"]]
        # Placed three times (attempt 1 may fail before it is seen running: its ranks exit at once).
        assert kinds.count("admitted") == 3 and kinds.count("running") >= 2, kinds
        assert [k for k in kinds if k in ("restarting", "preempted", "cancel_requested", "cancelled")] == \
            ["restarting", "preempted", "cancel_requested", "cancelled"], kinds
        assert any("exited with code 1" in e["message"] for e in told["events"] if e["kind"] == "restarting")
        assert any(preemptor["id"] in e["message"] for e in told["events"] if e["kind"] == "preempted"), \
            told["events"]
        assert [a["node_id"] for a in told["placement"]] == ["node-1"], "the last attempt's placement"
        # The listing merges etcd and the history: the story once, with carol's job; bob's view is the same.
        listed = alice.http.get("/v1/jobs", params={"state": "cancelled"}).json()["jobs"]
        assert [j["id"] for j in listed] == [story["id"]]
        assert bob.job(story["id"]) == told

        # The scheduler's GetJob, as the cluster's tool acting for TEAM, tells the same.
        with cluster.sync_channel(cluster.scheduler_addresses[0], identity.SCHEDULER) as channel:
            got = scheduler_pb2_grpc.JobServiceStub(channel).GetJob(
                scheduler_pb2.GetJobRequest(job_id=story["id"], team=TEAM), timeout=10).job
        assert (got.state, got.user, got.cancelled_by, got.attempt, got.restarts, list(got.preempted_by)) == \
            (types_pb2.JOB_STATE_CANCELLED, "alice", "bob", 3, 1, [preemptor["id"]])
        assert [e.kind for e in got.events] == kinds
        # Every attempt, where it ran and how it ended, through the API (gateway JSON and gRPC alike).
        assert [(a["attempt"], a["nodes"], a["gpus"], a["model"], a["outcome"]) for a in told["attempts"]] == \
            [(1, ["node-1"], 4, MODEL, "restarting"), (2, ["node-1"], 4, MODEL, "preempted"),
             (3, ["node-1"], 4, MODEL, "cancelled")], told["attempts"]
        assert preemptor["id"] in told["attempts"][1]["reason"] and told["attempts"][2]["reason"] == "cancelled"
        assert [(a.attempt, a.outcome) for a in got.attempts] == [
            (1, types_pb2.JOB_STATE_RESTARTING), (2, types_pb2.JOB_STATE_PREEMPTED), (3, types_pb2.JOB_STATE_CANCELLED)]

        # The history store: every attempt with its placement and how it ended, one usage record per attempt.
        rows, usage = _history(cluster, [story["id"], preemptor["id"]])
        assert set(rows) == {story["id"], preemptor["id"]}
        record = decode_job(rows[story["id"]].record)
        assert rows[story["id"]].state == "cancelled" and record.cancelled_by == "bob"
        attempts = [(a.attempt, a.nodes, a.gpus, a.model, a.outcome) for a in record.attempts]
        assert attempts == [(1, ("node-1",), 4, MODEL, "restarting"), (2, ("node-1",), 4, MODEL, "preempted"),
                            (3, ("node-1",), 4, MODEL, "cancelled")], record.attempts
        reasons = [a.reason for a in record.attempts]
        print(f"attempts' reasons: {reasons}")
        assert "exited with code 1" in reasons[0] and preemptor["id"] in reasons[1], reasons
        assert reasons[2] == "cancelled", reasons
        mine = [u for u in usage if u.job_id == story["id"]]
        assert [u.attempt for u in mine] == [1, 2, 3]
        for u, a in zip(mine, record.attempts, strict=True):
            assert (u.team, u.user, u.project, u.gpus, u.nodes, u.accelerator_model) == \
                (TEAM, "alice", "chronicle", 4, 1, MODEL)
            assert (u.started_at, u.ended_at) == (a.started_at, a.ended_at) and u.started_at < u.ended_at
        assert all(b.started_at >= a.ended_at for a, b in itertools.pairwise(mine)), "attempts overlap"
        theirs = [u for u in usage if u.job_id == preemptor["id"]]
        assert [(u.attempt, u.user, u.gpus) for u in theirs] == [(1, "carol", 1)]
        assert mine[1].ended_at <= theirs[0].started_at <= theirs[0].ended_at <= mine[2].started_at
    finally:
        for api in (operator, alice, carol, bob):
            api.http.close()

