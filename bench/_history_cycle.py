"""bench/history's leader part: two real scheduler leaders, twins but for their history, and one of them's etcd.

Each leader (`_history_leader`, a `SchedulerApp` in a process of its own, mTLS, its own etcd run as production
runs it: TLS, client certificates, auth on, auto-compaction) gets the same fleet and the same active load:
`nodes` 8-GPU nodes (trainyard_scheduler.sim's mixed fleet) written to etcd, filled with running gangs of 1, 1,
2 and 4 nodes submitted through JobService and started by the leader (its agents accept every launch), and
`pending` one-node jobs waiting behind them. Leader "none" archives to an empty PostgreSQL database; leader
"history" to the database the caller has already filled, and then `push` jobs go through its real path:
SubmitJob, CancelJob while pending (terminal at once), its archiver writes them to the history store and marks
them, and `job_ttl_s` (1 s) after they ended it deletes them from etcd. See bench/history.py for the figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._swarm import rss_mb
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing import etcd_secure
from trainyard_core.testing.etcd_secure import SecureEtcd
from trainyard_scheduler.history import HistoryStore
from trainyard_scheduler.sim import make_fleet
from trainyard_scheduler.state.codec import encode_node
from trainyard_scheduler.state.keys import Keys

PREFIX = "/trainyard"
GANG_NODES = (1, 1, 2, 4)  # the running load's gang sizes, repeated until the fleet is full
GPUS = 8
MB = 1024 * 1024


@dataclass(frozen=True)
class LeaderLoad:
    nodes: int
    pending: int
    push: int          # jobs submitted, cancelled, archived and expired through the "history" leader
    concurrency: int   # submit-and-cancel calls in flight
    max_live: int      # pushed jobs in etcd at most (submitted, not yet expired)
    rounds: int        # measurement windows, before and after the push
    window_s: float
    interval_s: float  # reconcile_interval_s: the loop cycles at least this often
    teams: tuple[str, ...]


class Leader:
    """The parent's handle on one leader process (see _history_leader's docstring for the protocol)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, port: int) -> None:
        self.name, self.proc, self.port = name, proc, port
        self._one_at_a_time = asyncio.Lock()

    @classmethod
    async def start(cls, name: str, settings: dict[str, Any], workdir: Path) -> Leader:
        path = workdir / f"leader-{name}.json"
        path.write_text(json.dumps(settings))
        with (workdir / f"leader-{name}.log").open("wb") as log:  # the child keeps its own copy of the fd
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench._history_leader", str(path),
                                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                                        limit=64 * MB)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"leader {name} exited with {await proc.wait()}; see {workdir}/leader-{name}.log:\n"
                               + (workdir / f"leader-{name}.log").read_text()[-3000:])
        return cls(name, proc, int(json.loads(line)["port"]))

    async def ask(self, op: str, **args: object) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self._one_at_a_time:
            self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            await self.proc.stdin.drain()
            line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"leader {self.name} exited with {await self.proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(b'{"op": "stop"}\n')
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 30)
            except (TimeoutError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()


def etcd_status(etcd: SecureEtcd) -> dict[str, float]:
    """The member's maintenance Status (etcdctl endpoint status -w json): revision, dbSize, dbSizeInUse."""
    status = json.loads(_etcdctl(etcd, "endpoint", "status", "-w", "json"))[0]["Status"]
    return {"revision": float(status["header"]["revision"]), "db_mb": status["dbSize"] / MB,
            "in_use_mb": status.get("dbSizeInUse", status["dbSize"]) / MB}


def compact_and_defrag(etcd: SecureEtcd) -> tuple[dict[str, float], dict[str, float]]:
    """What docs/operations.md ("etcd space") has an operator do: compact to the current revision, then
    defragment. Returns the Status after the compaction and after the defragmentation."""
    rev = int(etcd_status(etcd)["revision"])
    try:
        _etcdctl(etcd, "compaction", "--physical", str(rev))
    except RuntimeError as exc:
        # Auto-compaction got there first: on a member whose revision stood still for its window, the periodic
        # compactor compacts up to the current revision itself, and a compaction to it is refused.
        if "required revision has been compacted" not in str(exc):
            raise
    compacted = etcd_status(etcd)
    _etcdctl(etcd, "defrag")
    return compacted, etcd_status(etcd)


def _etcdctl(etcd: SecureEtcd, *args: str) -> str:
    member = etcd.member
    # A physical compaction after 200,000 deletes, or a defragmentation, outlasts etcdctl's default 5 s.
    done = subprocess.run(["etcdctl", f"--endpoints={member.client_url}", "--command-timeout=300s",
                           *member.etcdctl_tls(), *args], capture_output=True, text=True, timeout=330)
    if done.returncode != 0:
        raise RuntimeError(f"etcdctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout


async def _prefix_size(store: EtcdStore, prefix: str) -> tuple[int, int]:
    """(keys, bytes of keys and values) under `prefix`, read in pages."""
    keys = size = 0
    after: str | None = None
    while True:
        page = await store.range(prefix, start_after=after, limit=5000)
        keys += len(page.kvs)
        size += sum(len(kv.key) + len(kv.value) for kv in page.kvs)
        if not page.more or not page.kvs:
            return keys, size
        after = page.kvs[-1].key


def _spec(name: str, nodes: int, rng: random.Random) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name=name, command=["python", "-m", "train", "--config", "configs/run.yaml"],
                             resources=types_pb2.Resources(nodes=nodes, gpus_per_node=GPUS),
                             labels={"project": f"p{rng.randrange(200)}"})


async def _until(what: str, check: Any, timeout: float, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g}s")
        await asyncio.sleep(interval)


class _Clients:
    """JobService over mTLS as the gateway, to each leader."""

    def __init__(self, pki_dir: Path, leaders: dict[str, Leader]) -> None:
        tls = ClientTls(pki.files_for(pki_dir, identity.GATEWAY))
        self.channels = {n: secure_channel(f"127.0.0.1:{ld.port}", tls, identity.SCHEDULER)
                         for n, ld in leaders.items()}
        self.jobs = {n: scheduler_pb2_grpc.JobServiceStub(ch) for n, ch in self.channels.items()}

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


async def _active_load(load: LeaderLoad, clients: _Clients, leaders: dict[str, Leader]) -> int:
    """The same running gangs and pending jobs on every leader; returns how many gangs run on each."""
    rng = random.Random(11)
    gangs: list[int] = []
    used = 0
    while used + GANG_NODES[len(gangs) % len(GANG_NODES)] <= load.nodes:
        gangs.append(GANG_NODES[len(gangs) % len(GANG_NODES)])
        used += gangs[-1]

    async def submit(name: str, team: str, nodes: int) -> None:
        await asyncio.gather(*(jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
            spec=_spec(name, nodes, rng), team=team, user="bench")) for jobs in clients.jobs.values()))

    for i, nodes in enumerate(gangs):
        await submit(f"run-{i}", load.teams[i % len(load.teams)], nodes)

    async def running() -> bool:
        states = [(await ld.ask("status"))["jobs"] for ld in leaders.values()]
        return all(s["running"] == len(gangs) for s in states)
    await _until("every leader to run its gangs", running, 120)
    for i in range(load.pending):
        await submit(f"wait-{i}", load.teams[i % len(load.teams)], 1)

    async def pending() -> bool:
        states = [(await ld.ask("status"))["jobs"] for ld in leaders.values()]
        return all(s["pending"] == load.pending and s["running"] == len(gangs) for s in states)
    await _until("every leader to hold the pending jobs", pending, 120)
    return len(gangs)


@dataclass
class _Windows:
    """`rounds` windows in which both leaders' cycles were timed at once (the machine's noise hits them alike)."""

    cycles: dict[str, list[list[float]]]  # leader → per window, its cycles' durations (ms)
    rss_mb: dict[str, float]              # leader → RSS after the last window

    def all(self, name: str) -> list[float]:
        return [c for window in self.cycles[name] for c in window]

    def ratio(self, over: str, under: str) -> float:
        """The median over the windows of the window's median cycle of `over` / that of `under`: a burst of
        noise lands in one window of both."""
        return statistics.median(_median(a) / _median(b) for a, b in zip(self.cycles[over], self.cycles[under],
                                                                          strict=True) if a and b)


async def _windows(load: LeaderLoad, leaders: dict[str, Leader]) -> _Windows:
    cycles: dict[str, list[list[float]]] = {n: [] for n in leaders}
    for _ in range(load.rounds):
        answers = await asyncio.gather(*(ld.ask("cycles", s=load.window_s) for ld in leaders.values()))
        for name, answer in zip(leaders, answers, strict=True):
            cycles[name].append([s * 1e3 for s in answer["cycles"]])
    return _Windows(cycles, {n: ld.rss_mb() for n, ld in leaders.items()})


async def _push(load: LeaderLoad, jobs: scheduler_pb2_grpc.JobServiceStub,
                leader: Leader) -> tuple[float, float, float]:
    """`push` jobs submitted and cancelled while pending, `concurrency` calls at a time, and never more than
    `max_live` of them still in etcd (submitted, not yet expired): jobs end at a pace the archiver keeps up
    with, as in a cluster whose jobs end at well under its archiving rate, so no backlog of finished jobs
    piles up in etcd and in the leader's memory for the duration of the push (a burst would: its peak then
    sets the leader's heap, which the allocator does not give back). Waits until the leader has archived every
    one and deleted it from etcd. Returns (seconds from the first submit until the last job left etcd, the
    leader's largest RSS sampled meanwhile, its RSS when the first tenth of the jobs had left etcd)."""
    base = (await leader.ask("status"))["expired"]
    began = time.perf_counter()
    queue = iter(range(load.push))
    submitted = 0
    expired = 0.0
    peak_rss = leader.rss_mb()
    tenth_rss = math.nan
    room = asyncio.Event()
    room.set()
    done = asyncio.Event()

    async def follow() -> None:
        nonlocal expired, peak_rss, tenth_rss
        while not done.is_set():
            status = await leader.ask("status")
            expired = status["expired"] - base
            rss = leader.rss_mb()
            peak_rss = max(peak_rss, rss)
            if math.isnan(tenth_rss) and expired >= load.push / 10:
                tenth_rss = rss
            if submitted - expired < load.max_live:
                room.set()
            if expired >= load.push and status["backlog"] == 0:
                done.set()
            await asyncio.sleep(0.25)

    async def worker(w: int) -> None:
        nonlocal submitted
        rng = random.Random(w)
        for i in queue:
            while submitted - expired >= load.max_live:
                room.clear()
                await room.wait()
            submitted += 1
            team = load.teams[rng.randrange(len(load.teams))]
            user = f"u{rng.randrange(500)}"
            job = (await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
                spec=_spec(f"{rng.choice(['llama', 'bert', 'sweep'])}-{i % 997}", 1, rng), team=team,
                user=user))).job
            await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, team=team, user=user))

    follower = asyncio.create_task(follow())
    try:
        await asyncio.gather(*(worker(w) for w in range(load.concurrency)))
        submit_s = time.perf_counter() - began
        await asyncio.wait_for(done.wait(), timeout=max(120.0, submit_s))
    finally:
        done.set()
        await follower
    return time.perf_counter() - began, peak_rss, tenth_rss


def _leader_settings(etcd: SecureEtcd, pki_dir: Path, history_url: str, load: LeaderLoad) -> dict[str, Any]:
    return {**etcd_secure.settings_of(etcd.options()), "etcd_prefix": PREFIX, "listen_port": 0,
            "leader_ttl_s": 10, "reconcile_interval_s": load.interval_s, "history_url": history_url,
            "job_ttl_s": 1.0, "leader_grace_s": 86400.0, "worker_fence_s": 0, "preemption": False,
            **pki.files_for(pki_dir, identity.SCHEDULER).settings()}


async def _register_fleet(etcd: SecureEtcd, nodes: int) -> None:
    store = EtcdStore.from_options(etcd.options())
    try:
        keys = Keys(PREFIX)
        for node in make_fleet(nodes, GPUS, registered_at=time.time()):
            await store.put(keys.node(node.node_id), encode_node(node))
    finally:
        await store.close()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


async def compare(load: LeaderLoad, workdir: Path, history_urls: dict[str, str]) -> dict[str, float]:
    """The leaders' figures (see bench/history.py). `history_urls`: "none" (an empty database) and "history"
    (the filled one)."""
    pki_dir = workdir / "pki"
    pki.ensure(pki_dir, [identity.SCHEDULER, identity.GATEWAY])
    etcds = {name: await asyncio.to_thread(etcd_secure.start_secure, workdir / f"etcd-{name}", f"{PREFIX}/",
                                           {etcd_secure.SERVICE_USER: None}) for name in history_urls}
    leaders: dict[str, Leader] = {}
    clients: _Clients | None = None
    try:
        for etcd in etcds.values():
            await _register_fleet(etcd, load.nodes)
        for name, url in history_urls.items():
            leaders[name] = await Leader.start(name, _leader_settings(etcds[name], pki_dir, url, load), workdir)
        clients = _Clients(pki_dir, leaders)
        gangs = await _active_load(load, clients, leaders)
        before = await _windows(load, leaders)
        status_before = etcd_status(etcds["history"])

        pushed_s, peak_rss, tenth_rss = await _push(load, clients.jobs["history"], leaders["history"])
        undefragmented = etcd_status(etcds["history"])
        compacted, defragmented = await asyncio.to_thread(compact_and_defrag, etcds["history"])
        store = EtcdStore.from_options(etcds["history"].options())
        try:
            keys = Keys(PREFIX)
            audit_keys, audit_bytes = await _prefix_size(store, f"{PREFIX}/audit/")
            job_keys, _ = await _prefix_size(store, keys.jobs)
        finally:
            await store.close()
        history = await HistoryStore.open(history_urls["history"], migrate=False)
        try:
            audit_moved = await history.audit.count()  # the entries the leader moved out of etcd
        finally:
            await history.close()

        after = await _windows(load, leaders)
        status = {n: await ld.ask("status") for n, ld in leaders.items()}

        # The leader moves the audit log into the history store (audit_archive.py); what is left of it in etcd is
        # the mover's backlog at the push's end. The same member with that deleted too, compacted and defragmented
        # again: what etcd holds for everything but the audit log.
        _etcdctl(etcds["history"], "del", "--prefix", f"{PREFIX}/audit/")
        _, without_audit = await asyncio.to_thread(compact_and_defrag, etcds["history"])
    finally:
        if clients is not None:
            await clients.close()
        for ld in leaders.values():
            await ld.stop()
        for etcd in etcds.values():
            etcd_secure.stop_secure(etcd)

    none_ms, hist_ms = _median(after.all("none")), _median(after.all("history"))
    rss_before, rss_after = before.rss_mb, after.rss_mb
    return {
        "fleet_nodes": float(load.nodes), "running_gangs": float(gangs), "pending_jobs": float(load.pending),
        "pushed_jobs": float(load.push),
        "cycle_ms_none": none_ms, "cycle_ms_history": hist_ms,
        "cycle_ms_vs_history": after.ratio("history", "none"),
        "cycle_ms_p90_vs_history": _p90(after.all("history")) / _p90(after.all("none")),
        "cycles_sampled": float(min(len(after.all("none")), len(after.all("history")))),
        # The same two leaders before the push: twins, so this ratio is the method's own noise.
        "cycle_ms_twins_before_push": before.ratio("history", "none"),
        "leader_rss_mb_none": rss_after["none"], "leader_rss_mb_history": rss_after["history"],
        "leader_rss_mb_vs_history": rss_after["history"] / rss_after["none"],
        "leader_rss_twins_before_push": rss_before["history"] / rss_before["none"],
        "mirror_keys_none": float(status["none"]["mirror_keys"]),
        "mirror_keys_history": float(status["history"]["mirror_keys"]),
        "leader_rss_mb_peak_during_push": peak_rss,
        # What the last nine tenths of the push added: whether the leader's memory grows with the jobs it has
        # finished, or only warmed up (the first archives load code, fill caches and connection pools).
        "leader_rss_mb_per_100k_jobs_after_first_tenth": (rss_after["history"] - tenth_rss) / (0.9 * load.push) * 1e5,
        "leader_archive_per_s": load.push / pushed_s,
        "etcd_db_mb_before_push": status_before["db_mb"],
        "etcd_db_mb_after_100k_jobs_undefragmented": undefragmented["db_mb"],
        "etcd_db_in_use_mb_after_100k_jobs_undefragmented": undefragmented["in_use_mb"],
        "etcd_db_in_use_mb_after_100k_jobs_compacted": compacted["in_use_mb"],
        "etcd_db_mb_after_100k_jobs": defragmented["db_mb"],
        "etcd_db_in_use_mb_after_100k_jobs": defragmented["in_use_mb"],
        "etcd_db_vs_target": defragmented["db_mb"] / 64.0,
        "etcd_job_keys_after_push": float(job_keys),
        "etcd_audit_entries_after_push": float(audit_keys),
        "etcd_audit_mb_after_push": audit_bytes / MB,
        "history_audit_entries_after_push": float(audit_moved),
        "etcd_db_mb_after_100k_jobs_without_audit": without_audit["db_mb"],
    }


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else _median(values)
