"""GPU holdings per node: the store's own guard that no GPU is ever in two gangs.

Key `{p}/holdings/{node_id}`, value JSON `{"jobs": {job_id: [gpu index, ...]}}`, absent when the node
holds nothing. It is written only inside the transactions that create a gang's allocation
(`Repository.commit_placement`) or delete one (a release through `Repository.write`), together with it, so
at every revision a node's holdings are exactly the GPUs its allocations name.

Each of those transactions compares every involved node's holdings key with the mod revision this leader
last saw, and the GPUs it takes are checked against the value at that revision. A gang decided on a stale
view (a mirror that has not yet delivered this leader's own last commit, a new leader whose mirror is
behind) therefore loses its compare, or is refused before it is sent, instead of taking a GPU twice:
disjointness does not rest on the snapshot being current.

Concurrency: per-node locks serialize this leader's transactions that touch the same node, and the value
each one wrote is kept (`settle`), so two gangs that share a node in one cycle both commit: the second
compares the revision the first produced. A lock is held for one store transaction only (its duration is
bounded by the client's deadline). Kept values are dropped when a transaction loses its compare or its
outcome is unknown, and read again from the source (the leader's mirror, or the store itself).

GPU-less assignments (CPU tasks) are not held here: the invariant guarded is GPU disjointness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from trainyard_core.errors import Conflict
from trainyard_core.store import Compare, Delete, KeyValue, Put, mod_revision_is

from ..domain.models import Allocation
from .keys import Keys

# Where the current holdings of a node come from when this ledger has not written them itself: the mirror
# (a dict lookup) for the leader, the store for everything else.
Source = Callable[[str], Awaitable[KeyValue | None]]


class HeldElsewhere(Conflict):
    """A GPU a placement names is held by another job at the newest revision known."""


@dataclass(frozen=True, slots=True)
class NodeHolding:
    node_id: str
    revision: int  # mod revision of the key, what a transaction compares; 0: absent (holds nothing)
    jobs: Mapping[str, tuple[int, ...]]
    # The store revision at which this view is known to be true (for an absent key this ledger deleted, the
    # revision of that delete; a source's absent key says nothing newer than 0).
    as_of: int = 0

    def held_by_others(self, job_id: str) -> set[int]:
        return {g for j, gpus in self.jobs.items() if j != job_id for g in gpus}


@dataclass(frozen=True, slots=True)
class HoldingsChange:
    """The compares and writes one transaction adds, and the values it leaves behind if it succeeds."""

    compares: tuple[Compare, ...]
    ops: tuple[Put | Delete, ...]
    after: tuple[NodeHolding, ...]

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(h.node_id for h in self.after)


def encode_holding(jobs: Mapping[str, Sequence[int]]) -> bytes:
    return json.dumps({"jobs": {j: sorted(g) for j, g in sorted(jobs.items())}}, separators=(",", ":")).encode()


def decode_holding(node_id: str, kv: KeyValue | None) -> NodeHolding:
    if kv is None:
        return NodeHolding(node_id, 0, {})
    raw = json.loads(kv.value)
    return NodeHolding(node_id, kv.mod_revision, {str(j): tuple(int(g) for g in gpus)
                                                    for j, gpus in raw.get("jobs", {}).items()}, kv.mod_revision)


def gpus_by_node(alloc: Allocation) -> dict[str, tuple[int, ...]]:
    out: dict[str, list[int]] = {}
    for a in alloc.assignments:
        if a.gpu_indices:
            out.setdefault(a.node_id, []).extend(a.gpu_indices)
    return {n: tuple(sorted(g)) for n, g in out.items()}


class HoldingsLedger:
    def __init__(self, keys: Keys, source: Source) -> None:
        self._keys = keys
        self._source = source
        self._kept: dict[str, NodeHolding] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def reset(self) -> None:
        """Forget the values this ledger wrote (a new leadership term: the source is the authority again)."""
        self._kept.clear()

    @contextlib.asynccontextmanager
    async def locked(self, node_ids: Iterable[str]) -> AsyncIterator[None]:
        """Holds the locks of these nodes, taken in sorted order so that two gangs can never deadlock."""
        ordered = sorted(set(node_ids))
        async with contextlib.AsyncExitStack() as stack:
            for n in ordered:
                await stack.enter_async_context(self._locks.setdefault(n, asyncio.Lock()))
            yield

    async def current(self, node_id: str) -> NodeHolding:
        """The newest holdings known for a node: what this ledger wrote, or the source's, whichever is newer."""
        seen = decode_holding(node_id, await self._source(self._keys.holdings(node_id)))
        kept = self._kept.get(node_id)
        if kept is not None and kept.as_of >= seen.as_of:
            return kept
        self._kept.pop(node_id, None)
        return seen

    async def take(self, alloc: Allocation) -> HoldingsChange:
        """What placing `alloc` adds to its transaction. Raises Conflict when a GPU it names is held by
        another job at the newest revision known: the decision came from a stale view."""
        after: list[NodeHolding] = []
        compares: list[Compare] = []
        ops: list[Put | Delete] = []
        for node_id, gpus in gpus_by_node(alloc).items():
            cur = await self.current(node_id)
            taken = cur.held_by_others(alloc.job_id) & set(gpus)
            if taken:
                raise HeldElsewhere(f"GPU(s) {sorted(taken)} on {node_id} are already held "
                               f"(holdings at revision {cur.revision}); {alloc.job_id} decided on a stale view")
            jobs = {**cur.jobs, alloc.job_id: gpus}
            key = self._keys.holdings(node_id)
            compares.append(mod_revision_is(key, cur.revision))
            ops.append(Put(key, encode_holding(jobs)))
            after.append(NodeHolding(node_id, 0, jobs))
        return HoldingsChange(tuple(compares), tuple(ops), tuple(after))

    async def give_back(self, alloc: Allocation) -> HoldingsChange:
        """What releasing `alloc` adds to its transaction: its GPUs leave every node's holdings."""
        after: list[NodeHolding] = []
        compares: list[Compare] = []
        ops: list[Put | Delete] = []
        for node_id in gpus_by_node(alloc):
            cur = await self.current(node_id)
            if alloc.job_id not in cur.jobs:
                continue
            jobs = {j: g for j, g in cur.jobs.items() if j != alloc.job_id}
            key = self._keys.holdings(node_id)
            compares.append(mod_revision_is(key, cur.revision))
            ops.append(Put(key, encode_holding(jobs)) if jobs else Delete(key))
            after.append(NodeHolding(node_id, 0, jobs))
        return HoldingsChange(tuple(compares), tuple(ops), tuple(after))

    def settle(self, change: HoldingsChange, revision: int) -> None:
        """The transaction carrying `change` succeeded at `revision`: keep what it wrote."""
        for h in change.after:
            # A node left holding nothing is absent again: compared as 0, known true as of `revision`.
            self._kept[h.node_id] = NodeHolding(h.node_id, revision if h.jobs else 0, h.jobs, revision)

    def forget(self, node_ids: Iterable[str]) -> None:
        """A transaction lost its compare or its outcome is unknown: read these nodes afresh next time."""
        for n in node_ids:
            self._kept.pop(n, None)
