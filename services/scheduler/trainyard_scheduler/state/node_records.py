"""The node records in etcd: what agents registered, with their health and cordons, read and changed by the
scheduler's node service and its leader (a part of `Repository`, which hands out `repo.nodes`).

Every change is a compare-and-swap on the revision read, retried on conflict, so no acknowledged change of a
node (a cordon, a health change, a registration) is overwritten by one decided before it; a leader's writes
carry the election's fence, so a deposed leader's write fails instead of landing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from trainyard_core.errors import Conflict, NotFound
from trainyard_core.store import Compare, Delete, Put, Store, TxnResult, mod_revision_is

from ..domain.models import Node
from .codec import decode_node, encode_node
from .holdings import Source
from .keys import Keys

Txn = Callable[[Sequence[Compare], Sequence[Put | Delete]], Awaitable[TxnResult]]


class NodeRecords:
    def __init__(self, store: Store, keys: Keys, txn: Txn, fence: Callable[[], Compare] | None = None,
                 node_source: Source | None = None) -> None:
        """`txn`: the repository's transaction (it keeps the newest revision written); `node_source`, where
        given (the leader's mirror), is where `modify(mirror_first=True)` reads first."""
        self._store = store
        self._keys = keys
        self._txn = txn
        self._fence = fence
        self._node_source = node_source

    async def list(self) -> list[Node]:
        page = await self._store.range(self._keys.nodes)
        return [decode_node(kv.value) for kv in page.kvs]

    async def get(self, node_id: str) -> Node:
        kv = await self._store.get(self._keys.node(node_id))
        if kv is None:
            raise NotFound(f"node {node_id} is not registered")
        return decode_node(kv.value)

    async def modify(self, node_id: str, change: Callable[[Node | None], Node | None],
                     tries: int = 10, *, mirror_first: bool = False) -> tuple[Node | None, Node | None]:
        """Read-modify-write of a node record, a compare-and-swap on the revision read, retried on
        conflict. `change` gets the stored node (None: not registered) and returns the new record, or None
        for 'no change'; it may run several times. Returns (before, after) of the write that landed (after
        is None when nothing was written). `mirror_first`: the first read is from `node_source` (for a
        registration, whose unchanged case needs no write at all; not for health changes, where a mirror a
        moment behind could make a change look already written)."""
        key = self._keys.node(node_id)
        for attempt in range(tries):
            # The first read from the mirror where there is one: an agent registering again with what is stored
            # (after a failover, every agent at once) then costs no etcd round trip. A mirror behind etcd costs
            # a refused compare-and-swap and a read from the store, never a lost change.
            if attempt == 0 and mirror_first and self._node_source is not None:
                kv = await self._node_source(key)
            else:
                kv = await self._store.get(key)
            old = decode_node(kv.value) if kv else None
            new = change(old)
            if new is None or new == old:
                return old, None
            fence = [self._fence()] if self._fence is not None else []
            res = await self._txn([*fence, mod_revision_is(key, kv.mod_revision if kv else 0)],
                                  [Put(key, encode_node(new))])
            if res.succeeded:
                return old, new
            if self._fence is not None and not await self._still_leading():
                raise Conflict("leadership lost while writing a node")
        raise Conflict(f"node {node_id} kept changing; giving up after {tries} tries")

    async def _still_leading(self) -> bool:
        assert self._fence is not None
        res = await self._store.txn([self._fence()], [])
        return res.succeeded
