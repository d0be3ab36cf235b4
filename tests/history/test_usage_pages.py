"""HistoryStore.usage pages with a keyset (`after`, the last record's `key`), on SQLite and on PostgreSQL: every
record of a window once, in order, however many share a start time (issue 15's usage reports read all of a
window in pages)."""

from __future__ import annotations

from trainyard_scheduler.history import HistoryStore
from trainyard_scheduler.history.store import UsageKey, UsageRecord

from .test_history_store import T0, job, usage


async def _walk(store: HistoryStore, page: int, **window: object) -> list[UsageRecord]:
    seen: list[UsageRecord] = []
    after: UsageKey | None = None
    while True:
        got = await store.usage(limit=page, after=after, **window)  # type: ignore[arg-type]
        seen += got
        if len(got) < page:
            return seen
        after = got[-1].key


async def test_pages_after_a_key_hold_every_record_once_in_order(store: HistoryStore) -> None:
    # Three attempts of each of 7 jobs; many records start at the same instant (the keyset's ties).
    records = {n: tuple(usage(n, a, team="ml" if n % 2 else "vision", started=T0 + 100 * (a + n % 3),
                              ended=T0 + 100 * (a + n % 3) + 150) for a in range(3)) for n in range(7)}
    await store.archive([job(n, team=recs[0].team, records=recs) for n, recs in records.items()])
    everything = await store.usage()
    assert len(everything) == 21
    assert everything == sorted(everything, key=lambda r: r.key)
    for page in (1, 2, 5, 21, 50):
        assert await _walk(store, page) == everything, page
    window = {"team": "ml", "since": T0 + 120, "until": T0 + 450}
    assert await _walk(store, 2, **window) == await store.usage(**window)  # type: ignore[arg-type]
    last = everything[-1].key
    assert await store.usage(after=last) == []
    assert await store.usage(after=UsageKey(last.started_at, last.job_id, last.attempt - 1)) == [everything[-1]]
