"""The reconciler's snapshot, kept from the etcd mirror incrementally.

The builder holds the decoded live records (active jobs, allocations, nodes, the operator's queues, quotas and
usage, each running job's latest checkpoint) and, at each `build`, re-decodes only the keys the mirror says
changed since the last one (`PrefixMirror.subscribe`). A cycle's cost is then what changed plus copying the
live maps, not a walk over every key in etcd; a finished job is dropped from the view as soon as its record
says so, and its decoded record is not kept.

After the mirror reloads (a lost watch, a compaction) the next build starts from the whole copy again. A
record that does not decode: a job, allocation or node raises (as a full decode always did: the loop logs it
and tries again next cycle, from the whole copy); an operator record (queue, quota, usage) is logged and
ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TypeVar

from trainyard_core.ids import id_time
from trainyard_core.store.api import KeyValue
from trainyard_core.store.mirror import PrefixMirror

from ..domain.models import Allocation, Job, Node
from ..domain.queues import FairShareUsage, QueueConfig, TeamQuota
from ..domain.snapshot import ClusterSnapshot
from ..liveness import NodeLiveness
from .codec import decode_allocation, decode_job, decode_node, decode_queue, decode_quota, decode_usage
from .keys import Keys

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass
class PolicyState:
    """The operator policy found in etcd this cycle."""

    queues: dict[str, QueueConfig]
    quotas: dict[str, TeamQuota]
    usage: FairShareUsage
    usage_revision: int


class SnapshotBuilder:
    def __init__(self, mirror: PrefixMirror, keys: Keys) -> None:
        self._mirror = mirror
        self._keys = keys
        self._changes = mirror.subscribe()
        self._clear()

    def _clear(self) -> None:
        # key → (revision, decoded) for every live record kept; and the maps a snapshot hands out, by id.
        self._jobs: dict[str, tuple[Job, int]] = {}
        self._allocs: dict[str, tuple[Allocation, int]] = {}
        self._nodes: dict[str, Node] = {}
        # The nodes as the last snapshot got them: a copy made again only after a node record changed (they
        # change on registration and health, not with jobs), so a cycle does not copy the fleet.
        self._nodes_copy: Mapping[str, Node] | None = None
        self._dead_memo: tuple[Mapping[str, Node], frozenset[str], frozenset[str]] | None = None
        self._queues: dict[str, QueueConfig] = {}
        self._quotas: dict[str, TeamQuota] = {}
        self._usage: tuple[FairShareUsage, int] = (FairShareUsage(), 0)
        # Job id → when its latest committed checkpoint was begun: a checkpoint id says when it was minted
        # (the checkpoint-store mints it at Begin, with the record's created_at), so the pointer alone tells
        # the time and the checkpoint records need not be mirrored.
        self._latest_at: dict[str, float] = {}

    # -- keeping the view current ---------------------------------------------------------------------
    def _refresh(self) -> None:
        full, keys = self._changes.take()
        items = self._mirror.items
        if full:
            self._clear()
            keys = set(items)
        try:
            for key in keys:
                self._apply(key, items.get(key))
        except BaseException:
            self._changes.reloaded()  # half applied: start from the whole copy next time
            raise

    def _apply(self, key: str, kv: KeyValue | None) -> None:
        k = self._keys
        if key.startswith(k.jobs):
            ident = key[len(k.jobs):]
            job = decode_job(kv.value) if kv is not None else None
            if job is None or job.state.terminal:
                self._jobs.pop(ident, None)
            else:
                assert kv is not None
                self._jobs[ident] = (job, kv.mod_revision)
        elif key.startswith(k.allocations):
            ident = key[len(k.allocations):]
            if kv is None:
                self._allocs.pop(ident, None)
            else:
                self._allocs[ident] = (decode_allocation(kv.value), kv.mod_revision)
        elif key.startswith(k.nodes):
            ident = key[len(k.nodes):]
            self._nodes_copy = None
            if kv is None:
                self._nodes.pop(ident, None)
            else:
                self._nodes[ident] = decode_node(kv.value)
        elif key.startswith(k.queues):
            self._policy_record(self._queues, key[len(k.queues):], kv, decode_queue, QueueConfig)
        elif key.startswith(k.quotas):
            self._policy_record(self._quotas, key[len(k.quotas):], kv, decode_quota, TeamQuota)
        elif key == k.usage:
            usage = self._quietly(key, kv, decode_usage) if kv is not None else None
            self._usage = (usage, kv.mod_revision) if isinstance(usage, FairShareUsage) and kv is not None \
                else (FairShareUsage(), 0)
        elif key.startswith(k.checkpoints_latest):
            ident = key[len(k.checkpoints_latest):]
            at = id_time(kv.value.decode(errors="replace")) if kv is not None else None
            if at is None:
                self._latest_at.pop(ident, None)
            else:
                self._latest_at[ident] = at

    @staticmethod
    def _policy_record(into: dict[str, R], ident: str, kv: KeyValue | None,
                       decode: Callable[[bytes], object], kind: type[R]) -> None:
        obj = SnapshotBuilder._quietly(ident, kv, decode) if kv is not None else None
        if isinstance(obj, kind):
            into[ident] = obj
        else:
            into.pop(ident, None)

    @staticmethod
    def _quietly(key: str, kv: KeyValue, decode: Callable[[bytes], object]) -> object:
        """Operator records: one that does not decode is logged and ignored, never fatal to the loop."""
        try:
            return decode(kv.value)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring undecodable record %s: %s", kv.key, exc)
            return None

    # -- the snapshot ---------------------------------------------------------------------------------
    def build(self, liveness: NodeLiveness,
              released_at: Mapping[tuple[str, int], float]) -> tuple[ClusterSnapshot, PolicyState]:
        self._refresh()
        jobs = {ident: job for ident, (job, _) in self._jobs.items()}
        allocs = {ident: alloc for ident, (alloc, _) in self._allocs.items()}
        # What preempting a running job would lose runs from its latest committed checkpoint.
        for job_id in allocs:
            job = jobs.get(job_id)
            at = self._latest_at.get(job_id)
            if job is not None and at is not None:
                jobs[job_id] = replace(job, last_checkpoint_at=at)
        if self._nodes_copy is None:
            self._nodes_copy = MappingProxyType(dict(self._nodes))
        nodes = self._nodes_copy
        alive = liveness.alive(nodes)
        # The nodes not alive: the same set while neither the nodes nor the live ones changed (both hand the
        # same objects back then), so a cycle does not take the difference over the whole fleet.
        if self._dead_memo is None or self._dead_memo[0] is not nodes or self._dead_memo[1] is not alive:
            self._dead_memo = (nodes, alive, frozenset(nodes.keys() - alive))
        dead = self._dead_memo[2]
        snap = ClusterSnapshot(nodes=nodes, alive=alive, jobs=jobs, allocations=allocs,
                               job_revisions={ident: rev for ident, (_, rev) in self._jobs.items()},
                               allocation_revisions={ident: rev for ident, (_, rev) in self._allocs.items()},
                               reported_running=liveness.reports.running(),
                               reported_at=liveness.reports.reported_at(), released_at=released_at,
                               silence=liveness.silence(dead))
        usage, usage_rev = self._usage
        return snap, PolicyState(dict(self._queues), dict(self._quotas), usage, usage_rev)
