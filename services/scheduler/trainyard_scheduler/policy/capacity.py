"""Free capacity of one accelerator model, indexed by topology domain, and the gang finder over it.

Placement at 10,000 nodes cannot ask every node about every job. A `Pool` keeps, for each domain (leaf,
spine, zone, cluster), how many of its nodes have at least k free GPUs of the model, for every k; a
gang of N nodes x g GPUs then needs one look per domain to know where it fits, and only the chosen
domain's nodes are visited. Updates (a decision taking GPUs, a reservation holding them, a simulated
release) touch the node's four domains only.

Packing rule: the lowest tier with a domain that fits; among those domains the one with the fewest
fitting nodes (best fit, so large empty blocks stay whole for large gangs); inside it the fewest leaves,
and on each node the fewest free GPUs that suffice.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .topology import CLUSTER, LEAF, NODE, SPINE, ZONE

NodeOk = Callable[[str], bool]
NodeOrder = Callable[[str, int], float]

# How many candidate domains per tier a search tries when node-level filters (queue partitions, CPUs)
# reject nodes the counts included; past that the next tier is tried.
MAX_DOMAIN_TRIES = 16


@dataclass(frozen=True, slots=True)
class Found:
    nodes: tuple[str, ...]
    tier: int


class Pool:
    """Free GPUs of one model on schedulable nodes. Mutable: a placement session changes it while it decides
    (`ClusterIndex` re-syncs it from the next snapshot). Every choice it makes is canonical — by counts, then
    node and domain ids — so the same free GPUs give the same answer whatever order they were added in."""

    def __init__(self, model: str, paths: Mapping[str, tuple[str, str, str]], width: int) -> None:
        self.model = model
        self.paths = paths
        self.width = width  # the most GPUs of this model on one node
        self.free: dict[str, list[int]] = {}
        self._path_of: dict[str, tuple[str, str, str]] = {}  # where each node was filed
        # tier → domain id → counts, counts[k] = nodes with >= k free (k = 0..width)
        self._counts: tuple[dict[str, list[int]], ...] = ({}, {}, {}, {})
        self._leaf_nodes: dict[str, list[str]] = {}
        self._children: tuple[dict[str, list[str]], ...] = ({}, {}, {})  # spine→leaves, zone→spines, ""→zones
        # Nodes by their free count, with a lazy min-heap per count for the lowest node id.
        self._by_free: list[set[str]] = [set() for _ in range(width + 1)]
        self._heaps: list[list[str]] = [[] for _ in range(width + 1)]

    # -- building and updating --------------------------------------------------------------------------
    def add_node(self, node_id: str, free: Sequence[int]) -> None:
        leaf, spine, zone = self._path_of[node_id] = self.paths[node_id]
        if leaf not in self._leaf_nodes:
            self._leaf_nodes[leaf] = []
            self._children[0].setdefault(spine, []).append(leaf)
            if spine not in self._counts[1]:
                self._children[1].setdefault(zone, []).append(spine)
                if zone not in self._counts[2]:
                    self._children[2].setdefault("", []).append(zone)
        bisect.insort(self._leaf_nodes[leaf], node_id)
        for tier, dom in enumerate((leaf, spine, zone, "")):
            if dom not in self._counts[tier]:
                self._counts[tier][dom] = [0] * (self.width + 1)
        self.free[node_id] = sorted(free)
        self._shift(node_id, -1, len(free))

    def remove_node(self, node_id: str) -> None:
        old = len(self.free.pop(node_id))
        self._shift(node_id, old, -1)
        self._leaf_nodes[self._path_of.pop(node_id)[0]].remove(node_id)

    def set_free(self, node_id: str, free: Iterable[int]) -> None:
        new = sorted(free)
        old = len(self.free[node_id])
        self.free[node_id] = new
        if len(new) != old:
            self._shift(node_id, old, len(new))

    def take(self, node_id: str, gpus: Iterable[int]) -> None:
        gone = set(gpus)
        self.set_free(node_id, [i for i in self.free[node_id] if i not in gone])

    def give(self, node_id: str, gpus: Iterable[int]) -> None:
        self.set_free(node_id, set(self.free[node_id]) | set(gpus))

    def _shift(self, node_id: str, old: int, new: int) -> None:
        leaf, spine, zone = self._path_of[node_id]
        lo, hi, d = (old + 1, new, 1) if new > old else (new + 1, old, -1)
        lo = max(lo, 0)
        for tier, dom in enumerate((leaf, spine, zone, "")):
            counts = self._counts[tier][dom]
            for k in range(lo, hi + 1):
                counts[k] += d
        if old >= 0:
            self._by_free[old].discard(node_id)
        if new >= 0:
            self._by_free[new].add(node_id)
            heap = self._heaps[new]
            heapq.heappush(heap, node_id)
            if len(heap) > 2 * len(self._by_free[new]) + 64:  # compact stale entries now and then
                self._heaps[new] = sorted(self._by_free[new])

    def _lowest(self, k: int) -> str:
        """The lowest node id among nodes with exactly k free (the bucket must not be empty)."""
        heap, bucket = self._heaps[k], self._by_free[k]
        while heap[0] not in bucket:
            heapq.heappop(heap)
        return heap[0]

    # -- queries ------------------------------------------------------------------------------------------
    def total_free(self) -> int:
        return sum(len(v) for v in self.free.values())

    def nodes_with(self, gpus: int) -> int:
        """Nodes with at least `gpus` free."""
        if gpus > self.width:
            return 0
        counts = self._counts[3].get("")
        return counts[max(gpus, 0)] if counts else 0

    def feasible(self, nodes: int, gpus: int, max_tier: int) -> bool:
        """Whether `find` would succeed when every node is acceptable to the job: one look at the counts
        per domain, no node visited."""
        if gpus > self.width or self.nodes_with(gpus) < nodes:
            return False
        if nodes == 1 or max_tier >= CLUSTER:
            return True
        for tier, level in ((LEAF, 0), (SPINE, 1), (ZONE, 2)):
            if tier > max_tier:
                return False
            if any(c[gpus] >= nodes for c in self._counts[level].values()):
                return True
        return False

    def first_fit(self, releases: Sequence[tuple[str, int]], nodes: int, gpus: int, max_tier: int) -> int | None:
        """The fewest releases, in order, after which `feasible(nodes, gpus, max_tier)` would hold — each
        release being (node, GPUs it gives back) — or None if even all of them are not enough. One sweep
        over the releases with per-domain counters; the pool is not changed."""
        if gpus > self.width:
            return None
        if self.feasible(nodes, gpus, max_tier):
            return 0
        if nodes == 1:
            levels = [3]
        else:
            levels = [lvl for tier, lvl in ((LEAF, 0), (SPINE, 1), (ZONE, 2), (CLUSTER, 3)) if tier <= max_tier]
        extra: dict[str, int] = {}
        bumped: list[dict[str, int]] = [{}, {}, {}, {}]
        for k, (node_id, count) in enumerate(releases, 1):
            base = len(self.free[node_id])
            before = base + extra.get(node_id, 0)
            extra[node_id] = before + count - base
            if before < gpus <= before + count:
                path = self._path_of[node_id]
                for lvl in levels:
                    dom = path[lvl] if lvl < 3 else ""
                    c = bumped[lvl].get(dom, 0) + 1
                    bumped[lvl][dom] = c
                    if self._counts[lvl][dom][gpus] + c >= nodes:
                        return k
        return None

    def find(self, nodes: int, gpus: int, max_tier: int, ok: NodeOk, order: NodeOrder) -> Found | None:
        """Where a gang of `nodes` x `gpus` fits now, packed as low as possible; None if nowhere within
        `max_tier`. Does not change the pool."""
        if gpus > self.width or self.nodes_with(gpus) < nodes:
            return None
        if nodes == 1:
            for k in range(gpus, self.width + 1):
                if not self._by_free[k]:
                    continue
                lowest = self._lowest(k)
                if ok(lowest):
                    return Found((lowest,), NODE)
                for node_id in sorted(self._by_free[k]):
                    if ok(node_id):
                        return Found((node_id,), NODE)
            return None
        for tier, level in ((LEAF, 0), (SPINE, 1), (ZONE, 2), (CLUSTER, 3)):
            if tier > max_tier:
                return None
            fitting = [(c[gpus], dom) for dom, c in self._counts[level].items() if c[gpus] >= nodes]
            if not fitting:
                continue
            fitting.sort()
            for _, dom in fitting[:MAX_DOMAIN_TRIES]:
                chosen = self._select(self._leaves_under(level, dom), nodes, gpus, ok, order)
                if chosen is not None:
                    return Found(chosen, tier)
        return None

    def _leaves_under(self, level: int, dom: str) -> list[str]:
        if level == 0:
            return [dom]
        if level == 1:
            return list(self._children[0].get(dom, []))
        if level == 2:
            return [leaf for spine in self._children[1].get(dom, []) for leaf in self._children[0][spine]]
        return list(self._leaf_nodes)

    def _select(self, leaves: Sequence[str], nodes: int, gpus: int, ok: NodeOk,
                order: NodeOrder) -> tuple[str, ...] | None:
        per_leaf: list[list[str]] = []
        for leaf in leaves:
            fit = [n for n in self._leaf_nodes[leaf] if len(self.free[n]) >= gpus and ok(n)]
            if fit:
                per_leaf.append(fit)
        return select_by_leaves(per_leaf, nodes, lambda n: order(n, len(self.free[n])))


def select_by_leaves(per_leaf: list[list[str]], nodes: int,
                     key: Callable[[str], float]) -> tuple[str, ...] | None:
    """Choose `nodes` nodes spanning as few leaves as possible: whole largest leaves first, and for the
    remainder the smallest leaf that holds it (best fit). Inside a leaf, lowest `key` first."""
    if sum(len(x) for x in per_leaf) < nodes:
        return None
    per_leaf = sorted(per_leaf, key=lambda x: (-len(x), x[0]))
    chosen: list[str] = []
    remaining = nodes
    while remaining:
        holding = [x for x in per_leaf if len(x) >= remaining]
        if holding:
            leaf = min(holding, key=lambda x: (len(x), x[0]))
            chosen.extend(sorted(leaf, key=lambda n: (key(n), n))[:remaining])
            break
        leaf = per_leaf.pop(0)
        chosen.extend(leaf)
        remaining -= len(leaf)
    return tuple(chosen)
