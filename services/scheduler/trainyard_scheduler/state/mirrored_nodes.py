"""Records under one prefix of the replica's mirror of etcd, each decoded once per record revision.

SubmitJob checks every job against the whole fleet (`check_fits_fleet`). Reading every node record from
etcd for that cost one range of the whole node prefix per submit (megabytes at 10,000 nodes); the mirror
already holds them, and a record is decoded again only when its revision changed. Usage reports and the
quotas' current use read the live jobs and allocations the same way (`Decoded`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from trainyard_core.store.mirror import PrefixMirror

from ..domain.models import Allocation, Node
from .codec import decode_allocation, decode_node
from .keys import Keys

T = TypeVar("T")


class Decoded(Generic[T]):
    """`current()`: every record under `prefix`, decoded, by etcd key. Synchronous on purpose: what it returns
    is the mirror at one revision. Records that left the mirror are forgotten."""

    def __init__(self, mirror: PrefixMirror, prefix: str, decode: Callable[[bytes], T]) -> None:
        self._mirror = mirror
        self._prefix = prefix
        self._decode = decode
        self._cache: dict[str, tuple[int, T]] = {}

    def current(self) -> dict[str, T]:
        out: dict[str, T] = {}
        for key, kv in self._mirror.under(self._prefix).items():
            hit = self._cache.get(key)
            if hit is None or hit[0] != kv.mod_revision:
                hit = (kv.mod_revision, self._decode(kv.value))
                self._cache[key] = hit
            out[key] = hit[1]
        if len(self._cache) > len(out):
            for gone in [k for k in self._cache if k not in out]:
                del self._cache[gone]
        return out


class MirroredNodes:
    """The registered nodes, as one tuple that stays the same object until a node record changes: SubmitJob
    then neither walks the mirror's node records nor re-checks a request's fit against an unchanged fleet
    (`FleetFit`) on every submit."""

    def __init__(self, mirror: PrefixMirror, keys: Keys) -> None:
        self._nodes = Decoded(mirror, keys.nodes, decode_node)
        self._prefix = keys.nodes
        self._changes = mirror.subscribe()
        self._current: tuple[Node, ...] | None = None

    async def nodes(self) -> tuple[Node, ...]:
        full, changed = self._changes.take()
        if self._current is None or full or any(key.startswith(self._prefix) for key in changed):
            self._current = tuple(self._nodes.current().values())
        return self._current


class MirroredAllocations:
    """The gangs placed now (their allocation records), for the quotas' current use."""

    def __init__(self, mirror: PrefixMirror, keys: Keys) -> None:
        self._allocations = Decoded(mirror, keys.allocations, decode_allocation)

    def current(self) -> list[Allocation]:
        return list(self._allocations.current().values())
