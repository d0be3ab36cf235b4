"""The gateway's read view of the live jobs (job_view*.py) against a real scheduler with mTLS and a history
store, over the session's real etcd: GET and the lists it can answer come from the view, agree with what the
scheduler answers, never show an older state than the client's own write, scope teams as the scheduler does,
fall back to the scheduler while the view has no stream and recover; `?watch=true` streams the changes and
resumes after the last event id.

Every write goes through the gateway (HTTP), as a client's would; the scheduler is asked directly (over mTLS,
as the gateway principal) only to compare answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc.aio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.security import identity, pki
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.wait import eventually, truthy
from trainyard_gateway import convert
from trainyard_gateway.job_view import JobView, ViewedJob
from trainyard_gateway.job_view_pages import HistoryState, page
from trainyard_scheduler.domain.listing import JobFilter
from trainyard_scheduler.domain.operations import WAITING_MESSAGE

from .support import running_gateway
from .view_support import Deployment, deployment, reasons_written

REVISION = "X-Trainyard-Revision"
SPEC: dict[str, Any] = {"name": "train", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}


@pytest.fixture
async def live(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path,
               pki_dir: Path) -> AsyncIterator[Deployment]:
    """Finished jobs stay in etcd for an hour (the default): every job is live."""
    async with deployment(etcd_settings, key_prefix + "view", tmp_path, pki_dir) as d:
        yield d


@pytest.fixture
async def archiving(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path,
                    pki_dir: Path) -> AsyncIterator[Deployment]:
    """Finished jobs leave etcd for the history store as soon as they are archived (job_ttl_s 0)."""
    async with deployment(etcd_settings, key_prefix + "view", tmp_path, pki_dir, job_ttl_s=0.0) as d:
        yield d


async def _submit(http: httpx.AsyncClient, **spec: Any) -> httpx.Response:
    reply = await http.post("/v1/jobs", json={**SPEC, **spec})
    assert reply.status_code == 201, reply.text
    return reply


# --- GET and list from the view ------------------------------------------------------------------------------

async def test_reads_come_from_the_view_and_are_the_schedulers_answers(live: Deployment) -> None:
    alice = await live.gateway.create_token("vision", "alice")
    async with live.gateway.client(alice) as http:
        jobs = [(await _submit(http, name=f"train-{i}", labels={"project": "atlas"})).json() for i in range(3)]
        await reasons_written(http, [j["id"] for j in jobs])
        live.cluster.calls.clear()
        got = await http.get(f"/v1/jobs/{jobs[0]['id']}")
        page = await http.get("/v1/jobs", params={"state": "pending", "page_size": 2})
    assert live.cluster.calls.methods == [], "answered by the view: no call to the scheduler"
    assert got.status_code == 200 and REVISION in got.headers
    assert got.json() == await live.scheduler_get(jobs[0]["id"])
    assert page.status_code == 200 and REVISION in page.headers
    assert [j["id"] for j in page.json()["jobs"]] == [jobs[2]["id"], jobs[1]["id"]]
    request = scheduler_pb2.ListJobsRequest(team="vision", page_size=2, states=[1])
    assert page.json() == await live.scheduler_list(request)


async def test_a_listing_that_merges_the_history_is_the_views_above_the_bound_and_the_schedulers_below(
        archiving: Deployment, etcd_store: EtcdStore) -> None:
    """Two old jobs leave etcd; the first page of the newest (no state filter: live and finished merged) lies
    above every job of the history store, so the view answers it; paging on reaches the history's jobs, which
    the scheduler answers; the pages are the scheduler's, whoever answered."""
    alice = await archiving.gateway.create_token("vision", "alice")
    async with archiving.gateway.client(alice) as http:
        old = [(await _submit(http, name=f"old-{i}")).json()["id"] for i in range(2)]
        for job_id in old:
            await http.post(f"/v1/jobs/{job_id}:cancel")
        prefix = archiving.cluster.settings.etcd_prefix + "/jobs/"

        async def gone() -> bool:
            return not {kv.key[len(prefix):] for kv in (await etcd_store.range(prefix)).kvs} & set(old)
        await eventually(gone, timeout=30, what="the cancelled jobs to leave etcd")
        new = [(await _submit(http, name=f"new-{i}")).json()["id"] for i in range(4)]
        await reasons_written(http, new)
        pages, sources, token = [], [], ""
        while True:
            reply = await http.get("/v1/jobs", params={"page_size": 2, "page_token": token})
            request = scheduler_pb2.ListJobsRequest(team="vision", page_size=2, page_token=token)
            assert reply.json() == await archiving.scheduler_list(request)
            pages.append([j["id"] for j in reply.json()["jobs"]])
            sources.append("view" if REVISION in reply.headers else "scheduler")
            token = reply.json()["next_page_token"]
            if not token:
                break
    # (A full page from the history store says "more" to ListJobs, so an empty page ends the listing.)
    assert pages == [new[:1:-1], new[1::-1], old[::-1], []]
    # Above the bound with a job to spare: the view; the page that ends at the bound and the history's: not.
    assert sources == ["view", "scheduler", "scheduler", "scheduler"]


async def test_another_teams_job_is_not_found_and_operators_see_every_team(live: Deployment) -> None:
    alice = await live.gateway.create_token("vision", "alice")
    bob = await live.gateway.create_token("nlp", "bob")
    async with live.gateway.client(alice) as a, live.gateway.client(bob) as b, \
            live.gateway.client(live.gateway.admin_token) as admin:
        job = (await _submit(a)).json()
        live.cluster.calls.clear()
        other = await b.get(f"/v1/jobs/{job['id']}")
        listed = await b.get("/v1/jobs", params={"state": "pending"})
        asked = await b.get("/v1/jobs", params={"state": "pending", "team": "vision"})
        seen = await admin.get(f"/v1/jobs/{job['id']}")
        everyone = await admin.get("/v1/jobs", params={"state": "pending"})
    assert live.cluster.calls.methods == []
    assert other.status_code == 404
    assert other.json()["error"] == {"code": "not_found", "message": f"job {job['id']} not found"}
    assert listed.json() == asked.json() == {"jobs": [], "next_page_token": ""}
    assert seen.status_code == 200 and seen.json()["id"] == job["id"]
    assert [j["id"] for j in everyone.json()["jobs"]] == [job["id"]]
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # the scheduler says the same
        await live.scheduler_get(job["id"], team="nlp")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and refused.value.details() == f"job {job['id']} not found"


# --- reading one's own writes ---------------------------------------------------------------------------------

async def test_a_read_after_a_write_shows_the_write(live: Deployment) -> None:
    alice = await live.gateway.create_token("vision", "alice", role="admin")
    async with live.gateway.client(alice) as http:
        for i in range(8):
            submitted = await _submit(http, name=f"ryw-{i}")
            job, wrote = submitted.json(), int(submitted.headers[REVISION])
            got = await http.get(f"/v1/jobs/{job['id']}")
            newest = await http.get("/v1/jobs", params={"state": "pending", "page_size": 1})
            assert got.status_code == 200 and int(got.headers[REVISION]) >= wrote
            assert [j["id"] for j in newest.json()["jobs"]] == [job["id"]] and int(newest.headers[REVISION]) >= wrote
            held = await http.post(f"/v1/jobs/{job['id']}:hold", json={"reason": "wait"})
            assert held.status_code == 200, held.text
            assert (await http.get(f"/v1/jobs/{job['id']}")).json()["held_by"] == "alice"
            cancelled = await http.post(f"/v1/jobs/{job['id']}:cancel")
            assert int(cancelled.headers[REVISION]) > wrote
            after = await http.get(f"/v1/jobs/{job['id']}")
            assert after.json()["state"] == "cancelled" and int(after.headers[REVISION]) >= int(
                cancelled.headers[REVISION])
            assert job["id"] not in [j["id"] for j in (await http.get("/v1/jobs", params={"state": "pending"})).json()[
                "jobs"]]


async def test_a_client_of_two_gateways_reads_its_writes_with_the_revision(live: Deployment, etcd_settings: dict[
        str, str], pki_dir: Path) -> None:
    async with running_gateway(etcd=etcd_settings, etcd_prefix=live.cluster.settings.etcd_prefix,
                               scheduler_address=live.cluster.address, job_view_wait_s=0.2,
                               **pki.files_for(pki_dir, identity.GATEWAY).settings()) as other:
        alice = await live.gateway.create_token("vision", "alice")
        async with live.gateway.client(alice) as first, other.client(alice) as second:
            await eventually(lambda: truthy(other.app.app.state.deps.job_view.ready),  # type: ignore[union-attr]
                             what="the second gateway's view")
            submitted = await _submit(first)
            got = await second.get(f"/v1/jobs/{submitted.json()['id']}",
                                   headers={REVISION: submitted.headers[REVISION]})
            assert got.status_code == 200 and got.json()["id"] == submitted.json()["id"]
            assert int(got.headers[REVISION]) >= int(submitted.headers[REVISION])
            # A revision no view reaches in time: the scheduler answers (from etcd: no revision header). Compared
            # with the view's answer once the leader's pending reason, written a moment after the submit, is in
            # the view: the two reads could otherwise straddle that write.
            await reasons_written(second, [submitted.json()["id"]])
            now = await second.get(f"/v1/jobs/{submitted.json()['id']}")
            far = await second.get(f"/v1/jobs/{submitted.json()['id']}", headers={REVISION: str(2**62)})
            assert far.status_code == 200 and REVISION not in far.headers
            assert far.json() == now.json()
            bad = await second.get(f"/v1/jobs/{submitted.json()['id']}", headers={REVISION: "-1"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"


# --- the view without its stream --------------------------------------------------------------------------------

async def test_a_view_without_its_stream_answers_nothing_and_recovers_with_a_new_one(
        live: Deployment, etcd_settings: dict[str, str], tmp_path: Path, pki_dir: Path) -> None:
    alice = await live.gateway.create_token("vision", "alice")
    async with live.gateway.client(alice) as http:
        job = (await _submit(http)).json()
        assert REVISION in (await http.get(f"/v1/jobs/{job['id']}")).headers
        port = live.cluster.scheduler.grpc_port
        settings = live.cluster.settings.model_copy(update={"listen_port": port})
        await live.cluster.stop_scheduler()
        await eventually(lambda: truthy(not live.view.ready), what="the view to lose its stream")
        # No stale answer from a view without its stream: the read goes to the scheduler, which is down.
        down = await http.get(f"/v1/jobs/{job['id']}")
        assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable"
        from trainyard_scheduler.app import SchedulerApp
        replacement = SchedulerApp(settings)
        await replacement.start()
        try:
            await eventually(lambda: truthy(live.view.ready), timeout=15, what="a new snapshot")
            assert live.feed.streams >= 2
            back = await http.get(f"/v1/jobs/{job['id']}")
            assert back.status_code == 200 and REVISION in back.headers and back.json()["id"] == job["id"]
            newer = (await _submit(http, name="after")).json()
            listed = await http.get("/v1/jobs", params={"state": "pending"})
            assert [j["id"] for j in listed.json()["jobs"]] == [newer["id"], job["id"]]
        finally:
            await replacement.stop()


# --- ?watch=true ----------------------------------------------------------------------------------------------

class Watch:
    """One open watch stream, read event by event."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next(self, timeout: float = 10.0) -> dict[str, Any]:
        return await asyncio.wait_for(self._next(), timeout)

    async def _next(self) -> dict[str, Any]:
        event: dict[str, Any] = {}
        async for line in self._lines:
            if not line:
                if "event" in event:
                    return event
                continue
            if line.startswith(":"):
                continue  # keepalive
            name, _, value = line.partition(": ")
            event[name] = json.loads(value) if name == "data" else value
        raise AssertionError("the stream ended")

    async def until(self, test: Any, timeout: float = 20.0) -> dict[str, Any]:
        """The next event `test` accepts (events before it skipped)."""
        async def find() -> dict[str, Any]:
            while True:
                event = await self._next()
                if test(event):
                    return event
        return await asyncio.wait_for(find(), timeout)


@contextlib.asynccontextmanager
async def watching(http: httpx.AsyncClient, params: dict[str, Any] | None = None,
                   last_event_id: str = "") -> AsyncIterator[Watch]:
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    async with http.stream("GET", "/v1/jobs", params={"watch": "true", **(params or {})}, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        yield Watch(r)


async def test_watch_streams_a_teams_changes_and_resumes_after_the_last_event(live: Deployment) -> None:
    alice = await live.gateway.create_token("vision", "alice")
    bob = await live.gateway.create_token("nlp", "bob")
    async with live.gateway.client(alice) as a, live.gateway.client(bob) as b:
        first = (await _submit(a, name="first")).json()
        async with watching(a) as watch:
            snapshot = await watch.next()
            assert snapshot["event"] == "snapshot"
            assert (snapshot["data"]["jobs"], snapshot["data"]["reason"]) == (1, "start")
            listed = await watch.next()
            assert (listed["event"], listed["data"]["id"], listed["data"]["deleted"]) == ("job", first["id"], False)
            assert int(listed["id"]) == snapshot["data"]["revision"]
            await _submit(b, name="theirs")  # another team's: never shown
            second = (await _submit(a, name="second")).json()
            # The first job's pending reason, written by the scheduler after its submit answered, may come first.
            seen = await watch.until(lambda e: e["data"]["id"] != first["id"])
            assert seen["data"]["id"] == second["id"] and seen["data"]["state"] == "pending"
            resume_from = seen["id"]
        # While no one watches: a change and a new job.
        await a.post(f"/v1/jobs/{first['id']}:cancel")
        third = (await _submit(a, name="third")).json()
        async with watching(a, last_event_id=resume_from) as watch:
            replayed = [await watch.next()]
            while not {first["id"], third["id"]} <= {e["data"]["id"] for e in replayed}:
                replayed.append(await watch.next())
        # Every event is a change after the resume point (the scheduler also rewrites a pending job's reason,
        # so the team's jobs may show other changes too), none is another team's, and none is a snapshot.
        assert {e["event"] for e in replayed} == {"job"}
        assert {e["data"]["team"] for e in replayed} == {"vision"}
        assert all(int(e["id"]) > int(resume_from) for e in replayed if "id" in e)
        assert [e["data"]["state"] for e in replayed if e["data"]["id"] == first["id"]][-1] == "cancelled"
        # A filter: only pending jobs; the cancel of one is seen (it leaves the filter), then nothing of it.
        async with watching(a, {"state": "pending"}) as watch:
            snapshot = await watch.next()
            assert snapshot["data"]["jobs"] == 2
            assert {(await watch.next())["data"]["id"] for _ in range(2)} == {second["id"], third["id"]}
            await a.post(f"/v1/jobs/{second['id']}:cancel")
            left = await watch.until(lambda e: e["data"]["state"] != "pending")
            assert (left["data"]["id"], left["data"]["state"]) == (second["id"], "cancelled")
        # Another team's jobs, asked for by name: none, as the list answers.
        async with watching(b, {"team": "vision"}) as watch:
            assert (await watch.next())["data"]["jobs"] == 0


async def test_a_resume_point_the_view_cannot_replay_gets_a_snapshot_first(live: Deployment) -> None:
    async with live.gateway.client(live.gateway.admin_token) as http:
        job = (await _submit(http)).json()
        async with watching(http, last_event_id="1") as watch:
            snapshot = await watch.next()
            assert snapshot["event"] == "snapshot" and snapshot["data"]["reason"] == "resume point too old"
            assert (await watch.next())["data"]["id"] == job["id"]
        # Time bounds select too (a job submitted after 2099: none); a page token means nothing to a watch.
        async with watching(http, {"submitted_after": "2099-01-01T00:00:00Z", "page_token": "abc"}) as watch:
            assert (await watch.next())["data"]["jobs"] == 0
        for params, headers in (({}, {"Last-Event-ID": "not-a-revision"}), ({"last_event_id": "-1"}, {})):
            refused = await http.get("/v1/jobs", params={"watch": "true", **params}, headers=headers)
            assert refused.status_code == 400, (params, headers, refused.text)
            assert refused.json()["error"]["code"] == "invalid_argument"


async def test_a_job_that_leaves_etcd_is_a_deleted_event_and_is_read_from_the_history(archiving: Deployment) -> None:
    alice = await archiving.gateway.create_token("vision", "alice")
    async with archiving.gateway.client(alice) as http:
        job = (await _submit(http)).json()
        async with watching(http) as watch:
            await watch.until(lambda e: e["event"] == "job")
            await http.post(f"/v1/jobs/{job['id']}:cancel")
            gone = await watch.until(lambda e: e["event"] == "job" and e["data"]["deleted"])
        assert (gone["data"]["id"], gone["data"]["state"]) == (job["id"], "cancelled")
        archiving.cluster.calls.clear()
        got = await http.get(f"/v1/jobs/{job['id']}")
        assert got.status_code == 200 and got.json()["state"] == "cancelled"
        assert REVISION not in got.headers and archiving.cluster.calls.methods == ["GetJob"]
        # The team's listing now reaches into the history store: the scheduler answers it, with the job.
        listed = await http.get("/v1/jobs")
        assert [j["id"] for j in listed.json()["jobs"]] == [job["id"]] and REVISION not in listed.headers


# --- the view against the scheduler, for random job sets (a property) -----------------------------------------

USERS = (("vision", "alice"), ("vision", "bob"), ("nlp", "carol"))
NewJob = tuple[int, str, str, bool]  # (USERS index, project label, name prefix, cancelled: leaves etcd)
Query = tuple[int, tuple[str, ...], str, str, str, int]  # (who: -1 operator, states, user, project, prefix, size)

new_jobs = st.lists(st.tuples(st.integers(0, len(USERS) - 1), st.sampled_from(["atlas", "zeus"]),
                              st.sampled_from(["a-", "b-"]), st.booleans()), min_size=1, max_size=12)
queries = st.lists(st.tuples(st.integers(-1, len(USERS) - 1),
                             st.sampled_from([(), ("pending",), ("cancelled",), ("pending", "cancelled")]),
                             st.sampled_from(["", "alice", "carol"]), st.sampled_from(["", "atlas"]),
                             st.sampled_from(["", "a-"]), st.integers(1, 4)), min_size=1, max_size=5)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(jobs=new_jobs, asked=queries)
async def test_the_view_answers_what_the_scheduler_answers(archiving: Deployment, etcd_store: EtcdStore,
                                                           jobs: list[NewJob], asked: list[Query]) -> None:
    """Whatever jobs exist (live, or cancelled and moved to the history store), every GET and every page of
    every listing the gateway answers, by the view or by the scheduler, is the scheduler's own answer, and
    paging on with either's token gives the same pages. Pages of pending jobs only are always the view's."""
    d = archiving
    tokens = [await _token(d, team, user) for team, user in USERS]
    ids: list[str] = []
    # The ones that will leave etcd first: the newer live ones lie above the history's bound, where the view
    # answers the listings that merge in the history too.
    for who, project, prefix, cancel in sorted(jobs, key=lambda j: not j[3]):
        async with d.gateway.client(tokens[who]) as http:
            job = (await _submit(http, name=f"{prefix}{len(ids)}", labels={"project": project})).json()
            ids.append(job["id"])
            if cancel:
                await http.post(f"/v1/jobs/{job['id']}:cancel")
    prefix = d.cluster.settings.etcd_prefix + "/jobs/"

    async def archived() -> bool:
        # Every cancelled job has left etcd and every live one has the leader's pending reason: nothing changes
        # any more.
        stored = [json.loads(kv.value) for kv in (await etcd_store.range(prefix)).kvs]
        return bool(stored) and all(job["state"] != "cancelled" and job["message"] != WAITING_MESSAGE
                                    for job in stored)
    await eventually(archived, timeout=30, what="the cancelled jobs to leave etcd and the others' reasons")
    now = str((await etcd_store.range(prefix, limit=1)).revision)  # reads below wait for the view to get here

    for who, states, user, project, name_prefix, size in asked:
        team = "" if who < 0 else USERS[who][0]
        secret = d.gateway.admin_token if who < 0 else tokens[who]
        params: dict[str, Any] = {"page_size": size, "state": list(states), "user": user, "name_prefix": name_prefix}
        if project:
            params["label"] = f"project={project}"
        request = scheduler_pb2.ListJobsRequest(
            team=team, page_size=size, user=user, name_prefix=name_prefix,
            states=[convert.job_state_from_name(s) for s in states], labels={"project": project} if project else {})
        token = ""
        async with d.gateway.client(secret) as http:
            for _ in range(40):
                reply = await http.get("/v1/jobs", params={**params, "page_token": token}, headers={REVISION: now})
                assert reply.status_code == 200, reply.text
                request.page_token = token
                assert reply.json() == await d.scheduler_list(request), (params, token)
                if states == ("pending",):
                    assert REVISION in reply.headers, "a page of pending jobs is the view's"
                token = reply.json()["next_page_token"]
                if not token:
                    break
            for job_id in ids[-3:]:
                got = await http.get(f"/v1/jobs/{job_id}", headers={REVISION: now})
                try:
                    expected: dict[str, Any] | None = await d.scheduler_get(job_id, team=team)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND
                    expected = None
                assert (got.json() if got.status_code == 200 else None) == expected, got.text


_TOKENS: dict[tuple[int, str, str], str] = {}


async def _token(d: Deployment, team: str, user: str) -> str:
    """One token per user and deployment (the examples of a property share their deployment)."""
    key = (id(d), team, user)
    if key not in _TOKENS:
        _TOKENS[key] = await d.gateway.create_token(team, user)
    return _TOKENS[key]


# --- the page rule alone (job_view_pages.page), a table ------------------------------------------------------

def _viewed(job_id: str, team: str = "vision", state: int = 1) -> ViewedJob:
    return ViewedJob.of(scheduler_pb2.WatchedJob(job=types_pb2.Job(
        id=job_id, team=team, user="alice", state=state, spec=types_pb2.JobSpec(name=job_id, queue="default"))))


LIVE = [_viewed(f"job-{i}", team="vision" if i % 2 else "nlp") for i in range(1, 9)]  # job-1 .. job-8
OFF, EMPTY, BELOW_3, UNKNOWN = (HistoryState(), HistoryState(True, True, ""), HistoryState(True, True, "job-3"),
                                HistoryState(True, False, ""))


@pytest.mark.parametrize(("flt", "before", "limit", "history", "want"), [
    # No history store: the live jobs alone; "more" when any live job (any team) lies below the last one.
    (JobFilter(), "", 3, OFF, (["job-8", "job-7", "job-6"], True)),
    (JobFilter(team="vision"), "", 4, OFF, (["job-7", "job-5", "job-3", "job-1"], False)),
    (JobFilter(team="nlp"), "", 4, OFF, (["job-8", "job-6", "job-4", "job-2"], True)),  # job-1 is below job-2
    (JobFilter(), "job-3", 5, OFF, (["job-2", "job-1"], False)),
    # Only non-terminal states: no history merged, whatever the store holds.
    (JobFilter(states=frozenset({"pending"})), "", 2, UNKNOWN, (["job-8", "job-7"], True)),
    # Merged: L+1 matches above the bound, or the scheduler answers.
    (JobFilter(), "", 4, BELOW_3, (["job-8", "job-7", "job-6", "job-5"], True)),
    (JobFilter(), "", 5, BELOW_3, None),   # job-4 is the 5th; the 6th would be at the bound
    (JobFilter(team="vision"), "", 1, BELOW_3, (["job-7"], True)),
    (JobFilter(team="vision"), "", 2, BELOW_3, None),    # job-3, the third, is at the bound
    (JobFilter(team="vision"), "job-7", 1, BELOW_3, None),
    (JobFilter(), "", 8, EMPTY, None),     # all live, but the history's count decides "more"
    (JobFilter(), "", 2, UNKNOWN, None),   # the bound could not be read
    (JobFilter(submitted_after=1.0), "", 2, OFF, None),  # time bounds: never the view's
])
def test_which_pages_the_view_answers(flt: JobFilter, before: str, limit: int, history: HistoryState,
                                      want: tuple[list[str], bool] | None) -> None:
    jobs = {j.id: j for j in LIVE}
    ids = sorted(jobs)
    candidates = sorted(j.id for j in LIVE if not flt.team or j.team == flt.team)
    got = page(candidates, ids, jobs, flt, before=before, limit=limit, history=history)
    assert (None if got is None else ([j.id for j in got.jobs], got.more)) == want


# --- a job's JSON is made when first read, once ---------------------------------------------------------------

def test_changes_are_turned_into_json_only_when_read_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = convert.job_from_pb
    monkeypatch.setattr(convert, "job_from_pb", lambda pb: made.append(pb.id) or real(pb))

    def job(job_id: str, state: int, reason: str = "", exits: bool = False) -> scheduler_pb2.WatchedJob:
        pb = types_pb2.Job(id=job_id, team="vision", user="alice", state=state, message=reason,
                           spec=types_pb2.JobSpec(name=job_id, queue="default"))
        if exits:
            pb.exits.add(rank=0, exit_code=1)
        return scheduler_pb2.WatchedJob(job=pb, exits_from_allocation=exits)

    view = JobView()
    view.apply(scheduler_pb2.WatchJobsResponse(reset=True, synced=True, revision=1, jobs=[job("job-1", 1)]))
    for rev, reason in enumerate(["waiting", "still waiting", "no room"], start=2):  # changes nobody read
        view.apply(scheduler_pb2.WatchJobsResponse(revision=rev, jobs=[job("job-1", 1, reason), job("job-2", 1)]))
    assert view.ready and made == []
    got = view.get("job-1", "vision")
    assert got is not None
    assert json.loads(got.body)["message"] == "no room"   # the latest change, made at its first read
    assert got.list_body == got.body and got.listed.state.value == "pending" and made == ["job-1"]
    view.apply(scheduler_pb2.WatchJobsResponse(revision=5, jobs=[job("job-2", 2, exits=True)]))
    running = view.get("job-2", "vision")
    assert running is not None and made == ["job-1"]
    assert json.loads(running.body)["exits"] and not json.loads(running.list_body)["exits"]  # lists leave them out
    assert made == ["job-1", "job-2", "job-2"]
    assert running.body is running.body and made == ["job-1", "job-2", "job-2"]  # kept, not made again
