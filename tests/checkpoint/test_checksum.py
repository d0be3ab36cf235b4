"""Shard checksums: format, streaming in any piece sizes, and a mismatch naming the chunk."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_checkpoint import checksum
from trainyard_core.errors import InvalidArgument


def test_streaming_in_any_pieces_equals_one_pass() -> None:
    data = bytes(range(256)) * 1000
    whole = checksum.of_bytes(data, chunk_bytes=4096)
    h = checksum.ChunkHasher(4096)
    for i in range(0, len(data), 777):
        h.update(data[i:i + 777])
    assert h.result() == whole and len(whole.digests) == -(-len(data) // 4096)
    assert checksum.parse(str(whole)) == whole


def test_a_flipped_byte_names_its_chunk(tmp_path: Path) -> None:
    data = bytearray(b"x" * 10_000)
    expected = checksum.of_bytes(bytes(data), chunk_bytes=4096)
    data[5000] ^= 1
    path = tmp_path / "shard"
    path.write_bytes(bytes(data))
    with pytest.raises(checksum.ChecksumMismatch) as info:
        checksum.verify_file(path, expected, size=10_000)
    assert "chunk 1 (bytes 4096-8191) differs" in str(info.value)
    path.write_bytes(bytes(data[:9000]))
    with pytest.raises(checksum.ChecksumMismatch, match="size 9000 bytes, expected 10000"):
        checksum.verify_file(path, expected, size=10_000)
    with pytest.raises(checksum.ChecksumMismatch, match="missing"):
        checksum.verify_file(tmp_path / "gone", expected)


def test_empty_file_has_one_digest(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert checksum.of_file(path) == checksum.of_bytes(b"")
    checksum.verify_file(path, checksum.of_bytes(b""), size=0)


@pytest.mark.parametrize("bad", ["", "md5:abc", "xxh3c:0:0123456789abcdef", "xxh3c:64:xyz", "xxh3:123",
                                 "crc32c:1234"])
def test_bad_checksums_are_refused_with_the_valid_forms(bad: str) -> None:
    with pytest.raises(InvalidArgument, match=r"must be|must look like"):
        checksum.parse(bad)
