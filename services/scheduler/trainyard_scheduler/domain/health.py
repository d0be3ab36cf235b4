"""Pure: what GPU health reported by an agent does to its node record.

The agent's policy table decides each GPU's health and the action it calls for; the scheduler applies
the node-level part. An unhealthy GPU is taken out of placement (and the gang holding it is stopped, see
progress.py); an action of "drain_node" or "reboot_host" cordons the whole node, with the reason, until
an operator uncordons it. Nothing is ever uncordoned automatically: a GPU that recovers does not undo a
drain an operator has not looked at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .models import NODE_ACTIONS, Gpu, Node


def apply_gpu_health(node: Node, changed: Mapping[int, Gpu]) -> Node:
    """The node with the changed GPUs' health applied (unknown indices ignored), cordoned when a GPU's
    action asks for the node to be drained."""
    gpus = tuple(replace(g, healthy=changed[g.index].healthy, health_reason=changed[g.index].health_reason,
                         health_action=changed[g.index].health_action)
                 if g.index in changed else g for g in node.gpus)
    updated = replace(node, gpus=gpus)
    return cordon_for_health(updated)


def cordon_for_health(node: Node) -> Node:
    drain = next((g for g in node.gpus if not g.healthy and g.health_action in NODE_ACTIONS), None)
    if drain is None or node.cordoned:
        return node
    return replace(node, cordoned=True,
                   cordon_reason=f"health policy: GPU {drain.index} {drain.health_reason or 'unhealthy'} "
                                 f"({drain.health_action})")
