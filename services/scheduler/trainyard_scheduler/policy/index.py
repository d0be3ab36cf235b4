"""What a placement session starts from: schedulable nodes, free GPUs per model in topology pools, CPUs,
the model catalog. A pure function of the snapshot — `ClusterIndex.of(snapshot, gates)` builds it — that
can also be kept between sessions and brought up to date with `sync`, which re-derives only the nodes
whose record, liveness, stray workers or allocations changed, plus those the last session touched.

At 10,000 nodes a full build costs a few hundred milliseconds of Python; a cycle that places a handful of
gangs changes a handful of nodes. `sync` gives the same index a full build would (property-tested), so
decisions stay a function of the snapshot alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ..domain.models import Allocation, Job, Node
from ..domain.snapshot import ClusterSnapshot
from .api import ModelInfo, NodeGate, NodeView, placement_shape
from .capacity import Pool
from .topology import domain_path


@dataclass(frozen=True, slots=True)
class _NodeState:
    healthy: frozenset[int]
    models: Mapping[str, tuple[int, ...]]  # model → free healthy GPUs of it (empty if gated out)
    counts: Mapping[str, int]              # model → GPUs of it on the node
    capacity: Mapping[str, int]            # model → healthy GPUs counted as fleet capacity
    schedulable: bool
    cpu_only: bool


class ClusterIndex:
    def __init__(self, gates: Sequence[NodeGate]) -> None:
        self._gates = tuple(gates)
        self.paths: dict[str, tuple[str, str, str]] = {}
        self.pools: dict[str, Pool] = {}
        self.views: dict[str, NodeView] = {}
        self.healthy: dict[str, frozenset[int]] = {}
        self.model_of: dict[tuple[str, int], str] = {}
        self.base_free_cpus: dict[str, int] = {}
        self.cpu_nodes: set[str] = set()
        self.capacity: dict[str, int] = {}
        self._info: dict[str, ModelInfo] = {}
        self._nodes_with: dict[str, int] = {}  # model → registered nodes that have it
        self._state: dict[str, _NodeState] = {}
        self._nodes: dict[str, Node] = {}
        # The snapshot mapping `_nodes` was copied from: a snapshot that hands the same read-only one (the
        # reconciler's SnapshotBuilder does until a node record changes) needs no walk over the fleet.
        self._nodes_src: Mapping[str, Node] | None = None
        self._allocs: dict[str, Allocation] = {}
        self._alive: frozenset[str] = frozenset()
        self._orphaned: frozenset[str] = frozenset()
        self._used: dict[str, dict[str, tuple[tuple[int, ...], int]]] = {}  # node → job → (gpus, cpus)
        # Nodes a session changed (took GPUs); re-derived from the next snapshot.
        self.dirty: set[str] = set()
        # GPUs held per (team, queue, model, borrowed), for the session's ledger of quotas and fair share.
        self.held: dict[tuple[str, str, str, bool], int] = {}
        self._held_by: dict[str, list[tuple[tuple[str, str, str, bool], int]]] = {}
        # job → (allocation, model → what it would give back): GPUs that are healthy on schedulable nodes.
        self._releases: dict[str, tuple[Allocation, dict[str, list[tuple[str, tuple[int, ...]]]]]] = {}
        # job id → (the job record, its placement shape): kept while the snapshot hands the same record.
        self._shapes: dict[str, tuple[Job, tuple[object, ...]]] = {}

    @classmethod
    def of(cls, snap: ClusterSnapshot, gates: Sequence[NodeGate]) -> ClusterIndex:
        index = cls(gates)
        index.sync(snap)
        return index

    @property
    def catalog(self) -> dict[str, ModelInfo]:
        """Models some registered node has, with the healthy GPUs of each on live nodes."""
        return {m: ModelInfo(i.model, i.vendor, i.memory_mb, i.compute_capability, self.capacity.get(m, 0))
                for m, i in self._info.items() if self._nodes_with.get(m, 0) > 0}

    # -- bringing the index up to date -------------------------------------------------------------------
    def shape(self, job: Job) -> tuple[object, ...]:
        """`placement_shape(job)`, computed once per job record (a waiting job is looked at every cycle)."""
        hit = self._shapes.get(job.id)
        if hit is not None and hit[0] is job:
            return hit[1]
        shape = placement_shape(job)
        self._shapes[job.id] = (job, shape)
        return shape

    def sync(self, snap: ClusterSnapshot) -> None:
        if len(self._shapes) > 2 * len(snap.jobs) + 1024:
            self._shapes = {k: v for k, v in self._shapes.items() if snap.jobs.get(k) is v[0]}
        affected = set(self.dirty)
        self.dirty.clear()
        nodes_changed = not (isinstance(snap.nodes, MappingProxyType) and snap.nodes is self._nodes_src)
        if nodes_changed:
            for node_id, node in snap.nodes.items():
                if self._nodes.get(node_id) is not node:
                    affected.add(node_id)
            affected.update(n for n in self._nodes if n not in snap.nodes)
        if snap.alive is not self._alive and snap.alive != self._alive:
            affected.update(snap.alive ^ self._alive)
        orphaned = frozenset(snap.orphans())
        if orphaned != self._orphaned:
            affected.update(orphaned ^ self._orphaned)
        for job_id, alloc in snap.allocations.items():
            old = self._allocs.get(job_id)
            if old is not alloc:
                if old is not None:
                    affected.update(self._unuse(job_id, old))
                job = snap.jobs.get(job_id)
                affected.update(self._use(job_id, alloc, job.team if job else "", job.spec.queue if job else "",
                                          snap.nodes))
        for job_id in [j for j in self._allocs if j not in snap.allocations]:
            affected.update(self._unuse(job_id, self._allocs[job_id]))
        if nodes_changed:
            self._nodes = dict(snap.nodes)
            self._nodes_src = snap.nodes
        self._allocs = dict(snap.allocations)
        self._alive = snap.alive
        self._orphaned = orphaned
        for node_id in sorted(affected):
            self._refresh(node_id)
            for job_id in self._used.get(node_id, {}):
                self._releases.pop(job_id, None)

    def releases(self, job_id: str, alloc: Allocation, model: str) -> list[tuple[str, tuple[int, ...]]]:
        """The GPUs of `model` a running gang would give back: healthy ones on schedulable nodes."""
        hit = self._releases.get(job_id)
        if hit is None or hit[0] is not alloc:
            hit = (alloc, {})
            self._releases[job_id] = hit
        rels = hit[1].get(model)
        if rels is None:
            rels = hit[1][model] = self.releases_of(alloc, model)
        return rels

    def releases_of(self, alloc: Allocation, model: str) -> list[tuple[str, tuple[int, ...]]]:
        """`releases` without the cache (for gangs a session decided, which no snapshot holds yet)."""
        rels = []
        pool = self.pools.get(model)
        for a in alloc.assignments:
            node_id = a.node_id
            if pool is None or node_id not in pool.free or not a.gpu_indices:
                continue
            healthy = self.healthy[node_id]
            gpus = tuple(g for g in a.gpu_indices if g in healthy and self.model_of.get((node_id, g)) == model)
            if gpus:
                rels.append((node_id, gpus))
        return rels

    def _use(self, job_id: str, alloc: Allocation, team: str, queue: str, nodes: Mapping[str, Node]) -> list[str]:
        rows = []
        for a in alloc.assignments:
            self._used.setdefault(a.node_id, {})[job_id] = (a.gpu_indices, a.cpus)
            if a.gpu_indices:
                model = a.model
                if not model:
                    node = nodes.get(a.node_id)
                    model = next((g.model for g in node.gpus if g.index == a.gpu_indices[0]), "") if node else ""
                key = (alloc.team or team, queue, model, alloc.borrowed)
                self.held[key] = self.held.get(key, 0) + len(a.gpu_indices)
                rows.append((key, len(a.gpu_indices)))
        self._held_by[job_id] = rows
        return [a.node_id for a in alloc.assignments]

    def _unuse(self, job_id: str, alloc: Allocation) -> list[str]:
        self._releases.pop(job_id, None)
        for key, gpus in self._held_by.pop(job_id, ()):
            left = self.held[key] - gpus
            if left:
                self.held[key] = left
            else:
                del self.held[key]
        for a in alloc.assignments:
            held = self._used.get(a.node_id)
            if held is not None:
                held.pop(job_id, None)
                if not held:
                    del self._used[a.node_id]
        return [a.node_id for a in alloc.assignments]

    def _refresh(self, node_id: str) -> None:
        old = self._state.pop(node_id, None)
        if old is not None:
            for model, count in old.capacity.items():
                self.capacity[model] -= count
            for model in old.counts:
                self._nodes_with[model] -= 1
        node = self._nodes.get(node_id)
        path = domain_path(node.labels) if node is not None else None
        moved = path is not None and self.paths.get(node_id, path) != path
        if old is not None:
            for model in old.counts:
                pool = self.pools.get(model)
                if pool is not None and node_id in pool.free and (node is None or moved
                                                                   or model not in _counts(node)):
                    pool.remove_node(node_id)
        self.views.pop(node_id, None)
        self.cpu_nodes.discard(node_id)
        if node is None or path is None:
            self.paths.pop(node_id, None)
            self.healthy.pop(node_id, None)
            self.base_free_cpus.pop(node_id, None)
            for key in [k for k in self.model_of if k[0] == node_id]:
                del self.model_of[key]
            return
        self.paths[node_id] = path
        state = self._derive(node_id, node)
        self._state[node_id] = state
        for model, count in state.capacity.items():
            self.capacity[model] = self.capacity.get(model, 0) + count
        for model in state.counts:
            self._nodes_with[model] = self._nodes_with.get(model, 0) + 1
        for model, count in state.counts.items():
            pool = self.pools.get(model)
            if not state.schedulable:
                # Not offered at all (not even as a node whose GPUs a search may imagine freed).
                if pool is not None and node_id in pool.free:
                    pool.remove_node(node_id)
                continue
            if pool is None or count > pool.width:
                pool = self._rebuild_pool(model, max(count, pool.width if pool else 0))
            if node_id in pool.free:
                pool.set_free(node_id, state.models.get(model, ()))
            else:
                pool.add_node(node_id, state.models.get(model, ()))

    def _derive(self, node_id: str, node: Node) -> _NodeState:
        used = self._used.get(node_id, {})
        taken = {g for gpus, _ in used.values() for g in gpus}
        cpus = max(0, node.cpus - sum(c for _, c in used.values()))
        alive = node_id in self._alive
        healthy = frozenset(g.index for g in node.gpus if g.healthy)
        free = tuple(g.index for g in node.gpus if g.healthy and g.index not in taken)
        view = NodeView(node=node, free_gpus=free, alive=alive, has_orphans=node_id in self._orphaned,
                        free_cpus=cpus)
        schedulable = not any(gate.admit(view) is not None for gate in self._gates)
        counts: dict[str, int] = {}
        capacity: dict[str, int] = {}
        by_model: dict[str, list[int]] = {}
        for g in node.gpus:
            self.model_of[(node_id, g.index)] = g.model
            if g.model not in self._info:
                self._info[g.model] = ModelInfo(g.model, g.vendor, g.memory_mb, g.compute_capability)
            counts[g.model] = counts.get(g.model, 0) + 1
            if alive and g.healthy:
                capacity[g.model] = capacity.get(g.model, 0) + 1
            if schedulable and g.index in free:
                by_model.setdefault(g.model, []).append(g.index)
        self.healthy[node_id] = healthy
        self.base_free_cpus[node_id] = cpus
        if schedulable:
            self.views[node_id] = view
            if not node.gpus:
                self.cpu_nodes.add(node_id)
        return _NodeState(healthy, {m: tuple(v) for m, v in by_model.items()}, counts, capacity, schedulable,
                          not node.gpus)

    def _rebuild_pool(self, model: str, width: int) -> Pool:
        """A node with more GPUs of a model than the pool was sized for: a wider pool, same contents."""
        old = self.pools.get(model)
        pool = Pool(model, self.paths, width)
        if old is not None:
            for node_id, free in old.free.items():
                pool.add_node(node_id, free)
        self.pools[model] = pool
        return pool


def _counts(node: Node) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in node.gpus:
        out[g.model] = out.get(g.model, 0) + 1
    return out
