"""Settings of the checkpoint-store: flags `--storage-url` etc., environment `TRAINYARD_CHECKPOINT_STORE_<SETTING>`
(e.g. `TRAINYARD_CHECKPOINT_STORE_STORAGE_URL`), or a `--config` file.

The prefix was `TRAINYARD_CHECKPOINT_`; the exact old names of settings still work, with a warning. That
prefix also holds the variables given to workers (`TRAINYARD_CHECKPOINT_STORE`, the store's address, with no
trailing `_`; `TRAINYARD_CHECKPOINT_EVERY_STEPS`, ...), which a store started from a worker's environment
must not take for settings, so only the current prefix refuses names that are no setting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from trainyard_core.security import identity
from trainyard_core.security.identity import Principal
from trainyard_core.security.unix_ids import Identity, check_run_as, read_run_as_file
from trainyard_core.settings import EtcdSettings

# S3 bucket names: 3-63 characters, lower-case letters, digits, '.', '-'.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True, slots=True)
class StorageUrl:
    scheme: Literal["file", "s3"]
    path: Path | None = None  # file://
    bucket: str = ""  # s3://
    prefix: str = ""  # s3://, without slashes at either end


def parse_storage_url(url: str) -> StorageUrl:
    """What a storage URL names. Raises ValueError with a message for the operator."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a storage URL takes no query or fragment")
    if scheme == "s3":
        if "@" in parts.netloc or ":" in parts.netloc:
            raise ValueError(f"{url!r}: put S3 credentials and endpoint in the s3_* settings, not in the URL")
        if not _BUCKET_RE.match(parts.netloc):
            raise ValueError(f"{url!r}: {parts.netloc!r} is not a valid S3 bucket name (s3://bucket/prefix)")
        prefix = unquote(parts.path).strip("/")
        if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
            raise ValueError(f"{url!r}: the S3 prefix must not contain empty, '.' or '..' parts")
        return StorageUrl("s3", bucket=parts.netloc, prefix=prefix)
    if scheme != "file":
        raise ValueError(f"{url!r}: unsupported storage URL scheme {parts.scheme or '(none)'!r}; "
                         "expected file:///absolute/path or s3://bucket/prefix")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{url!r}: a file:// URL names a local path and takes no host "
                         "(write file:///path with three slashes)")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"{url!r}: the storage path must be absolute (file:///path)")
    root = Path(path)
    if ".." in root.parts:
        raise ValueError(f"{url!r}: the storage path must not contain '..'")
    if root == Path("/"):
        raise ValueError(f"{url!r}: refusing the filesystem root as checkpoint storage")
    return StorageUrl("file", path=root)


def _secret(value: SecretStr | None) -> str:
    return value.get_secret_value() if value is not None else ""


class CheckpointSettings(EtcdSettings):
    """Trainyard checkpoint-store: checkpoint metadata and lifecycle over etcd and shared storage."""

    env_prefix: ClassVar[str] = "TRAINYARD_CHECKPOINT_STORE_"
    legacy_env_prefixes: ClassVar[tuple[str, ...]] = ("TRAINYARD_CHECKPOINT_",)

    def principal(self) -> Principal | None:
        return identity.CHECKPOINT_STORE

    listen_host: str = Field("127.0.0.1", description="address the gRPC server binds")
    listen_port: int = Field(50053, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    storage_url: str = Field(
        "file:///var/lib/trainyard/checkpoints",
        description="where checkpoints live: file:///path (POSIX or a mounted distributed filesystem) or "
                    "s3://bucket/prefix")
    s3_endpoint_url: str = Field("", description="S3 endpoint (MinIO, Ceph RGW, ...); empty: AWS")
    s3_region: str = Field("", description="S3 region; empty: botocore's default")
    s3_access_key_id: SecretStr | None = Field(
        None, description="S3 access key id; empty: botocore's credential chain")
    s3_secret_access_key: SecretStr | None = Field(None, description="S3 secret access key")
    s3_session_token: SecretStr | None = Field(None, description="S3 session token (temporary credentials)")
    s3_conditional_writes: bool = Field(
        True, description="write the manifest with If-None-Match (turn off for servers without it)")
    commit_verify: Literal["checksum", "size"] = Field(
        "checksum", description="what Commit checks of each shard: size and checksum (reads every byte), "
                                "or size only")
    verify_concurrency: int = Field(8, ge=1, le=256, description="shards read at once while verifying a commit")
    gc_interval_s: float = Field(300.0, ge=0, description="seconds between GC passes; 0: no background GC")
    gc_grace_s: float = Field(
        3600.0, ge=0, description="seconds aborted checkpoints' and orphaned files stay before GC removes them")
    gc_abandon_writing_s: float = Field(
        6 * 3600.0, gt=0, description="a checkpoint still WRITING this long after Begin is aborted by GC")
    gc_tombstone_retention_s: float = Field(
        7 * 86400.0, ge=0, description="seconds a DELETED record is kept before GC drops it")
    gc_lock_ttl_s: int = Field(30, ge=2, le=3600, description="TTL of the GC lock (one pass at a time)")
    restore_lease_max_ttl_s: int = Field(86400, ge=1, description="longest restore lease a client may ask for")
    shutdown_grace_s: float = Field(5.0, ge=0, description="seconds in-flight calls get on shutdown")
    tool_teams: list[str] = Field(
        default_factory=list, description="the teams whose jobs' checkpoints an internal tool (certificate "
        "trainyard://tool/<name>) may act on, as TOOL:TEAM pairs (e.g. ops:ml,ops:research), as the scheduler's "
        "setting of that name; a tool names one of them in x-trainyard-team. The gateway acts for its users' teams")

    run_as: dict[str, str] = Field(
        default_factory=dict,
        description="POSIX storage on a host where workers run as their team's Unix identity (the agents' run_as): "
                    "the same mapping, e.g. ml=2001:2001,research=2002:2002. Each job's checkpoint directories are "
                    "then handed to its team's uid:gid, mode 0700, so its workers can write their shards and no "
                    "other team can read them. Needs the store to run as root (it reads and removes what workers "
                    "wrote). Empty: directories stay the store's own (one team, or S3)")
    run_as_file: str = Field("", description="site file of the same mapping, one 'team uid:gid' per line, '#' "
                                             "comments (the agents' run_as_file); run_as entries win")

    @model_validator(mode="before")
    @classmethod
    def _merge_run_as_file(cls, data: Any) -> Any:
        if isinstance(data, dict):
            path = data.get("run_as_file")
            if path and isinstance(path, str):
                data = {**data, "run_as": {**read_run_as_file(path), **dict(data.get("run_as") or {})}}
        return data

    @field_validator("run_as")
    @classmethod
    def _check_run_as(cls, v: dict[str, str]) -> dict[str, str]:
        check_run_as(v)  # user names are looked up here: one missing on this host stops the store at start
        return v

    def owners(self) -> dict[str, Identity]:
        """Each team's identity on the storage (empty: no mapping)."""
        return check_run_as(self.run_as)

    @field_validator("tool_teams")
    @classmethod
    def _tool_teams(cls, v: list[str]) -> list[str]:
        identity.tool_team_bindings(v)
        return v

    def tool_team_map(self) -> dict[str, frozenset[str]]:
        return identity.tool_team_bindings(self.tool_teams)

    @field_validator("storage_url")
    @classmethod
    def _check_storage_url(cls, value: str) -> str:
        parse_storage_url(value)
        return value

    @model_validator(mode="after")
    def _check_run_as_storage(self) -> CheckpointSettings:
        if self.run_as and self.storage.scheme != "file":
            raise ValueError("run_as hands POSIX checkpoint directories to teams; with s3:// storage there are "
                             "none: leave run_as and run_as_file empty (bucket policies keep S3 apart)")
        return self

    @model_validator(mode="after")
    def _check_s3_credentials(self) -> CheckpointSettings:
        # The message names the settings, never their values.
        if bool(_secret(self.s3_access_key_id)) != bool(_secret(self.s3_secret_access_key)):
            raise ValueError("s3_access_key_id and s3_secret_access_key go together: set both or neither")
        return self

    @property
    def storage(self) -> StorageUrl:
        return parse_storage_url(self.storage_url)

    @property
    def storage_root(self) -> Path:
        """The directory of a file:// storage URL (ValueError for an S3 one)."""
        url = self.storage
        if url.path is None:
            raise ValueError(f"{self.storage_url!r} is not a file:// storage URL")
        return url.path

    def s3_credentials(self) -> tuple[str, str, str]:
        """(access key id, secret, session token); empty strings where unset. Pass them on, never log them."""
        return (_secret(self.s3_access_key_id), _secret(self.s3_secret_access_key), _secret(self.s3_session_token))
