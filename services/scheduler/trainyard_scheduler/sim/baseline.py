"""The yardstick: type-unaware gang FIFO, with the same signature and result type as `policy.place.place`.

- Strict FIFO by submission time: the oldest pending job is the head; when it does not fit, nothing behind
  it is placed (no backfill, no reservations, no preemption, no priorities, no quotas).
- First fit over nodes in node-id order; a gang takes its share on each of the first nodes with room.
- Type-unaware: it does not prefer a faster model, ignores speed factors and speed hints, and a gang may mix
  models (it then runs at the speed of its slowest model).
- Topology-unaware: node order is all it knows (the tier is still computed, for reporting).

What it does respect: the job's hard accelerator request (an exact model, an any-of list, or a class such
as a vendor or a minimum memory). A job that refuses a model would not run on it in any scheduler, and
honouring it means both policies run the same work on the same hardware choices users allowed; what the
baseline lacks is the *choice* among acceptable models. Whole gangs only, like our policy: the point of
comparison is the placement, not the gang deadlock that per-worker FIFO would add.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..domain.models import Job, JobState, Node, NodeAssignment
from ..domain.queues import PolicyConfig
from ..domain.snapshot import ClusterSnapshot
from ..policy.api import ModelInfo, Profile
from ..policy.place import Decision, PlacementResult, Unplaced, choose_master_port
from ..policy.plugins.accelerators import AcceleratorRequest
from ..policy.topology import domain_path, gang_tier
from .simulator import Timer


class GangFifo:
    """Callable like `place`. Keeps only a cache of the fleet's static layout (node order, GPU models,
    topology paths), rebuilt whenever it is handed a different node mapping; results depend on the
    snapshot alone."""

    name = "gang-fifo"

    def __init__(self) -> None:
        self._nodes: Mapping[str, Node] | None = None
        self._order: list[str] = []
        self._paths: dict[str, tuple[str, str, str]] = {}
        self._catalog: dict[str, ModelInfo] = {}
        self._model_of: dict[str, dict[int, str]] = {}
        self._accepts = AcceleratorRequest()

    def _layout(self, nodes: Mapping[str, Node]) -> None:
        if self._nodes is nodes:
            return
        self._nodes = nodes
        self._order = sorted(nodes)
        self._paths = {n: domain_path(node.labels) for n, node in nodes.items()}
        self._catalog = {}
        self._model_of = {n: {g.index: g.model for g in node.gpus} for n, node in nodes.items()}
        for node in nodes.values():
            for g in node.gpus:
                self._catalog.setdefault(g.model, ModelInfo(g.model, g.vendor, g.memory_mb, g.compute_capability))

    def __call__(self, snapshot: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
                 port_range: tuple[int, int] = (29500, 29999), timer: Timer | None = None) -> PlacementResult:
        self._layout(snapshot.nodes)
        result = PlacementResult()
        queue = sorted((j for j in snapshot.jobs.values() if j.state is JobState.PENDING and not j.cancel_requested),
                       key=lambda j: (j.created_at, j.id))
        if not queue:
            return result
        used = snapshot.used_gpus()
        ports = snapshot.used_master_ports()
        # Free healthy GPUs per schedulable node, in node-id order (nodes with none are left out).
        free: dict[str, list[int]] = {}
        for node_id in self._order:
            node = snapshot.nodes[node_id]
            if node_id not in snapshot.alive or node.cordoned or not node.gpus:
                continue
            taken = used.get(node_id, ())
            idle = [g.index for g in node.gpus if g.healthy and g.index not in taken]
            if idle:
                free[node_id] = idle
        models: dict[tuple[object, ...], frozenset[str]] = {}
        for pos, job in enumerate(queue):
            started = timer() if timer else 0.0
            decision = self._first_fit(job, snapshot, free, models, ports, port_range)
            if timer:
                result.timings.append((job.id, timer() - started))
            if decision is None:
                result.unplaced.append(Unplaced(job.id, "head of the FIFO queue: waiting for room"))
                result.unplaced.extend(Unplaced(j.id, f"behind {job.id} in the FIFO queue") for j in queue[pos + 1:])
                break
            result.decisions.append(decision)
        return result

    def _first_fit(self, job: Job, snapshot: ClusterSnapshot, free: dict[str, list[int]],
                   models: dict[tuple[object, ...], frozenset[str]], ports: dict[str, set[int]],
                   port_range: tuple[int, int]) -> Decision | None:
        r = job.spec.resources
        if r.cpu_only:
            return None  # CPU tasks are not part of the comparison
        shape = (r.accelerator, r.accelerators, r.vendor, r.min_memory_gb, r.min_compute_capability)
        ok = models.get(shape)
        if ok is None:
            ok = models[shape] = frozenset(m for m, info in self._catalog.items()
                                           if self._accepts.filter(job, info) is None)
        chosen: list[tuple[str, list[int]]] = []
        for node_id, idle in free.items():
            model_of = self._model_of[node_id]
            gpus = [i for i in idle if model_of[i] in ok]
            if len(gpus) >= r.gpus_per_node:
                chosen.append((node_id, gpus[: r.gpus_per_node]))
                if len(chosen) == r.nodes:
                    break
        if len(chosen) < r.nodes:
            return None
        assignments = []
        gang_models: set[str] = set()
        for rank, (node_id, gpus) in enumerate(chosen):
            model = self._model_of[node_id][gpus[0]]
            gang_models.add(model)
            first = rank * r.gpus_per_node
            assignments.append(NodeAssignment(node_id, rank, tuple(gpus), tuple(range(first, first + r.gpus_per_node)),
                                              model=model))
            left = [g for g in free[node_id] if g not in gpus]
            if left:
                free[node_id] = left
            else:
                del free[node_id]
        master = assignments[0].node_id
        port = choose_master_port(job.id, job.attempt, ports.get(master, set()), port_range)
        ports.setdefault(master, set()).add(port)
        tier = gang_tier([a.node_id for a in assignments], self._paths)
        model = next(iter(gang_models)) if len(gang_models) == 1 else "mixed"
        return Decision(job.id, tuple(assignments), port, model, False, tier)


def gang_fifo() -> GangFifo:
    """A fresh baseline (one per simulator, so layout caches are never shared)."""
    return GangFifo()
