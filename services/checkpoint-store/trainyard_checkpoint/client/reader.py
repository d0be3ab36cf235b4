"""DCP StorageReader that verifies what it reads against the checksums recorded at commit.

Reading and verifying are one pass: for each file, the items this rank needs are taken in offset order,
each chunk (of the xxh3c checksum) they touch is verified before any byte of it is used, and the items are
decoded from the verified bytes. A rank therefore verifies exactly the chunks it reads (with resharding,
only its part of a file), never reads a byte twice, and never copies a corrupt byte into the state dict.
Local files are memory-mapped (hashed in the page cache, copied once into the tensors); remote ones are
read through a window of chunks. A file whose size differs from the record is refused before it is read
(so a mapped file is never read past its end).

A tensor item is a `torch.save` archive. Rather than `torch.load` it (which allocates a new tensor, copies
the bytes into it, and is then copied again into the state dict), the reader finds the storage's bytes in
the archive (zip directory + `torch.load` onto the meta device for dtype, shape and strides) and copies
them straight from the verified bytes into the state dict's tensor: one copy, as a raw read would need.
Anything else (another byte order, a dtype conversion, quantized or sparse tensors, transforms) goes
through `torch.load` as stock DCP does.

`precheck` is the cheap part every load does first: existence and size of a share of the checkpoint's
files (the ranks split the list, so together they look at every file once) and the full check of
`.metadata`, whose verified bytes the reader then unpickles instead of reading the file again.
"""

from __future__ import annotations

import io
import mmap
import pickle
import struct
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import checksum
from ..checksum import Checksum
from .errors import CheckpointError, ShardCorrupt
from .service import CheckpointInfo, ShardRecord
from .storage import HashingFileSystem, Location
from .writer import METADATA_FILE


def _parse(shard: ShardRecord, location: str) -> Checksum:
    try:
        return checksum.parse(shard.checksum)
    except Exception as e:  # InvalidArgument: a record the service should never have accepted
        raise ShardCorrupt(shard.path, f"recorded checksum is unusable: {e}", location) from None


def check_sizes(location: Location, shards: Iterable[ShardRecord]) -> list[ShardCorrupt]:
    """Existence and size of each shard; one ShardCorrupt per problem."""
    problems = []
    for shard in shards:
        size = location.size(shard.path)
        if size is None:
            problems.append(ShardCorrupt(shard.path, "missing", location.url))
        elif size != shard.size_bytes:
            problems.append(ShardCorrupt(shard.path, f"size {size} bytes, expected {shard.size_bytes}",
                                         location.url))
    return problems


def read_verified(location: Location, shard: ShardRecord) -> bytes:
    """The whole file, verified (for `.metadata`, which every rank reads in full)."""
    expected = _parse(shard, location.url)
    try:
        data = location.read_all(shard.path)
    except FileNotFoundError:
        raise ShardCorrupt(shard.path, "missing", location.url) from None
    try:
        checksum.verify_blocks(shard.path, [data], expected, size=shard.size_bytes)
    except checksum.ChecksumMismatch as e:
        raise ShardCorrupt(shard.path, e.detail, location.url) from None
    return data


def precheck(ckpt: CheckpointInfo, rank: int, world_size: int) -> tuple[bytes, list[ShardCorrupt]]:
    """This rank's share of the existence and size checks, and the verified `.metadata` bytes."""
    location = Location(ckpt.location)
    meta = next((s for s in ckpt.shards if s.path == METADATA_FILE), None)
    if meta is None:
        return b"", [ShardCorrupt(METADATA_FILE, "not declared in the checkpoint's record", ckpt.location)]
    mine = [s for i, s in enumerate(sorted(ckpt.shards, key=lambda s: s.path)) if i % world_size == rank]
    problems = check_sizes(location, mine)
    try:
        data = read_verified(location, meta)
    except ShardCorrupt as e:
        return b"", [*problems, e]
    return data, problems


class _ViewReader(io.RawIOBase):
    """A seekable read-only stream over a memoryview; `readinto` lets torch.load copy straight from it."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class _VerifiedFile:
    """Serves byte ranges of one file; every chunk a range touches is verified once, before it is served.

    A local file is memory-mapped: chunks are hashed in the page cache and items are copied from there
    straight into their tensors (one copy, as stock DCP). A remote one is read through a window of whole
    chunks: ranges are asked for in increasing offset order (a file's DCP items, sorted), and moving on,
    the chunks the window shares with the next range are kept, not read again. Memory: the largest item
    plus at most two chunks.
    """

    def __init__(self, stream: IO[bytes], shard: ShardRecord, expected: Checksum, location: str,
                 mapped: mmap.mmap | None = None) -> None:
        self._stream = stream
        self._map = memoryview(mapped) if mapped is not None else None
        self._verified: set[int] = set()
        self._shard = shard
        self._size = shard.size_bytes
        self._location = location
        self._expected = expected
        # A whole-file digest is one chunk as long as the file.
        self._chunk = expected.chunk_bytes if expected.algo == "xxh3c" else max(self._size, 1)
        self._buf = bytearray()
        self._start = 0
        self._end = 0

    def _corrupt(self, detail: str) -> ShardCorrupt:
        return ShardCorrupt(self._shard.path, detail, self._location)

    def release(self) -> None:
        """Drop this reader's hold on the mapping (so it can be closed)."""
        if self._map is not None:
            self._map.release()
            self._map = None

    def _verify(self, index: int, data: memoryview) -> None:
        if not self._expected.verifiable:
            return
        start = index * self._chunk
        if self._expected.algo != "xxh3c":
            try:
                checksum.verify_blocks(self._shard.path, [bytes(data)], self._expected, size=self._size)
            except checksum.ChecksumMismatch as e:
                raise self._corrupt(e.detail) from None
            return
        if index >= len(self._expected.digests):
            raise self._corrupt(f"chunk {index} has no recorded digest")
        if checksum.digest(data) != self._expected.digests[index]:
            raise self._corrupt(f"chunk {index} (bytes {start}-{start + len(data) - 1}) differs from its checksum")

    def read(self, offset: int, length: int) -> memoryview:
        if offset < 0 or offset + length > self._size:
            raise self._corrupt(f"an item at bytes {offset}-{offset + length - 1} lies outside the file")
        if length == 0:
            return memoryview(b"")
        if self._map is not None:
            for index in range(offset // self._chunk, (offset + length - 1) // self._chunk + 1):
                if index not in self._verified:
                    a = index * self._chunk
                    self._verify(index, self._map[a:min(a + self._chunk, self._size)])
                    self._verified.add(index)
            return self._map[offset:offset + length]
        start = offset // self._chunk * self._chunk
        end = min(((offset + length - 1) // self._chunk + 1) * self._chunk, self._size)
        if not (self._start <= start and end <= self._end):
            buf = bytearray(end - start)
            view = memoryview(buf)
            pos = start
            if self._start <= start < self._end:  # verified chunks shared with the previous window
                kept = self._end - start
                view[:kept] = memoryview(self._buf)[start - self._start:]
                pos = self._end
            self._stream.seek(pos)
            while pos < end:
                n = self._stream.readinto(view[pos - start:])  # type: ignore[attr-defined]
                if not n:
                    raise self._corrupt(f"ends at byte {pos}, expected {self._size} bytes")
                pos += n
            first_new = (self._end if self._start <= start < self._end else start) // self._chunk
            for index in range(first_new, (end - 1) // self._chunk + 1):
                a = index * self._chunk - start
                self._verify(index, view[a:min(a + self._chunk, end - start)])
            self._buf, self._start, self._end = buf, start, end
        return memoryview(self._buf)[offset - self._start:offset - self._start + length]


@contextmanager
def _mapped(stream: IO[bytes], size: int) -> Iterator[mmap.mmap | None]:
    """A read-only mapping of a local file (None for remote files and empty ones)."""
    try:
        fd = stream.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        yield None
        return
    if size == 0:
        yield None
        return
    mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    try:
        yield mapped
    finally:
        try:
            mapped.close()
        except BufferError:  # a view is still referenced; the mapping goes when it does
            pass


# Same-size integer types to copy any dtype's elements bit for bit (numpy knows no bfloat16 or float8).
_AS_INT_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_AS_INT_NUMPY: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_LOCAL_HEADER = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class _Stored:
    """One tensor inside a `torch.save` archive: its storage's bytes and, as a meta tensor, how the
    tensor lies on them (dtype, shape, strides and offset, in elements)."""

    data: memoryview
    layout: torch.Tensor


def _stored_tensor(blob: memoryview) -> _Stored | None:
    """The tensor `torch.save` wrote into `blob`, located without reading its data; None when it is
    anything but one dense tensor stored uncompressed in this machine's byte order."""
    try:
        return _locate(blob)
    except Exception:  # not an archive this understands: torch.load decodes it, or says what is wrong
        return None


def _locate(blob: memoryview) -> _Stored | None:
    with zipfile.ZipFile(_ViewReader(blob)) as archive:
        entries = {e.filename: e for e in archive.infolist()}
        prefixes = [name[:-len("data.pkl")] for name in entries if name.endswith("/data.pkl")]
        if len(prefixes) != 1:
            return None
        prefix = prefixes[0]
        storages = [e for name, e in entries.items() if name.startswith(f"{prefix}data/")]
        order = entries.get(f"{prefix}byteorder")
        if len(storages) != 1 or order is None or archive.read(order) != sys.byteorder.encode():
            return None
    entry = storages[0]
    header = entry.header_offset
    if entry.compress_type != zipfile.ZIP_STORED or bytes(blob[header:header + 4]) != _LOCAL_HEADER:
        return None
    name_len, extra_len = struct.unpack_from("<HH", blob, header + 26)
    start = header + 30 + name_len + extra_len
    layout = torch.load(cast(IO[bytes], _ViewReader(blob)), map_location="meta", weights_only=True)
    if (type(layout) is not torch.Tensor or not layout.is_meta or layout.layout != torch.strided
            or layout.is_quantized or layout.untyped_storage().nbytes() != entry.file_size
            or start + entry.file_size > len(blob)):
        return None
    return _Stored(blob[start:start + entry.file_size], layout)


def _copy_stored(stored: _Stored, target: torch.Tensor) -> bool:
    """Copy `stored` (already narrowed to `target`'s shape) into `target`, bit for bit; False (nothing
    copied) when the dtypes differ or `target` is not a plain CPU tensor: `target.copy_` converts then."""
    src = stored.layout
    size = src.element_size()
    if (target.dtype != src.dtype or target.device.type != "cpu" or size not in _AS_INT_TORCH
            or target.is_conj() or target.is_neg() or target.layout != torch.strided):
        return False
    if src.numel() == 0:
        return True
    extent = 1 + sum((n - 1) * stride for n, stride in zip(src.size(), src.stride(), strict=True))
    first = src.storage_offset() * size
    if first + extent * size > len(stored.data):
        return False
    if src.is_contiguous() and target.is_contiguous():  # one flat run of bytes: a plain memory copy
        dst = target.reshape(-1).view(torch.uint8).numpy()
        np.copyto(dst, np.frombuffer(stored.data, dtype=np.uint8, count=dst.size, offset=first))
        return True
    flat = np.frombuffer(stored.data, dtype=np.uint8, count=extent * size, offset=first)
    view = np.lib.stride_tricks.as_strided(flat.view(_AS_INT_NUMPY[size]), shape=tuple(src.size()),
                                           strides=tuple(s * size for s in src.stride()), writeable=False)
    np.copyto(target.view(_AS_INT_TORCH[size]).numpy(), view)
    return True


class TrainyardReader(FileSystemReader):
    """Reads a committed Trainyard checkpoint; every byte used is verified first (see the module doc).

    `metadata_bytes`: the verified `.metadata` from `precheck` (read again and verified when empty).
    """

    def __init__(self, ckpt: CheckpointInfo, *, metadata_bytes: bytes = b"", thread_count: int = 2) -> None:
        super().__init__(ckpt.location)
        self.location = Location(ckpt.location)
        self.fs = cast(Any, HashingFileSystem(self.location, chunk_bytes=checksum.CHUNK_BYTES, sync_files=False))
        self.path = self.location.local if self.location.local is not None else self.location.root
        self._ckpt = ckpt
        self._shards: Mapping[str, ShardRecord] = {s.path: s for s in ckpt.shards}
        self._metadata_bytes = metadata_bytes
        self._threads = max(1, thread_count)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("Trainyard checkpoints have one global .metadata, not per-rank ones")
        data = self._metadata_bytes
        if not data:
            shard = self._shards.get(METADATA_FILE)
            if shard is None:
                raise ShardCorrupt(METADATA_FILE, "not declared in the checkpoint's record", self._ckpt.location)
            data = read_verified(self.location, shard)
        metadata = cast(Metadata, pickle.loads(data))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _read_file(self, name: str, reqs: Sequence[ReadItem], planner: LoadPlanner) -> None:
        shard = self._shards.get(name)
        if shard is None:
            raise ShardCorrupt(name, "is referenced by .metadata but not declared in the checkpoint's record",
                               self._ckpt.location)
        expected = _parse(shard, self._ckpt.location)
        size = self.location.size(name)
        if size is None:
            raise ShardCorrupt(name, "missing", self._ckpt.location)
        if size != shard.size_bytes:
            raise ShardCorrupt(name, f"size {size} bytes, expected {shard.size_bytes}", self._ckpt.location)
        ordered = sorted(reqs, key=lambda r: cast(_StorageInfo, self.storage_data[r.storage_index]).offset)
        with self.location.open_read(name) as stream, _mapped(stream, size) as mapped:
            source = _VerifiedFile(stream, shard, expected, self._ckpt.location, mapped)
            try:
                self._read_items(source, ordered, planner)
            finally:
                source.release()

    def _read_items(self, source: _VerifiedFile, ordered: Sequence[ReadItem], planner: LoadPlanner) -> None:
        for req in ordered:
            info = cast(_StorageInfo, self.storage_data[req.storage_index])
            data = source.read(info.offset, info.length)
            descriptors = info.transform_descriptors or ()
            if req.type == LoadItemType.BYTE_IO:
                loaded = self.transforms.transform_load_stream(req, descriptors, cast(IO[bytes], _ViewReader(data)))
                planner.load_bytes(req, io.BytesIO(loaded.read(-1)))
                continue
            target: torch.Tensor | None = None
            stored = None if descriptors else _stored_tensor(data)
            if stored is not None:
                layout = narrow_tensor_by_index(stored.layout, req.storage_offsets, req.lengths)
                target = self._target(req, planner, layout.size())
                if _copy_stored(_Stored(stored.data, layout), target):
                    planner.commit_tensor(req, target)
                    continue
            loaded = self.transforms.transform_load_stream(req, descriptors, cast(IO[bytes], _ViewReader(data)))
            seekable = loaded if loaded.seekable() else io.BytesIO(loaded.read(-1))
            tensor = cast(torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True))
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            if target is None:
                target = self._target(req, planner, tensor.size())
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    @staticmethod
    def _target(req: ReadItem, planner: LoadPlanner, size: torch.Size) -> torch.Tensor:
        target = planner.resolve_tensor(req).detach()
        if target.size() != size:
            raise CheckpointError(f"{req.storage_index}: the checkpoint holds {tuple(size)}, "
                                  f"the state dict expects {tuple(target.size())}")
        return target

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = cast(_StorageInfo, self.storage_data[item.storage_index])
            per_file.setdefault(info.relative_path, []).append(item)
        if len(per_file) <= 1 or self._threads == 1:
            for name, reqs in per_file.items():
                self._read_file(name, reqs, planner)
        else:
            with ThreadPoolExecutor(max_workers=min(self._threads, len(per_file))) as pool:
                for done in [pool.submit(self._read_file, name, reqs, planner) for name, reqs in per_file.items()]:
                    done.result()
        out: Future[None] = Future()
        out.set_result(None)
        return out
