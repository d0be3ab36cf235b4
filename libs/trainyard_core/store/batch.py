"""Group commit of independent writes: many callers' small transactions sent as one etcd transaction.

Each write is its own compares and puts (an audit entry: `absent(key)` and its put; a new job: its record and
its idempotency key). Alone, each costs an etcd request of its own: a gRPC call, a raft proposal, a disk
sync. Under load those fixed costs are most of what such a write costs, on etcd's side and on the caller's
(bench/gateway: four transactions per job submitted, two of them audit entries). So writes are committed in
groups, as a database commits its log:

    txn(w) ──▶ a slot free: sent at once, alone (no wait when idle)
           └─▶ every slot busy: waits; when a slot frees, the next transaction carries every waiting write that
               fits (arrival order, no key twice, within the operation and byte budgets)
    group ──▶ one txn [each write's compares] → [each write's puts]
          ──▶ succeeded: every write succeeded, at the transaction's revision
          ──▶ failed: a group of one: that write failed (its compare did not hold). More: etcd does not say
              which compare failed, so each write waits again with a cap of half the group, until the one
              whose compare failed is alone: one write's failure never fails another's
          ──▶ refused as a whole before any change (FailedPrecondition: a write's lease is gone;
              InvalidArgument: over etcd's limits): a group of one gets the error; a larger one is halved
              as above, so only the write that caused it hears of it
          ──▶ unknown outcome (Unavailable, or anything else raised): every write of the group gets that
              exception: the transaction landed whole or not at all, the same for each of them

Only independent writes belong here: a caller whose write depends on another's answer (read, then compare the
revision read) must not be grouped behind writes that may change its keys, and gains nothing from it.
Concurrency contract: used from one event loop; a write's result is its transaction's, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import FailedPrecondition, InvalidArgument
from .api import Compare, Delete, Put, Store, TxnResult

# Transactions in flight at once: one is planned while another is in etcd.
MAX_IN_FLIGHT = 2
# etcd's default --max-txn-ops is 128 (each of compares and operations): a group stays well under it.
MAX_GROUP_OPS = 64
# Under etcd's default --max-request-bytes (1.5 MiB); a single larger write is still sent, alone.
MAX_GROUP_BYTES = 512 * 1024


def settle_with(futures: Iterable[asyncio.Future[Any]], exc: BaseException) -> None:
    """A transaction carrying these writers' futures ended in `exc`: each not yet resolved gets it (an
    Exception), or is cancelled (a cancellation or an exit, which the sending task then raises itself)."""
    for future in futures:
        if future.done():
            continue
        if isinstance(exc, Exception):
            future.set_exception(exc)
        else:
            future.cancel()


@dataclass(eq=False)
class _Write:
    compares: tuple[Compare, ...]
    ops: tuple[Put | Delete, ...]
    future: asyncio.Future[TxnResult]
    cap: int = 0  # the most writes its next group may carry (0: no cap); halved each time a group fails
    keys: frozenset[str] = field(init=False)
    size: int = field(init=False)
    bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.keys = frozenset(op.key for op in self.ops)
        self.size = max(len(self.compares), len(self.ops))
        self.bytes = (sum(len(op.key) + (len(op.value) if isinstance(op, Put) else 0) for op in self.ops)
                      + sum(len(c.key) for c in self.compares))


class TxnBatcher:
    """`txn(compares, ops)` with the result of the store's own txn for that write, sent grouped with others."""

    def __init__(self, store: Store, *, max_in_flight: int = MAX_IN_FLIGHT, max_ops: int = MAX_GROUP_OPS,
                 max_bytes: int = MAX_GROUP_BYTES) -> None:
        if max_in_flight < 1 or max_ops < 1 or max_bytes < 1:
            raise ValueError("max_in_flight, max_ops and max_bytes must be positive")
        self._store = store
        self._max_in_flight = max_in_flight
        self._max_ops = max_ops
        self._max_bytes = max_bytes
        self._waiting: list[_Write] = []
        self._sending: set[asyncio.Task[None]] = set()
        self.transactions = 0  # sent, and how many carried more than one write (tests and benchmarks read them)
        self.grouped = 0

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> TxnResult:
        write = _Write(tuple(compares), tuple(ops), asyncio.get_running_loop().create_future())
        self._waiting.append(write)
        self._dispatch()
        return await write.future

    def _dispatch(self) -> None:
        while self._waiting and len(self._sending) < self._max_in_flight:
            group = self._next_group()
            taken = set(map(id, group))
            self._waiting = [w for w in self._waiting if id(w) not in taken]
            task = asyncio.create_task(self._send(group), name="grouped txn")
            self._sending.add(task)

    def _next_group(self) -> list[_Write]:
        """Waiting writes in arrival order: no key twice, within the budgets and the cap of a failed group.
        Never empty: the first waiting write always goes, alone if it is over a budget."""
        group: list[_Write] = []
        keys: set[str] = set()
        size = bytes_ = limit = 0
        for w in self._waiting:
            if w.keys & keys:
                continue
            lim = min(limit, w.cap) if limit and w.cap else limit or w.cap
            if group and ((lim and len(group) >= lim) or size + w.size > self._max_ops
                          or bytes_ + w.bytes > self._max_bytes):
                continue
            group.append(w)
            keys |= w.keys
            size += w.size
            bytes_ += w.bytes
            limit = lim
        return group

    async def _send(self, group: list[_Write]) -> None:
        try:
            live = [w for w in group if not w.future.done()]  # a caller cancelled while it waited: not sent
            if not live:
                return
            self.transactions += 1
            self.grouped += len(live) > 1
            try:
                res = await self._store.txn([c for w in live for c in w.compares],
                                            [op for w in live for op in w.ops])
            except (FailedPrecondition, InvalidArgument):
                if len(live) == 1:
                    raise
                self._split(live)  # refused before any change: find the write it is about
                return
            if res.succeeded or len(live) == 1:
                for w in live:
                    if not w.future.done():
                        w.future.set_result(res)
                return
            self._split(live)
        except BaseException as exc:  # resolve every future whatever happened, then let the task end
            settle_with((w.future for w in group), exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._sending.discard(asyncio.current_task())
            self._dispatch()

    def _split(self, group: list[_Write]) -> None:
        """A group failed as a whole: its writes wait again, first in line, at most half of it per group."""
        half = -(-len(group) // 2)
        for w in group:
            w.cap = min(w.cap, half) if w.cap else half
        self._waiting[:0] = group
