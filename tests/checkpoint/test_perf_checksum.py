"""The fast paths of chunked XXH3 give exactly the digests of the plain per-chunk definition: whole chunks
hashed in one call, pieces that straddle chunks streamed, files read through one reused buffer."""

from __future__ import annotations

import array
import os
from pathlib import Path

import pytest
import xxhash

from trainyard_checkpoint import checksum

CHUNK = 4096


def reference(data: bytes, chunk: int) -> checksum.Checksum:
    """The format's definition, spelled out: one XXH3-64 per chunk, the last one possibly short."""
    digests = [xxhash.xxh3_64(data[i:i + chunk]).hexdigest() for i in range(0, len(data), chunk)] or [
        xxhash.xxh3_64(b"").hexdigest()]
    return checksum.Checksum("xxh3c", chunk, tuple(digests))


def test_digest_is_the_hex_the_format_records() -> None:
    for data in (b"", b"a", os.urandom(CHUNK * 3 + 1)):
        assert checksum.digest(data) == xxhash.xxh3_64(data).hexdigest()
        assert len(checksum.digest(data)) == 16


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK, 5 * CHUNK + 77])
@pytest.mark.parametrize("piece", [1, 1000, CHUNK, CHUNK + 3, 3 * CHUNK, 10 * CHUNK])
def test_any_pieces_give_the_reference_digests(size: int, piece: int) -> None:
    data = os.urandom(size)
    h = checksum.ChunkHasher(CHUNK)
    for i in range(0, len(data), piece):
        h.update(memoryview(data)[i:i + piece])
    assert h.result() == reference(data, CHUNK) and h.size == size
    assert checksum.of_bytes(data, CHUNK) == reference(data, CHUNK)


def test_pieces_that_start_mid_chunk_and_span_several() -> None:
    data = os.urandom(7 * CHUNK + 5)
    h = checksum.ChunkHasher(CHUNK)
    for a, b in [(0, 100), (100, 3 * CHUNK + 50), (3 * CHUNK + 50, 3 * CHUNK + 51), (3 * CHUNK + 51, len(data))]:
        h.update(data[a:b])
    assert h.result() == reference(data, CHUNK)


def test_a_hasher_reused_after_a_chunk_starts_the_next_one_fresh() -> None:
    data = os.urandom(2 * CHUNK)
    h = checksum.ChunkHasher(CHUNK)
    h.update(data[:10])
    h.update(data[10:CHUNK + 10])  # completes chunk 0 in the streaming hasher, starts chunk 1 in it
    h.update(data[CHUNK + 10:])
    assert h.result() == reference(data, CHUNK)


@pytest.mark.parametrize("size", [0, 1, CHUNK, 3 * CHUNK + 5])
def test_files_hash_as_their_bytes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    assert checksum.of_file(path, CHUNK) == reference(data, CHUNK)
    checksum.verify_file(path, reference(data, CHUNK), size=size)


def test_verify_file_reading_larger_blocks_than_chunks_still_names_the_chunk(tmp_path: Path) -> None:
    data = bytearray(os.urandom(300 * CHUNK))  # verify_file reads at least 1 MiB at a time
    expected = reference(bytes(data), CHUNK)
    data[270 * CHUNK + 1] ^= 1
    path = tmp_path / "shard"
    path.write_bytes(bytes(data))
    with pytest.raises(checksum.ChecksumMismatch, match=r"chunk 270 \(bytes 1105920-1110015\) differs"):
        checksum.verify_file(path, expected, size=len(data))


def test_whole_file_digests_count_bytes_of_any_buffer() -> None:
    values = array.array("d", [1.0, 2.0, 3.0])
    expected = checksum.Checksum("xxh3", 0, (xxhash.xxh3_64(values.tobytes()).hexdigest(),))
    checksum.verify_blocks("x", [memoryview(values)], expected, size=24)
    with pytest.raises(checksum.ChecksumMismatch, match="size 24 bytes, expected 3"):
        checksum.verify_blocks("x", [memoryview(values)], expected, size=3)
