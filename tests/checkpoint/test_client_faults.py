"""The client library under damage and crashes: corrupt checkpoints are detected, named and skipped;
a saving process killed anywhere never leaves a partial checkpoint that is listed as committed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_checkpoint import checksum
from trainyard_checkpoint.app import CheckpointApp

from .checkpoint_support import Client, location_dir
from .scripts.gang import Zygote, job_env, logs_of, run_gang, start_gang, zygote_fixture  # noqa: F401 - the zygote fixture


async def all_checkpoints(client: Client, job_id: str) -> list[pb.Checkpoint]:
    resp = await client.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=job_id, page_size=1000))
    assert not resp.next_page_token
    return list(resp.checkpoints)


def damage_free(ckpt: pb.Checkpoint) -> str | None:
    """Why a committed checkpoint is not complete and intact (None: it is). Independent of the client
    library: sizes and checksums straight from the record, every file in its directory declared."""
    base = location_dir(ckpt.location)
    declared = {s.path for s in ckpt.shards}
    if ".metadata" not in declared:
        return "no .metadata declared"
    extra = {p.name for p in base.iterdir()} - declared - {ckpt.manifest_path}
    if extra:
        return f"undeclared files {sorted(extra)}"
    for s in ckpt.shards:
        try:
            checksum.verify_file(base / s.path, checksum.parse(s.checksum), size=s.size_bytes)
        except checksum.ChecksumMismatch as e:
            return str(e)
    return None


async def test_damaged_checkpoints_are_named_and_skipped_for_the_previous_good_one(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    # 4 KiB checksum chunks, so a flipped byte is pinned to one chunk of a multi-chunk file.
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-damage", TRAINYARD_CHECKPOINT_CHUNK_BYTES="4096")
    saved = (await run_gang(zygote, ["save", "1", "2", "3", "4", "5"], world_size=2, env=env,
                            out=tmp_path / "save"))[0]["saved"]
    by_step = {r["step"]: r for r in saved}

    def biggest(step: int) -> tuple[Path, str, int]:
        path, size = max(((p, s) for p, s, _, _ in by_step[step]["shards"] if p.endswith(".distcp")),
                         key=lambda ps: ps[1])
        return location_dir(by_step[step]["location"]) / path, path, size

    # step 5: a byte of .metadata flipped; 4: a shard deleted; 3: one truncated; 2: a byte flipped in
    # chunk 1 of the largest shard. Step 1 is intact.
    meta = location_dir(by_step[5]["location"]) / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(bytes(data))
    deleted = location_dir(by_step[4]["location"]) / "__1_0.distcp"
    deleted.unlink()
    truncated, truncated_name, truncated_size = biggest(3)
    truncated.write_bytes(truncated.read_bytes()[: truncated_size // 2])
    flipped, flipped_name, flipped_size = biggest(2)
    assert flipped_size > 8192, "the flipped file must span several chunks"
    data = bytearray(flipped.read_bytes())
    data[4096 + 10] ^= 0xFF
    flipped.write_bytes(bytes(data))

    two = await run_gang(zygote, ["load"], world_size=2, env=env, out=tmp_path / "load2")
    for report in two:
        assert report["step"] == 1 and report["mismatches"] == [], report
        skipped = {s["step"]: " ".join(s["problems"]) for s in report["skipped"]}
        assert list(skipped) == [5, 4, 3, 2], report
        assert "'.metadata'" in skipped[5] and "chunk 0" in skipped[5], skipped[5]
        assert "'__1_0.distcp'" in skipped[4] and "missing" in skipped[4], skipped[4]
        assert (f"'{truncated_name}'" in skipped[3]
                and f"size {truncated_size // 2} bytes, expected {truncated_size}" in skipped[3]), skipped[3]
        assert f"'{flipped_name}'" in skipped[2] and "chunk 1 (bytes 4096-8191)" in skipped[2], skipped[2]
    log = (tmp_path / "load2" / "rank0.log").read_text()
    assert "is damaged, falling back" in log and f"{flipped_name}" in log and "chunk 1" in log, log
    # The reader reported each one; the service checked the named files itself and marked them DAMAGED,
    # moving the job's latest pointer back to step 1.
    records = {c.step: c for c in await all_checkpoints(client, "job-damage")}
    for step, what in [(5, "'.metadata'"), (4, "'__1_0.distcp' (rank 1) is missing"),
                       (3, f"'{truncated_name}'"), (2, f"'{flipped_name}'")]:
        assert records[step].state == pb.CHECKPOINT_STATE_DAMAGED, records[step]
        assert what in records[step].damage and records[step].HasField("damaged_at"), records[step].damage
    assert "chunk 1" in records[2].damage and "is truncated" in records[3].damage, records
    assert records[1].state == pb.CHECKPOINT_STATE_COMMITTED
    assert (await client.latest("job-damage")).step == 1
    # A later reader goes straight to step 1, on any world size.
    one = (await run_gang(zygote, ["load"], world_size=1, env=env, out=tmp_path / "load1"))[0]
    assert one["step"] == 1 and one["skipped"] == [] and one["mismatches"] == [], one


async def test_a_damage_report_the_service_cannot_confirm_changes_nothing(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-falsealarm")
    saved = (await run_gang(zygote, ["save", "1", "2"], world_size=1, env=env, out=tmp_path / "save"))[0]["saved"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.ReportDamaged(pb.ReportDamagedRequest(checkpoint_id=saved[1]["id"],
                                                                reason="my NFS client returned zeros"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not marked damaged" in (err.value.details() or "") and "zeros" in (err.value.details() or "")
    latest = await client.latest("job-falsealarm")
    assert latest.id == saved[1]["id"] and latest.state == pb.CHECKPOINT_STATE_COMMITTED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.ReportDamaged(pb.ReportDamagedRequest(checkpoint_id=saved[1]["id"],
                                                                shard_paths=["../../etc/passwd"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'..'" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.ReportDamaged(pb.ReportDamagedRequest(checkpoint_id=saved[1]["id"],
                                                                shard_paths=["nope.distcp"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no shard" in (err.value.details() or "")


async def test_after_falling_back_the_job_can_save_again(app: CheckpointApp, client: Client, tmp_path: Path,
                                                          zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-refall")
    saved = (await run_gang(zygote, ["save", "1", "2"], world_size=1, env=env, out=tmp_path / "save"))[0]["saved"]
    (location_dir(saved[1]["location"]) / "__0_0.distcp").unlink()
    # The restarted job resumes from step 1 and, training on, saves step 2 again.
    report = (await run_gang(zygote, ["resume", "2"], world_size=1, env=env, out=tmp_path / "resume"))[0]
    assert report["loaded"]["step"] == 1
    assert (await client.latest("job-refall")).id == report["saved"][0]["id"]


async def test_a_job_without_checkpoints_loads_nothing(app: CheckpointApp, tmp_path: Path, zygote: Zygote) -> None:
    env = job_env(f"127.0.0.1:{app.grpc_port}", "job-fresh")
    report = (await run_gang(zygote, ["load"], world_size=1, env=env, out=tmp_path / "load"))[0]
    assert report["step"] is None and report["checkpoint"] is None and report["skipped"] == []


def _trace(path: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []


def _kill_points(trace: list[str], write_every: int) -> list[int]:
    """1-based indices: every point that is not a write, and every `write_every`-th write."""
    picked, writes = [], 0
    for i, name in enumerate(trace, start=1):
        if name.endswith(" write"):
            writes += 1
            if writes % write_every:
                continue
        picked.append(i)
    return picked


async def test_a_save_killed_at_any_point_never_leaves_a_partial_committed_checkpoint(
        app: CheckpointApp, client: Client, tmp_path: Path, zygote: Zygote) -> None:
    job = "job-crash"
    address = f"127.0.0.1:{app.grpc_port}"
    base = tmp_path / "baseline"
    await run_gang(zygote, ["save", "1"], world_size=2, out=base,
                   env=job_env(address, job, TRAINYARD_TEST_KILL_TRACE=str(base / "trace{rank}.txt")))
    traces = {rank: _trace(base / f"trace{rank}.txt") for rank in (0, 1)}
    trials = [(0, n) for n in _kill_points(traces[0], 12)] + [(1, n) for n in _kill_points(traces[1], 24)]
    assert len(trials) >= 50, trials

    killed_at: list[str] = []
    verified: set[str] = set()
    for i, (rank, n) in enumerate(trials):
        out = tmp_path / f"trial{i}"
        env = job_env(address, job, TRAINYARD_TEST_KILL_AT=f"{rank}:{n}",
                      TRAINYARD_TEST_KILL_TRACE=str(out / "trace{rank}.txt"))
        step = i + 2
        workers = await start_gang(zygote, ["save", str(step)], world_size=2, env=env, out=out)
        try:
            done, _ = await asyncio.wait([w.wait() for w in workers], timeout=60,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert done, f"trial {i}: no worker ended within 60s\n{logs_of(workers)}"
        finally:
            for w in workers:  # the job is torn down as Trainyard does when a worker dies
                w.kill()
        exits = await asyncio.gather(*(w.wait() for w in workers))
        assert exits[rank].signal == 9, f"trial {i}: rank {rank} was to kill itself at point {n}: {exits}\n" \
                                        f"{logs_of(workers)}"
        point = _trace(out / f"trace{rank}.txt")[-1]
        killed_at.append(point)
        rank0_reached_commit = "after commit" in _trace(out / "trace0.txt")

        records = await all_checkpoints(client, job)
        this = [c for c in records if c.step == step]
        assert len(this) == 1, f"trial {i}: {len(this)} checkpoints of step {step}"
        committed = this[0].state == pb.CHECKPOINT_STATE_COMMITTED
        assert committed == rank0_reached_commit, \
            f"trial {i} (rank {rank} killed at {point!r}): state {pb.CheckpointState.Name(this[0].state)}"
        for c in records:
            if c.state == pb.CHECKPOINT_STATE_COMMITTED and c.id not in verified:
                problem = damage_free(c)
                assert problem is None, f"trial {i} (rank {rank} killed at {point!r}): {c.id} is committed but " \
                                        f"{problem}"
                verified.add(c.id)
        latest = await client.latest(job)
        assert latest.step == max(c.step for c in records if c.state == pb.CHECKPOINT_STATE_COMMITTED)

    assert {"begun", "before write", "after write", "after fsync", "after close", "files written", "before rename",
            "after rename", "metadata written", "before commit", "after commit", "saved"} <= set(killed_at), killed_at
    # The survivor of all this loads intact (the library's own verification, and bit for bit).
    report = (await run_gang(zygote, ["load"], world_size=1, env=job_env(address, job),
                             out=tmp_path / "final"))[0]
    latest = await client.latest(job)
    assert report["checkpoint"] == latest.id and report["mismatches"] == [] and report["skipped"] == [], \
        json.dumps(report)
