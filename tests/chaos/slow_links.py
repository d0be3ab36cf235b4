"""Invariant (f) of the chaos checker: no false death for a node that is only slow.

While a node's only fault is latency (the `latency` kind: a round trip under 1 s, well inside the 2 s pulse
acknowledgement window), the node must not be lost. netfaults.py opens a window for the node once the delay is on
(`open`) and closes it before the delay goes (`close`); the node has no other fault meanwhile (one fault per
node). Within a window:

- no allocation is stopped with "node <id> lost contact" (domain/progress.py's reason) that was not so when
  the window opened — checked on every read of the allocations, a few times a second;
- the leader's node view never shows the node not ready — every half second. A cordoned node's view says
  cordoned whatever its liveness; only its allocations tell then.

A read counts only if its window was open before the read began and still is after it ended, so a loss
decided just after the delay went (for another reason) is never blamed on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import grpc.aio

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import LocalCluster
from trainyard_core.errors import Unavailable
from trainyard_core.security import identity
from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.domain.models import Allocation
from trainyard_scheduler.state.codec import decode_allocation
from trainyard_scheduler.state.keys import Keys

SLOW = "(f) no false death for a node that is only slow"
READY_STATES = (types_pb2.NODE_STATE_READY, types_pb2.NODE_STATE_CORDONED)


def _state_name(state: int) -> str:
    return str(types_pb2.NodeState.Name(state))  # type: ignore[arg-type]


def lost_contact(allocs: list[Allocation], node: str) -> frozenset[tuple[str, int]]:
    """(job, attempt) of the allocations stopped because `node` was lost."""
    reason = f"node {node} lost contact"
    return frozenset((a.job_id, a.attempt) for a in allocs if a.stop_reason == reason)


@dataclass(frozen=True)
class SlowWindow:
    seq: int
    node: str
    what: str                                # the fault, for the violation's text
    baseline: frozenset[tuple[str, int]]     # allocations already stopped for its loss when the window opened


class SlowLinks:
    def __init__(self, cluster: LocalCluster, store: EtcdStore, keys: Keys,
                 violation: Callable[[str, str, str], None], count: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.store = store
        self.keys = keys
        self._violation = violation
        self._count = count
        self._open: dict[str, SlowWindow] = {}
        self._seq = 0
        self._channels: dict[str, grpc.aio.Channel] = {}

    def windows(self) -> dict[str, SlowWindow]:
        """The windows open now (take them before a read, hand them to the check after it)."""
        return dict(self._open)

    async def open(self, node: str, what: str) -> bool:
        """Hold (f) for `node` from now on, until `close`; `what` is its fault. False, and nothing watched,
        when the baseline cannot be read."""
        try:
            result = await self.store.range(self.keys.allocations)
        except Unavailable:
            return False
        allocs = [decode_allocation(kv.value) for kv in result.kvs]
        self._seq += 1
        self._open[node] = SlowWindow(self._seq, node, what, lost_contact(allocs, node))
        self._count("(f) latency windows")
        return True

    def close(self, node: str) -> None:
        self._open.pop(node, None)

    def _still_open(self, window: SlowWindow) -> bool:
        return self._open.get(window.node) is window

    def check_allocations(self, allocs: list[Allocation], revision: int, before: dict[str, SlowWindow]) -> None:
        """(f) on one read of the allocations at `revision`; `before`: the windows open when the read began."""
        for node, window in before.items():
            if not self._still_open(window):
                continue
            self._count("(f) allocation reads in a latency window")
            for job_id, attempt in sorted(lost_contact(allocs, node) - window.baseline):
                self._violation(SLOW, f"{node}/{job_id}/{attempt}",
                                f"etcd revision {revision}: the gang of {job_id} attempt {attempt} was stopped for "
                                f"\"node {node} lost contact\" while the node's only fault was {window.what}")

    def check_states(self, states: dict[str, int], before: dict[str, SlowWindow]) -> None:
        """(f) on one node view (node → NodeState); `before`: the windows open when it was asked for."""
        for node, window in before.items():
            if not self._still_open(window):
                continue
            self._count("(f) node views in a latency window")
            state = states.get(node)
            if state is not None and state not in READY_STATES:
                self._violation(SLOW, f"{node}/view/{window.seq}",
                                f"the leader's node view shows {node} {_state_name(state)} while the "
                                f"node's only fault was {window.what}")

    async def check_views(self) -> None:
        before = self.windows()
        if not before:
            return
        states = await self._leader_node_states()
        if states is None:
            self._count("(f) node views failed (no leader answered)")
            return
        self.check_states(states, before)

    async def _leader_node_states(self) -> dict[str, int] | None:
        kv = await self.store.get(self.keys.leader)
        if kv is None:
            return None
        address = kv.value.decode()
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.cluster.channel(address, identity.SCHEDULER)
        try:
            resp = await scheduler_pb2_grpc.NodeServiceStub(channel).ListNodes(scheduler_pb2.ListNodesRequest(),
                                                                               timeout=2.0)
        except grpc.aio.AioRpcError:
            return None
        return {n.node_id: n.state for n in resp.nodes}

    async def close_channels(self) -> None:
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
