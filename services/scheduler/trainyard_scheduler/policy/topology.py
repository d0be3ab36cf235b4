"""The network as a tree of domains: NVLink island ⊂ node ⊂ leaf switch ⊂ spine ⊂ zone ⊂ cluster.

A node's place comes from the labels its agent registers (settings or the site topology file): `switch`
(or `leaf`) names its leaf switch, `spine` and `zone` the levels above. Names are scoped by their parents,
so two spines may both have a leaf called `leaf-1`. Nodes without labels share one unnamed leaf: an
unlabelled fleet is flat, which is the truth as far as the scheduler can know it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..domain.models import TIERS, Node

ISLAND, NODE, LEAF, SPINE, ZONE, CLUSTER = range(len(TIERS))
TIER_INDEX = {name: i for i, name in enumerate(TIERS)}


def domain_path(labels: Mapping[str, str]) -> tuple[str, str, str]:
    """(leaf id, spine id, zone id) of a node, each unique in the cluster."""
    zone = labels.get("zone", "")
    spine = labels.get("spine", "")
    leaf = labels.get("switch") or labels.get("leaf", "")
    return f"{zone}/{spine}/{leaf}", f"{zone}/{spine}", zone


def gang_tier(node_ids: Sequence[str], paths: Mapping[str, tuple[str, str, str]],
              single_island: bool = False) -> int:
    """The lowest tier whose one domain holds every node of the gang."""
    if len(set(node_ids)) <= 1:
        return ISLAND if single_island else NODE
    for tier, level in ((LEAF, 0), (SPINE, 1), (ZONE, 2)):
        if len({paths[n][level] for n in node_ids}) == 1:
            return tier
    return CLUSTER


def islands_of(node: Node) -> dict[int, int]:
    """GPU index → NVLink island id (a GPU without NVLink is its own island)."""
    return {g.index: (g.nvlink_island if g.nvlink_island >= 0 else 1000 + g.index) for g in node.gpus}


def pick_gpus(free: Iterable[int], count: int, islands: Mapping[int, int]) -> tuple[int, ...]:
    """`count` GPUs out of `free`, inside one NVLink island when one has room (the fullest such island,
    so whole islands stay free for bigger shares); otherwise filling the largest islands first. The
    result is in island order, so neighbouring local ranks share the closest links."""
    by_island: dict[int, list[int]] = {}
    for i in sorted(free):
        by_island.setdefault(islands.get(i, 1000 + i), []).append(i)
    fitting = [(len(v), k) for k, v in by_island.items() if len(v) >= count]
    if fitting:
        _, best = min(fitting)
        return tuple(by_island[best][:count])
    chosen: list[int] = []
    for _, k in sorted(((-len(v), k) for k, v in by_island.items())):
        chosen.extend(by_island[k][: count - len(chosen)])
        if len(chosen) == count:
            break
    return tuple(chosen)


def optimal_tier(nodes: int, leaf_nodes: int, spine_nodes: int, zone_nodes: int) -> int:
    """The lowest tier an empty fleet of this shape could fit a gang in (the benchmark's yardstick)."""
    if nodes <= 1:
        return NODE
    for tier, size in ((LEAF, leaf_nodes), (SPINE, spine_nodes), (ZONE, zone_nodes)):
        if nodes <= size:
            return tier
    return CLUSTER
