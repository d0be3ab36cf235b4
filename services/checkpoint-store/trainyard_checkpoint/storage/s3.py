"""S3 (and S3-compatible: MinIO, Ceph RGW, moto) storage through fsspec's s3fs.
Layout: `s3://<bucket>/<prefix>/<job_id>/<checkpoint_id>/<shard path>`.

S3 has no directories and no rename, so:
- `prepare` creates nothing: a location exists once a worker has put an object under it;
- the manifest is the last object the service writes, put with `If-None-Match: *` (an exclusive create,
  `s3_conditional_writes`); a server that does not support conditional writes gets a look then a put;
- `remove` deletes every object under the location's prefix (in batches of 1000).

s3fs runs its own event loop in a thread; the blocking (sync) API is called from worker threads, so the
service's event loop never blocks on the network. Credentials come from the settings (or, when none are
given, botocore's usual chain); they are never put in a URL, a log line or an error message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, TypeVar
from urllib.parse import urlsplit

import s3fs  # type: ignore[import-untyped]

from trainyard_core.errors import FailedPrecondition, TrainyardError, Unavailable
from trainyard_core.ids import is_valid_id

from ..checksum import ChecksumMismatch
from ..domain.gc import StoredLocation
from ..domain.validation import is_checkpoint_id

T = TypeVar("T")


class S3Storage:
    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str = "", region: str = "",
                 access_key_id: str = "", secret_access_key: str = "", session_token: str = "",
                 conditional_writes: bool = True) -> None:
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._endpoint = endpoint_url
        self._conditional = conditional_writes
        client_kwargs: dict[str, Any] = {}
        if region:
            client_kwargs["region_name"] = region
        self._fs: Any = s3fs.S3FileSystem(
            key=access_key_id or None, secret=secret_access_key or None, token=session_token or None,
            endpoint_url=endpoint_url or None, client_kwargs=client_kwargs, skip_instance_cache=True,
            use_listings_cache=False, asynchronous=False)

    @property
    def url(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    def _root_path(self) -> str:
        return f"{self._bucket}/{self._prefix}" if self._prefix else self._bucket

    def location_for(self, job_id: str, checkpoint_id: str) -> str:
        return f"{self.url}/{job_id}/{checkpoint_id}"

    def _path(self, location: str) -> str:
        """The s3fs path ("bucket/key") of a location of this storage; FailedPrecondition otherwise."""
        parts = urlsplit(location)
        if parts.scheme != "s3" or parts.netloc != self._bucket or parts.query or parts.fragment:
            raise FailedPrecondition(f"location {location!r} is not an s3:// URL of this storage ({self.url})")
        key = parts.path.strip("/")
        if self._prefix:
            if not key.startswith(self._prefix + "/"):
                raise FailedPrecondition(f"location {location!r} is not under this storage's root ({self.url})")
            key = key[len(self._prefix) + 1:]
        rel = key.split("/")
        if len(rel) != 2 or not is_valid_id(rel[0]) or not is_valid_id(rel[1]):
            raise FailedPrecondition(f"location {location!r} is not a checkpoint location "
                                     f"(<root>/<job_id>/<checkpoint_id>) of {self.url}")
        return f"{self._root_path()}/{key}"

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except TrainyardError:
            raise
        except FileNotFoundError:
            raise
        except OSError as e:
            # botocore's messages name the operation and the error code, never the credentials.
            raise Unavailable(f"S3 storage {self.url}: cannot {what}: {e}") from e

    async def check(self) -> None:
        def probe() -> None:
            # HeadBucket: cheap, and it needs the credentials to work (a listing of a big root would not be).
            self._fs.call_s3("head_bucket", Bucket=self._bucket)

        try:
            await asyncio.to_thread(probe)
        except FileNotFoundError:
            raise OSError(f"S3 bucket {self._bucket!r} not found at {self._endpoint or 'AWS'} "
                          "(set --storage-url / TRAINYARD_CHECKPOINT_STORE_STORAGE_URL)") from None
        except Exception as e:
            raise OSError(f"cannot use S3 checkpoint storage {self.url} at {self._endpoint or 'AWS'}: "
                          f"{type(e).__name__}: {e} (check --storage-url and the s3_* settings)") from None

    async def close(self) -> None:
        fs = self._fs
        if getattr(fs, "_s3", None) is not None:
            await asyncio.to_thread(s3fs.S3FileSystem.close_session, fs.loop, fs._s3creator)
            fs._s3 = None

    async def prepare(self, location: str, team: str = "") -> None:
        # S3 has no directories, and workers write with the store's bucket policy: only check the location.
        self._path(location)

    def _info(self, key: str, path: str) -> int | None:
        try:
            info = self._fs.info(key, refresh=True)
        except FileNotFoundError:
            return None
        if info.get("type") != "file":
            raise FailedPrecondition(f"shard {path!r} is not an object (a prefix of other objects)")
        return int(info["size"])

    async def stat(self, location: str, path: str) -> int | None:
        key = f"{self._path(location)}/{path}"
        try:
            return await self._call(f"read shard {path!r}", lambda: self._info(key, path))
        except FileNotFoundError:
            return None

    def read_blocks(self, location: str, path: str, block_bytes: int) -> Generator[bytes, None, None]:
        key = f"{self._path(location)}/{path}"
        try:
            f = self._fs.open(key, "rb", block_size=block_bytes, cache_type="none")
        except FileNotFoundError:
            raise ChecksumMismatch(path, "missing") from None
        except OSError as e:
            raise Unavailable(f"S3 storage {self.url}: cannot read shard {path!r}: {e}") from e
        with f:
            while True:
                try:
                    block = f.read(block_bytes)
                except FileNotFoundError:
                    raise ChecksumMismatch(path, "missing (removed while it was read)") from None
                except OSError as e:
                    raise Unavailable(f"S3 storage {self.url}: cannot read shard {path!r}: {e}") from e
                if not block:
                    return
                yield bytes(block)

    def _write_once_sync(self, key: str, location: str, name: str, data: bytes) -> None:
        if self._conditional:
            try:
                self._fs.pipe_file(key, data, mode="create")
                return
            except FileExistsError:
                pass
        else:
            try:
                self._fs.info(key, refresh=True)
            except FileNotFoundError:
                self._fs.pipe_file(key, data)
                return
        if bytes(self._fs.cat_file(key)) != data:
            raise FailedPrecondition(f"{name} already exists in {location} with other "
                                     "content: another commit of this checkpoint with a different shard list "
                                     "got there first; begin a new checkpoint")

    async def write_once(self, location: str, name: str, data: bytes) -> None:
        key = f"{self._path(location)}/{name}"
        await self._call(f"write {name}", lambda: self._write_once_sync(key, location, name, data))

    def _dirs(self, path: str) -> list[str]:
        try:
            entries = self._fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

    def _list_sync(self) -> list[StoredLocation]:
        out: list[StoredLocation] = []
        root = self._root_path()
        for job in self._dirs(root):
            if not is_valid_id(job):
                continue
            for ckpt in self._dirs(f"{root}/{job}"):
                if is_checkpoint_id(ckpt):
                    out.append(StoredLocation(job, ckpt, self.location_for(job, ckpt)))
        return out

    async def list_locations(self) -> list[StoredLocation]:
        return await self._call("list checkpoints", self._list_sync)

    def _remove_sync(self, key: str) -> None:
        try:
            objects = self._fs.find(key, refresh=True)
        except FileNotFoundError:
            return
        if objects:
            self._fs.rm(list(objects))

    async def remove(self, location: str) -> None:
        key = self._path(location)
        await self._call("remove a checkpoint", lambda: self._remove_sync(key))
