"""Pieces of the client library in one process: verified reads by chunk, staging to shared memory and
back, errors that survive pickling, settings from the environment."""

from __future__ import annotations

import io
import itertools
import mmap
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from trainyard_checkpoint import checksum
from trainyard_checkpoint.client import CheckpointError, ClientSettings, ConfigError, ShardCorrupt
from trainyard_checkpoint.client.errors import from_dcp, integrity_failures
from trainyard_checkpoint.client.faults import KillSpec
from trainyard_checkpoint.client.reader import _VerifiedFile
from trainyard_checkpoint.client.service import ShardRecord
from trainyard_checkpoint.client.staging import Materializer, Stager

CHUNK = 4096


class CountingReader(io.FileIO):
    bytes_read = 0

    def readinto(self, b: Any) -> int:
        n = super().readinto(b) or 0
        self.bytes_read += n
        return n


def verified_file(tmp_path: Path, data: bytes, recorded: bytes | None = None) -> tuple[_VerifiedFile, CountingReader]:
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    expected = checksum.of_bytes(recorded if recorded is not None else data, CHUNK)
    shard = ShardRecord("__0_0.distcp", len(data), str(expected), 0)
    stream = CountingReader(path, "r")
    return _VerifiedFile(stream, shard, expected, "file:///ckpt"), stream


def test_ranges_across_chunks_read_each_byte_once(tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 5 + 123)
    f, stream = verified_file(tmp_path, data)
    # Sorted, contiguous items of mixed sizes, some spanning chunk boundaries.
    offsets = [0, 100, 4000, 9000, 9001, 15000, len(data)]
    for a, b in itertools.pairwise(offsets):
        assert bytes(f.read(a, b - a)) == data[a:b]
    assert stream.bytes_read == len(data), "a chunk shared by two items is not read twice"


@pytest.mark.parametrize("mapped", [False, True], ids=["window", "mmap"])
def test_a_flipped_byte_is_found_by_the_read_that_covers_its_chunk(tmp_path: Path, mapped: bool) -> None:
    good = os.urandom(CHUNK * 4)
    bad = bytearray(good)
    bad[3 * CHUNK + 7] ^= 0x10
    f, stream = verified_file(tmp_path, bytes(bad), recorded=good)
    if mapped:  # how a local file is read: verified in place in the page cache
        f = _VerifiedFile(stream, f._shard, f._expected, "file:///ckpt", mmap.mmap(stream.fileno(), 0,
                                                                                   access=mmap.ACCESS_READ))
    assert bytes(f.read(0, 2 * CHUNK)) == good[: 2 * CHUNK], "chunks before the damage are fine"
    with pytest.raises(ShardCorrupt) as info:
        f.read(3 * CHUNK, 10)
    assert info.value.shard == "__0_0.distcp"
    assert "chunk 3 (bytes 12288-16383) differs" in str(info.value)


def test_a_short_file_is_reported_with_where_it_ends(tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 2)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data[:5000])
    shard = ShardRecord("__0_0.distcp", len(data), str(checksum.of_bytes(data, CHUNK)), 0)
    with open(path, "rb") as stream:
        f = _VerifiedFile(stream, shard, checksum.parse(shard.checksum), "file:///ckpt")
        with pytest.raises(ShardCorrupt, match="ends at byte 5000, expected 8192 bytes"):
            f.read(4096, 2000)


class Counter:
    """A Stateful: staged through its state_dict()."""

    def __init__(self) -> None:
        self.n = torch.tensor(7)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def test_staging_snapshots_every_tensor_and_rebuilds_it_in_the_saver() -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    state: dict[str, Any] = {
        "model": {"w": base.t(), "half": torch.randn(5).to(torch.bfloat16), "mask": torch.tensor([True, False]),
                  "empty": torch.empty(0, 3), "param": torch.nn.Parameter(torch.ones(3))},
        "optim": [{"step": torch.tensor(3.0), "lr": 0.1}, ("adam", torch.zeros(2, dtype=torch.int64))],
        "extra": io.BytesIO(b"opaque"), "counter": Counter(), "name": "run-1",
    }
    stager, saver = Stager(), Materializer()
    skeleton, new = stager.stage(state)
    assert new and stager.arena is not None
    saver.attach(os.dup(stager.arena.fd), stager.arena.nbytes, stager.arena.generation)
    with torch.no_grad():
        base.add_(100)  # training goes on: the snapshot must not change
    built = saver.build(pickle.loads(pickle.dumps(skeleton)))
    w = built["model"]["w"]
    assert torch.equal(w, torch.arange(24, dtype=torch.float32).view(4, 6).t())
    assert w.untyped_storage().nbytes() == w.nbytes, "exactly its bytes: DCP writes it without a copy"
    half = built["model"]["half"]
    assert torch.equal(half, state["model"]["half"]) and half.dtype == torch.bfloat16
    assert built["model"]["mask"].tolist() == [True, False] and built["model"]["empty"].shape == (0, 3)
    assert built["optim"][0]["step"].item() == 3.0 and built["optim"][0]["lr"] == 0.1
    assert built["optim"][1][0] == "adam" and built["optim"][1][1].dtype == torch.int64
    assert built["extra"].getvalue() == b"opaque" and built["counter"]["n"].item() == 7 and built["name"] == "run-1"

    skeleton, new = stager.stage(state)
    assert not new, "the arena is reused when the state fits"
    assert torch.equal(saver.build(skeleton)["model"]["w"], base.t())
    stager.close()


def test_errors_cross_process_boundaries_intact() -> None:
    corrupt = ShardCorrupt("__1_0.distcp", "chunk 2 (bytes 8-11) differs from its checksum", "file:///c")
    again = pickle.loads(pickle.dumps(corrupt))
    assert isinstance(again, ShardCorrupt) and again.shard == corrupt.shard and str(again) == str(corrupt)
    err = pickle.loads(pickle.dumps(CheckpointError("commit refused", {1: corrupt})))
    assert str(err) == "commit refused" and isinstance(err.failures[1], ShardCorrupt)

    from torch.distributed.checkpoint.api import CheckpointException

    both = CheckpointException("read", {0: (corrupt, None), 1: (FileNotFoundError(2, "gone", "x"), None)})
    converted = from_dcp(both, "loading checkpoint c")
    # An ordinary Exception (DCP's CheckpointException is a BaseException), naming each rank's failure.
    assert isinstance(converted, Exception) and sorted(converted.failures) == [0, 1]
    assert "rank 0: trainyard_checkpoint.client.errors.ShardCorrupt: shard '__1_0.distcp'" in str(converted)
    assert "rank 1: FileNotFoundError: [Errno 2] gone: 'x'" in str(converted)
    found = integrity_failures({0: corrupt, 1: FileNotFoundError(2, "gone", "x")})
    assert found is not None and [p.shard for p in found] == ["__1_0.distcp", "x"]
    assert integrity_failures({0: corrupt, 1: RuntimeError("state dict mismatch")}) is None


def test_settings_come_from_the_environment_and_name_what_is_missing() -> None:
    env = {"TRAINYARD_CHECKPOINT_STORE": "10.0.0.5:50053", "TRAINYARD_JOB_ID": "job-a", "TRAINYARD_ATTEMPT": "2",
           "TRAINYARD_CHECKPOINT_THREADS": "4", "TRAINYARD_CHECKPOINT_KEEP_LAST": "3",
           "TRAINYARD_TEST_KILL_AT": "1:17", "TRAINYARD_CHECKPOINT_PLAINTEXT": "1"}
    s = ClientSettings.from_env(env)
    assert (s.store_address, s.job_id, s.attempt, s.thread_count) == ("10.0.0.5:50053", "job-a", 2, 4)
    assert s.retention is not None and s.retention.keep_last == 3
    assert s.kill == KillSpec(at=17, rank=1, trace_path="")
    with pytest.raises(ConfigError, match="TRAINYARD_JOB_ID is not set"):
        ClientSettings.from_env({"TRAINYARD_CHECKPOINT_STORE": "h:1"})
    with pytest.raises(ConfigError, match="TRAINYARD_ATTEMPT='x' is not an integer"):
        ClientSettings.from_env({**env, "TRAINYARD_ATTEMPT": "x"})
    assert issubclass(ConfigError, Exception)


def test_the_jobs_trace_comes_from_the_environment_and_a_malformed_one_is_dropped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    import grpc

    from trainyard_checkpoint.client.service import open_channel
    env = {"TRAINYARD_CHECKPOINT_STORE": "127.0.0.1:1", "TRAINYARD_JOB_ID": "job-a",
           "TRAINYARD_CHECKPOINT_PLAINTEXT": "1"}
    traceparent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert ClientSettings.from_env({**env, "TRAINYARD_TRACEPARENT": traceparent}).traceparent == traceparent
    assert ClientSettings.from_env(env).traceparent == ""
    plain = open_channel("127.0.0.1:1", None, True)
    traced = open_channel("127.0.0.1:1", None, True, traceparent)
    with caplog.at_level("WARNING"):
        bad = open_channel("127.0.0.1:1", None, True, "not-a-traceparent")
    assert "TRAINYARD_TRACEPARENT is not a W3C traceparent" in caplog.text
    try:
        assert type(traced) is not type(plain), "the trace goes through an interceptor on the channel"
        assert type(bad) is type(plain)
        assert isinstance(traced, grpc.Channel)
    finally:
        for channel in (plain, traced, bad):
            channel.close()
