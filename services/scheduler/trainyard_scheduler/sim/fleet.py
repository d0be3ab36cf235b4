"""A synthetic fleet for the simulator and the benchmark: nodes in a 3-tier network (leaf switch ⊂ spine
⊂ zone), three GPU models from two vendors.

Models are bought the way real clusters buy them: a block of `block_leaves` consecutive leaf switches
(default 4 leaves = 128 nodes) holds one model, blocks are dealt out in a weighted round robin over the
model mix, and block boundaries line up with spine boundaries. Every model therefore has whole 128-node
blocks inside one spine, and spines mix models block by block, as a fleet grown over several purchases
does. Within a node all GPUs are one model; `island_size` GPUs share an NVLink (or Infinity Fabric)
island.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..domain.models import Gpu, Node
from ..policy.topology import domain_path

# Model and vendor names as node agents report them (normalised: the names users ask for and speed
# factors are keyed by).
H100 = "H100-80GB-HBM3"
A100 = "A100-SXM4-80GB"
MI300X = "Instinct-MI300X"


@dataclass(frozen=True, slots=True)
class GpuModel:
    model: str
    vendor: str
    memory_mb: int
    compute_capability: str


MODELS: Mapping[str, GpuModel] = {
    H100: GpuModel(H100, "nvidia", 81_559, "9.0"),
    A100: GpuModel(A100, "nvidia", 81_920, "8.0"),
    MI300X: GpuModel(MI300X, "amd", 196_608, "9.4"),
}
DEFAULT_MIX: tuple[tuple[str, float], ...] = ((H100, 0.4), (A100, 0.4), (MI300X, 0.2))


@dataclass(frozen=True, slots=True)
class FleetShape:
    nodes: int = 10_000
    gpus_per_node: int = 8
    nodes_per_leaf: int = 32
    leaves_per_spine: int = 16
    zones: int = 2
    # Consecutive leaves of one model (one purchase); should divide leaves_per_spine.
    block_leaves: int = 4
    island_size: int = 8
    cpus: int = 128
    mix: tuple[tuple[str, float], ...] = DEFAULT_MIX

    @property
    def leaves(self) -> int:
        return math.ceil(self.nodes / self.nodes_per_leaf)

    @property
    def spines(self) -> int:
        return math.ceil(self.leaves / self.leaves_per_spine)

    @property
    def spines_per_zone(self) -> int:
        return math.ceil(self.spines / self.zones)

    @property
    def spine_nodes(self) -> int:
        return self.nodes_per_leaf * self.leaves_per_spine

    @property
    def zone_nodes(self) -> int:
        return self.spine_nodes * self.spines_per_zone

    @property
    def block_nodes(self) -> int:
        return self.nodes_per_leaf * self.block_leaves


def block_models(blocks: int, mix: Sequence[tuple[str, float]]) -> list[str]:
    """Smooth weighted round robin: the model of each block, close to the mix at every prefix."""
    credit = {m: 0.0 for m, _ in mix}
    total = sum(w for _, w in mix)
    out: list[str] = []
    for _ in range(blocks):
        for m, w in mix:
            credit[m] += w
        best = max(credit, key=lambda m: (credit[m], m))
        credit[best] -= total
        out.append(best)
    return out


def make_fleet(nodes: int = 10_000, gpus_per_node: int = 8, *, shape: FleetShape | None = None,
               registered_at: float = 0.0) -> list[Node]:
    """`nodes` nodes named node-00000.. in leaf order, labelled zone/spine/switch. Pass `shape` for the
    other parameters (its `nodes`/`gpus_per_node` are overridden by the arguments)."""
    base = shape or FleetShape()
    shape = FleetShape(nodes, gpus_per_node, base.nodes_per_leaf, base.leaves_per_spine, base.zones,
                       base.block_leaves, base.island_size, base.cpus, base.mix)
    models = block_models(math.ceil(shape.leaves / shape.block_leaves), shape.mix)
    width = len(str(max(nodes - 1, 1)))
    out: list[Node] = []
    for i in range(nodes):
        leaf = i // shape.nodes_per_leaf
        spine = leaf // shape.leaves_per_spine
        zone = spine // shape.spines_per_zone
        info = MODELS[models[leaf // shape.block_leaves]]
        node_id = f"node-{i:0{width}d}"
        gpus = tuple(Gpu(index=g, uuid=f"GPU-{node_id}-{g}", vendor=info.vendor, model=info.model,
                         memory_mb=info.memory_mb, compute_capability=info.compute_capability,
                         nvlink_island=g // shape.island_size) for g in range(gpus_per_node))
        out.append(Node(node_id=node_id, hostname=node_id, agent_address=f"{node_id}:50052",
                        worker_address=node_id, gpus=gpus, registered_at=registered_at,
                        labels={"zone": f"zone-{zone}", "spine": f"spine-{spine:02d}", "switch": f"leaf-{leaf:03d}"},
                        cpus=shape.cpus, memory_mb=2_000_000, simulated=True))
    return out


@dataclass(frozen=True, slots=True)
class DomainSizes:
    """The largest leaf, spine and zone (in nodes) of one model, or of the whole fleet (model "")."""

    leaf: int
    spine: int
    zone: int


def domain_sizes(nodes: Sequence[Node]) -> dict[str, DomainSizes]:
    """Per model (and "" for the whole fleet): the largest domain at each tier, counting nodes of that
    model only. The yardstick for `optimal_tier`: where an empty fleet could put a gang of the model."""
    counts: dict[str, list[dict[str, int]]] = {}
    for node in nodes:
        path = domain_path(node.labels)
        keys = {"", *(g.model for g in node.gpus)}
        for key in keys:
            per_level = counts.setdefault(key, [{}, {}, {}])
            for level in range(3):
                per_level[level][path[level]] = per_level[level].get(path[level], 0) + 1
    return {k: DomainSizes(*(max(v[level].values()) for level in range(3))) for k, v in counts.items()}


def capacity(nodes: Sequence[Node], speed: Mapping[str, float]) -> float:
    """The fleet's throughput in A100-equivalent GPUs (sum of speed factors over healthy GPUs)."""
    return sum(speed.get(g.model, 1.0) for n in nodes for g in n.gpus if g.healthy)
