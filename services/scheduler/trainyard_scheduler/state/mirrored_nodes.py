"""The registered nodes as the replica's mirror of etcd holds them, decoded once per record revision.

SubmitJob checks every job against the whole fleet (`check_fits_fleet`). Reading every node record from
etcd for that cost one range of the whole node prefix per submit (megabytes at 10,000 nodes); the mirror
already holds them, and a record is decoded again only when its revision changed.
"""

from __future__ import annotations

from trainyard_core.store.mirror import PrefixMirror

from ..domain.models import Node
from .codec import decode_node
from .keys import Keys


class MirroredNodes:
    def __init__(self, mirror: PrefixMirror, keys: Keys) -> None:
        self._mirror = mirror
        self._prefix = keys.nodes
        self._cache: dict[str, tuple[int, Node]] = {}

    async def nodes(self) -> list[Node]:
        out: list[Node] = []
        seen: set[str] = set()
        for key, kv in self._mirror.under(self._prefix).items():
            seen.add(key)
            hit = self._cache.get(key)
            if hit is None or hit[0] != kv.mod_revision:
                hit = (kv.mod_revision, decode_node(kv.value))
                self._cache[key] = hit
            out.append(hit[1])
        if len(self._cache) > len(seen):
            for gone in [k for k in self._cache if k not in seen]:
                del self._cache[gone]
        return out
