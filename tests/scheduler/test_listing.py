"""ListJobs: live jobs (etcd) and finished ones (the history store) in one newest-first listing, every filter,
opaque page tokens that keep their filter, and pages that stay stable while jobs arrive or move to history.

The filter is checked three ways over one data set: the pure `listing.matches`, the SQL of the history store
(SQLite here; tests/history runs the store's own contract on PostgreSQL too) and the merged RPC."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.clock import SystemClock
from trainyard_core.errors import InvalidArgument
from trainyard_core.store.memory import MemoryStore
from trainyard_scheduler.archive import archived
from trainyard_scheduler.domain import listing
from trainyard_scheduler.domain.listing import JobFilter
from trainyard_scheduler.domain.models import Job, JobState
from trainyard_scheduler.grpc.servicer import JobServicer
from trainyard_scheduler.history.access import History
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job

T0 = 1_790_000_000.0
TEAMS = ("team-a", "team-b")
STATES = (JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


def _job(n: int) -> Job:
    """Job n of the data set: submitted n minutes after T0, with fields that vary at different rates."""
    state = STATES[n % len(STATES)]
    job = make_job(f"job-{n:05d}", team=TEAMS[n % 2], created=T0 + 60 * n, state=state,
                   queue=("default", "batch", "default")[n % 3])
    spec = replace(job.spec, name=("sweep-", "train-", "eval-")[n % 3] + str(n),
                   labels={"project": ("atlas", "zeus")[n % 4 == 0], **({"env": "prod"} if n % 5 == 0 else {})})
    finished = T0 + 60 * n + 30 * (n % 7) if state.terminal else None
    return replace(job, spec=spec, user=("alice", "bob", "carol")[n % 3], finished_at=finished)


DATA = [_job(n) for n in range(60)]


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[JobServicer, Repository, History]]:
    """60 jobs: the finished ones with an even number are only in the history store (they left etcd), the
    odd ones in both (archived, not expired yet); live jobs only in etcd."""
    repo = Repository(MemoryStore(), Keys("/t"))
    history = History(f"sqlite+aiosqlite:///{tmp_path / 'history.db'}")
    store = await history.store()
    for job in DATA:
        if job.state.terminal:
            await store.archive([archived(job)])
        if not job.state.terminal or int(job.id[-5:]) % 2:
            await repo.create_job(job)
    yield JobServicer(repo, SystemClock(), asyncio.Event(), history=history), repo, history
    await history.close()


def _ts(t: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


async def _walk(servicer: JobServicer, page_size: int, page_token: str = "", **fields: object) -> list[str]:
    seen: list[str] = []
    token = page_token
    while True:
        reply = await servicer.ListJobs(scheduler_pb2.ListJobsRequest(page_size=page_size, page_token=token,
                                                                      **fields), None)  # type: ignore[arg-type]
        assert len(reply.jobs) <= page_size
        seen += [j.id for j in reply.jobs]
        token = reply.next_page_token
        if not token:
            return seen


CASES: list[tuple[str, dict[str, object], JobFilter]] = [
    ("nothing", {}, JobFilter()),
    ("team", {"team": "team-b"}, JobFilter(team="team-b")),
    ("user", {"user": "carol"}, JobFilter(user="carol")),
    ("live states only", {"states": [types_pb2.JOB_STATE_PENDING, types_pb2.JOB_STATE_RUNNING]},
     JobFilter(states=frozenset({"pending", "running"}))),
    ("a terminal and a live state", {"states": [types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_PENDING]},
     JobFilter(states=frozenset({"failed", "pending"}))),
    ("queue", {"queue": "batch"}, JobFilter(queue="batch")),
    ("labels", {"labels": {"project": "zeus", "env": "prod"}}, JobFilter(labels={"project": "zeus", "env": "prod"})),
    ("name prefix", {"name_prefix": "sweep-"}, JobFilter(name_prefix="sweep-")),
    ("submitted range", {"submitted_after": _ts(T0 + 600), "submitted_before": _ts(T0 + 1800)},
     JobFilter(submitted_after=T0 + 600, submitted_before=T0 + 1800)),
    ("finished after", {"finished_after": _ts(T0 + 2000)}, JobFilter(finished_after=T0 + 2000)),
    ("finished before, team and state", {"finished_before": _ts(T0 + 1500), "team": "team-a",
                                         "states": [types_pb2.JOB_STATE_SUCCEEDED]},
     JobFilter(finished_before=T0 + 1500, team="team-a", states=frozenset({"succeeded"}))),
]


@pytest.mark.parametrize(("fields", "flt"), [(f, flt) for _, f, flt in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("page_size", [1, 7, 500])
async def test_every_filter_lists_what_matches_newest_first_once(
        setup: tuple[JobServicer, Repository, History], fields: dict[str, object], flt: JobFilter,
        page_size: int) -> None:
    servicer, _, _ = setup
    want = sorted((j.id for j in DATA if listing.matches(j, flt)), reverse=True)
    assert want or flt == JobFilter(labels={"project": "zeus", "env": "prod"}), "the data set exercises the filter"
    assert await _walk(servicer, page_size, **fields) == want


async def test_a_job_submitted_or_archived_between_pages_shifts_nothing(
        setup: tuple[JobServicer, Repository, History]) -> None:
    servicer, repo, history = setup
    first = await servicer.ListJobs(scheduler_pb2.ListJobsRequest(page_size=10), None)  # type: ignore[arg-type]
    shown = [j.id for j in first.jobs]
    # A newer job arrives, and a live job further down finishes and leaves etcd for the history store.
    await repo.create_job(_job(99))
    moving = next(j for j in DATA[::-1] if not j.state.terminal and j.id < shown[-1])
    found = await repo.get_job(moving.id)
    assert found is not None
    done = replace(moving, state=JobState.SUCCEEDED, finished_at=T0 + 10_000)
    await (await history.store()).archive([archived(done)])
    await repo.delete_job(done, found[1])
    rest = await _walk(servicer, 10, page_token=first.next_page_token)
    assert shown + rest == sorted((j.id for j in DATA), reverse=True), "every job once, the new one on no page"


async def test_page_tokens_are_opaque_and_bound_to_their_filter(
        setup: tuple[JobServicer, Repository, History]) -> None:
    servicer, _, _ = setup
    first = await servicer.ListJobs(scheduler_pb2.ListJobsRequest(page_size=2, user="bob"), None)  # type: ignore[arg-type]
    token = first.next_page_token
    assert token and DATA[0].id[:4] not in token, "a token does not show the cursor"
    with pytest.raises(InvalidArgument, match="other filters"):
        await servicer.ListJobs(scheduler_pb2.ListJobsRequest(page_size=2, page_token=token), None)  # type: ignore[arg-type]
    forged = base64.urlsafe_b64encode(json.dumps({"v": 1, "b": "job-x!", "f": "0"}).encode()).decode().rstrip("=")
    for bad in ("job-00010", "%%%", forged, "e30"):
        with pytest.raises(InvalidArgument, match="not a token this API issued"):
            await servicer.ListJobs(scheduler_pb2.ListJobsRequest(page_token=bad), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("flt", "message"), [
    (JobFilter(user="a b"), "user filter"),
    (JobFilter(queue="Bad_"), "queue filter"),
    (JobFilter(labels={"bad key!": "x"}), "label filter key"),
    (JobFilter(labels={"k": "x" * 254}), "at most 253"),
    (JobFilter(labels={f"k{i}": "v" for i in range(65)}), "at most 64 label filters"),
    (JobFilter(name_prefix="x" * 64), "name_prefix must be at most 63"),
    (JobFilter(finished_after=1e300), "is not a time"),
    (JobFilter(states=frozenset({"bogus"})), "state filter"),
])
def test_filters_no_job_could_match_are_refused_with_what_to_fix(flt: JobFilter, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        listing.check_filter(flt)


def test_an_empty_time_range_matches_nothing_and_is_no_error() -> None:
    for flt in (JobFilter(submitted_after=10.0, submitted_before=5.0), JobFilter(finished_before=-100.0)):
        listing.check_filter(flt)
        assert not any(listing.matches(j, flt) for j in DATA)


def test_digest_ignores_order_and_tells_filters_apart() -> None:
    a = JobFilter(states=frozenset({"failed", "pending"}), labels={"a": "1", "b": "2"})
    b = JobFilter(states=frozenset({"pending", "failed"}), labels={"b": "2", "a": "1"})
    assert a.digest() == b.digest()
    assert a.digest() != replace(a, team="x").digest() != replace(a, submitted_after=0.0).digest()
    assert listing.decode_token(listing.encode_token("job-00001", a), b) == "job-00001"
