"""The leader prunes the history store past the retention settings: job rows after
`history_job_retention_days`, usage records after `history_usage_retention_days` (a job's usage outlives its
row), at most once an interval, in bounded passes; a failed prune is counted and archiving goes on. The
settings refuse what is neither 0 (keep forever) nor a number of days.

The archiver's own tests run it on the in-memory store with a hand-moved clock and a real SQLite history;
the last one runs a real scheduler (real etcd, mTLS) with the settings and watches it prune."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pydantic
import pytest

from trainyard_core.clock import ManualClock
from trainyard_core.security import identity, pki
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing.wait import eventually
from trainyard_scheduler import metrics
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.archive import Archiver, ArchiveSettings, archived
from trainyard_scheduler.domain.models import JobState
from trainyard_scheduler.history.access import History
from trainyard_scheduler.history.store import ArchivedJob, HistoryStore, HistoryUnavailable, Pruned, UsageRecord
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state import codec
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import NOW, make_job

KEYS = Keys("/ty")
DAY = 86400.0


def finished(job_id: str, ended: float, *, usage_ended: float | None = None) -> ArchivedJob:
    """A job as the history has it, finished at `ended`, with one usage record ending at `usage_ended`."""
    job = replace(make_job(job_id), state=JobState.SUCCEEDED, finished_at=ended)
    end = ended if usage_ended is None else usage_ended
    return replace(archived(job), usage=(UsageRecord(
        job_id=job_id, attempt=0, team=job.team, user=job.user, project="", queue="default", accelerator_model="H100",
        gpus=8, cpus=64, nodes=1, started_at=end - 3600, ended_at=end),))


def pruned_total(kind: str) -> float:
    return float(metrics.HISTORY_PRUNED.labels(kind=kind)._value.get())


@dataclass
class Leader:
    archiver: Archiver
    clock: ManualClock
    history: History
    store: HistoryStore
    etcd: MemoryStore
    mirror: PrefixMirror


@pytest.fixture
def history_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"


@pytest.fixture
def archive_settings() -> ArchiveSettings:
    return ArchiveSettings(job_ttl_s=3600, job_retention_s=1 * DAY, usage_retention_s=5 * DAY)


@pytest.fixture
async def leader(history_url: str, archive_settings: ArchiveSettings) -> AsyncIterator[Leader]:
    clock = ManualClock(NOW)
    etcd = MemoryStore()
    mirror = PrefixMirror(etcd, KEYS.prefix + "/")
    await mirror.start()
    history = History(history_url)
    archiver = Archiver(repo=Repository(etcd, KEYS), mirror=mirror, history=history, clock=clock,
                        settings=archive_settings)
    try:
        yield Leader(archiver, clock, history, await history.store(), etcd, mirror)
    finally:
        await history.close()
        await mirror.stop()


async def test_prunes_job_rows_and_usage_on_their_own_retention_at_most_once_an_interval(
        leader: Leader, caplog: pytest.LogCaptureFixture) -> None:
    await leader.store.archive([
        finished("job-old", NOW - 10 * DAY),     # past both retentions
        finished("job-mid", NOW - 2 * DAY),      # its row goes, its usage stays
        finished("job-new", NOW - 3600),         # kept whole
    ])
    jobs_before, usage_before = pruned_total("job"), pruned_total("usage")
    with caplog.at_level(logging.INFO, logger="trainyard_scheduler.archive"):
        assert await leader.archiver.prune() == Pruned(jobs=2, usage=1)
    assert await leader.store.get("job-old") is None and await leader.store.get("job-mid") is None
    assert await leader.store.count() == 1
    assert sorted(u.job_id for u in await leader.store.usage()) == ["job-mid", "job-new"], \
        "usage outlives its job's row"
    assert (pruned_total("job") - jobs_before, pruned_total("usage") - usage_before) == (2, 1)
    line = next(r for r in caplog.records if r.getMessage() == "pruned the history store")
    assert line.levelno == logging.INFO
    assert (line.__dict__["jobs_pruned"], line.__dict__["usage_pruned"]) == (2, 1)

    # Within the interval nothing is pruned, even what has passed its retention meanwhile.
    await leader.store.archive([finished("job-late", NOW - 3 * DAY)])
    assert await leader.archiver.prune() is None
    leader.clock.advance(3599)
    assert await leader.archiver.prune() is None
    assert await leader.store.get("job-late") is not None
    leader.clock.advance(1)
    assert await leader.archiver.prune() == (1, 0)
    assert await leader.store.get("job-late") is None


@pytest.mark.parametrize("archive_settings", [ArchiveSettings(job_ttl_s=3600)])
async def test_without_a_retention_nothing_is_pruned(leader: Leader) -> None:
    await leader.store.archive([finished("job-old", NOW - 3650 * DAY)])
    assert await leader.archiver.prune() is None
    assert await leader.store.count() == 1 and len(await leader.store.usage()) == 1


@pytest.mark.parametrize("archive_settings", [ArchiveSettings(job_retention_s=DAY, prune_batch=2, prune_batches=2)])
async def test_a_large_prune_goes_on_at_the_next_pass_and_logs_once_when_done(
        leader: Leader, caplog: pytest.LogCaptureFixture) -> None:
    await leader.store.archive([finished(f"job-{n}", NOW - 10 * DAY + n) for n in range(7)])
    with caplog.at_level(logging.INFO, logger="trainyard_scheduler.archive"):
        assert await leader.archiver.prune() == (4, 0), "2 batches of 2: the pass's budget"
        assert not [r for r in caplog.records if r.getMessage() == "pruned the history store"]
        assert await leader.archiver.prune() == (3, 0), "due again at once while there is more"
        assert await leader.archiver.prune() is None, "then not before the interval"
    lines = [r for r in caplog.records if r.getMessage() == "pruned the history store"]
    assert len(lines) == 1 and lines[0].__dict__["jobs_pruned"] == 7
    assert await leader.store.count() == 0


async def test_a_failed_prune_is_counted_and_archiving_goes_on(leader: Leader, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    async def unavailable(**_: object) -> Pruned:
        raise HistoryUnavailable("prune jobs: history database at test: statement timeout")

    monkeypatch.setattr(leader.store, "prune", unavailable)
    done = replace(make_job("job-done"), state=JobState.FAILED, finished_at=NOW - 60)
    await leader.etcd.put(KEYS.job(done.id), codec.encode_job(done))
    await leader.mirror.wait_for(await leader.etcd.put(KEYS.prefix + "/marker", b"x"))
    errors = metrics.HISTORY_ERRORS._value.get()
    with caplog.at_level(logging.WARNING, logger="trainyard_scheduler.archive"):
        assert await leader.archiver.step() == 1, "archived and marked"
        assert await leader.archiver.prune() is None
    assert metrics.HISTORY_ERRORS._value.get() == errors + 1
    assert any("cannot prune the history store" in r.getMessage() and "statement timeout" in r.getMessage()
               for r in caplog.records)
    assert await leader.store.get("job-done") is not None
    kv = await leader.etcd.get(KEYS.job(done.id))
    assert kv is not None and codec.decode_job(kv.value).archived_at == NOW
    assert await leader.archiver.prune() is None, "tried again at the next interval, not at every pass"
    monkeypatch.undo()
    leader.clock.advance(3600)
    assert await leader.archiver.prune() == (0, 0)


@pytest.mark.parametrize("value", [-1, 36_501])
@pytest.mark.parametrize("name", ["history_job_retention_days", "history_usage_retention_days"])
def test_retention_settings_are_0_or_whole_days(name: str, value: int) -> None:
    assert getattr(SchedulerSettings.model_validate({}), name) == 0, "the default: kept forever"
    assert getattr(SchedulerSettings.model_validate({name: 1}), name) == 1
    with pytest.raises(pydantic.ValidationError, match=rf"{name} must be 0 \(keep forever\) or a number of days"):
        SchedulerSettings.model_validate({name: value})
    with pytest.raises(pydantic.ValidationError, match="valid integer"):
        SchedulerSettings.model_validate({name: 0.5})


async def test_the_leader_prunes_with_the_retention_settings(etcd_settings: dict[str, str], key_prefix: str,
                                                             pki_dir: Path, history_url: str) -> None:
    now = time.time()
    store = await HistoryStore.open(history_url)
    try:
        await store.archive([finished("job-old", now - 10 * DAY), finished("job-new", now - 3600)])
        app = SchedulerApp(SchedulerSettings.model_validate(dict(
            **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), listen_port=0, leader_ttl_s=2,
            reconcile_interval_s=0.2, history_url=history_url, history_job_retention_days=1,
            history_usage_retention_days=30, **pki.files_for(pki_dir, identity.SCHEDULER).settings())))
        await app.start()
        try:
            async def pruned() -> bool:
                return await store.get("job-old") is None

            await eventually(pruned, what="the leader to prune the job past its retention", timeout=20)
            assert await store.get("job-new") is not None
            assert sorted(u.job_id for u in await store.usage()) == ["job-new", "job-old"], \
                "its usage is kept for 30 days"
        finally:
            await app.stop()
    finally:
        await store.close()
