"""Fleet liveness (issue 13): one scheduler leader holding a swarm of simulated agents, with jobs flowing.

One real local cluster (etcd with TLS, client certificates and auth; one scheduler; the checkpoint-store; the
gateway; no real agents), mTLS on, the scheduler at its DEFAULT liveness settings (`node_timeout_s`,
`heartbeat_interval_ms` as `SchedulerSettings` has them: nothing is tuned for the benchmark). `nodes`
simulated agents in a few swarm processes (`_swarm`, `_simagent`): each the real Reporter and ExitReporter
with its own node certificate, and its own AgentService server the scheduler launches and stops through.

A run, in order:
1. idle: the scheduler's CPU over `idle_s` before any node exists (reported beside, not subtracted); then the
   liveness floor (`_keepalive.py`): a bare server with the scheduler's transport, keepalive options and pulse
   endpoint holding `keepalive_connections` idle streams whose clients pulse, its CPU per connection-second
   over `keepalive_window_s`;
2. ramp: half the nodes register (`ramp_per_s`) and a census (ListNodes) finds every one ready, then
   `settle_s`, the leader's RSS; the same for the other half;
3. quiet: every node up and no job yet, the scheduler's CPU over `quiet_s` (the liveness cost alone);
4. steady: for `steady_s`, jobs flow through the gateway's HTTP API — a 1-GPU job every `one_gpu_every_s`
   and a 64-GPU gang (8 nodes x 8 GPUs) every `gang_every_s`, each `sleep <job_s>`, which the simulated
   agents "run" that long and then report every rank's exit 0. The time is cut in windows of `window_s`;
   between two a census reads the scheduler's view of every node (its own cost stays out of the windows).
   An etcd put seen through a watch on the same etcd is timed every `floor_every_s` (the floor);
5. stops: `stop_rounds` rounds, each crashing `stop_per_round` nodes (their swarm process is SIGKILLed, so the
   kernel closes their sockets with a FIN) and silencing as many (blackholed behind a proxy: no data, no
   FIN), then GetNode for each every 50 ms until it says NOT_READY;
6. a last census, and every job's outcome;
7. failovers: the scheduler SIGKILLed and started again `failovers` times (a new term: every agent registers
   again at once), a census every half second until every live node is ready again and the new leader's grace
   plus a node timeout have passed. In the first, `stop_per_round` more nodes (a process of their own) are
   crashed once the new leader has heard each of them: hosts that die during the new leader's grace.

Figures:
- `scheduler_cpu_us_per_node_s`: the scheduler process's CPU time (`_swarm.cpu_s`) over the steady windows,
  divided by nodes x seconds. Raw: the idle baseline (`scheduler_idle_cpu_percent`) is NOT subtracted, and
  the jobs' own cost (placing, launching, exits) is in it. `nodes_per_core` = 1e6 / that (target >= 20,000:
  10k nodes at <= 50 % of a core), `scheduler_cpu_percent` the same as % of a core. Beside it:
  `scheduler_cpu_us_per_node_s_no_jobs` (the quiet window) and `keepalive_floor_us_per_conn_s`, with their
  ratio: how much of the liveness cost is the transport and the pulses themselves.
- `false_deaths`: nodes that were never stopped but that a census saw not ready, or that a gang was stopped
  for ("node X lost contact"), over the steady window and the stops (target 0). `live_stream_breaks`: how
  many times such nodes had to register again (each one a heartbeat stream that ended; not a death unless
  the scheduler also counted the node lost).
- `detect_s_p99` (and p50, per way): stop → the first GetNode answer that says NOT_READY (resolution 50 ms;
  a node never seen not ready within `detect_timeout_s` counts as infinitely late). Target <= 3.
- `failover_false_deaths`: live nodes a census read not ready after a failover (target 0), and
  `failover_all_ready_s`, the kill to every live node ready again. `failover_crash_detect_s_max`: the nodes
  crashed in the new leader's grace, crash → NOT_READY (the grace loses a node that found the new leader and
  went silent unless many went silent with it: services/scheduler/trainyard_scheduler/grace.py), and
  `failover_crash_at_s`, when they crashed (seconds after the scheduler was killed). No target.
- `leader_rss_mb_extrapolated_10k`: the leader's RSS at N/2 and N nodes, extrapolated linearly to 10,000
  (EXTRAPOLATED, not measured, unless N is 10,000). Target <= 1,000. Each is read once the nodes that came
  up last have dropped their idle connections (AGENT_IDLE_S after they are ready), as in a fleet's steady
  state; `leader_sockets_at_n` is how many sockets the leader holds open then.
- `submit_to_admitted_p50_ms_1gpu` / `_p99_ms_1gpu`, the same `_64gpu`: as a client sees them — POST
  /v1/jobs, then GET every 5 ms until the job reads admitted (or running) — for jobs submitted in the steady
  window; `etcd_put_watch_p50_ms` beside them, and their p50s over it (targets: 1-GPU <= 3x, 64-GPU <= 10x).
  Beside them, to tell the parts apart: `submit_p50_ms` (the POST alone) and
  `created_to_admitted_event_p50_ms_*` (the job's creation to its admitted event, both the scheduler's clock).
- context: the swarm's own CPU, the whole machine's, the counts asked for.

The benchmark prints and returns figures; it asserts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import httpx

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import LocalCluster, tail
from trainyard_core.contract import JobState
from trainyard_core.rpc.liveness import AGENT_IDLE_S
from trainyard_core.rpc.pulse import PULSE_INTERVAL_S
from trainyard_core.security import identity
from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.liveness import MAX_GRACE_S
from trainyard_scheduler.settings import SchedulerSettings

from ._keepalive import floor_us_per_conn_s
from ._swarm import Swarm, SwarmSpec, cpu_s, host_cpu, issue_certs, node_ids, pct, rss_mb, sockets, tmpdir

TARGET_NODES_PER_CORE = 20_000.0
TARGET_DETECT_S = 3.0
TARGET_RSS_MB_10K = 1_000.0
TARGET_1GPU_VS_FLOOR = 3.0
TARGET_64GPU_VS_FLOOR = 10.0
EXTRAPOLATE_TO = 10_000
GANG_NODES, GANG_GPUS_PER_NODE = 8, 8
POLL_S = 0.005        # a client's GET while it waits for admission
STATE_POLL_S = 0.05   # GetNode while waiting for a stopped node to be seen
ADMITTED = frozenset({JobState.ADMITTED.value, JobState.RUNNING.value, JobState.SUCCEEDED.value})
ENDED_BADLY = frozenset({JobState.FAILED.value, JobState.CANCELLED.value})
FLOOR_KEY = "/fleet-bench/floor"  # outside the scheduler's prefix: its mirror never sees it
T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    # What this 2-core machine drives with the scheduler, etcd, the gateway and the swarm on it together: at
    # 5,000 the scheduler took ~30% of a core with the jobs flowing and the swarm ~42%. 10,000 did not come up
    # here: past ~5,500 registered in the ramp both cores were saturated, etcd calls timed out and the leader
    # lost its lease (docs/operations.md, "Fleet size").
    nodes: int = 5_000
    workers: int = 4               # swarm processes of the nodes that never stop
    steady_s: float = 300.0
    window_s: float = 30.0
    idle_s: float = 5.0
    quiet_s: float = 30.0          # all nodes up, no job yet: the liveness cost alone
    settle_s: float = 5.0
    ramp_per_s: float = 100.0
    register_timeout_s: float = 300.0  # after the last start, for every node to have registered
    stop_rounds: int = 3
    stop_per_round: int = 4        # nodes per way (crash, silent) per round
    detect_timeout_s: float = 30.0
    drain_s: float = 30.0          # after the stops, for the jobs in flight to end (restarted ones included)
    job_s: float = 3.0
    one_gpu_every_s: float = 1.0
    gang_every_s: float = 5.0
    floor_every_s: float = 1.0
    keepalive_connections: int = 500  # the bare server's, for the keepalive floor
    keepalive_window_s: float = 10.0
    failovers: int = 1             # the scheduler killed and started again (a new term): every agent at once
    failover_watch_s: float = 70.0
    logs_to: str = ""              # a directory to copy the run's logs to (BENCH_FLEET_LOGS_TO); "": not kept


TINY = Config(nodes=20, workers=1, steady_s=6.0, window_s=3.0, idle_s=1.0, quiet_s=2.0, settle_s=1.0, ramp_per_s=50.0,
              stop_rounds=1, stop_per_round=1, detect_timeout_s=30.0, job_s=1.0, one_gpu_every_s=0.5,
              gang_every_s=2.0, floor_every_s=0.25, keepalive_connections=50, keepalive_window_s=3.0,
              failover_watch_s=30.0)


@dataclass(frozen=True)
class Plan:
    """Which node goes to which swarm process: (node id, topology index) lists."""

    regular: tuple[tuple[tuple[str, int], ...], ...]  # one per worker process
    crash: tuple[tuple[tuple[str, int], ...], ...]    # one process per round
    silent: tuple[tuple[str, int], ...]               # one process, every node behind its own proxy
    silent_rounds: tuple[tuple[str, ...], ...]
    # One process crashed during the first failover, once the new leader has heard its nodes (not in `stopped`:
    # until then they are live nodes like the regular ones, their false deaths counted).
    failover_crash: tuple[tuple[str, int], ...] = ()

    @property
    def stopped(self) -> frozenset[str]:
        return frozenset(n for group in (*self.crash, self.silent) for n, _ in group)


def plan(config: Config) -> Plan:
    """Pure: the stop candidates are the last ids (their own processes), the rest dealt to the workers."""
    stops = config.stop_rounds * config.stop_per_round
    if config.workers < 1 or config.stop_rounds < 1 or config.stop_per_round < 1:
        raise ValueError("workers, stop_rounds and stop_per_round must be at least 1")
    per = config.stop_per_round
    stopped = 2 * stops + (per if config.failovers else 0)
    if config.nodes - stopped < GANG_NODES:
        raise ValueError(f"nodes={config.nodes}: need at least {GANG_NODES} nodes that never stop (for a gang) "
                         f"besides the {stopped} stopped ones")
    nodes = list(enumerate(node_ids(config.nodes)))
    keep = [(n, i) for i, n in nodes[:config.nodes - stopped]]
    failover_nodes = [(n, i) for i, n in nodes[len(keep):config.nodes - 2 * stops]]
    crash_nodes = [(n, i) for i, n in nodes[config.nodes - 2 * stops:config.nodes - stops]]
    silent_nodes = [(n, i) for i, n in nodes[config.nodes - stops:]]
    return Plan(
        regular=tuple(tuple(keep[w::config.workers]) for w in range(config.workers)),
        crash=tuple(tuple(crash_nodes[r * per:(r + 1) * per]) for r in range(config.stop_rounds)),
        silent=tuple(silent_nodes),
        silent_rounds=tuple(tuple(n for n, _ in silent_nodes[r * per:(r + 1) * per])
                            for r in range(config.stop_rounds)),
        failover_crash=tuple(failover_nodes))


def scheduler_defaults() -> dict[str, Any]:
    """The scheduler's own defaults of the liveness settings the local cluster passes explicitly."""
    fields = SchedulerSettings.model_fields
    return {"node_timeout_s": fields["node_timeout_s"].default,
            "heartbeat_interval_ms": fields["heartbeat_interval_ms"].default}


@dataclass
class Outcome:
    """What a run found (the facts the swarm test asserts on; `figures` turns them into numbers)."""

    nodes: int
    stopped: frozenset[str]
    idle_cpu_percent: float = math.nan
    keepalive_floor_us: float = math.nan
    quiet_cpu_s: float = 0.0
    quiet_wall_s: float = 0.0
    steady_cpu_s: float = 0.0
    steady_wall_s: float = 0.0
    swarm_cpu_s: float = 0.0
    host_busy_percent: float = math.nan
    rss_mb: dict[int, float] = field(default_factory=dict)          # nodes registered → leader RSS
    sockets: dict[int, int] = field(default_factory=dict)           # nodes registered → leader's open sockets
    not_ready: dict[str, str] = field(default_factory=dict)         # never-stopped node → census that saw it
    lost_contact: dict[str, str] = field(default_factory=dict)      # never-stopped node → job stopped for it
    stream_breaks: dict[str, int] = field(default_factory=dict)     # never-stopped node → extra registrations
    detect_s: dict[str, float] = field(default_factory=dict)        # stopped node → stop to NOT_READY
    way: dict[str, str] = field(default_factory=dict)               # stopped node → "crash" | "silent"
    admitted_ms: dict[str, list[float]] = field(default_factory=lambda: {"1gpu": [], "64gpu": []})
    # The same jobs as the scheduler recorded them: the job's creation to its admitted event (both the
    # scheduler's clock), so the client-seen figure can be told apart into the scheduler's part and the rest.
    admitted_server_ms: dict[str, list[float]] = field(default_factory=lambda: {"1gpu": [], "64gpu": []})
    submit_ms: list[float] = field(default_factory=list)  # the POST alone, both kinds
    floor_ms: list[float] = field(default_factory=list)
    job_states: Counter[str] = field(default_factory=Counter)      # "<kind>:<state>" at the end
    job_errors: list[str] = field(default_factory=list)
    scheduler_unavailable: int = 0  # node-view reads answered UNAVAILABLE: moments without a leader
    failover_not_ready: dict[str, str] = field(default_factory=dict)  # live node → failover that lost it
    failover_all_ready_s: list[float] = field(default_factory=list)   # kill → every live node ready again
    # The nodes crashed in the first failover once the new leader had heard them: crash → NOT_READY, and when
    # the crash came (seconds after the scheduler was killed).
    failover_detect_s: dict[str, float] = field(default_factory=dict)
    failover_crash_at_s: float = math.nan

    @property
    def false_deaths(self) -> set[str]:
        return set(self.not_ready) | set(self.lost_contact)

    @property
    def undetected(self) -> set[str]:
        return {n for n, s in self.detect_s.items() if not math.isfinite(s)}


_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class SchedulerView:
    """The scheduler's node view, as an operator's tool reads it (NodeService over mTLS). A read the scheduler
    answers UNAVAILABLE (no leader at that moment: its term ended) is counted in `unavailable` and retried,
    for `patience_s` at most: a leader change is a result of the run, not the end of it. So is a read that
    passed its deadline (DEADLINE_EXCEEDED: a leader too busy to answer in time, during a failover's storm)."""

    def __init__(self, cluster: LocalCluster, patience_s: float = 60.0) -> None:
        self._channel = cluster.channel(cluster.scheduler_addresses[0], identity.SCHEDULER)
        self._stub = scheduler_pb2_grpc.NodeServiceStub(self._channel)
        self._patience_s = patience_s
        self.unavailable = 0

    async def _ask(self, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self._patience_s
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRIED or time.monotonic() > deadline:
                    raise
                self.unavailable += 1
            await asyncio.sleep(0.5)

    async def census(self) -> dict[str, int]:
        answer = await self._ask(lambda: self._stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=120))
        return {n.node_id: n.state for n in answer.nodes}

    async def heard(self, node_id: str) -> bool:
        """Whether the leader of now has heard from the node in its term: a registration or a beat (its
        last_heartbeat is set)."""
        answer = await self._ask(lambda: self._stub.GetNode(scheduler_pb2.GetNodeRequest(node_id=node_id), timeout=10))
        return bool(answer.node.HasField("last_heartbeat"))

    async def seen_not_ready(self, node_id: str, since: float, timeout: float) -> float:
        """Seconds from `since` (monotonic) to the first answer that says NOT_READY; inf after `timeout`."""
        while time.monotonic() - since < timeout:
            answer = await self._ask(lambda: self._stub.GetNode(scheduler_pb2.GetNodeRequest(node_id=node_id),
                                                                timeout=10))
            if answer.node.state == types_pb2.NODE_STATE_NOT_READY:
                return time.monotonic() - since
            await asyncio.sleep(STATE_POLL_S)
        return math.inf

    async def close(self) -> None:
        await self._channel.close()


class EtcdFloor:
    """One put seen through a watch on the same etcd: what a watch-driven scheduler cannot go below."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self._waiting: dict[bytes, asyncio.Future[float]] = {}
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # The watch starts at a put already made, so seeing that one means it is established.
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting[b"0"] = fut
        revision = await self._store.put(FLOOR_KEY, b"0")
        self._task = asyncio.create_task(self._watch(revision))
        await asyncio.wait_for(fut, 30)

    async def _watch(self, revision: int) -> None:
        async for batch in self._store.watch(FLOOR_KEY, start_revision=revision):
            seen = time.perf_counter()
            for ev in batch:
                fut = self._waiting.pop(ev.value, None)
                if fut is not None and not fut.done():
                    fut.set_result(seen)

    async def sample(self) -> float:
        self._seq += 1
        value = str(self._seq).encode()
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting[value] = fut
        began = time.perf_counter()
        await self._store.put(FLOOR_KEY, value)
        return (await asyncio.wait_for(fut, 10) - began) * 1e3

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class JobFlow:
    """1-GPU jobs and 64-GPU gangs submitted over the gateway at a steady pace; each submission's admission
    is timed as its client sees it while `recording`."""

    KINDS = {"1gpu": {"nodes": 1, "gpus_per_node": 1},
             "64gpu": {"nodes": GANG_NODES, "gpus_per_node": GANG_GPUS_PER_NODE}}

    def __init__(self, http: httpx.AsyncClient, config: Config, outcome: Outcome) -> None:
        self._http = http
        self._config = config
        self._out = outcome
        self.recording = False
        self.jobs: dict[str, str] = {}  # job id → kind
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        every = {"1gpu": self._config.one_gpu_every_s, "64gpu": self._config.gang_every_s}
        await asyncio.gather(*(self._pace(kind, every[kind], stop) for kind in self.KINDS))

    async def _pace(self, kind: str, every_s: float, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        next_at, n = loop.time(), 0
        while not stop.is_set():
            task = asyncio.create_task(self._one(kind, n))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            n += 1
            next_at += every_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - loop.time()))

    async def _one(self, kind: str, n: int) -> None:
        try:
            await self._submit_and_wait(kind, n)
        except httpx.HTTPError as exc:  # the gateway unreachable or too slow: a result, counted
            self._out.job_errors.append(f"{kind} #{n}: {type(exc).__name__}: {exc}")

    async def _submit_and_wait(self, kind: str, n: int) -> None:
        spec = {"name": f"fleet-{kind}-{n}", "command": ["sleep", f"{self._config.job_s:g}"],
                "resources": self.KINDS[kind]}
        record = self.recording
        began = time.perf_counter()
        r = await self._http.post("/v1/jobs", json=spec)
        if record:
            self._out.submit_ms.append((time.perf_counter() - began) * 1e3)
        if not r.is_success:
            self._out.job_errors.append(f"submit {kind}: HTTP {r.status_code}: {r.text[:200]}")
            return
        job_id = r.json()["id"]
        self.jobs[job_id] = kind
        while True:
            got = await self._http.get(f"/v1/jobs/{job_id}")
            if got.is_success:
                body = got.json()
                state = body["state"]
                if state in ADMITTED:
                    break
                if state in ENDED_BADLY:
                    self._out.job_errors.append(f"{job_id} ({kind}) ended {state} before it was admitted")
                    return
            elif got.status_code != 429:  # a rate-limited poll is retried like any other
                self._out.job_errors.append(f"get {job_id}: HTTP {got.status_code}")
                return
            await asyncio.sleep(POLL_S)
        if record:
            self._out.admitted_ms[kind].append((time.perf_counter() - began) * 1e3)
            admitted = [e["at"] for e in body.get("events", []) if e.get("kind") == "admitted"]
            if admitted and body.get("created_at"):
                server = datetime.fromisoformat(admitted[0]) - datetime.fromisoformat(body["created_at"])
                self._out.admitted_server_ms[kind].append(server.total_seconds() * 1e3)

    async def drain(self, timeout: float) -> None:
        """Wait for the submissions in flight, then for every job to end (at most `timeout` in all)."""
        deadline = time.monotonic() + timeout
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        pending = set(self.jobs)
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                got = await self._http.get(f"/v1/jobs/{job_id}")
                if got.is_success and got.json()["state"] in (s.value for s in JobState if s.terminal):
                    pending.discard(job_id)
            if pending:
                await asyncio.sleep(0.5)

    async def outcomes(self, stopped: frozenset[str]) -> None:
        """Each job's final state, and every gang stopped for a node that was never stopped."""
        for job_id, kind in self.jobs.items():
            got = await self._http.get(f"/v1/jobs/{job_id}")
            if not got.is_success:
                self._out.job_errors.append(f"get {job_id}: HTTP {got.status_code}")
                continue
            job = got.json()
            self._out.job_states[f"{kind}:{job['state']}"] += 1
            for event in job.get("events", []):
                node = _lost_node(event.get("message", ""))
                if node and node not in stopped:
                    self._out.lost_contact.setdefault(node, job_id)


def _lost_node(message: str) -> str:
    """The node of a "node X lost contact" reason (progress.py's words), '' for any other message."""
    words = message.split()
    for i in range(len(words) - 2):
        if words[i] == "node" and words[i + 2] == "lost" and i + 3 < len(words) and words[i + 3] == "contact":
            return words[i + 1]
    return ""


class Fleet:
    """One run against a started cluster (see the module docstring for the phases)."""

    def __init__(self, config: Config, cluster: LocalCluster) -> None:
        self.config = config
        self.cluster = cluster
        self.plan = plan(config)
        self.out = Outcome(nodes=config.nodes, stopped=self.plan.stopped)
        proc = cluster.procs["scheduler"].popen
        assert proc is not None
        self.pid = proc.pid
        self.swarms: list[Swarm] = []
        self.crash_swarms: list[Swarm] = []
        self.failover_swarm: Swarm | None = None
        self.view: SchedulerView | None = None
        self._began = time.monotonic()

    def _say(self, what: str) -> None:
        """A progress line: a full run takes minutes."""
        print(f"fleet +{time.monotonic() - self._began:5.0f}s  {what}", flush=True)

    def _spec(self, name: str, nodes: Sequence[tuple[str, int]], behind_proxy: frozenset[str] = frozenset()
              ) -> SwarmSpec:
        return SwarmSpec(name=name, scheduler_address=self.cluster.scheduler_address,
                         pki_dir=str(self.cluster.pki_dir), nodes=tuple(nodes), behind_proxy=behind_proxy,
                         log_path=str(self.cluster.workdir / "logs" / f"swarm-{name}.log"))

    async def run(self) -> Outcome:
        c = self.config
        issue_certs(self.cluster.pki_dir, node_ids(max(c.nodes, c.keepalive_connections)))
        self.view = SchedulerView(self.cluster)
        before = cpu_s(self.pid)
        await asyncio.sleep(c.idle_s)
        self.out.idle_cpu_percent = (cpu_s(self.pid) - before) / c.idle_s * 100
        self.out.keepalive_floor_us = await floor_us_per_conn_s(self.cluster.pki_dir, node_ids(c.keepalive_connections),
                                                                c.keepalive_window_s, self.cluster.workdir / "logs")
        self._say(f"idle scheduler and keepalive floor measured; starting {c.nodes:,} nodes")
        silent = self._spec("silent", self.plan.silent, frozenset(n for n, _ in self.plan.silent))
        self.crash_swarms = [Swarm(self._spec(f"crash-{r}", nodes)) for r, nodes in enumerate(self.plan.crash)]
        self.swarms = [Swarm(self._spec(f"w{w}", nodes)) for w, nodes in enumerate(self.plan.regular)]
        self.swarms.append(Swarm(silent))
        if self.plan.failover_crash:
            self.failover_swarm = Swarm(self._spec("failover-crash", self.plan.failover_crash))
        try:
            await self._ramp()
            await self._steady_and_stops()
        finally:
            self.out.scheduler_unavailable = self.view.unavailable
            await self.view.close()
            await asyncio.gather(*(s.close() for s in [*self.swarms, *self._stop_swarms()]), return_exceptions=True)
        return self.out

    def _stop_swarms(self) -> list[Swarm]:
        """The processes whose nodes are stopped on purpose (each comes up whole in the ramp's first half)."""
        return [*self.crash_swarms, *([self.failover_swarm] if self.failover_swarm is not None else [])]

    async def _ramp(self) -> None:
        c = self.config
        halves: list[list[tuple[Swarm, list[str]]]] = [[], []]
        for s in [*self._stop_swarms(), *self.swarms]:
            ids = [n for n, _ in s.spec.nodes]
            cut = len(ids) // 2 if s in self.swarms[:-1] else len(ids)  # stop candidates come up first
            halves[0].append((s, ids[:cut]))
            halves[1].append((s, ids[cut:]))
        expected = 0
        for half in halves:
            count = sum(len(ids) for _, ids in half)
            expected += count
            # Each process at its share of the pace, so the whole fleet registers at ramp_per_s.
            answers = await asyncio.gather(*(
                s.call("start", ids, max(1.0, c.ramp_per_s * len(ids) / count), c.register_timeout_s,
                       timeout=c.register_timeout_s + 2 * count / c.ramp_per_s + 30)
                for s, ids in half if ids))
            missing = [m for a in answers for m in a["missing"]]
            if missing:
                raise RuntimeError(f"{count - sum(a['registered'] for a in answers)} node(s) had not registered "
                                   f"{c.register_timeout_s:g}s after the ramp, e.g. {missing[:5]}; the end of "
                                   f"{self.swarms[0].spec.log_path}:\n{tail(Path(self.swarms[0].spec.log_path))}")
            await self._all_ready(expected, timeout=60)
            self._say(f"{expected:,} nodes registered and ready")
            # Measured once the agents that came up last have dropped their idle connections (AGENT_IDLE_S):
            # the fleet's steady state, not the ramp's handshakes.
            await asyncio.sleep(c.settle_s + (AGENT_IDLE_S if expected >= 100 else 0.0))
            self.out.rss_mb[expected] = rss_mb(self.pid)
            self.out.sockets[expected] = sockets(self.pid)

    async def _all_ready(self, count: int, timeout: float) -> None:
        assert self.view is not None
        deadline = time.monotonic() + timeout
        while True:
            states = await self.view.census()
            ready = sum(1 for s in states.values() if s == types_pb2.NODE_STATE_READY)
            if ready >= count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {ready} of {count} registered nodes ready after {timeout:g}s")
            await asyncio.sleep(1.0)

    async def _census(self, label: str) -> None:
        assert self.view is not None
        states = await self.view.census()
        for node_id in node_ids(self.config.nodes):
            if node_id not in self.out.stopped and states.get(node_id) != types_pb2.NODE_STATE_READY:
                self.out.not_ready.setdefault(node_id, label)

    async def _steady_and_stops(self) -> None:
        c = self.config
        async with httpx.AsyncClient(base_url=self.cluster.url, timeout=60,
                                     headers={"Authorization": f"Bearer {self.cluster.token}"}) as http:
            store = EtcdStore.from_options(self.cluster.etcd_options())
            floor = EtcdFloor(store)
            flow = JobFlow(http, c, self.out)
            stop_jobs, stop_floor = asyncio.Event(), asyncio.Event()
            try:
                await floor.start()
                cpu0, t0 = cpu_s(self.pid), time.monotonic()
                await asyncio.sleep(c.quiet_s)
                self.out.quiet_cpu_s, self.out.quiet_wall_s = cpu_s(self.pid) - cpu0, time.monotonic() - t0
                await self._census("the window without jobs")
                self._say("quiet window measured; jobs start")
                jobs = asyncio.create_task(flow.run(stop_jobs))
                floors = asyncio.create_task(self._floor(floor, stop_floor))
                flow.recording = True
                await self._windows()
                flow.recording = False
                stop_floor.set()
                await floors
                self._say("steady window measured; stopping nodes")
                await self._stops()
                self._say("every stopped node seen not ready (or given up on); waiting for the jobs to end")
                stop_jobs.set()
                await jobs
                await flow.drain(timeout=c.drain_s)
                await self._census("after the stops")
                await flow.outcomes(self.out.stopped)
                await self._stream_breaks()
                self._say("outcomes read")
                await self._failovers()
            finally:
                stop_jobs.set()
                stop_floor.set()
                await floor.close()
                await store.close()

    async def _floor(self, floor: EtcdFloor, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.out.floor_ms.append(await floor.sample())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.floor_every_s)

    async def _windows(self) -> None:
        c = self.config
        swarm_pids = [s.pid for s in self.swarms]
        windows = max(1, round(c.steady_s / c.window_s))
        host_busy = host_total = 0.0
        for w in range(windows):
            cpu0, swarm0, host0, t0 = cpu_s(self.pid), sum(map(cpu_s, swarm_pids)), host_cpu(), time.monotonic()
            await asyncio.sleep(c.steady_s / windows)
            t1, cpu1, swarm1, host1 = time.monotonic(), cpu_s(self.pid), sum(map(cpu_s, swarm_pids)), host_cpu()
            self.out.steady_cpu_s += cpu1 - cpu0
            self.out.steady_wall_s += t1 - t0
            self.out.swarm_cpu_s += swarm1 - swarm0
            host_busy, host_total = host_busy + host1[0] - host0[0], host_total + host1[1] - host0[1]
            self.out.host_busy_percent = host_busy / host_total * 100 if host_total else math.nan
            await self._census(f"steady window {w + 1}/{windows}")

    async def _stops(self) -> None:
        assert self.view is not None
        silent = self.swarms[-1]
        timeout = self.config.detect_timeout_s
        for r in range(self.config.stop_rounds):
            crash = self.crash_swarms[r]
            crashed_at = crash.kill()
            waits = {n: self.view.seen_not_ready(n, crashed_at, timeout) for n, _ in crash.spec.nodes}
            self.out.way.update({n: "crash" for n in waits})
            silenced_at: dict[str, float] = await silent.call("silence", list(self.plan.silent_rounds[r]), timeout=30)
            waits.update({n: self.view.seen_not_ready(n, at, timeout) for n, at in silenced_at.items()})
            self.out.way.update({n: "silent" for n in silenced_at})
            seen = await asyncio.gather(*waits.values())
            self.out.detect_s.update(dict(zip(waits, seen, strict=True)))

    async def _failovers(self) -> None:
        """The scheduler SIGKILLed and started again, `failovers` times: a new term that no agent's stream
        survives, so every agent registers again at once (what a failover to a standby does to the fleet). A
        census every half second for `failover_watch_s`, and at least as long as the new leader's grace may
        last plus a node timeout (the grace lasts while agents keep arriving or many are silent together, up to
        MAX_GRACE_S: the nodes it keeps, and loses at its end, must be watched until then): the time from the
        kill until every live node reads ready again, and every live node read not ready on the way (one the new
        leader did not hear from within its grace, or lost at its end: a false death)."""
        assert self.view is not None
        c = self.config
        defaults = SchedulerSettings.model_fields
        settle = min(c.failover_watch_s, MAX_GRACE_S + float(defaults["node_timeout_s"].default) + 2.0)
        crashing = frozenset(n for n, _ in self.plan.failover_crash)
        live = [n for n in node_ids(c.nodes) if n not in self.out.stopped and n not in crashing]
        for r in range(c.failovers):
            began = time.monotonic()
            await asyncio.to_thread(self.cluster.restart, "scheduler", kill=True)
            proc = self.cluster.procs["scheduler"].popen
            assert proc is not None
            self.pid = proc.pid
            crash = asyncio.create_task(self._crash_in_grace(began)) if r == 0 and crashing else None
            all_ready = math.inf
            while time.monotonic() - began < c.failover_watch_s:
                states = await self.view.census()
                down = [n for n in live if states.get(n) != types_pb2.NODE_STATE_READY]
                for n in down:
                    self.out.failover_not_ready.setdefault(n, f"failover {r + 1}")
                if not down and all_ready == math.inf:
                    all_ready = time.monotonic() - began
                if all_ready < math.inf and time.monotonic() - began > settle and (crash is None or crash.done()):
                    break
                await asyncio.sleep(0.5)
            if crash is not None:
                await crash
            self.out.failover_all_ready_s.append(all_ready)
            self._say(f"failover {r + 1}: every live node ready again {all_ready:.1f}s after the kill, "
                      f"{len(self.out.failover_not_ready)} live node(s) seen not ready")

    async def _crash_in_grace(self, began: float) -> None:
        """The failover-crash process SIGKILLed once the new leader has heard each of its nodes (registered
        with it; the beat that opens a pulse session follows), then each node's crash → NOT_READY: during the
        new leader's grace, where a node that found the leader and went silent is lost unless many went silent
        with it (grace.py)."""
        assert self.view is not None and self.failover_swarm is not None
        view, timeout = self.view, self.config.failover_watch_s
        nodes = [n for n, _ in self.failover_swarm.spec.nodes]
        for _ in range(math.ceil(timeout / STATE_POLL_S)):
            if all(await asyncio.gather(*map(view.heard, nodes))) or time.monotonic() - began > timeout:
                break
            await asyncio.sleep(STATE_POLL_S)
        # Heard means registered; the agent's first beat, which opens its pulse session, follows at once.
        await asyncio.sleep(2 * PULSE_INTERVAL_S)
        crashed_at = self.failover_swarm.kill()
        self.out.failover_crash_at_s = crashed_at - began
        seen = await asyncio.gather(*(view.seen_not_ready(n, crashed_at, timeout) for n in nodes))
        self.out.failover_detect_s.update(dict(zip(nodes, seen, strict=True)))
        self._say(f"failover: {len(nodes)} node(s) crashed {crashed_at - began:.1f}s after the kill, once the new "
                  f"leader had heard them; lost {max(seen):.1f}s after the crash at the latest")

    async def _stream_breaks(self) -> None:
        for s in self.swarms:
            stats = await s.call("stats", timeout=60)
            for node_id, registrations in stats["registrations"].items():
                if node_id not in self.out.stopped and registrations > 1:
                    self.out.stream_breaks[node_id] = registrations - 1


def run_fleet(config: Config) -> Outcome:
    with tmpdir("bench-fleet-") as tmp:
        cluster = LocalCluster(Path(tmp), gateway_port=0, nodes=[], **scheduler_defaults())
        try:
            cluster.start()
            return asyncio.run(Fleet(config, cluster).run())
        finally:
            cluster.stop()
            if config.logs_to:  # the services' and the swarm's logs outlive the run's directory
                shutil.copytree(cluster.workdir / "logs", config.logs_to, dirs_exist_ok=True)


def _p(values: Sequence[float], q: float) -> float:
    return pct(values, q) if values else math.nan


def figures(config: Config, out: Outcome) -> dict[str, float]:
    n = config.nodes
    us = out.steady_cpu_s / (n * out.steady_wall_s) * 1e6 if out.steady_wall_s else math.nan
    half, full = sorted(out.rss_mb)
    slope = (out.rss_mb[full] - out.rss_mb[half]) / (full - half)
    rss_10k = out.rss_mb[full] + slope * (EXTRAPOLATE_TO - full)
    detect = list(out.detect_s.values())
    by_way = {w: [s for node, s in out.detect_s.items() if out.way[node] == w] for w in ("crash", "silent")}
    floor = statistics.median(out.floor_ms) if out.floor_ms else math.nan
    one, gang = out.admitted_ms["1gpu"], out.admitted_ms["64gpu"]
    f = {
        "nodes": float(n),
        "steady_s": out.steady_wall_s,
        "scheduler_cpu_us_per_node_s": us,
        "nodes_per_core": 1e6 / us,
        "nodes_per_core_vs_target": (1e6 / us) / TARGET_NODES_PER_CORE,
        "scheduler_cpu_percent": out.steady_cpu_s / out.steady_wall_s * 100,
        "scheduler_cpu_us_per_node_s_no_jobs": out.quiet_cpu_s / (n * out.quiet_wall_s) * 1e6,
        "keepalive_floor_us_per_conn_s": out.keepalive_floor_us,
        "scheduler_no_jobs_vs_keepalive_floor": (out.quiet_cpu_s / (n * out.quiet_wall_s) * 1e6 / out.keepalive_floor_us
                                                 if out.keepalive_floor_us > 0 else math.nan),
        "scheduler_idle_cpu_percent": out.idle_cpu_percent,
        "swarm_cpu_percent": out.swarm_cpu_s / out.steady_wall_s * 100,
        "host_busy_percent": out.host_busy_percent,
        "false_deaths": float(len(out.false_deaths)),
        "live_stream_breaks": float(sum(out.stream_breaks.values())),
        "detect_s_p99": _p(detect, 0.99),
        "detect_s_p50": _p(detect, 0.5),
        "detect_s_p99_crash": _p(by_way["crash"], 0.99),
        "detect_s_p99_silent": _p(by_way["silent"], 0.99),
        "detect_vs_target": _p(detect, 0.99) / TARGET_DETECT_S,
        "stops": float(len(detect)),
        "stops_undetected": float(len(out.undetected)),
        "leader_rss_mb_at_half_n": out.rss_mb[half],
        "leader_rss_mb_at_n": out.rss_mb[full],
        "leader_sockets_at_n": float(out.sockets[full]),
        "leader_rss_mb_extrapolated_10k": rss_10k,
        "leader_rss_extrapolated_10k_vs_target": rss_10k / TARGET_RSS_MB_10K,
        "submit_to_admitted_p50_ms_1gpu": _p(one, 0.5),
        "submit_to_admitted_p99_ms_1gpu": _p(one, 0.99),
        "submit_to_admitted_p50_ms_64gpu": _p(gang, 0.5),
        "submit_to_admitted_p99_ms_64gpu": _p(gang, 0.99),
        "etcd_put_watch_p50_ms": floor,
        "submit_to_admitted_1gpu_vs_floor": _p(one, 0.5) / floor,
        "submit_to_admitted_64gpu_vs_floor": _p(gang, 0.5) / floor,
        "submit_p50_ms": _p(out.submit_ms, 0.5),
        "submit_p99_ms": _p(out.submit_ms, 0.99),
        "created_to_admitted_event_p50_ms_1gpu": _p(out.admitted_server_ms["1gpu"], 0.5),
        "created_to_admitted_event_p50_ms_64gpu": _p(out.admitted_server_ms["64gpu"], 0.5),
        "jobs_1gpu_sampled": float(len(one)),
        "jobs_64gpu_sampled": float(len(gang)),
        "jobs_succeeded": float(sum(v for k, v in out.job_states.items() if k.endswith(":succeeded"))),
        "job_errors": float(len(out.job_errors)),
        "scheduler_unavailable_reads": float(out.scheduler_unavailable),
        "failover_false_deaths": float(len(out.failover_not_ready)),
        "failover_all_ready_s": max(out.failover_all_ready_s, default=math.nan),
        "failover_crash_at_s": out.failover_crash_at_s,
        "failover_crash_detect_s_max": max(out.failover_detect_s.values(), default=math.nan),
    }
    return f


def _report(config: Config, out: Outcome, f: dict[str, float]) -> None:
    defaults = scheduler_defaults()
    print(f"\nfleet: {config.nodes:,} simulated nodes on one leader, scheduler defaults "
          f"node_timeout_s={defaults['node_timeout_s']:g}, heartbeat_interval_ms={defaults['heartbeat_interval_ms']}")
    rows = [
        ("nodes_per_core", f">= {TARGET_NODES_PER_CORE:,.0f}", f["nodes_per_core"] >= TARGET_NODES_PER_CORE,
         f"1e6 / {f['scheduler_cpu_us_per_node_s']:.3g} us of scheduler CPU per node-second (raw: the idle "
         f"{f['scheduler_idle_cpu_percent']:.2g}% of a core is not subtracted)"),
        ("false_deaths", "0", f["false_deaths"] == 0, f"over {f['steady_s']:.0f}s steady and the stops"),
        ("failover_false_deaths", "0", f["failover_false_deaths"] == 0,
         f"live nodes seen not ready after the scheduler was killed and restarted ({config.failovers}x); all ready "
         f"again after {f['failover_all_ready_s']:.3g}s"),
        ("detect_s_p99", f"<= {TARGET_DETECT_S:g}", f["detect_s_p99"] <= TARGET_DETECT_S,
         f"{int(f['stops'])} stops (crash p99 {f['detect_s_p99_crash']:.3g}s, silent {f['detect_s_p99_silent']:.3g}s)"),
        ("leader_rss_mb_extrapolated_10k", f"<= {TARGET_RSS_MB_10K:,.0f}",
         f["leader_rss_mb_extrapolated_10k"] <= TARGET_RSS_MB_10K,
         f"EXTRAPOLATED from {f['leader_rss_mb_at_half_n']:.0f} MB at N/2 and {f['leader_rss_mb_at_n']:.0f} MB at N"),
        ("submit_to_admitted_1gpu_vs_floor", f"<= {TARGET_1GPU_VS_FLOOR:g}",
         f["submit_to_admitted_1gpu_vs_floor"] <= TARGET_1GPU_VS_FLOOR,
         f"p50 {f['submit_to_admitted_p50_ms_1gpu']:.3g} ms over etcd put->watch {f['etcd_put_watch_p50_ms']:.3g} ms"),
        ("submit_to_admitted_64gpu_vs_floor", f"<= {TARGET_64GPU_VS_FLOOR:g}",
         f["submit_to_admitted_64gpu_vs_floor"] <= TARGET_64GPU_VS_FLOOR,
         f"p50 {f['submit_to_admitted_p50_ms_64gpu']:.3g} ms"),
    ]
    for key, goal, ok, what in rows:
        print(f"  {key:<34} {f[key]:>12.4g}  {goal:>10}  {'ok' if ok else 'MISS':4}  {what}")
    print(f"  without jobs: {f['scheduler_cpu_us_per_node_s_no_jobs']:.3g} us per node-second, "
          f"{f['scheduler_no_jobs_vs_keepalive_floor']:.3g}x what a bare server with the same keepalive spends per "
          f"idle connection-second ({f['keepalive_floor_us_per_conn_s']:.3g} us, same run); over the steady "
          f"window the swarm used {f['swarm_cpu_percent']:.0f}% of a core and the whole machine was "
          f"{f['host_busy_percent']:.0f}% busy")
    if out.failover_detect_s:
        print(f"  in the failover's grace: {len(out.failover_detect_s)} node(s) crashed "
              f"{f['failover_crash_at_s']:.1f}s after the scheduler was killed, once the new leader had heard "
              f"them, were lost {f['failover_crash_detect_s_max']:.2f}s after the crash at the latest")
    for label, found in (("not ready in a census", out.not_ready), ("gang stopped for", out.lost_contact)):
        if found:
            print(f"  false deaths, {label}: {dict(list(found.items())[:5])}")
    if out.scheduler_unavailable:
        print(f"  the scheduler answered UNAVAILABLE (no leader) or not in time to {out.scheduler_unavailable} "
              "node-view reads: its term ended, or it was busy, during the run")
    for error in out.job_errors[:5]:
        print(f"  job error: {error}")


def run(config: Config = Config()) -> dict[str, float]:
    out = run_fleet(config)
    f = figures(config, out)
    _report(config, out, f)
    return f
