"""`HistoryStore.list` gives the same pages whichever way it reads them (store._page_query): a label that drives
the page through its own index or is checked on a walk, a range read whole from its own index or checked on a
walk, on either side of the caps that choose between them, with the other filters and `before` applied the
same way. Behaviour only: which plan a database picks, and how fast, is bench/history.py's business."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from trainyard_scheduler.history import ArchivedJob, HistoryStore, JobFilter
from trainyard_scheduler.history import store as history_store

T0 = 1_764_633_600.25
JOBS = 120


def _job(n: int) -> ArchivedJob:
    labels = {"env": "prod" if n % 2 else "test"}
    if n % 3 == 0:
        labels["project"] = "atlas"
    submitted = T0 + n * 60
    return ArchivedJob(job_id=f"j-{n:06d}", team=("ml", "speech", "vision")[n % 3 // 2 + n % 2],
                       user=("ada", "bob")[n % 5 == 0], name=("train-a", "train-b", "eval")[n % 4 % 3],
                       queue=("default", "batch")[n % 7 == 0], state=("SUCCEEDED", "FAILED")[n % 4 == 1],
                       labels=labels, submitted_at=submitted, finished_at=submitted + 30 + (n % 11) * 300,
                       record=b"r%d" % n)


@dataclass(frozen=True)
class Case:
    what: str
    flt: JobFilter


CASES = [
    Case("label", JobFilter(labels={"project": "atlas"})),
    Case("label and team", JobFilter(team="ml", labels={"project": "atlas"})),
    Case("two labels", JobFilter(labels={"env": "prod", "project": "atlas"})),
    Case("label, state and name", JobFilter(states=frozenset({"FAILED"}), labels={"env": "test"},
                                            name_prefix="train")),
    Case("label and finished window", JobFilter(labels={"project": "atlas"}, finished_after=T0 + 600,
                                                finished_before=T0 + 4000)),
    Case("label nobody has", JobFilter(team="ml", labels={"project": "nobody"})),
    Case("name prefix", JobFilter(name_prefix="train")),
    Case("team and name prefix", JobFilter(team="speech", name_prefix="train-b")),
    Case("finished window", JobFilter(finished_after=T0 + 1200, finished_before=T0 + 5400)),
    Case("team, user and finished window", JobFilter(team="vision", user="bob", finished_after=T0,
                                                     finished_before=T0 + 7200)),
    Case("submitted and finished windows", JobFilter(submitted_after=T0 + 600, submitted_before=T0 + 4800,
                                                     finished_after=T0 + 1800, finished_before=T0 + 6000)),
    Case("window and queue that nothing matches", JobFilter(queue="batch", finished_after=T0 + 60,
                                                            finished_before=T0 + 400)),
    Case("window, label and state", JobFilter(states=frozenset({"SUCCEEDED"}), labels={"env": "prod"},
                                              finished_after=T0 + 900, finished_before=T0 + 6300)),
]


def _matches(j: ArchivedJob, f: JobFilter) -> bool:
    def within(value: float, low: float | None, high: float | None) -> bool:
        return (low is None or value >= low) and (high is None or value < high)

    return ((not f.team or j.team == f.team) and (not f.user or j.user == f.user)
            and (not f.queue or j.queue == f.queue) and (not f.states or j.state in f.states)
            and all(j.labels.get(k) == v for k, v in f.labels.items()) and j.name.startswith(f.name_prefix)
            and within(j.submitted_at, f.submitted_after, f.submitted_before)
            and within(j.finished_at, f.finished_after, f.finished_before))


def _expected(data: list[ArchivedJob], f: JobFilter, before: str = "") -> list[str]:
    return sorted((j.job_id for j in data if _matches(j, f) and (not before or j.job_id < before)), reverse=True)


# Caps below, at and above what the dataset's filters select: each flips some filter from "its index drives"
# to "checked on a walk" and back (JOBS / 3 label jobs of "project", JOBS / 2 of each "env").
@pytest.mark.parametrize("cap", [1, JOBS // 3, JOBS // 3 + 1, JOBS // 2, 10_000])
async def test_every_plan_gives_the_same_pages(store: HistoryStore, cap: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_store, "_LABEL_DRIVER_CAP", cap)
    monkeypatch.setattr(history_store, "_RANGE_DRIVER_CAP", cap)
    data = [_job(n) for n in range(JOBS)]
    await store.archive(data)
    for case in CASES:
        want = _expected(data, case.flt)
        assert [j.job_id for j in await store.list(case.flt, limit=1000)] == want, f"{case.what}, cap {cap}"
        for limit in (1, 3):
            got = [j.job_id for j in await store.list(case.flt, limit=limit)]
            assert got == want[:limit], f"{case.what}, cap {cap}, limit {limit}"
        # Page by page with `before`, as a client does: the pages join up to the whole answer.
        pages: list[str] = []
        for _ in range(len(want) // 4 + 2):  # bounded: a wrong page must fail the test, not loop
            if not (page := await store.list(case.flt, limit=4, before=pages[-1] if pages else "")):
                break
            pages += [j.job_id for j in page]
        assert pages == want, f"{case.what}, cap {cap}, paged"
        if len(want) > 2:
            middle = want[len(want) // 2]
            got = [j.job_id for j in await store.list(case.flt, limit=1000, before=middle)]
            assert got == _expected(data, case.flt, middle), f"{case.what}, cap {cap}, before {middle}"


async def test_a_page_comes_back_whole(store: HistoryStore) -> None:
    data = [_job(n) for n in range(JOBS)]
    await store.archive(data)
    by_id = {j.job_id: j for j in data}
    for flt in (JobFilter(team="ml", labels={"project": "atlas"}), JobFilter(team="speech", name_prefix="train")):
        page = await store.list(flt, limit=5)
        assert page and page == [by_id[j.job_id] for j in page], "rows with their labels, as archived"


async def test_postgres_vacuums_the_listed_tables_every_10000_archived_rows(store: HistoryStore) -> None:
    """Migration 0004: the storage parameters that keep the newest rows in the visibility map (see there)."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("a PostgreSQL storage parameter")
    async with store.engine.connect() as conn:
        options: dict[str, list[str] | None] = dict((await conn.execute(sa.text(
            "SELECT relname, reloptions FROM pg_class WHERE relname IN ('jobs', 'job_labels', 'usage_records') "
            "AND relnamespace = current_schema()::regnamespace"))).all())
    wanted = ["autovacuum_vacuum_insert_threshold=10000", "autovacuum_vacuum_insert_scale_factor=0"]
    assert sorted(options["jobs"] or ()) == sorted(options["job_labels"] or ()) == sorted(wanted)
    assert options["usage_records"] is None, "usage_records keeps the server's defaults"
