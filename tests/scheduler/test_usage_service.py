"""UsageService.GetUsage against a real scheduler replica (issue 15): mTLS on, a real etcd, a real SQLite history
store. The scripted day of test_usage is put where the scheduler keeps it: finished jobs in the history (as the
archiver writes them), one of them also still in etcd (archived, not yet expired), and the running job in etcd
with its earlier attempt and its live allocation. The replica is a standby (another candidate holds the
leadership), so it answers from its mirror, and nothing moves the allocation meanwhile. Its clock is a manual
one: the running gang is counted up to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.scheduler.v1 import usage_pb2, usage_pb2_grpc
from trainyard_core import contract as c
from trainyard_core.clock import ManualClock
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.tls import ClientTls
from trainyard_core.store.election import LeaderElection
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.archive import archived
from trainyard_scheduler.history.store import HistoryStore
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.repository import Repository

from .test_usage import T0, H, Script, day

OPS = identity.tool("ops")
PRICES = {"H100": 2.5, "A100": 1.25}


def ts(hours: float) -> Timestamp:
    return Timestamp(seconds=int(T0 + hours * H))


def request(start_h: float, end_h: float, group_by: str = "", **more: object) -> usage_pb2.GetUsageRequest:
    return usage_pb2.GetUsageRequest(since=ts(start_h), until=ts(end_h), group_by=group_by, **more)  # type: ignore[arg-type]


@dataclass
class Replica:
    app: SchedulerApp
    clock: ManualClock
    script: Script
    pki_dir: Path

    def channel(self, principal: Principal = identity.GATEWAY) -> grpc.aio.Channel:
        return secure_channel(f"127.0.0.1:{self.app.grpc_port}", ClientTls(pki.files_for(self.pki_dir, principal)),
                              identity.SCHEDULER)


async def _put_the_day(app: SchedulerApp, s: Script, history_url: str) -> None:
    store = await HistoryStore.open(history_url)
    try:
        await store.archive([archived(replace(job, finished_at=job.updated_at))
                             for job_id, job in s.jobs.items() if job_id != "job-b"])
    finally:
        await store.close()
    repo = Repository(app.store, app.keys)  # unfenced: the test writes as the leader would
    # job-a: archived and still in etcd (within job_ttl_s): in both places, to be counted once.
    done = s.jobs["job-a"]
    await repo.create_job(replace(done, finished_at=done.updated_at, archived_at=done.updated_at))
    # job-b: running its second attempt (the first, preempted, is recorded on the job), its gang placed at 4h.
    await repo.create_job(replace(s.jobs["job-b"], state=s.jobs["job-b"].state))
    found = await repo.get_job("job-b")
    assert found is not None
    await repo.commit_placement(found[0], found[1], s.allocs["job-b"])


@pytest.fixture
async def replica(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path,
                  tmp_path: Path) -> AsyncIterator[Replica]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"
    settings = SchedulerSettings.model_validate(dict(
        **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), listen_port=0, leader_ttl_s=2, history_url=url,
        usage_prices=PRICES, usage_currency="EUR", tool_teams=["ops:vision"],
        **pki.files_for(pki_dir, identity.SCHEDULER).settings()))
    s = day()  # ends at 6h, job-b running
    clock = ManualClock(s.clock.now())
    app = SchedulerApp(settings, clock=clock)
    other = LeaderElection(app.store, app.keys.leader, "another-replica:1", settings.leader_ttl_s)
    await other.campaign()  # the leader is elsewhere: this replica serves reads only
    try:
        await _put_the_day(app, s, url)
        await app.start()
        assert not app.leadership.is_leader

        async def mirrored() -> bool:
            return app.keys.allocation("job-b") in app._mirror.items
        await eventually(mirrored, what="the replica's mirror to hold the running gang")
        yield Replica(app, clock, s, pki_dir)
    finally:
        await app.stop()
        await other.resign()


def rows(reply: usage_pb2.GetUsageResponse) -> dict[str, tuple[float, float, float, float]]:
    return {r.group: (r.gpu_hours, r.cpu_hours, r.cost, r.unpriced_gpu_hours) for r in reply.rows}


async def test_the_day_by_every_grouping_as_the_domain_adds_it_up(replica: Replica) -> None:
    async with replica.channel() as ch:
        usage = usage_pb2_grpc.UsageServiceStub(ch)
        for group_by in c.USAGE_GROUPS:
            for start, end in [(0, 6), (0, 3), (3, 6), (1.5, 4.75), (5, 8)]:
                reply = await usage.GetUsage(request(start, end, group_by))
                expected = replica.script.report(start, end, group_by)
                assert rows(reply) == {r.group: (r.amount.gpu_hours, r.amount.cpu_hours, r.amount.cost_value,
                                                 r.amount.unpriced_gpu_hours) for r in expected.rows}, (group_by, start)
                assert [r.group for r in reply.rows] == [r.group for r in expected.rows]
                t = expected.total
                assert (reply.total.gpu_hours, reply.total.cost, reply.groups) == \
                    (t.gpu_hours, t.cost_value, len(expected.rows))
        whole = await usage.GetUsage(request(0, 6))
    assert rows(whole) == {"vision": (60.0, 288.0, 110.0, 8.0), "nlp": (66.0, 32.0, 160.0, 2.0)}
    assert (whole.currency, dict(whole.prices), list(whole.unpriced_models)) == ("EUR", PRICES, ["A100+H100", "L40S"])
    assert (whole.since, whole.until, whole.group_by) == (ts(0), ts(6), "team")
    assert whole.computed_at == ts(6)


async def test_the_running_gang_is_counted_up_to_the_replicas_clock(replica: Replica) -> None:
    async with replica.channel() as ch:
        usage = usage_pb2_grpc.UsageServiceStub(ch)
        before = await usage.GetUsage(request(4, 12, "job"))
        replica.clock.advance(1.5 * H)
        after = await usage.GetUsage(request(4, 12, "job"))
    # job-b: 4 A100 since 4h; job-a's second attempt ran to 5h.
    assert rows(before)["job-b"] == (8.0, 0.0, 10.0, 0.0)
    assert rows(after)["job-b"] == (14.0, 0.0, 17.5, 0.0)
    assert rows(after)["job-a"] == rows(before)["job-a"] == (8.0, 64.0, 20.0, 0.0)


async def test_a_team_sees_its_own_use_and_a_tool_only_its_teams(replica: Replica) -> None:
    async with replica.channel() as ch:
        vision = await usage_pb2_grpc.UsageServiceStub(ch).GetUsage(request(0, 6, "user", team="vision"))
    assert rows(vision) == {"alice": (44.0, 288.0, 90.0, 8.0), "bob": (16.0, 0.0, 20.0, 0.0)}
    assert vision.total.gpu_hours == 60.0
    async with replica.channel(OPS) as ch:
        usage = usage_pb2_grpc.UsageServiceStub(ch)
        mine = await usage.GetUsage(request(0, 6, "team", team="vision"))
        assert rows(mine) == {"vision": (60.0, 288.0, 110.0, 8.0)}
        for team, message in [("", "must name the team it acts for; its teams: vision"),
                              ("nlp", "may not act for team 'nlp'; its teams: vision")]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await usage.GetUsage(request(0, 6, team=team))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and message in str(err.value.details())


async def test_the_limit_cuts_the_rows_not_the_totals(replica: Replica) -> None:
    async with replica.channel() as ch:
        reply = await usage_pb2_grpc.UsageServiceStub(ch).GetUsage(request(0, 6, "job", limit=2))
    assert [r.group for r in reply.rows] == ["job-c", "job-a"] and reply.groups == 6
    assert reply.total.gpu_hours == 126.0


@pytest.mark.parametrize(("change", "message"), [
    ({"since": None}, "since must be set: a usage window is [since, until)"),
    ({"since": None, "until": None}, "since and until must be set"),
    ({"since": ts(6), "until": ts(5)}, "give an end (until) at or after its start (since)"),
    ({"group_by": "account"}, "group_by must be one of team, project, user, model, queue, job (got 'account')"),
    ({"limit": c.MAX_USAGE_ROWS + 1}, f"limit must be from 1 to {c.MAX_USAGE_ROWS}"),
    ({"limit": -1}, "limit must be from 1"),
    ({"team": "Not A Team"}, "team 'Not A Team' must be"),
])
async def test_what_is_refused_says_what_to_fix(replica: Replica, change: dict[str, object], message: str) -> None:
    req = request(0, 6)
    for name, value in change.items():
        if value is None:
            req.ClearField(name)  # type: ignore[arg-type]
        elif isinstance(value, Timestamp):
            getattr(req, name).CopyFrom(value)
        else:
            setattr(req, name, value)
    async with replica.channel() as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await usage_pb2_grpc.UsageServiceStub(ch).GetUsage(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err.value.details())


async def test_an_empty_window_answers_zeros_with_the_currency(replica: Replica) -> None:
    async with replica.channel() as ch:
        reply = await usage_pb2_grpc.UsageServiceStub(ch).GetUsage(request(3, 3))
    assert list(reply.rows) == [] and reply.total.gpu_hours == 0 and reply.currency == "EUR"
