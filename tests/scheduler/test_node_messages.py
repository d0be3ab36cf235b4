"""ListNodes' messages built once per node record (grpc/node_messages.py) are the messages `node_to_pb` builds,
call after call: for live, lost and cordoned nodes, with and without allocated GPUs and a heartbeat, with a later
registration time than the record's, after a record changed, and once a node has left the fleet."""

from __future__ import annotations

from dataclasses import replace

from tests.scheduler.builders import make_node
from trainyard_scheduler.domain.models import GpuLink
from trainyard_scheduler.grpc import convert
from trainyard_scheduler.grpc.node_messages import NodeMessages


def _expected(nodes, alive, allocated, beats, registered):  # type: ignore[no-untyped-def]
    out = []
    for n in nodes:
        at = registered.get(n.node_id)
        shown = replace(n, registered_at=at) if at is not None and at > n.registered_at else n
        out.append(convert.node_to_pb(shown, alive=n.node_id in alive, allocated=allocated.get(n.node_id, set()),
                                      last_heartbeat=beats.get(n.node_id)))
    return out


def test_the_listing_is_what_node_to_pb_gives_call_after_call() -> None:
    links = (GpuLink(gpu_a=0, gpu_b=1, level="NV12", nvlinks=12),)
    nodes = [replace(make_node("a", cordoned=True), gpu_links=links), make_node("b", unhealthy=[3]),
             make_node("c", gpus=0), make_node("d", labels={"zone": "z1"})]
    messages = NodeMessages()
    rounds = [
        ({"a", "b", "d"}, {"b": {0, 1}, "d": {7}}, {"a": 1_800_000_000.25, "b": 1_800_000_001.5}, {}),
        ({"b"}, {}, {"b": 1_800_000_002.0}, {"d": 1_900_000_000.0}),  # d registered again; a, c, d lost
        ({"a", "b", "c", "d"}, {"c": set()}, {}, {"d": 1_900_000_000.0, "a": 1.0}),  # an earlier time is not shown
    ]
    for alive, allocated, beats, registered in rounds:
        got = messages.listing(nodes, alive=alive, allocated=allocated, last_heartbeat=beats.get,
                               registered_at=registered)
        assert list(got.nodes) == _expected(nodes, alive, allocated, beats, registered)

    # A changed record is built again; a node that left is forgotten.
    nodes = [replace(nodes[0], cordoned=False), nodes[1]]
    got = messages.listing(nodes, alive={"a"}, allocated={}, last_heartbeat=lambda _: None, registered_at={})
    assert list(got.nodes) == _expected(nodes, {"a"}, {}, {}, {})
    assert set(messages._built) == {"a", "b"}
