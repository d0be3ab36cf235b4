"""Transactions that move GPU holdings: group commit, at most one transaction per node in flight.

A write (a gang's placement, a release, a repair) is its own compares and operations (the job, the
allocation) plus holdings edits per node (`state/holdings.py`). Its holdings compares name the revision
the ledger knows, which only the transaction in flight on that node can change, so two transactions on
one node must not be in flight at once: the second would compare a revision the first is about to
replace. And a transaction's fixed cost (one gRPC call, the leader fence, etcd's own per-request work)
is most of what a small gang's commit costs. So writes are committed in groups, as a database commits
its log: at most `max_in_flight` transactions are in flight; the writes that arrive meanwhile wait, and
the next transaction carries as many waiting writes as fit, planned in arrival order on top of each
other's results:

    submit(w) ──▶ waiting ──(a slot free, its nodes free)──▶ batch [w, and later waiting writes whose nodes
                  are free, within the transaction's operation and byte budgets]
    batch ──▶ plan edits on the newest holdings (a write whose GPUs are held is refused alone:
              HeldElsewhere) ──▶ one txn [fence, each write's compares, each changed node's revision]
          ──▶ succeeded: every write succeeded; the ledger keeps the new holdings
          ──▶ failed: a batch of one write: it failed. More: etcd does not say which compare failed, so the
              batch is split in halves, each sent again, until the write that lost its race is alone, so
              one write's lost race never fails another's (log2(batch) extra transactions for it).

Measured with the scheduler benchmark (docs/scheduler-benchmark.md): a lock per node across the round
trip ran the commit path at 0.46 of the same transactions sent raw, one transaction per gang with only
node-sharing writes merged at 0.52-0.96 (0.50-0.64 of the 2-key transaction without holdings), this at
1.00-1.09 of that 2-key rate in full benchmark runs.

Order: writes are taken in arrival order; a write that waits for a busy node keeps later writes that share
a node with it waiting too, so a large gang is never starved by a stream of small ones on its nodes.
Writes with no holdings edits (a CPU task) go straight to the store.
Concurrency contract: one committer per repository, used from one event loop; a write's future resolves
once, with the transaction's result (or its exception: Unavailable means unknown outcome, for every
write of that transaction).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from trainyard_core.errors import InvalidArgument
from trainyard_core.store import Compare, Delete, Put, TxnResult, mod_revision_is
from trainyard_core.store.batch import settle_with

from .holdings import Edit, HeldElsewhere, HoldingsLedger, Jobs, NodeHolding, encode_holding

Txn = Callable[[Sequence[Compare], Sequence[Put | Delete]], Awaitable[TxnResult]]

# Transactions in flight at once. Two keep etcd busy while the next group forms; more only split the groups.
MAX_IN_FLIGHT = 2
# A group's payload stays under etcd's default --max-request-bytes (1.5 MiB); one write larger than this
# is still sent, alone.
MAX_GROUP_BYTES = 1 << 20
# Per holdings key in a transaction: its compare, its key and its JSON value (a few GPU lists).
_HOLDING_BYTES = 160


@dataclass(eq=False)
class HoldingsWrite:
    compares: tuple[Compare, ...]
    ops: tuple[Put | Delete, ...]
    edits: Mapping[str, Edit]  # by node
    future: asyncio.Future[TxnResult]
    cap: int = 0  # the most writes its next transaction may carry (0: no cap); halved each time it fails
    keys: frozenset[str] = field(init=False)
    nodes: frozenset[str] = field(init=False)
    size: int = field(init=False)
    bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.keys = frozenset(op.key for op in self.ops)
        self.nodes = frozenset(self.edits)
        # Operations it adds to the larger side of a transaction (at most one holdings key per node).
        self.size = max(len(self.compares), len(self.ops)) + len(self.edits)
        self.bytes = (sum(len(op.key) + len(op.value) if isinstance(op, Put) else len(op.key) for op in self.ops)
                      + sum(len(c.key) for c in self.compares) + _HOLDING_BYTES * len(self.edits))


class HoldingsCommitter:
    def __init__(self, ledger: HoldingsLedger, txn: Txn, fence: Callable[[], list[Compare]], max_ops: int,
                 *, max_in_flight: int = MAX_IN_FLIGHT, max_bytes: int = MAX_GROUP_BYTES) -> None:
        self._ledger = ledger
        self._txn = txn
        self._fence = fence
        self._max_ops = max_ops
        self._max_in_flight = max_in_flight
        self._max_bytes = max_bytes
        self._waiting: list[HoldingsWrite] = []
        self._busy: set[str] = set()
        self._sending: set[asyncio.Task[None]] = set()
        self._dispatching: asyncio.Handle | None = None
        self.batches = 0  # transactions sent, and how many of them carried more than one write
        self.merged = 0

    async def submit(self, compares: Sequence[Compare], ops: Sequence[Put | Delete],
                     edits: Mapping[str, Edit]) -> TxnResult:
        if not edits:
            return await self._txn([*self._fence(), *compares], ops)
        write = HoldingsWrite(tuple(compares), tuple(ops), dict(edits), asyncio.get_running_loop().create_future())
        self._waiting.append(write)
        self._dispatch_soon()
        return await write.future

    def _dispatch_soon(self) -> None:
        """Dispatch once the writes submitted in this turn of the event loop are all waiting: a gang
        commit's callers wake together (one cycle's decisions, the writes a finished transaction let in)."""
        if self._dispatching is None:
            self._dispatching = asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """While a slot is free, send the next group: waiting writes in arrival order whose nodes are free."""
        self._dispatching = None
        while self._waiting and len(self._sending) < self._max_in_flight:
            # The waiting writes shared over the free slots, so the transactions overlap (one is planned
            # and sent while another is in etcd) rather than one carrying everything and the next nothing.
            share = -(-len(self._waiting) // (self._max_in_flight - len(self._sending)))
            batch = self._next_group(share)
            if not batch:
                return
            taken = set(map(id, batch))
            self._waiting = [w for w in self._waiting if id(w) not in taken]
            nodes = frozenset().union(*(w.nodes for w in batch))
            self._busy |= nodes
            task = asyncio.create_task(self._send(batch, nodes), name="holdings commit")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    def _next_group(self, share: int) -> list[HoldingsWrite]:
        """The next transaction's writes, in arrival order: free nodes, no key twice, within the operation
        and byte budgets and the cap of a group that failed; at most `share` of them, except that a write
        sharing a node with the group always joins it (it could only wait for this group otherwise)."""
        group: list[HoldingsWrite] = []
        nodes: set[str] = set()
        held = set(self._busy)  # nodes a write may not touch: in flight, or wanted by an earlier waiting write
        keys: set[str] = set()
        size = bytes_ = limit = 0
        for w in self._waiting:
            if w.nodes & held or w.keys & keys:
                held |= w.nodes  # it keeps its place on its nodes
                continue
            lim = min(limit, w.cap) if limit and w.cap else limit or w.cap
            if group and ((lim and len(group) >= lim) or size + w.size > self._max_ops
                          or bytes_ + w.bytes > self._max_bytes or (len(group) >= share and not w.nodes & nodes)):
                held |= w.nodes
                continue
            group.append(w)
            nodes |= w.nodes
            keys |= w.keys
            size += w.size
            bytes_ += w.bytes
            limit = lim
        return group

    async def _send(self, batch: list[HoldingsWrite], nodes: frozenset[str]) -> None:
        try:
            await self._commit(batch, nodes)
        except BaseException as exc:  # resolve every future whatever happened, then let the task end
            settle_with((w.future for w in batch), exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._busy -= nodes
            self._sending.discard(asyncio.current_task())
            self._dispatch_soon()

    async def _commit(self, batch: list[HoldingsWrite], nodes: frozenset[str]) -> None:
        before: dict[str, NodeHolding] = {n: await self._ledger.current(n) for n in nodes}
        after: dict[str, Jobs] = {n: h.jobs for n, h in before.items()}
        sent: list[HoldingsWrite] = []
        for w in batch:
            if w.future.done():  # its caller was cancelled while it waited: not sent
                continue
            try:
                mine: dict[str, Jobs] = {}
                for n, edit in w.edits.items():
                    new = edit(mine.get(n, after[n]))
                    if new is not None:
                        mine[n] = new
            except HeldElsewhere as exc:
                w.future.set_exception(exc)  # refused alone, before anything is sent
                continue
            after.update(mine)
            sent.append(w)
        if not sent:
            return
        changed = {n: jobs for n, jobs in after.items() if jobs != before[n].jobs}
        compares = [*self._fence(), *(c for w in sent for c in w.compares)]
        ops: list[Put | Delete] = [op for w in sent for op in w.ops]
        for n, jobs in changed.items():
            key = self._ledger.keys.holdings(n)
            compares.append(mod_revision_is(key, before[n].revision))  # 0: still absent
            ops.append(Put(key, encode_holding(jobs)) if jobs else Delete(key))
        self.batches += 1
        self.merged += len(sent) > 1
        try:
            res = await self._txn(compares, ops)
        except InvalidArgument:
            # etcd refused the request as a whole (its size): nothing was written. A group goes again in
            # halves, so only a write too large alone is refused.
            self._ledger.forget(changed)
            if len(sent) == 1:
                raise
            self._split(sent)
            return
        except BaseException:
            self._ledger.forget(changed)
            raise
        if res.succeeded:
            self._ledger.settle(changed, res.revision)
            for w in sent:
                if not w.future.done():  # a caller cancelled meanwhile does not hear it; the others do
                    w.future.set_result(res)
            return
        self._ledger.forget(changed)
        if len(sent) == 1:
            if not sent[0].future.done():
                sent[0].future.set_result(res)
            return
        self._split(sent)  # which write's compare failed is not told

    def _split(self, sent: list[HoldingsWrite]) -> None:
        """A group that failed goes again in halves, ahead of later arrivals (those whose callers are still
        waiting)."""
        again = [w for w in sent if not w.future.done()]
        half = (len(sent) + 1) // 2
        for w in again:
            w.cap = half
        self._waiting[:0] = again
