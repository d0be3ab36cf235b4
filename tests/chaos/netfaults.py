"""Network faults and frozen processes, carried out for `faults.Faults` (which owns the bookkeeping: the fault
records, what is down or busy, the restore tasks).

How each is made (the cluster runs with `LocalCluster(control_plane_netns=True)`: every node, scheduler
replica, the checkpoint-store and the gateway on a host of its own, etcd on addresses of the bridge; the
mechanisms are `trainyard_core.testing.linkfaults`):

| kind | on whose link | what |
|---|---|---|
| partition_agent_leader | a node's | cut from the leader's host, both ways; the standby's host stays reachable |
| partition_leader_etcd | the leader's | cut from every etcd member's address |
| partition_gateway_scheduler | the gateway's | cut from the leader's host, or from every replica's |
| isolate_node | a node's | cut from everyone |
| packet_loss | a node's | each packet dropped with the drawn probability, each way |
| latency | a node's | every frame held back delay ± jitter each way (round trip < 1 s) |
| freeze_agent, freeze_scheduler, freeze_etcd_member | - | SIGSTOP the process, SIGCONT after the drawn time |

A partial partition (agent ↔ leader cut, agent ↔ standby fine) is a lost node by definition: a node is alive
only while the leader hears it; a standby refuses the agent's stream and relays nothing
(docs/operations.md, "Network faults").

Limits, so the cluster stays recoverable without hiding anything: one fault per host at a time; nodes with a
fault of any kind at most MAX_AGENTS_DOWN; a fault on a scheduler replica (freeze, cut from etcd) only while
every replica runs and none has another; one etcd member down or frozen at a time. Latency is applied only to
a node the leader sees ready, and while it is the node's only fault the checker holds invariant (f): the node
is never lost for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainyard_core.testing.linkfaults import Impairment, Peer
from trainyard_core.testing.netns import HostNetwork

from .schedule import Fault

if TYPE_CHECKING:
    from .faults import Faults

log = logging.getLogger(__name__)


@dataclass
class Frozen:
    pid: int
    name: str       # what it is: a node's agent, a scheduler replica, "etcd:<member>"


@dataclass
class NetFaults:
    owner: Faults
    network: HostNetwork | None
    # Latency windows of invariant (f): open(node, what) when a node's only fault is latency, close(node) at its end.
    open_slow: Callable[[str, str], Awaitable[bool]]
    close_slow: Callable[[str], None]
    frozen: dict[str, Frozen] = field(default_factory=dict)

    # -- helpers ---------------------------------------------------------------------------------------
    def _net(self) -> HostNetwork:
        if self.network is None:
            raise RuntimeError("network faults need the cluster on hosts of their own (control_plane_netns)")
        return self.network

    def _address(self, name: str) -> str:
        return self._net().hosts[name].address

    async def _impair(self, host: str, imp: Impairment) -> None:
        await asyncio.to_thread(self._net().impair, host, imp)

    def _heal(self, host: str) -> None:
        if self.network is not None and host in self.network.impairments:
            self.network.heal(host)

    async def _leader(self) -> str | None:
        """The scheduler replica (proc name) that leads now, from the election key; None when nobody does."""
        kv = await self.owner.store.get(self.owner.keys.leader)
        if kv is None or kv.value.decode() not in self.owner.cluster.scheduler_addresses:
            return None
        return self.owner.cluster.scheduler_names[self.owner.cluster.scheduler_addresses.index(kv.value.decode())]

    def _schedulers_whole(self) -> bool:
        return all(n not in self.owner._down and n not in self.owner._busy and self.owner.running(n)
                   for n in self.owner.cluster.scheduler_names)

    def _restore_later(self, after_s: float, what: str, work: Callable[[], None]) -> None:
        async def restore() -> None:
            await asyncio.sleep(after_s)
            await asyncio.to_thread(work)
        self.owner._later(what, restore)

    async def _node_fault(self, fault: Fault, imp: Impairment, *, unreachable: bool) -> str | None:
        """Put `imp` on a node picked for `fault`; it is healed after the fault's time. The node's name, or None
        (recorded as skipped) when no node may take a fault now."""
        node = self.owner._pick_node(fault)
        if node is None:
            self.owner._record(fault, "-", f"skipped: {self.owner.max_troubled} nodes have faults already")
            return None
        self.owner._busy.add(node)
        if unreachable:
            self.owner._down.add(node)

        def heal() -> None:
            try:
                self._heal(node)
            finally:
                self.owner._busy.discard(node)
                self.owner._down.discard(node)
        try:
            await self._impair(node, imp)
        except BaseException:
            heal()
            raise
        self._restore_later(fault.down_s, node, heal)
        return node

    # -- partitions --------------------------------------------------------------------------------------
    async def _partition_agent_leader(self, fault: Fault) -> None:
        leader = await self._leader()
        if leader is None or not self._schedulers_whole():
            self.owner._record(fault, "-", "skipped: no leader, or a replica is down (the standby must answer)")
            return
        standby = [n for n in self.owner.cluster.scheduler_names if n != leader]
        node = await self._node_fault(fault, Impairment(cut=(Peer(self._address(leader)),)), unreachable=False)
        if node is not None:
            self.owner._record(fault, node, "done", f"cut from the leader ({leader}); the standby "
                                                    f"({', '.join(standby)}) reachable; healed in {fault.down_s:.1f}s")

    async def _isolate_node(self, fault: Fault) -> None:
        node = await self._node_fault(fault, Impairment(isolated=True), unreachable=True)
        if node is not None:
            self.owner._record(fault, node, "done", f"cut from every peer; healed in {fault.down_s:.1f}s")

    async def _packet_loss(self, fault: Fault) -> None:
        node = await self._node_fault(fault, Impairment(loss_pct=fault.amount), unreachable=False)
        if node is not None:
            self.owner._record(fault, node, "done", f"{fault.amount:.1f}% loss each way for {fault.down_s:.1f}s")

    async def _partition_leader_etcd(self, fault: Fault) -> None:
        leader = await self._leader()
        if leader is None or not self._schedulers_whole():
            self.owner._record(fault, "-", "skipped: no leader, or a replica is down already")
            return
        members = self.owner.cluster.etcd_cluster
        self.owner._busy.add(leader)
        self.owner._down.add(leader)

        def heal() -> None:
            try:
                self._heal(leader)
            finally:
                self.owner._busy.discard(leader)
                self.owner._down.discard(leader)
        try:
            await self._impair(leader, Impairment(cut=tuple(Peer(m.host) for m in members)))
        except BaseException:
            heal()
            raise
        self.owner._record(fault, leader, "done", f"leader cut from every etcd member; healed in {fault.down_s:.1f}s")
        self._restore_later(fault.down_s, leader, heal)

    async def _partition_gateway_scheduler(self, fault: Fault) -> None:
        if "gateway" in self.owner._busy:
            self.owner._record(fault, "gateway", "skipped: the gateway has a fault already")
            return
        names = self.owner.cluster.scheduler_names
        if fault.scope == "leader":
            leader = await self._leader()
            if leader is None:
                self.owner._record(fault, "-", "skipped: no leader right now")
                return
            names = [leader]
        self.owner._busy.add("gateway")

        def heal() -> None:
            try:
                self._heal("gateway")
            finally:
                self.owner._busy.discard("gateway")
        try:
            await self._impair("gateway", Impairment(cut=tuple(Peer(self._address(n)) for n in names)))
        except BaseException:
            heal()
            raise
        self.owner._record(fault, "gateway", "done", f"cut from {', '.join(names)}; healed in {fault.down_s:.1f}s")
        self._restore_later(fault.down_s, "gateway", heal)

    async def _latency(self, fault: Fault) -> None:
        node = self.owner._pick_node(fault)
        if node is None:
            self.owner._record(fault, "-", f"skipped: {self.owner.max_troubled} nodes have faults already")
            return
        views = {v.node_id: v for v in await self.owner.operator.nodes()}
        if node not in views or not views[node].ready:
            self.owner._record(fault, node, "skipped: the leader does not see it ready (or no leader now)")
            return
        self.owner._busy.add(node)
        imp = Impairment(delay_ms=fault.amount, jitter_ms=fault.jitter_ms)
        try:
            await self._impair(node, imp)
            watched = await self.open_slow(node, f"{fault.kind} t+{fault.at:.1f}s {imp.describe()}")
        except BaseException:
            self.close_slow(node)
            await asyncio.to_thread(self._heal, node)
            self.owner._busy.discard(node)
            raise
        self.owner._record(fault, node, "done", f"{imp.describe()} for {fault.down_s:.1f}s"
                           + ("" if watched else "; (f) not watched: no baseline could be read"))

        def heal() -> None:
            self.close_slow(node)   # before the delay goes: the window covers latency only
            try:
                self._heal(node)
            finally:
                self.owner._busy.discard(node)
        self._restore_later(fault.down_s, node, heal)

    # -- frozen processes --------------------------------------------------------------------------------
    def _freeze(self, key: str, pid: int, name: str, after_s: float) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.frozen[key] = Frozen(pid, name)
        self.owner._down.add(key)
        self.owner._busy.add(key)

        def thaw() -> None:
            try:
                self._thaw(key)
            finally:
                self.owner._down.discard(key)
                self.owner._busy.discard(key)
        self._restore_later(after_s, key, thaw)

    def _thaw(self, key: str) -> None:
        frozen = self.frozen.pop(key, None)
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen.pid, signal.SIGCONT)

    async def _freeze_agent(self, fault: Fault) -> None:
        node = self.owner._pick_node(fault)
        if node is None:
            self.owner._record(fault, "-", f"skipped: {self.owner.max_troubled} nodes have faults already")
            return
        popen = self.owner.cluster.procs[node].popen
        assert popen is not None
        self._freeze(node, popen.pid, f"agent {node}", fault.down_s)
        self.owner._record(fault, node, "done", f"agent pid {popen.pid} SIGSTOPped, SIGCONT in {fault.down_s:.1f}s")

    async def _freeze_scheduler(self, fault: Fault) -> None:
        leader = await self._leader()
        if leader is None or not self._schedulers_whole():
            self.owner._record(fault, "-", "skipped: no leader, or a replica is down already")
            return
        names = self.owner.cluster.scheduler_names
        name = leader if fault.scope == "leader" else next((n for n in names if n != leader), leader)
        popen = self.owner.cluster.procs[name].popen
        assert popen is not None
        self._freeze(name, popen.pid, f"scheduler {name}", fault.down_s)
        role = "leader" if name == leader else "standby"
        self.owner._record(fault, name, "done", f"{role} pid {popen.pid} SIGSTOPped, SIGCONT in {fault.down_s:.1f}s")

    async def _freeze_etcd_member(self, fault: Fault) -> None:
        members = self.owner.cluster.etcd_cluster
        if any(f"etcd:{m.name}" in self.owner._down for m in members):
            self.owner._record(fault, "-", "skipped: an etcd member is down already")
            return
        member = members[int(fault.pick * len(members))]
        if member.proc is None or member.proc.poll() is not None:
            self.owner._record(fault, f"etcd {member.name}", "skipped: not running")
            return
        self._freeze(f"etcd:{member.name}", member.proc.pid, f"etcd {member.name}", fault.down_s)
        self.owner._record(fault, f"etcd {member.name}", "done",
                           f"{member.endpoint} SIGSTOPped, SIGCONT in {fault.down_s:.1f}s")

    # -- healing -----------------------------------------------------------------------------------------
    def undo(self) -> list[str]:
        """SIGCONT everything frozen and take every impairment off (idempotent; also for a test's finally)."""
        done = []
        for key in list(self.frozen):
            what = self.frozen[key].name
            self._thaw(key)
            done.append(f"SIGCONT {what}")
        if self.network is not None:
            for host in list(self.network.impairments):
                self.close_slow(host)
                self.network.heal(host)
                done.append(f"healed the link of {host}")
        return done

    def kinds(self) -> dict[str, Callable[[Fault], Awaitable[Any]]]:
        return {k: getattr(self, f"_{k}") for k in (
            "partition_agent_leader", "partition_leader_etcd", "partition_gateway_scheduler", "isolate_node",
            "packet_loss", "latency", "freeze_agent", "freeze_scheduler", "freeze_etcd_member")}
