"""Carrying out a plan's faults against a running LocalCluster, and healing everything afterwards.

Each fault fires at its planned offset; one that takes something down starts a task that brings it back
after the planned downtime, so faults overlap as they would in production. Limits keep the cluster
recoverable without hiding anything: at most one etcd member down (a 3-member quorum survives one), a
scheduler is killed only while its standby runs, at most two of the three nodes with a fault at a time (one
fault per node). The network faults and frozen processes are netfaults.py's.

Every fault is recorded (`FaultRecord`), also when it is skipped because its target was not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_cli.local import LocalCluster
from trainyard_core.security import identity
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing import etcd as etcd_testing
from trainyard_scheduler.state.keys import Keys

from . import procs
from .netfaults import NetFaults
from .operations import Operator
from .schedule import Fault
from .workload import MARKER

log = logging.getLogger(__name__)

MAX_AGENTS_DOWN = 2


@dataclass
class FaultRecord:
    at: float            # seconds since the start of the chaos phase
    kind: str
    target: str
    outcome: str         # "done", "skipped: ...", "failed: ..."
    detail: str = ""

    def describe(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"t+{self.at:6.1f}s {self.kind:<25} {self.target:<22} {self.outcome}{extra}"


@dataclass
class Faults:
    cluster: LocalCluster
    store: EtcdStore
    run_id: str
    # (node_id, gpu index) → (job_id, attempt) as the checker last read it from etcd.
    allocated: Callable[[], dict[tuple[str, int], tuple[str, int]]]
    operator: Operator
    # Invariant (f)'s latency windows (Checker.open_slow / close_slow); none without a checker.
    open_slow: Callable[[str, str], Awaitable[bool]] | None = None
    close_slow: Callable[[str], None] | None = None
    keys: Keys = field(default_factory=Keys)
    records: list[FaultRecord] = field(default_factory=list)
    max_troubled: int = MAX_AGENTS_DOWN
    _t0: float = 0.0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _down: set[str] = field(default_factory=set)   # what is down, frozen or cut off now: proc names, "etcd:<member>"
    _busy: set[str] = field(default_factory=set)   # what has a fault now (a superset of _down but for etcd)
    _repairs: list[tuple[str, int]] = field(default_factory=list)
    net: NetFaults = field(init=False)

    def __post_init__(self) -> None:
        async def unwatched(node: str, what: str) -> bool:
            return False
        self.net = NetFaults(self, self.cluster.network, self.open_slow or unwatched,
                             self.close_slow or (lambda node: None))

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _record(self, fault: Fault, target: str, outcome: str, detail: str = "") -> None:
        rec = FaultRecord(round(self._now(), 1), fault.kind, target, outcome, detail)
        self.records.append(rec)
        log.info("fault %s", rec.describe())

    def recent(self, n: int = 8) -> list[str]:
        return [r.describe() for r in self.records[-n:]]

    @property
    def nodes(self) -> list[str]:
        return [n for n, _ in self.cluster.nodes]

    def agent_up(self, node: str) -> bool:
        p = self.cluster.procs[node]
        return node not in self._down and p.popen is not None and p.popen.poll() is None and bool(p.ports)

    def running(self, name: str) -> bool:
        return _running(self.cluster, name)

    # -- the schedule ----------------------------------------------------------------------------------
    async def run(self, faults: tuple[Fault, ...], stop: asyncio.Event) -> None:
        self._t0 = time.monotonic()
        for fault in faults:
            delay = fault.at - self._now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
            try:
                await (getattr(self, f"_{fault.kind}", None) or self.net.kinds()[fault.kind])(fault)
            except Exception as exc:  # a fault that could not be carried out is reported, not fatal
                log.exception("fault %s", fault.describe())
                self._record(fault, "-", f"failed: {type(exc).__name__}: {exc}")

    def _later(self, what: str, work: Callable[[], Any]) -> None:
        async def runner() -> None:
            try:
                await work()
            except Exception:
                log.exception("restoring %s failed; the heal step retries", what)
        task = asyncio.create_task(runner(), name=f"restore {what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- faults ----------------------------------------------------------------------------------------
    async def _worker_kill(self, fault: Fault) -> None:
        # The process each shim started (a process group leader); its own children go with it.
        workers = sorted((w for w in await asyncio.to_thread(procs.workers, MARKER, self.run_id) if w.pid == w.pgid),
                         key=lambda w: (w.job_id, w.attempt, w.rank))
        if not workers:
            self._record(fault, "-", "skipped: no worker running")
            return
        w = workers[int(fault.pick * len(workers))]
        sent = procs.kill(w.pid, w.start_time)
        self._record(fault, f"{w.job_id}/{w.attempt}/r{w.rank}", "done" if sent else "skipped: it had exited",
                     f"pid {w.pid} on {w.node_id}")

    def _pick_node(self, fault: Fault) -> str | None:
        """A node for a fault of its own: up and without another fault, while fewer than max_troubled have one."""
        free = [n for n in self.nodes if self.agent_up(n) and n not in self._busy]
        if not free or len(self.nodes) - len(free) >= self.max_troubled:
            return None
        return free[int(fault.pick * len(free))]

    async def _agent_kill(self, fault: Fault) -> None:
        node = self._pick_node(fault)
        if node is None:
            self._record(fault, "-", f"skipped: {self.max_troubled} nodes have faults already")
            return
        self._down.add(node)
        self._busy.add(node)
        await asyncio.to_thread(self.cluster.procs[node].kill)
        self._record(fault, node, "done", f"agent SIGKILLed, back in {fault.down_s:.1f}s")
        self._later(node, lambda: self._restart_proc(node, fault.down_s))

    async def _host_crash(self, fault: Fault) -> None:
        node = self._pick_node(fault)
        if node is None:
            self._record(fault, "-", f"skipped: {self.max_troubled} nodes have faults already")
            return
        self._down.add(node)
        self._busy.add(node)
        proc = self.cluster.procs[node]
        await asyncio.to_thread(proc.kill)
        state_dir = proc.env["TRAINYARD_AGENT_STATE_DIR"]
        # Shims first, so none of them records its worker's end: a host that loses power writes nothing.
        shims = await asyncio.to_thread(procs.shims, state_dir)
        for pid, start in shims:
            procs.kill(pid, start)
        workers = [w for w in await asyncio.to_thread(procs.workers, MARKER, self.run_id) if w.node_id == node]
        for w in workers:
            procs.kill(w.pid, w.start_time, group=w.pid == w.pgid)
        self._record(fault, node, "done", f"agent, {len(shims)} shim(s) and {len(workers)} worker process(es) "
                                          f"SIGKILLed, back in {fault.down_s:.1f}s")
        self._later(node, lambda: self._restart_proc(node, fault.down_s))

    async def _restart_proc(self, name: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        proc = self.cluster.procs[name]
        try:
            await asyncio.to_thread(_start, proc)
        finally:
            self._down.discard(name)
            self._busy.discard(name)

    async def _xid(self, fault: Fault) -> None:
        allocated = sorted(k for k in self.allocated() if self.agent_up(k[0]))
        if allocated and fault.gpu_pick < 0.6:
            node, gpu = allocated[int(fault.pick * len(allocated))]
        else:
            picked = self._pick_node_any(fault)
            if picked is None:
                self._record(fault, "-", "skipped: no agent up")
                return
            node, gpu = picked, int(fault.gpu_pick * _gpu_count(self.cluster, picked))
        port = self.cluster.procs[node].ports["grpc_port"]
        async with self.cluster.channel(f"{self.cluster.address_of(node)}:{port}", identity.node(node)) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            answer = await stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=gpu, kind="xid", xid=fault.xid),
                                            timeout=10)
        holder = self.allocated().get((node, gpu))
        self._record(fault, f"{node}/gpu{gpu}", "done",
                     f"GPU now {answer.gpu.health_action or 'none'}/{answer.gpu.health_reason or 'healthy'}"
                     + (f"; held by {holder[0]}/{holder[1]}" if holder else "")
                     + f"; repaired in {fault.down_s:.1f}s")
        self._repairs.append((node, gpu))
        self._later(f"{node}/gpu{gpu}", lambda: self._repair_later(node, gpu, fault.down_s))

    def _pick_node_any(self, fault: Fault) -> str | None:
        up = [n for n in self.nodes if self.agent_up(n)]
        return up[int(fault.pick * len(up))] if up else None

    async def _repair_later(self, node: str, gpu: int, after_s: float) -> None:
        await asyncio.sleep(after_s)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if await self.operator.repair(node, gpu):
                return
            await asyncio.sleep(1.0)

    async def _scheduler_leader_kill(self, fault: Fault) -> None:
        names = self.cluster.scheduler_names
        if any(n in self._down or n in self._busy or not _running(self.cluster, n) for n in names):
            self._record(fault, "-", "skipped: a scheduler replica is down already")
            return
        kv = await self.store.get(self.keys.leader)
        if kv is None:
            self._record(fault, "-", "skipped: no leader right now")
            return
        identity = kv.value.decode()
        if identity not in self.cluster.scheduler_addresses:
            self._record(fault, identity, "skipped: the leader is not one of ours")
            return
        name = names[self.cluster.scheduler_addresses.index(identity)]
        self._down.add(name)
        await asyncio.to_thread(self.cluster.procs[name].kill)
        self._record(fault, name, "done", f"leader epoch {kv.create_revision} SIGKILLed, back in {fault.down_s:.1f}s")
        self._later(name, lambda: self._restart_proc(name, fault.down_s))

    async def _etcd_member_kill(self, fault: Fault) -> None:
        members = self.cluster.etcd_cluster
        if any(f"etcd:{m.name}" in self._down for m in members):
            self._record(fault, "-", "skipped: an etcd member is down already")
            return
        member = members[int(fault.pick * len(members))]
        self._down.add(f"etcd:{member.name}")
        await asyncio.to_thread(member.kill)
        self._record(fault, f"etcd {member.name}", "done", f"{member.endpoint} SIGKILLed, back in {fault.down_s:.1f}s")

        async def back() -> None:
            await asyncio.sleep(fault.down_s)
            try:
                await asyncio.to_thread(etcd_testing.restart, member, members)
            finally:
                self._down.discard(f"etcd:{member.name}")
        self._later(f"etcd {member.name}", back)

    async def _checkpoint_store_restart(self, fault: Fault) -> None:
        name = "checkpoint-store"
        if name in self._down:
            self._record(fault, name, "skipped: down already")
            return
        self._down.add(name)
        proc = self.cluster.procs[name]
        await asyncio.to_thread(proc.stop if fault.graceful else proc.kill)
        self._record(fault, name, "done", f"{'SIGTERM' if fault.graceful else 'SIGKILL'}, back in {fault.down_s:.1f}s")
        self._later(name, lambda: self._restart_proc(name, fault.down_s))

    # -- healing ---------------------------------------------------------------------------------------
    async def heal(self, timeout: float = 90.0) -> list[str]:
        """Bring back everything that is down, mark every GPU that had a fault (or that the leader reports
        unhealthy) healthy, uncordon every node; returns what it did. AssertionError when the cluster is not
        whole within `timeout`."""
        done: list[str] = []
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout / 2)
        done += await asyncio.to_thread(self.net.undo)
        for m in self.cluster.etcd_cluster:
            if m.proc is None or m.proc.poll() is not None:
                await asyncio.to_thread(etcd_testing.restart, m, self.cluster.etcd_cluster)
                done.append(f"restarted etcd {m.name}")
        for name, proc in self.cluster.procs.items():
            if proc.popen is None or proc.popen.poll() is not None:
                await asyncio.to_thread(_start, proc)
                done.append(f"restarted {name}")
        self._down.clear()
        self._busy.clear()
        deadline = time.monotonic() + timeout
        to_repair = set(self._repairs)
        views: list[Any] = []
        while time.monotonic() < deadline:
            views = await self.operator.nodes()
            for v in views:
                to_repair |= {(v.node_id, g) for g in v.unhealthy}
            for node, gpu in sorted(to_repair):
                if await self.operator.set_healthy(node, gpu):
                    to_repair.discard((node, gpu))
                    done.append(f"marked {node}/gpu{gpu} healthy")
            for v in views:
                if v.cordoned and not v.unhealthy and await self.operator.uncordon(v.node_id):
                    done.append(f"uncordoned {v.node_id}")
            whole = (len(views) == len(self.nodes) and not to_repair
                     and all(v.ready and not v.cordoned and not v.unhealthy for v in views))
            if whole:
                return done
            await asyncio.sleep(0.5)
        raise AssertionError(f"the cluster was not whole again {timeout:g}s after the faults stopped: "
                             f"nodes {views}, GPUs still to repair {sorted(to_repair)}")


def _start(proc: Any) -> None:
    if proc.popen is not None and proc.popen.poll() is None:
        return
    proc.start()
    proc.wait_ready()


def _running(cluster: LocalCluster, name: str) -> bool:
    p = cluster.procs[name].popen
    return p is not None and p.poll() is None


def _gpu_count(cluster: LocalCluster, node: str) -> int:
    profile = dict(cluster.nodes)[node]
    digits = profile.rsplit("x", 1)[-1]
    return int(digits) if digits.isdigit() else 1
