"""Node records as `types_pb2.Node` messages for ListNodes, built once per record.

Converting a node is building dozens of messages (its GPUs, its GPU links); at 5,000 nodes a ListNodes built
them all in one go and held the leader's event loop for about half a second (pulses, submits and every other
call waited; measured with `make bench BENCH=fleet`, where the gateway's fleet sampler lists the nodes every
few seconds). What changes between two calls is a node's state, its allocated GPUs and its last heartbeat;
the rest changes only with the record. So each record's message is built once (per record object, which the
mirror keeps while the record is unchanged) and a call copies it (one C-level copy) and sets those three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2

from ..domain.models import Node
from . import convert


def registration_shown(node: Node, seen_at: float | None) -> float:
    """The registration time to show for a node: a later one this leader saw (`seen_at`: a re-registration it
    handled that left the record as it was) wins over the record's."""
    return seen_at if seen_at is not None and seen_at > node.registered_at else node.registered_at


class NodeMessages:
    """The message of each node record, by node id; records that left the fleet are dropped on the next call."""

    def __init__(self) -> None:
        self._built: dict[str, tuple[Node, float, types_pb2.Node]] = {}

    def _static(self, node: Node, registered_at: float) -> types_pb2.Node:
        hit = self._built.get(node.node_id)
        if hit is None or hit[0] is not node or hit[1] != registered_at:
            shown = node if registered_at == node.registered_at else replace(node, registered_at=registered_at)
            msg = convert.node_to_pb(shown, alive=True, allocated=set(), last_heartbeat=None)
            msg.ClearField("state")
            hit = self._built[node.node_id] = (node, registered_at, msg)
        return hit[2]

    def listing(self, nodes: Sequence[Node], *, alive: Iterable[str], allocated: Mapping[str, set[int]],
                last_heartbeat: Callable[[str], float | None],
                registered_at: Mapping[str, float]) -> scheduler_pb2.ListNodesResponse:
        """What `convert.node_to_pb` gives for each node, in one response; `registered_at`: the registration
        times this leader saw, by node (`registration_shown`)."""
        live = frozenset(alive)
        out = scheduler_pb2.ListNodesResponse()
        for node in nodes:
            msg = out.nodes.add()
            msg.CopyFrom(self._static(node, registration_shown(node, registered_at.get(node.node_id))))
            msg.state = convert.node_state_pb(node, node.node_id in live)
            used = allocated.get(node.node_id)
            if used:
                msg.allocated_gpus.extend(sorted(used))
            seen = last_heartbeat(node.node_id)
            if seen is not None:
                ts = Timestamp()
                ts.FromNanoseconds(int(seen * 1e9))
                msg.last_heartbeat.CopyFrom(ts)
        if len(self._built) > len(nodes):
            present = {n.node_id for n in nodes}
            for gone in [k for k in self._built if k not in present]:
                del self._built[gone]
        return out
