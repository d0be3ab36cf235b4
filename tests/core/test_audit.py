"""The audit log against the session's real etcd: append, newest-first queries with filters and stable
paging, retention by leases per time bucket, writes that fail and are retried; and the agent's file sink."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from pathlib import Path

import pytest

from tests.core.store_faults import FaultyStore
from trainyard_core import audit
from trainyard_core.audit import AuditEntry, AuditFile, AuditFilter, AuditLog
from trainyard_core.clock import ManualClock
from trainyard_core.errors import InvalidArgument
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

T0 = 1_800_000_000.0


def entry(t: float, *, principal: str = "trainyard://tool/ops", action: str = "/svc.v1.S/Do", target: str = "",
          result: str = "ok", team: str = "", **kw: object) -> AuditEntry:
    return AuditEntry.make(time=t, principal=principal, service="scheduler", action=action, target=target,
                           result=result, team=team, **kw)  # type: ignore[arg-type]


def failures(sink: str) -> float:
    value = audit.WRITE_FAILURES.labels(sink=sink)._value.get()
    return float(value)


async def test_entries_read_back_newest_first_with_every_field(etcd_store: EtcdStore, key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    first = entry(T0, principal="user:vision/alice", role="member", team="vision", target="job/job-1",
                  action="POST /v1/jobs/{job_id}:cancel", request_id="req-42", detail={"http_status": 200})
    assert await log.append(first)
    assert await log.append(entry(T0 + 1, target="node/gpu-01", result="permission_denied", message="no"))
    page = await log.query(AuditFilter())
    assert [e.target for e in page.entries] == ["node/gpu-01", "job/job-1"]
    assert page.next_page_token == ""
    got = page.entries[1]
    assert (got.time, got.principal, got.role, got.team, got.action, got.request_id, dict(got.detail)) == \
        (T0, "user:vision/alice", "member", "vision", "POST /v1/jobs/{job_id}:cancel", "req-42",
         {"http_status": "200"})
    assert got.user == "alice" and got.id
    kvs = (await etcd_store.range(key_prefix.rstrip("/") + "/audit/")).kvs
    assert [kv.key.rsplit("/", 1)[1] for kv in kvs] == [e.id for e in page.entries]
    assert all(kv.lease for kv in kvs)


async def test_a_fresh_request_id_replaces_a_missing_or_unusable_one(etcd_store: EtcdStore, key_prefix: str) -> None:
    assert entry(T0).request_id.startswith("r-")
    assert entry(T0, request_id="bad id\nwith newline").request_id.startswith("r-")
    long = entry(T0, message="x" * 5000, detail={f"k{i}": "v" * 999 for i in range(20)})
    assert len(long.message) == audit.MAX_MESSAGE and len(long.detail) == audit.MAX_DETAIL_FIELDS
    assert all(len(v) == audit.MAX_DETAIL_VALUE for v in long.detail.values())


async def test_filters_combine(etcd_store: EtcdStore, key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    rows = [
        entry(T0 + 0, principal="user:vision/alice", team="vision", action="POST /v1/jobs", target="job/job-a"),
        entry(T0 + 1, principal="user:nlp/alice", team="nlp", action="POST /v1/jobs", target="job/job-b"),
        entry(T0 + 2, principal="user:vision/bob", team="vision", target="job/job-a",
              action="/trainyard.scheduler.v1.JobService/CancelJob", result="permission_denied"),
        entry(T0 + 3, principal="trainyard://node/gpu-01", action="/trainyard.scheduler.v1.NodeService/RegisterNode",
              target="node/gpu-01"),
    ]
    for r in rows:
        assert await log.append(r)

    async def targets(**kw: object) -> list[str]:
        return [f"{e.principal} {e.target}" for e in (await log.query(AuditFilter(**kw))).entries]  # type: ignore[arg-type]

    assert await targets(user="alice") == ["user:nlp/alice job/job-b", "user:vision/alice job/job-a"]
    assert await targets(user="alice", team="vision") == ["user:vision/alice job/job-a"]
    assert await targets(principal="trainyard://node/gpu-01") == ["trainyard://node/gpu-01 node/gpu-01"]
    assert await targets(action="CancelJob") == ["user:vision/bob job/job-a"]
    assert await targets(action="/trainyard.scheduler.v1.JobService/CancelJob") == ["user:vision/bob job/job-a"]
    assert await targets(action="Cancel") == []  # the last part whole, not any substring
    assert await targets(target="job/job-a") == ["user:vision/bob job/job-a", "user:vision/alice job/job-a"]
    assert await targets(result="permission_denied") == ["user:vision/bob job/job-a"]
    assert await targets(since=T0 + 1, until=T0 + 2) == ["user:vision/bob job/job-a", "user:nlp/alice job/job-b"]
    assert await targets(until=T0) == ["user:vision/alice job/job-a"]
    assert await targets(since=T0 + 3) == ["trainyard://node/gpu-01 node/gpu-01"]


async def test_pages_are_stable_while_entries_are_appended(etcd_store: EtcdStore, key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    for i in range(7):
        assert await log.append(entry(T0 + i, target=f"job/job-{i}"))
    first = await log.query(AuditFilter(), page_size=3)
    assert [e.target for e in first.entries] == ["job/job-6", "job/job-5", "job/job-4"]
    for i in range(7, 10):  # newer entries arrive between the pages
        assert await log.append(entry(T0 + i, target=f"job/job-{i}"))
    second = await log.query(AuditFilter(), page_size=3, page_token=first.next_page_token)
    assert [e.target for e in second.entries] == ["job/job-3", "job/job-2", "job/job-1"]
    third = await log.query(AuditFilter(), page_size=3, page_token=second.next_page_token)
    assert [e.target for e in third.entries] == ["job/job-0"]
    assert third.next_page_token == ""
    assert [e.target for e in (await log.query(AuditFilter(), page_size=1)).entries] == ["job/job-9"]


async def test_a_sparse_filter_reads_a_bounded_stretch_per_page(etcd_store: EtcdStore, key_prefix: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit, "MAX_SCAN", 4)
    log = AuditLog(etcd_store, key_prefix)
    for i in range(6):
        assert await log.append(entry(T0 + i, target="job/rare" if i == 0 else "job/common"))
    page = await log.query(AuditFilter(target="job/rare"))
    assert page.entries == [] and page.next_page_token  # 4 read, none matched: more may follow
    rest = await log.query(AuditFilter(target="job/rare"), page_token=page.next_page_token)
    assert [e.target for e in rest.entries] == ["job/rare"] and rest.next_page_token == ""


async def test_bad_page_tokens_and_sizes_are_refused(etcd_store: EtcdStore, key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    for token in ("nope", "YTE6eHh4", audit.encode_page_token("0" * 19)):
        with pytest.raises(InvalidArgument, match="page_token is not one this API handed out"):
            await log.query(AuditFilter(), page_token=token)
    with pytest.raises(InvalidArgument, match="page_size must be 1-500"):
        await log.query(AuditFilter(), page_size=0)


async def test_retention_drops_whole_buckets(etcd_store: EtcdStore, key_prefix: str) -> None:
    """One lease per bucket, TTL = retention + one bucket: here 1 s + 1 s, so the entries go within ~2 s."""
    clock = ManualClock(start=T0)
    log = AuditLog(etcd_store, key_prefix, retention_s=1, bucket_s=1, clock=clock)
    assert await log.append(entry(0, target="job/a"))
    assert await log.append(entry(0, target="job/b"))
    clock.advance(1)
    assert await log.append(entry(0, target="job/c"))
    kvs = (await etcd_store.range(log.prefix)).kvs
    leases = {kv.key: kv.lease for kv in kvs}
    assert len(set(leases.values())) == 2  # a and b share their bucket's lease; c has the next one's

    async def gone() -> bool:
        return not (await etcd_store.range(log.prefix)).kvs

    await eventually(gone, timeout=10, what="the audit entries to expire with their leases")


async def test_a_lost_answer_is_retried_without_a_second_entry(etcd_store: EtcdStore, key_prefix: str) -> None:
    faulty = FaultyStore(etcd_store)
    log = AuditLog(faulty, key_prefix)
    faulty.lose_txn_answers(1)
    assert await log.append(entry(T0, target="job/x"))
    assert faulty.lost_txns == 1
    assert [e.target for e in (await log.query(AuditFilter())).entries] == ["job/x"]


async def test_a_revoked_bucket_lease_is_replaced(etcd_store: EtcdStore, key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix, clock=ManualClock(start=T0))
    assert await log.append(entry(0, target="job/1"))
    lease = (await etcd_store.range(log.prefix)).kvs[0].lease
    await etcd_store.revoke_lease(lease)  # takes job/1 with it
    assert await log.append(entry(0, target="job/2"))
    kvs = (await etcd_store.range(log.prefix)).kvs
    assert len(kvs) == 1 and kvs[0].lease not in (0, lease)


async def test_an_unreachable_store_is_logged_and_counted(key_prefix: str, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit, "WRITE_BACKOFF_S", 0.01)
    store = EtcdStore(f"127.0.0.1:{free_port()}", timeout=0.3)
    try:
        log = AuditLog(store, key_prefix)
        before = failures("etcd")
        with caplog.at_level(logging.ERROR, logger="trainyard_core.audit"):
            assert not await log.append(entry(T0, target="job/lost", action="/x.v1.S/CancelJob"))
        assert failures("etcd") == before + 1
        [rec] = [r for r in caplog.records if r.getMessage() == "audit entry not written"]
        assert rec.levelno == logging.ERROR and rec.audit_target == "job/lost"  # type: ignore[attr-defined]
    finally:
        await store.close()


async def test_record_finishes_the_write_when_its_caller_is_cancelled(etcd_store: EtcdStore,
                                                                      key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    task = asyncio.ensure_future(audit.record(log, entry(T0, target="job/cancelled")))
    await asyncio.sleep(0)  # the write has started
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def written() -> bool:
        return bool((await log.query(AuditFilter(target="job/cancelled"))).entries)

    await eventually(written, what="the shielded audit write to land")


async def test_the_file_sink_fsyncs_each_entry_and_rotates_by_size(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = AuditFile(path, max_bytes=1000, backups=2, clock=ManualClock(start=T0))
    for i in range(20):
        assert await sink.append(entry(0, target=f"job/{i}"))
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "audit.jsonl.1").exists() and (tmp_path / "audit.jsonl.2").exists()
    assert not (tmp_path / "audit.jsonl.3").exists()
    assert all(p.stat().st_size <= 1000 for p in tmp_path.glob("audit.jsonl*"))  # noqa: ASYNC240
    kept = [e.target for e in sink.entries()]
    assert kept == [f"job/{i}" for i in range(20 - len(kept), 20)]  # the newest, in order; the oldest dropped
    assert len(kept) < 20


async def test_the_file_sink_counts_a_write_it_cannot_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit, "WRITE_BACKOFF_S", 0.01)
    sink = AuditFile(tmp_path / "missing-dir" / "audit.jsonl", max_bytes=4096, backups=1)
    before = failures("file")
    assert not await sink.append(entry(T0))
    assert failures("file") == before + 1


async def test_the_schedulers_mirror_leaves_the_audit_log_out(etcd_store: EtcdStore, key_prefix: str) -> None:
    """The scheduler mirrors everything under its prefix but the audit log: neither loaded (a paged load
    jumps over it) nor kept from the watch, and an audit write alone does not wake the reconcile loop."""
    from trainyard_core.store.mirror import PrefixMirror

    log = AuditLog(etcd_store, key_prefix)
    base = key_prefix.rstrip("/")
    await etcd_store.put(f"{base}/allocations/a", b"1")
    for i in range(7):
        assert await log.append(entry(T0 + i))
    await etcd_store.put(f"{base}/jobs/j", b"2")
    mirror = PrefixMirror(etcd_store, base + "/", page_size=3, exclude=(log.prefix,))
    await mirror.start()
    try:
        assert sorted(mirror.items) == [f"{base}/allocations/a", f"{base}/jobs/j"]
        mirror.changed.clear()
        assert await log.append(entry(T0 + 10))
        revision = (await etcd_store.range(log.prefix, limit=1)).revision
        assert await mirror.wait_for(revision)
        assert not mirror.changed.is_set()
        assert sorted(mirror.items) == [f"{base}/allocations/a", f"{base}/jobs/j"]
        await etcd_store.put(f"{base}/jobs/k", b"3")

        async def woke() -> bool:
            return mirror.changed.is_set()

        await eventually(woke, what="a job write to wake the mirror's reader")
    finally:
        await mirror.stop()


async def test_an_append_gives_up_at_its_deadline(key_prefix: str, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A store that takes longer than the deadline to fail (its own timeout is longer): the append gives up
    at the deadline, counted, and says that the entry may have landed."""
    monkeypatch.setattr(audit, "WRITE_DEADLINE_S", 0.3)
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections and never answers on them
    store = EtcdStore(f"127.0.0.1:{silent.getsockname()[1]}", timeout=5.0)
    try:
        before = failures("etcd")
        with caplog.at_level(logging.ERROR, logger="trainyard_core.audit"):
            assert not await AuditLog(store, key_prefix).append(entry(T0))
        assert failures("etcd") == before + 1
        [rec] = [r for r in caplog.records if r.getMessage() == "audit entry not written"]
        assert "may or may not be stored" in rec.error  # type: ignore[attr-defined]
    finally:
        await store.close()
        silent.close()


def test_messages_are_kept_without_the_values_they_quote() -> None:
    e = entry(T0, result="invalid_argument", message="env.K: must be text without NUL characters (got 'sec\\'ret'); "
                                                     "resources.nodes: must be >= 1 (got 0) (see the docs)")
    assert e.message == "env.K: must be text without NUL characters; resources.nodes: must be >= 1 (see the docs)"


def test_an_entry_is_written_with_every_field_and_read_back_equal() -> None:
    entry = AuditEntry.make(time=1_700_000_000.25, principal="user:vision/ada", service="gateway",
                            action="POST /v1/jobs", target="job/job-1", result="ok", message="submitted",
                            request_id="r-1", role="member", team="vision", detail={"nodes": 2})
    entry = dataclasses.replace(entry, id="e-1")
    written = json.loads(entry.to_json())
    assert set(written) == {f.name for f in dataclasses.fields(AuditEntry)}  # a new field is never left out
    assert written["detail"] == {"nodes": "2"}
    assert AuditEntry.from_json(entry.to_json()) == entry
    assert audit.entry_to_dict(entry) == written
