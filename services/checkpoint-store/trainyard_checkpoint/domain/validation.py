"""Validation of requests, before anything is read or written. Each failure is an InvalidArgument whose
message names the field and says what is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainyard_core import contract
from trainyard_core.errors import InvalidArgument
from trainyard_core.ids import is_valid_id

from .. import checksum
from .checkpoint import RESERVED_PREFIX, Lineage, Shard
from .retention import RetentionPolicy, validate_policy

CHECKPOINT_ID_PREFIX = "ckpt"
MAX_JOB_SPEC_BYTES = 64 * 1024
MAX_CODE_VERSION_CHARS = 256
MAX_HOLDER_CHARS = 256
LEASE_ID_RE = re.compile(r"^[0-9a-f]{1,16}$")
# The record (with every shard) is one etcd value, and etcd caps a request at 1.5 MiB by default.
# 10,000 shards of ~100 bytes each stay well under it; issue 5 moves big manifests into storage.
MAX_SHARDS = 10_000
MAX_SHARD_PATH_CHARS = 1024
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_BYTES = 16 * 1024
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class BeginRequest:
    job_id: str
    attempt: int
    step: int
    world_size: int
    metadata: Mapping[str, str]
    lineage: Lineage = field(default_factory=Lineage)
    retention: RetentionPolicy | None = None


def validate_job_id(job_id: str, field_name: str = "job_id") -> None:
    if not job_id:
        raise InvalidArgument(f"{field_name} is required")
    if not is_valid_id(job_id):
        raise InvalidArgument(f"{field_name} {job_id!r} is not a valid job id (3-63 characters: lower-case "
                              "letters, digits and '-', starting with a letter)")


def is_checkpoint_id(value: str) -> bool:
    return is_valid_id(value) and value.startswith(CHECKPOINT_ID_PREFIX + "-")


def validate_checkpoint_id(checkpoint_id: str, field_name: str = "checkpoint_id") -> None:
    if not checkpoint_id:
        raise InvalidArgument(f"{field_name} is required")
    if not is_checkpoint_id(checkpoint_id):
        raise InvalidArgument(f"{field_name} {checkpoint_id!r} is not a checkpoint id (expected "
                              f"'{CHECKPOINT_ID_PREFIX}-' followed by lower-case letters and digits, as "
                              "returned by BeginCheckpoint)")


def validate_begin(req: BeginRequest) -> None:
    validate_job_id(req.job_id)
    if req.attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {req.attempt}")
    if req.step < 0:
        raise InvalidArgument(f"step must be >= 0, got {req.step}")
    if req.world_size < 1:
        raise InvalidArgument(f"world_size must be >= 1, got {req.world_size}")
    validate_metadata(req.metadata)
    validate_lineage(req.lineage)
    if req.retention is not None:
        validate_policy(req.retention, "retention")


def validate_metadata(metadata: Mapping[str, str], field_name: str = "metadata") -> None:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"{field_name} has {len(metadata)} entries; at most {MAX_METADATA_ENTRIES} "
                              "are allowed")
    size = 0
    for key, value in metadata.items():
        if not key or len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidArgument(f"{field_name} key {key!r} must be 1-{MAX_METADATA_KEY_CHARS} characters")
        size += len(key.encode()) + len(value.encode())
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(f"{field_name} is {size} bytes; at most {MAX_METADATA_BYTES} are allowed (put "
                              "large data in storage and a reference here)")


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def validate_lineage(lineage: Lineage) -> None:
    if lineage.job_spec:
        size = len(lineage.job_spec.encode())
        if size > MAX_JOB_SPEC_BYTES:
            raise InvalidArgument(f"lineage.job_spec is {size} bytes; at most {MAX_JOB_SPEC_BYTES} are allowed")
        try:
            spec = json.loads(lineage.job_spec)
        except ValueError as e:
            raise InvalidArgument(f"lineage.job_spec is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise InvalidArgument("lineage.job_spec must be a JSON object (the job's spec as submitted)")
    if len(lineage.code_version) > MAX_CODE_VERSION_CHARS or _has_control(lineage.code_version):
        raise InvalidArgument(f"lineage.code_version must be at most {MAX_CODE_VERSION_CHARS} characters "
                              "without control characters")
    validate_metadata(lineage.parameters, "lineage.parameters")


def validate_tag(tag: str) -> None:
    if not contract.CHECKPOINT_TAG.matches(tag):  # fullmatch: re's `$` took a trailing newline ("best\n")
        raise InvalidArgument(f"tag {tag!r} must be {contract.CHECKPOINT_TAG.rule}")


def validate_lease_request(ttl_s: int, max_ttl_s: int, holder: str) -> None:
    if not 1 <= ttl_s <= max_ttl_s:
        raise InvalidArgument(f"ttl_s must be in [1, {max_ttl_s}] seconds, got {ttl_s}")
    if len(holder) > MAX_HOLDER_CHARS or _has_control(holder):
        raise InvalidArgument(f"holder must be at most {MAX_HOLDER_CHARS} characters without control characters")


def validate_lease_id(lease_id: str) -> None:
    if not lease_id:
        raise InvalidArgument("lease_id is required")
    if not LEASE_ID_RE.match(lease_id):
        raise InvalidArgument(f"lease_id {lease_id[:40]!r} is not a lease id returned by AcquireRestoreLease")


def shard_path_problem(path: str) -> str | None:
    """Why `path` is not acceptable as a shard path relative to a checkpoint's location, or None.

    Accepted: a relative POSIX path in canonical form, so it cannot leave the checkpoint's directory
    and one file has one spelling (no '', '.' or '..' components, no '/' at either end, no backslash,
    no NUL or other control characters).
    """
    if not path:
        return "is empty"
    if len(path) > MAX_SHARD_PATH_CHARS:
        return f"is longer than {MAX_SHARD_PATH_CHARS} characters"
    if path.startswith("/"):
        return "is absolute; shard paths are relative to the checkpoint's location"
    if "\\" in path:
        return "contains a backslash; use '/' as the separator"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "contains a control character"
    parts = path.split("/")
    if ".." in parts:
        return "contains '..'; shards must stay inside the checkpoint's location"
    if "" in parts or "." in parts:
        return "is not in canonical form (empty or '.' component)"
    if any(p.startswith(RESERVED_PREFIX) for p in parts):
        return f"uses the reserved prefix {RESERVED_PREFIX!r} (the service's own files)"
    return None


def validate_shard_paths(paths: Sequence[str], field_name: str = "shard_paths") -> None:
    """Shard paths named by a caller (a damage report): each in canonical relative form, at most
    MAX_SHARDS of them."""
    if len(paths) > MAX_SHARDS:
        raise InvalidArgument(f"{len(paths)} {field_name} given; at most {MAX_SHARDS} are allowed")
    for i, path in enumerate(paths):
        problem = shard_path_problem(path)
        if problem is not None:
            raise InvalidArgument(f"{field_name}[{i}] {path[:200]!r} {problem}")


def validate_shards(shards: Sequence[Shard], world_size: int, *, verifiable: bool = False) -> None:
    """Checks a commit's shard list against the checkpoint's world size.

    `verifiable`: the service verifies checksums at commit, so each must be one it can compute (xxh3c
    or xxh3; a crc32c is refused rather than recorded unchecked).
    """
    if not shards:
        raise InvalidArgument("shards is empty: a commit declares every file of the checkpoint")
    if len(shards) > MAX_SHARDS:
        raise InvalidArgument(f"{len(shards)} shards declared; at most {MAX_SHARDS} are allowed")
    seen: set[str] = set()
    for i, shard in enumerate(shards):
        where = f"shards[{i}]"
        problem = shard_path_problem(shard.path)
        if problem is not None:
            raise InvalidArgument(f"{where}.path {shard.path!r} {problem}")
        if shard.path in seen:
            raise InvalidArgument(f"{where}.path {shard.path!r} is declared twice")
        seen.add(shard.path)
        if shard.size_bytes < 0:
            raise InvalidArgument(f"{where}.size_bytes of {shard.path!r} must be >= 0, got "
                                  f"{shard.size_bytes}")
        if not 0 <= shard.rank < world_size:
            raise InvalidArgument(f"{where}.rank of {shard.path!r} must be in [0, {world_size}) for a "
                                  f"checkpoint of world size {world_size}, got {shard.rank}")
        try:
            parsed = checksum.parse(shard.checksum)
        except InvalidArgument as e:
            raise InvalidArgument(f"{where}.checksum of {shard.path!r}: {e.message} (lower-case hex)") from None
        if verifiable and not parsed.verifiable:
            raise InvalidArgument(f"{where}.checksum of {shard.path!r} is {parsed.algo}, which this service "
                                  "cannot verify at commit (commit_verify=checksum); declare "
                                  "xxh3c:<chunk bytes>:<hex>... (trainyard_checkpoint.checksum)")


def page_size(requested: int) -> int:
    """0 means the default; larger than the maximum is clamped (not an error, per the usual API style)."""
    if requested < 0:
        raise InvalidArgument(f"page_size must be >= 0, got {requested}")
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def validate_page_token(token: str) -> None:
    """Page tokens are the last checkpoint id of the previous page."""
    if token:
        try:
            validate_checkpoint_id(token, "page_token")
        except InvalidArgument:
            raise InvalidArgument(f"page_token {token!r} is not a token returned by ListCheckpoints") \
                from None
