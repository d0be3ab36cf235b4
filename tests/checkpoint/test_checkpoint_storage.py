"""POSIX storage backend on a real directory: layout, sizes, reads, listing, containment, removal."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from trainyard_checkpoint.checksum import ChecksumMismatch
from trainyard_checkpoint.storage import PosixStorage
from trainyard_core.errors import FailedPrecondition
from trainyard_core.security.unix_ids import Identity


@pytest.fixture
def storage(tmp_path: Path) -> PosixStorage:
    s = PosixStorage(tmp_path / "root")
    s.ensure_root()
    return s


async def test_layout_stat_and_remove(storage: PosixStorage, tmp_path: Path) -> None:
    location = storage.location_for("job-a", "ckpt-1")
    assert location == (tmp_path / "root" / "job-a" / "ckpt-1").as_uri()
    await storage.prepare(location)
    await storage.prepare(location)  # idempotent
    directory = tmp_path / "root" / "job-a" / "ckpt-1"
    (directory / "sub").mkdir()
    (directory / "sub" / "s.distcp").write_bytes(b"x" * 1234)
    (directory / "empty").write_bytes(b"")

    assert await storage.stat(location, "sub/s.distcp") == 1234
    assert await storage.stat(location, "empty") == 0
    assert await storage.stat(location, "missing") is None
    assert await storage.stat(location, "empty/below-a-file") is None
    with pytest.raises(FailedPrecondition, match="not a regular file"):
        await storage.stat(location, "sub")

    await storage.remove(location)
    assert not directory.exists()
    await storage.remove(location)  # idempotent
    assert (tmp_path / "root" / "job-a").is_dir(), "the job directory is left for concurrent begins"


async def test_links_leading_outside_are_refused(storage: PosixStorage, tmp_path: Path) -> None:
    outside = tmp_path / "secret"
    outside.write_bytes(b"do not look")
    location = storage.location_for("job-a", "ckpt-2")
    await storage.prepare(location)
    directory = tmp_path / "root" / "job-a" / "ckpt-2"
    os.symlink(outside, directory / "shard")
    (directory / "real").write_bytes(b"abc")
    os.symlink("real", directory / "alias")
    with pytest.raises(FailedPrecondition, match="leads outside"):
        await storage.stat(location, "shard")
    assert await storage.stat(location, "alias") == 3, "a link inside the checkpoint is followed"


async def test_removal_does_not_follow_a_planted_link(storage: PosixStorage, tmp_path: Path) -> None:
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "data").write_bytes(b"keep me")
    (tmp_path / "root" / "job-a").mkdir()
    os.symlink(victim, tmp_path / "root" / "job-a" / "ckpt-3")
    await storage.remove(storage.location_for("job-a", "ckpt-3"))
    assert (victim / "data").read_bytes() == b"keep me"


@pytest.mark.parametrize("location", [
    "file:///etc",
    "file:///",
    "s3://bucket/job-a/ckpt-1",
    "ROOT/job-a",
    "ROOT/job-a/ckpt-1/deeper",
    "ROOT/job-a/../../outside",
])
async def test_locations_outside_the_root_are_refused(storage: PosixStorage, location: str) -> None:
    location = location.replace("ROOT", storage.url)
    for call in (storage.stat(location, "x"), storage.remove(location), storage.prepare(location)):
        with pytest.raises(FailedPrecondition, match="location"):
            await call


def test_unusable_root_fails_start_up_with_a_clear_message(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError, match=r"cannot create checkpoint storage root .*STORAGE_URL"):
        PosixStorage(blocker / "root").ensure_root()


async def test_read_blocks_streams_and_refuses_what_stat_refuses(storage: PosixStorage, tmp_path: Path) -> None:
    location = storage.location_for("job-a", "ckpt-4")
    await storage.prepare(location)
    directory = tmp_path / "root" / "job-a" / "ckpt-4"
    (directory / "s.distcp").write_bytes(bytes(range(250)))
    assert [len(b) for b in storage.read_blocks(location, "s.distcp", 100)] == [100, 100, 50]
    assert b"".join(storage.read_blocks(location, "s.distcp", 64)) == bytes(range(250))
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", directory / "link")
    with pytest.raises(FailedPrecondition, match="leads outside"):
        list(storage.read_blocks(location, "link", 100))
    with pytest.raises(ChecksumMismatch, match="missing"):
        list(storage.read_blocks(location, "gone", 100))


async def test_list_locations_names_only_checkpoint_directories(storage: PosixStorage, tmp_path: Path) -> None:
    for job, ckpt in (("job-a", "ckpt-1"), ("job-a", "ckpt-2"), ("job-b", "ckpt-3")):
        await storage.prepare(storage.location_for(job, ckpt))
    root = tmp_path / "root"
    (root / "job-a" / "notes.txt").write_text("x")
    (root / "job-a" / "other-dir").mkdir()
    (root / "Bad Job").mkdir()
    (root / "file-at-root").write_text("x")
    found = sorted((s.job_id, s.checkpoint_id, s.location) for s in await storage.list_locations())
    assert found == [(j, c, storage.location_for(j, c)) for j, c in
                     (("job-a", "ckpt-1"), ("job-a", "ckpt-2"), ("job-b", "ckpt-3"))]


async def test_what_is_not_a_regular_file_is_refused_without_blocking(storage: PosixStorage, tmp_path: Path) -> None:
    location = storage.location_for("job-a", "ckpt-5")
    await storage.prepare(location)
    directory = tmp_path / "root" / "job-a" / "ckpt-5"
    os.mkfifo(directory / "fifo.distcp")  # a read of it would wait for a writer forever
    with pytest.raises(FailedPrecondition, match="not a regular file"):
        await storage.stat(location, "fifo.distcp")
    with pytest.raises(FailedPrecondition, match="not a regular file"):
        list(storage.read_blocks(location, "fifo.distcp", 100))


async def test_a_link_in_place_of_the_manifest_is_not_followed(storage: PosixStorage, tmp_path: Path) -> None:
    location = storage.location_for("job-a", "ckpt-6")
    await storage.prepare(location)
    secret = tmp_path / "secret"
    secret.write_bytes(b"manifest bytes")
    os.symlink(secret, tmp_path / "root" / "job-a" / "ckpt-6" / "manifest.json")
    with pytest.raises(FailedPrecondition, match=r"already exists .* with other content"):
        await storage.write_once(location, "manifest.json", b"manifest bytes")
    assert secret.read_bytes() == b"manifest bytes"


# Teams apart (`owners`): directories handed to the team's uid; see also test_job_credentials.py, where workers of a
# team's uid save and load through the real store.
OWNERS = {"ml": Identity(2001, 2001)}



async def test_owned_directories_go_to_the_team_and_stay_the_stores_above(public_tmp: Path) -> None:
    storage = PosixStorage(public_tmp / "root", OWNERS)
    storage.ensure_root()
    location = storage.location_for("job-a", "ckpt-1")
    await storage.prepare(location, "ml")
    await storage.prepare(location, "ml")  # idempotent
    directory = public_tmp / "root" / "job-a" / "ckpt-1"
    modes = {p: (os.lstat(p).st_uid, stat.S_IMODE(os.lstat(p).st_mode))
             for p in (public_tmp / "root", directory.parent, directory)}
    assert modes == {public_tmp / "root": (0, 0o711), directory.parent: (0, 0o711), directory: (2001, 0o700)}
    # A shard the team's worker wrote with umask 077 is read and removed by the store.
    fd = os.open(directory / "s.distcp", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"abc")
    os.close(fd)
    os.chown(directory / "s.distcp", 2001, 2001)
    assert await storage.stat(location, "s.distcp") == 3
    await storage.remove(location)
    assert not directory.exists()

    for team, message in (("vision", "team 'vision' has no Unix identity"), ("", "no team recorded")):
        with pytest.raises(FailedPrecondition, match=message):
            await storage.prepare(storage.location_for("job-b", "ckpt-1"), team)
    # A job directory someone else made is not used: its owner could swap checkpoints in it.
    os.mkdir(public_tmp / "root" / "job-c")
    os.chown(public_tmp / "root" / "job-c", 2001, 2001)
    with pytest.raises(FailedPrecondition, match="belongs to uid 2001, not to the store"):
        await storage.prepare(storage.location_for("job-c", "ckpt-1"), "ml")


def test_owned_storage_needs_root_and_parents_others_may_pass(public_tmp: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OSError, match=r"workers cannot reach .* \(chmod o\+x"):
        PosixStorage(tmp_path / "root", OWNERS).ensure_root()  # pytest's tmp_path is 0700
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    with pytest.raises(OSError, match=r"run_as needs the checkpoint-store to run as root \(it runs as uid 1234\)"):
        PosixStorage(public_tmp / "root", OWNERS).ensure_root()
