"""The nodes a submit is checked against come from the replica's mirror, decoded once per record revision."""

from __future__ import annotations

from dataclasses import replace

from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_scheduler.state import codec
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.mirrored_nodes import MirroredNodes

from .builders import make_job, make_node

KEYS = Keys("/ty")


async def test_nodes_follow_the_mirror_and_are_decoded_again_only_when_changed() -> None:
    store = MemoryStore()
    await store.put(KEYS.node("n-a"), codec.encode_node(make_node("n-a")))
    await store.put(KEYS.node("n-b"), codec.encode_node(make_node("n-b", gpus=4)))
    job = make_job("job-x", gpus=8)
    await store.put(KEYS.job(job.id), codec.encode_job(job))  # not a node: left out
    mirror = PrefixMirror(store, "/ty/")
    await mirror.start()
    try:
        view = MirroredNodes(mirror, KEYS)
        first = {n.node_id: n for n in await view.nodes()}
        assert set(first) == {"n-a", "n-b"}
        same = await view.nodes()
        again = {n.node_id: n for n in same}
        assert again["n-a"] is first["n-a"], "an unchanged record is not decoded again"
        await mirror.wait_for(await store.put(KEYS.job("job-y"), codec.encode_job(make_job("job-y", gpus=1))))
        assert await view.nodes() is same, "no node record changed: the same fleet object (SubmitJob's fit memo)"

        changed = replace(make_node("n-a"), cordoned=True, cordon_reason="maintenance")
        rev = await store.put(KEYS.node("n-a"), codec.encode_node(changed))
        assert await mirror.wait_for(rev)
        now = {n.node_id: n for n in await view.nodes()}
        assert now["n-a"].cordoned and now["n-b"] is first["n-b"]

        assert await store.delete(KEYS.node("n-b"))
        assert await mirror.wait_for(await store.put("/ty/marker", b"x"))  # the delete is mirrored before it
        assert [n.node_id for n in await view.nodes()] == ["n-a"]
    finally:
        await mirror.stop()
