"""Prometheus metrics of the checkpoint-store (served when --metrics-port is set).

The service never moves checkpoint data (workers write and read storage directly), so what it measures is
what it sees of a save and a load:
- a save is a Begin and, once every rank wrote its shards, a Commit: `save_seconds` runs from the Begin to
  the Commit that made the checkpoint COMMITTED, `saved_bytes_total` and `size_bytes` count the shards the
  Commit recorded; `commit_seconds` is the Commit's own work (verifying the shards in storage, writing the
  manifest, the transaction), and `commits_total{result}` its outcome;
- a load holds a restore lease on the checkpoint while it reads it (client/loading.py): `loads_total` and
  `load_bytes_total` count the leases taken and the size of the checkpoints they cover, `load_seconds` runs
  from the lease's acquisition to its release (a lease left to expire is not timed);
- garbage collection: passes by result, their duration, and what they removed by action, with the bytes of
  the checkpoints whose files went (as their records give them: an aborted checkpoint or an orphan in storage
  has no recorded size, and counts in `gc_removed_total` only).

Labels: `result` and `action` from the closed vocabularies below; no job or checkpoint id.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from .domain.gc import ActionKind

_SECONDS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
_BYTES = tuple(float(2**n) for n in range(20, 46, 3))  # 1 MiB to 16 TiB, 8 times each

BEGUN = Counter("trainyard_checkpoint_begun_total", "Checkpoints begun (a save started)")
COMMIT_RESULTS: tuple[str, ...] = ("committed", "refused", "failed")
COMMITS = Counter("trainyard_checkpoint_commits_total",
                  "Commits of a WRITING checkpoint by result (committed; refused: a shard missing, truncated or "
                  "corrupt in storage, or the attempt superseded; failed: the store or storage could not be "
                  "reached, or the commit lost every retry)", ["result"])
COMMIT_SECONDS = Histogram("trainyard_checkpoint_commit_seconds",
                           "Duration of a commit that succeeded: shard verification, manifest, transaction",
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0))
SAVE_SECONDS = Histogram("trainyard_checkpoint_save_seconds",
                         "Time from a checkpoint's Begin to its Commit (the ranks writing their shards)",
                         buckets=_SECONDS)
SAVED_BYTES = Counter("trainyard_checkpoint_saved_bytes_total", "Bytes of the shards of the checkpoints committed")
SIZE_BYTES = Histogram("trainyard_checkpoint_size_bytes", "Size of each committed checkpoint (its shards)",
                       buckets=_BYTES)
ABORTED = Counter("trainyard_checkpoint_aborted_total", "Checkpoints aborted (by their job, or by GC as abandoned)")
DAMAGED = Counter("trainyard_checkpoint_damaged_total",
                  "Committed checkpoints marked damaged after a reader's report was confirmed in storage")
LOADS = Counter("trainyard_checkpoint_loads_total", "Restore leases taken (a load started)")
LOAD_BYTES = Counter("trainyard_checkpoint_load_bytes_total", "Bytes of the checkpoints leased for a load")
LOAD_SECONDS = Histogram("trainyard_checkpoint_load_seconds",
                         "Time a load held its restore lease, from acquisition to release", buckets=_SECONDS)
GC_RESULTS: tuple[str, ...] = ("ok", "skipped", "failed")
GC_RUNS = Counter("trainyard_checkpoint_gc_runs_total",
                  "Garbage-collection passes by result (skipped: another replica held the GC lock)", ["result"])
GC_SECONDS = Histogram("trainyard_checkpoint_gc_seconds", "Duration of a garbage-collection pass that ran",
                       buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0))
GC_ACTIONS: tuple[str, ...] = tuple(kind.value.lower() for kind in ActionKind)
GC_REMOVED = Counter("trainyard_checkpoint_gc_removed_total",
                     "What garbage collection did, by action (delete_by_retention, remove_aborted, remove_damaged, "
                     "remove_orphan, abort_abandoned, purge_tombstone)", ["action"])
GC_REMOVED_BYTES = Counter("trainyard_checkpoint_gc_removed_bytes_total",
                           "Bytes of the committed checkpoints whose files garbage collection removed (as recorded)")


def action_label(kind: ActionKind) -> str:
    return kind.value.lower()
