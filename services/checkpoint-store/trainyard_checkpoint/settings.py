"""Settings of the checkpoint-store (env prefix `TRAINYARD_CHECKPOINT_`, flags `--storage-url` etc.)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import Field, field_validator

from trainyard_core.settings import BaseSettings

S3_NOT_YET = ("S3 support arrives with the checkpoint issue (issue 5); use a file:// URL "
              "(a local or mounted distributed filesystem) for now")


def parse_storage_url(url: str) -> Path:
    """The directory a `file://` storage URL names. Raises ValueError with a message for the operator."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        raise ValueError(f"{url!r}: {S3_NOT_YET}")
    if scheme != "file":
        raise ValueError(f"{url!r}: unsupported storage URL scheme {parts.scheme or '(none)'!r}; "
                         "expected file:///absolute/path")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{url!r}: a file:// URL names a local path and takes no host "
                         "(write file:///path with three slashes)")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a storage URL takes no query or fragment")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"{url!r}: the storage path must be absolute (file:///path)")
    root = Path(path)
    if ".." in root.parts:
        raise ValueError(f"{url!r}: the storage path must not contain '..'")
    if root == Path("/"):
        raise ValueError(f"{url!r}: refusing the filesystem root as checkpoint storage")
    return root


class CheckpointSettings(BaseSettings):
    """Trainyard checkpoint-store: checkpoint metadata and lifecycle over etcd and shared storage."""

    listen_host: str = Field("127.0.0.1", description="address the gRPC server binds")
    listen_port: int = Field(50053, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    storage_url: str = Field(
        "file:///var/lib/trainyard/checkpoints",
        description="where checkpoints live: file:///path (POSIX or a mounted distributed filesystem)")
    shutdown_grace_s: float = Field(5.0, ge=0, description="seconds in-flight calls get on shutdown")

    @field_validator("storage_url")
    @classmethod
    def _check_storage_url(cls, value: str) -> str:
        parse_storage_url(value)
        return value

    @property
    def storage_root(self) -> Path:
        return parse_storage_url(self.storage_url)
