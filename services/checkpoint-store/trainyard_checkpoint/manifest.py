"""The manifest: `.trainyard-manifest.json`, written by the service into a checkpoint's location at commit,
after every shard was verified and before the etcd transaction that commits the record.

It makes a checkpoint directory self-describing without the service: which files belong to it, their
sizes and checksums, and where the checkpoint comes from. Stock DCP readers ignore it (DCP reads only
`.metadata` and the files it names).

The bytes are a pure function of the record as committed, without the commit time, so a retried
commit writes the same bytes and an existing manifest with other bytes reveals a conflicting commit.

    {
      "format": "trainyard-checkpoint-manifest", "version": 1,
      "checkpoint_id": "ckpt-...", "job_id": "...", "attempt": 0, "step": 100, "world_size": 2,
      "created_at": 1700000000.0, "location": "file:///.../job/ckpt-...",
      "total_bytes": 1234,
      "shards": [{"path": ".metadata", "rank": 0, "size_bytes": 99, "checksum": "xxh3c:..."}, ...],
      "lineage": {"job_spec": "{...}", "code_version": "...", "parameters": {...}},
      "metadata": {...}
    }
"""

from __future__ import annotations

import json
from typing import Any

from .domain import Checkpoint

FORMAT = "trainyard-checkpoint-manifest"
VERSION = 1


def manifest_doc(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "checkpoint_id": ckpt.id,
        "job_id": ckpt.job_id,
        "attempt": ckpt.attempt,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "created_at": ckpt.created_at,
        "location": ckpt.location,
        "total_bytes": ckpt.total_bytes,
        "shards": [{"path": s.path, "rank": s.rank, "size_bytes": s.size_bytes, "checksum": s.checksum}
                   for s in ckpt.shards],
        "lineage": {"job_spec": ckpt.lineage.job_spec, "code_version": ckpt.lineage.code_version,
                    "parameters": dict(ckpt.lineage.parameters)},
        "metadata": dict(ckpt.metadata),
    }


def manifest_bytes(ckpt: Checkpoint) -> bytes:
    """The manifest of `ckpt` (a record with its shard list as committed)."""
    return (json.dumps(manifest_doc(ckpt), sort_keys=True, indent=1) + "\n").encode()
