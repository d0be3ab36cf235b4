"""GPU holdings per node: the store's own guard that no GPU is ever in two gangs.

Key `{p}/holdings/{node_id}`, value JSON `{"jobs": {job_id: [gpu index, ...]}}`, absent when the node
holds nothing. It is written only inside the transactions that create a gang's allocation
(`Repository.commit_placement`) or delete one (a release through `Repository.write`), together with it, so
at any revision a node's holdings are exactly the GPUs its allocations name.

Each of those transactions compares every node whose holdings it changes with the revision this leader
last saw, and the GPUs it takes are checked against the value at that revision before it is sent. A gang
decided on a stale view (a mirror that has not yet delivered this leader's own last commit, a new leader
whose mirror is behind) is therefore refused before it is sent (`HeldElsewhere`) or loses its compare,
instead of taking a GPU twice: disjointness does not rest on the snapshot being current.

This module holds the data and the pure edits (`take`, `give_back`, `drop`: node → how its holdings
change) and `HoldingsLedger`, the newest value known per node; `state/group_commit.py` turns edits into
transactions. The ledger keeps what this leader's successful transactions wrote, so the next transaction
on a node compares the revision it produced even before the mirror has delivered it; a kept value is
dropped when a transaction on its node fails or its outcome is unknown, and read again from the source
(the leader's mirror, or the store).

Per node, not per leaf switch: measured with the scheduler benchmark, per-leaf keys cut etcd's work per
gang but made gangs packed into one leaf wait for each other (0.34 of etcd's raw rate against 0.50).

GPU-less assignments (CPU tasks) are not held here: the invariant guarded is GPU disjointness.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import orjson

from trainyard_core.errors import Conflict
from trainyard_core.store import KeyValue

from ..domain.models import Allocation
from .keys import Keys

# Where the current holdings of a node come from when this ledger has not written them itself: the mirror
# (a dict lookup) for the leader, the store for everything else.
Source = Callable[[str], Awaitable[KeyValue | None]]
Jobs = Mapping[str, tuple[int, ...]]
# How one node's holdings change: the jobs map it had → the jobs map it gets (None: unchanged). May raise
# HeldElsewhere. Pure.
Edit = Callable[[Jobs], Jobs | None]


class HeldElsewhere(Conflict):
    """A GPU a placement names is held by another job at the newest revision known."""


@dataclass(frozen=True, slots=True)
class NodeHolding:
    node_id: str
    revision: int  # mod revision of the key, what a transaction compares; 0: absent (holds nothing)
    jobs: Jobs
    # The store revision at which this view is known to be true (for an absent key this ledger deleted, the
    # revision of that delete; a source's absent key says nothing newer than 0).
    as_of: int = 0


def encode_holding(jobs: Jobs) -> bytes:
    """Canonical bytes (jobs sorted, each job's GPUs sorted): equal holdings encode equal."""
    return orjson.dumps({"jobs": {j: sorted(g) for j, g in jobs.items()}}, option=orjson.OPT_SORT_KEYS)


def decode_holding(node_id: str, kv: KeyValue | None) -> NodeHolding:
    if kv is None:
        return NodeHolding(node_id, 0, {})
    raw = orjson.loads(kv.value)
    return NodeHolding(node_id, kv.mod_revision, {str(j): tuple(int(g) for g in gpus)
                                                    for j, gpus in raw.get("jobs", {}).items()}, kv.mod_revision)


def gpus_by_node(alloc: Allocation) -> dict[str, tuple[int, ...]]:
    out: dict[str, list[int]] = {}
    for a in alloc.assignments:
        if a.gpu_indices:
            out.setdefault(a.node_id, []).extend(a.gpu_indices)
    return {n: tuple(sorted(g)) for n, g in out.items()}


def take(alloc: Allocation) -> dict[str, Edit]:
    """Placing `alloc`: its GPUs join each node's holdings; HeldElsewhere when another job holds one."""
    def edit(node_id: str, want: tuple[int, ...]) -> Edit:
        def apply(jobs: Jobs) -> Jobs | None:
            taken = {g for j, gpus in jobs.items() if j != alloc.job_id for g in gpus} & set(want)
            if taken:
                raise HeldElsewhere(f"GPU(s) {sorted(taken)} on {node_id} are already held; {alloc.job_id} was "
                                    "decided on a stale view")
            return None if jobs.get(alloc.job_id) == want else {**jobs, alloc.job_id: want}
        return apply
    return {n: edit(n, g) for n, g in gpus_by_node(alloc).items()}


def give_back(alloc: Allocation) -> dict[str, Edit]:
    """Releasing `alloc`: its job leaves the holdings of every node of the gang."""
    return drop(gpus_by_node(alloc), [alloc.job_id])


def drop(node_ids: Iterable[str], job_ids: Iterable[str]) -> dict[str, Edit]:
    """These jobs leave these nodes' holdings."""
    gone = frozenset(job_ids)

    def apply(jobs: Jobs) -> Jobs | None:
        if not gone & set(jobs):
            return None
        return {j: g for j, g in jobs.items() if j not in gone}
    return dict.fromkeys(node_ids, apply)


class HoldingsLedger:
    def __init__(self, keys: Keys, source: Source) -> None:
        self.keys = keys
        self._source = source
        self._kept: dict[str, NodeHolding] = {}

    def reset(self) -> None:
        """Forget the values this ledger wrote (a new leadership term: the source is the authority again)."""
        self._kept.clear()

    async def current(self, node_id: str) -> NodeHolding:
        """The newest holdings known for a node: what this ledger wrote, or the source's, whichever is newer."""
        kv = await self._source(self.keys.holdings(node_id))
        kept = self._kept.get(node_id)
        if kept is not None and kept.as_of >= (kv.mod_revision if kv is not None else 0):
            return kept  # what this ledger wrote is at least as new: no need to decode the source's
        self._kept.pop(node_id, None)
        return decode_holding(node_id, kv)

    def settle(self, written: Mapping[str, Jobs], revision: int) -> None:
        """A transaction that wrote these nodes' holdings succeeded at `revision`: keep what it wrote."""
        for node_id, jobs in written.items():
            # A node left holding nothing is absent again: compared as 0, known true as of `revision`.
            self._kept[node_id] = NodeHolding(node_id, revision if jobs else 0, jobs, revision)

    def forget(self, node_ids: Iterable[str]) -> None:
        """A transaction lost its compare or its outcome is unknown: read these nodes afresh next time."""
        for n in node_ids:
            self._kept.pop(n, None)
