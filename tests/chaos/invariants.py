"""The invariant checker of a chaos run. It reads etcd and the agents while the faults happen, and asserts
only safety properties (never "X happened within N seconds") plus, at the end, one liveness property with a
generous deadline.

(a) No GPU in two gangs. Every read of the scheduler's allocation records (`allocations/`, one etcd range,
    so one revision) must give each (node, GPU) to at most one record. Checked a few times a second.
    At the same revision: every allocation belongs to a job that is not terminal and is at the
    allocation's attempt (the scheduler writes a job's end and the release of its gang in one
    transaction).
(b) Every accepted job is eventually terminal or running: after the faults stop and the cluster is healed,
    within the settle deadline; and every job the gateway accepted is in etcd.
(c) No committed checkpoint lost. A checkpoint record (`checkpoints/<job>/<id>`) once seen COMMITTED is
    afterwards COMMITTED with the same shards, DELETED (retention, GC) or DAMAGED (the service found it so);
    never anything else, never gone. Each is read back from storage once it is seen COMMITTED (every
    shard's size and checksum, and the manifest); a failed read counts only if etcd still says COMMITTED
    after it (Delete marks the record before it removes the files). The job's `checkpoints-latest`
    pointer names a COMMITTED record of that job, in the same read. Jobs that resume verify the restored
    contents themselves (programs/train.py) and report a mismatch.
(d) No job runs two attempts at once. The live workers are every process of the run (found in /proc by
    the marker in their environment, so workers of a dead agent count too), checked against each live
    agent's ListWorkers. A job with live processes of two attempts is a violation only if each of them is
    still alive when read a second time, after all the first reads: then they were alive at one instant.
    The same double read guards a physical form of (a): live processes of two gangs on one GPU.
(f) No false death for a node that is only slow: while a node's only fault is latency below the timeout, no
    gang is stopped for its loss and the leader never shows it not ready (slow_links.py says how).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import grpc
import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_checkpoint import checksum
from trainyard_checkpoint.domain.checkpoint import MANIFEST_NAME, Checkpoint, CheckpointState
from trainyard_checkpoint.repository import decode as decode_checkpoint
from trainyard_cli.local import LocalCluster
from trainyard_core.errors import Unavailable
from trainyard_core.security import identity
from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.domain.models import Allocation, Job
from trainyard_scheduler.state.codec import decode_allocation, decode_job
from trainyard_scheduler.state.keys import Keys

from . import procs
from .slow_links import SlowLinks
from .workload import MARKER

log = logging.getLogger(__name__)

STABLE = (CheckpointState.COMMITTED, CheckpointState.DELETED, CheckpointState.DAMAGED)

@dataclass
class Violation:
    at: float
    invariant: str
    detail: str
    context: list[str] = field(default_factory=list)
    count: int = 1
    wall: str = field(default_factory=lambda: time.strftime("%H:%M:%S"))   # as in the services' text logs

    def describe(self) -> str:
        more = f" (seen {self.count} times)" if self.count > 1 else ""
        lines = [f"t+{self.at:.1f}s ({self.wall}) invariant {self.invariant}: {self.detail}{more}"]
        if self.context:
            lines.append("    faults just before:")
            lines.extend(f"      {c}" for c in self.context)
        return "\n".join(lines)


@dataclass
class Snapshot:
    """Everything under the prefix at one etcd revision, decoded."""

    revision: int
    jobs: dict[str, Job]
    allocations: dict[str, Allocation]
    checkpoints: dict[str, Checkpoint]           # checkpoint id → record
    latest: dict[str, str]                       # job id → checkpoint id


class Checker:
    def __init__(self, cluster: LocalCluster, store: EtcdStore, run_id: str, *,
                 context: Callable[[], list[str]] = list, keys: Keys | None = None) -> None:
        self.cluster = cluster
        self.store = store
        self.run_id = run_id
        self.keys = keys or Keys()
        self.context = context
        self.violations: dict[tuple[str, str], Violation] = {}
        self.stats: dict[str, int] = {}
        self.allocated: dict[tuple[str, int], tuple[str, int]] = {}
        self._t0 = time.monotonic()
        self._decoded: dict[str, tuple[int, Any]] = {}
        self._ckpt_seen: dict[str, Checkpoint] = {}   # id → last record seen, for ids ever seen COMMITTED
        self._verified: set[str] = set()
        self._to_verify: asyncio.Queue[str] = asyncio.Queue()
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        # (f): latency windows, opened and closed by netfaults.py.
        self.slow = SlowLinks(cluster, store, self.keys, self.violation, self._count)
        self.last_snapshot: Snapshot | None = None
        # The checker's own failures (not the cluster's): a check that keeps failing checks nothing.
        self.errors: list[str] = []

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + n

    def violation(self, invariant: str, key: str, detail: str) -> None:
        found = self.violations.get((invariant, key))
        if found is not None:
            found.count += 1
            return
        v = Violation(round(time.monotonic() - self._t0, 1), invariant, detail, self.context())
        self.violations[(invariant, key)] = v
        log.error("VIOLATION %s", v.describe())

    # -- loops -----------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._t0 = time.monotonic()
        tasks = [asyncio.create_task(self._every(0.25, self.check_allocations, stop)),
                 asyncio.create_task(self._every(1.0, self.check_snapshot, stop)),
                 asyncio.create_task(self._every(0.5, self.check_processes, stop)),
                 asyncio.create_task(self._every(0.5, self.slow.check_views, stop)),
                 asyncio.create_task(self._verify_loop(stop))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for ch in self._channels.values():
                with contextlib.suppress(Exception):
                    await ch.close()
            await self.slow.close_channels()

    async def _every(self, period: float, check: Callable[[], Any], stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await check()
            except Unavailable as exc:
                self._count("etcd reads failed")
                log.info("checker: etcd unavailable: %s", exc)
            except Exception as exc:
                self._count("checker errors")
                self.errors.append(f"{getattr(check, '__name__', check)}: {type(exc).__name__}: {exc}")
                log.exception("checker %s failed", getattr(check, "__name__", check))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)

    # -- (a) -------------------------------------------------------------------------------------------
    async def check_allocations(self) -> None:
        windows = self.slow.windows()
        result = await self.store.range(self.keys.allocations)
        allocs = [self._decode(kv.key, kv.mod_revision, kv.value, decode_allocation) for kv in result.kvs]
        self._count("(a) allocation reads")
        self.allocated = self._gpu_owners(allocs, result.revision)
        self.slow.check_allocations(allocs, result.revision, windows)

    def _gpu_owners(self, allocs: list[Allocation], revision: int) -> dict[tuple[str, int], tuple[str, int]]:
        owners: dict[tuple[str, int], tuple[str, int]] = {}
        for alloc in allocs:
            for a in alloc.assignments:
                for gpu in a.gpu_indices:
                    other = owners.get((a.node_id, gpu))
                    if other is not None and other[0] != alloc.job_id:
                        self.violation("(a) no GPU in two gangs", f"{a.node_id}/{gpu}",
                                       f"etcd revision {revision}: GPU {gpu} of {a.node_id} is in the allocations "
                                       f"of {other[0]} (attempt {other[1]}) and {alloc.job_id} (attempt "
                                       f"{alloc.attempt})")
                    owners[(a.node_id, gpu)] = (alloc.job_id, alloc.attempt)
        return owners

    # -- one revision of everything: (a) consistency, (c) records and pointers -------------------------
    async def snapshot(self) -> Snapshot:
        result = await self.store.range(self.keys.prefix + "/")
        k = self.keys
        jobs: dict[str, Job] = {}
        allocs: dict[str, Allocation] = {}
        ckpts: dict[str, Checkpoint] = {}
        latest: dict[str, str] = {}
        for kv in result.kvs:
            if kv.key.startswith(k.jobs):
                job = self._decode(kv.key, kv.mod_revision, kv.value, decode_job)
                jobs[job.id] = job
            elif kv.key.startswith(k.allocations):
                alloc = self._decode(kv.key, kv.mod_revision, kv.value, decode_allocation)
                allocs[alloc.job_id] = alloc
            elif kv.key.startswith(k.checkpoints):
                ckpt = self._decode(kv.key, kv.mod_revision, kv.value, decode_checkpoint)
                ckpts[ckpt.id] = ckpt
            elif kv.key.startswith(k.checkpoints_latest):
                latest[kv.key[len(k.checkpoints_latest):]] = kv.value.decode()
        live = {kv.key for kv in result.kvs}
        for stale in [key for key in self._decoded if key not in live]:
            del self._decoded[stale]
        snap = Snapshot(result.revision, jobs, allocs, ckpts, latest)
        self.last_snapshot = snap
        return snap

    async def check_snapshot(self) -> None:
        snap = await self.snapshot()
        self._count("(a)(c) snapshot reads")
        self._gpu_owners(list(snap.allocations.values()), snap.revision)
        for job_id, alloc in snap.allocations.items():
            job = snap.jobs.get(job_id)
            if job is None or job.state.terminal:
                self.violation("(a) allocations belong to active jobs", job_id,
                               f"etcd revision {snap.revision}: allocation of {job_id} attempt {alloc.attempt} "
                               f"exists but the job is {'missing' if job is None else job.state.value}")
            elif job.attempt != alloc.attempt:
                self.violation("(a) allocations belong to active jobs", job_id,
                               f"etcd revision {snap.revision}: allocation of {job_id} is for attempt "
                               f"{alloc.attempt} but the job is at attempt {job.attempt} ({job.state.value})")
        self._check_checkpoints(snap)

    def _check_checkpoints(self, snap: Snapshot) -> None:
        for ckpt_id, prev in list(self._ckpt_seen.items()):
            now = snap.checkpoints.get(ckpt_id)
            where = f"checkpoint {ckpt_id} of job {prev.job_id} (step {prev.step})"
            if now is None:
                if prev.state is CheckpointState.COMMITTED:
                    self.violation("(c) no committed checkpoint lost", ckpt_id,
                                   f"etcd revision {snap.revision}: the record of {where} is gone; it was "
                                   "last seen COMMITTED")
                del self._ckpt_seen[ckpt_id]
                continue
            if now.state not in STABLE or (prev.state is not CheckpointState.COMMITTED
                                           and now.state is CheckpointState.COMMITTED):
                self.violation("(c) no committed checkpoint lost", ckpt_id,
                               f"etcd revision {snap.revision}: {where} went {prev.state.value} → {now.state.value}")
            elif now.state is CheckpointState.COMMITTED and now.shards != prev.shards:
                self.violation("(c) no committed checkpoint lost", ckpt_id,
                               f"etcd revision {snap.revision}: {where} is COMMITTED with another shard list")
            self._ckpt_seen[ckpt_id] = now
        for ckpt_id, ckpt in snap.checkpoints.items():
            if ckpt.state is CheckpointState.COMMITTED and ckpt_id not in self._ckpt_seen:
                self._ckpt_seen[ckpt_id] = ckpt
                self._count("(c) checkpoints seen committed")
                self._to_verify.put_nowait(ckpt_id)
        for job_id, ckpt_id in snap.latest.items():
            named = snap.checkpoints.get(ckpt_id)
            if named is None or named.state is not CheckpointState.COMMITTED or named.job_id != job_id:
                self.violation("(c) latest pointer names a committed checkpoint", f"{job_id}/{ckpt_id}",
                               f"etcd revision {snap.revision}: checkpoints-latest/{job_id} names {ckpt_id}, which "
                               f"is {'missing' if named is None else named.state.value + ' of job ' + named.job_id}")

    async def _verify_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                ckpt_id = await asyncio.wait_for(self._to_verify.get(), 0.5)
            except TimeoutError:
                continue
            try:
                await self.verify_checkpoint(ckpt_id)
            except Unavailable:
                self._to_verify.put_nowait(ckpt_id)
                await asyncio.sleep(0.5)

    async def verify_checkpoint(self, ckpt_id: str) -> None:
        ckpt = self._ckpt_seen.get(ckpt_id)
        if ckpt is None or ckpt.state is not CheckpointState.COMMITTED:
            return
        problems = await asyncio.to_thread(storage_problems, ckpt)
        self._count("(c) checkpoint reads from storage")
        if not problems:
            self._verified.add(ckpt_id)
            return
        # Only a record that still says COMMITTED after the failed read is a lost checkpoint.
        kv = await self.store.get(f"{self.keys.checkpoints}{ckpt.job_id}/{ckpt_id}")
        now = decode_checkpoint(kv.value) if kv is not None else None
        if now is not None and now.state is CheckpointState.COMMITTED:
            self.violation("(c) no committed checkpoint lost", ckpt_id,
                           f"checkpoint {ckpt_id} of job {ckpt.job_id} (step {ckpt.step}) is COMMITTED in etcd "
                           f"(revision {kv.mod_revision if kv else '-'}) but its files do not verify: "
                           + "; ".join(problems[:5]))
        elif now is None:
            self.violation("(c) no committed checkpoint lost", ckpt_id,
                           f"checkpoint {ckpt_id} of job {ckpt.job_id}: files do not verify and the record is gone")

    # -- (d) -------------------------------------------------------------------------------------------
    async def check_processes(self) -> None:
        listed, answered = await self._agent_listings()
        live = await asyncio.to_thread(procs.workers, MARKER, self.run_id)
        self._count("(d) process scans")
        by_job: dict[str, dict[int, list[procs.WorkerProc]]] = {}
        by_gpu: dict[tuple[str, int], dict[tuple[str, int], list[procs.WorkerProc]]] = {}
        for w in live:
            by_job.setdefault(w.job_id, {}).setdefault(w.attempt, []).append(w)
            for g in w.gpus:
                by_gpu.setdefault((w.node_id, g), {}).setdefault(w.gang, []).append(w)
        listed_pids = {pid for pid, _ in listed.values()}
        unlisted = [w for w in live if w.pid == w.pgid and w.pid not in listed_pids and w.node_id in answered]
        if unlisted:
            self._count("(d) info: scans with a live worker its (live) agent does not list")
        suspects = {w for attempts in by_job.values() if len(attempts) > 1 for ws in attempts.values() for w in ws}
        suspects |= {w for gangs in by_gpu.values() if len(gangs) > 1 for ws in gangs.values() for w in ws}
        if not suspects:
            return
        # Second read, after every first read: a process alive at both was alive over the whole interval.
        confirmed = {w for w in suspects if procs.alive(w.pid, w.start_time)}
        jobs: dict[str, dict[int, list[procs.WorkerProc]]] = {}
        gpus: dict[tuple[str, int], dict[tuple[str, int], list[procs.WorkerProc]]] = {}
        for w in confirmed:
            jobs.setdefault(w.job_id, {}).setdefault(w.attempt, []).append(w)
            for g in w.gpus:
                gpus.setdefault((w.node_id, g), {}).setdefault(w.gang, []).append(w)

        def agents_view(ws: list[procs.WorkerProc]) -> str:
            def seen_by(w: procs.WorkerProc) -> str:
                if w.pid in listed_pids:
                    return "listed by its agent"
                if w.node_id in answered:
                    return "not listed by its agent"
                return "its agent is down" if not self._agent_alive(w.node_id) else "its agent did not answer"
            ordered = sorted(ws, key=lambda w: (w.attempt, w.rank, w.pid))
            return ", ".join(f"{w.describe()} {seen_by(w)}" for w in ordered)
        for job_id, attempts in jobs.items():
            if len(attempts) > 1:
                self.violation("(d) no job runs two attempts at once", job_id,
                               f"job {job_id} has live processes of attempts {sorted(attempts)} at once: "
                               + agents_view([w for ws in attempts.values() for w in ws]))
        for (node, gpu), gangs in gpus.items():
            if len(gangs) > 1:
                self.violation("(a) no GPU in two gangs (live processes)", f"{node}/{gpu}",
                               f"GPU {gpu} of {node} is used by live processes of {sorted(gangs)} at once: "
                               + agents_view([w for ws in gangs.values() for w in ws]))

    def _agent_alive(self, node: str) -> bool:
        p = self.cluster.procs[node].popen
        return p is not None and p.poll() is None

    async def _agent_listings(self) -> tuple[dict[tuple[str, str, int, int], tuple[int, bool]], set[str]]:
        """(node, job, attempt, rank) → (pid, running) of every worker the live agents list as running, and
        the nodes whose agent answered."""
        out: dict[tuple[str, str, int, int], tuple[int, bool]] = {}
        answered: set[str] = set()

        async def listing(node: str) -> None:
            # All at once: a frozen or cut-off agent costs one timeout, not one per agent.
            proc = self.cluster.procs[node]
            port = proc.ports.get("grpc_port")
            if not port or not self._agent_alive(node):
                return
            channel = self._channels.get((node, port))
            if channel is None:
                channel = self._channels[(node, port)] = self.cluster.channel(
                    f"{self.cluster.address_of(node)}:{port}", identity.node(node))
            try:
                resp = await agent_pb2_grpc.AgentServiceStub(channel).ListWorkers(agent_pb2.ListWorkersRequest(),
                                                                                  timeout=2.0)
            except grpc.aio.AioRpcError:
                self._count("(d) agent listings failed")
                return
            self._count("(d) agent listings")
            answered.add(node)
            for w in resp.workers:
                if w.running:
                    out[(node, w.job_id, w.attempt, w.rank)] = (w.pid, w.running)
        await asyncio.gather(*(listing(node) for node, _ in self.cluster.nodes))
        return out, answered

    # -- the end ---------------------------------------------------------------------------------------
    async def final_checkpoints(self) -> int:
        """Read every COMMITTED checkpoint back from storage once more; returns how many."""
        snap = await self.snapshot()
        self._check_checkpoints(snap)
        committed = [c for c in snap.checkpoints.values() if c.state is CheckpointState.COMMITTED]
        for c in committed:
            self._ckpt_seen[c.id] = c
            await self.verify_checkpoint(c.id)
        return len(committed)

    def _decode(self, key: str, rev: int, raw: bytes, fn: Callable[[bytes], Any]) -> Any:
        hit = self._decoded.get(key)
        if hit is not None and hit[0] == rev:
            return hit[1]
        obj = fn(raw)
        self._decoded[key] = (rev, obj)
        return obj


def storage_problems(ckpt: Checkpoint) -> list[str]:
    """What is wrong with a checkpoint's files in storage (file:// only); [] when all verify."""
    parts = urlsplit(ckpt.location)
    if parts.scheme != "file":
        return []
    root = Path(unquote(parts.path))
    problems = []
    if not (root / MANIFEST_NAME).is_file():
        problems.append(f"manifest {root / MANIFEST_NAME} missing")
    for shard in ckpt.shards:
        try:
            checksum.verify_file(root / shard.path, checksum.parse(shard.checksum), shard.size_bytes)
        except checksum.ChecksumMismatch as exc:
            problems.append(f"shard {shard.path} (rank {shard.rank}): {exc}")
        except OSError as exc:
            problems.append(f"shard {shard.path} (rank {shard.rank}): {exc}")
    return problems
