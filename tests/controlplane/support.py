"""What the control-plane fault tests share: deadline polling, a gateway client that rides out a restart,
the agents' worker listings, etcd through `etcdctl`, the workers' start records, and an observer thread
that samples allocations and workers for the whole of a fault.

Every wait here is a poll with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from tests.e2e.conftest import TERMINAL, Api
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import LocalCluster
from trainyard_core.security import identity
from trainyard_core.testing.etcd import EtcdProcess
from trainyard_core.testing.wait import until
from trainyard_scheduler.state.keys import Keys

PROGRAMS = Path(__file__).parent / "programs"
KEYS = Keys()
# Gateway answers that mean "the control plane behind me is moving", not "your request is wrong".
TRANSIENT_HTTP = {502, 503, 504}


# --- the gateway ---------------------------------------------------------------------------------------

class Gateway(Api):
    """The e2e `Api` plus calls that tolerate the moment a fault makes the gateway (or the scheduler behind
    it) unreachable: they report "no answer" instead of failing, and submits retry under one
    Idempotency-Key so a retried submit can never create a second job."""

    def try_job(self, job_id: str) -> dict[str, Any] | None:
        try:
            r = self.http.get(f"/v1/jobs/{job_id}")
        except httpx.TransportError:
            return None
        if r.status_code in TRANSIENT_HTTP:
            return None
        assert r.status_code == 200, r.text
        job: dict[str, Any] = r.json()
        return job

    def submit_retrying(self, spec: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        key = uuid.uuid4().hex
        last = ""

        def attempt() -> dict[str, Any] | None:
            nonlocal last
            try:
                r = self.http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": key})
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                return None
            if r.status_code in TRANSIENT_HTTP:
                last = f"{r.status_code} {r.text}"
                return None
            assert r.status_code in (200, 201), r.text
            job: dict[str, Any] = r.json()
            return job

        return until(attempt, timeout, lambda: f"submit of {spec['name']} accepted; last answer {last}",
                     interval=0.1)

    def wait_state(self, job_id: str, states: set[str], timeout: float = 60.0) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            job = self.try_job(job_id)
            if job is None:
                return None
            seen.update(job)
            if job["state"] in states:
                return job
            if job["state"] in TERMINAL:
                raise AssertionError(f"job {job_id} ended {job['state']}, wanted {states}: {job['message']}")
            return None

        return until(reached, timeout, lambda: f"job {job_id} in {states}; last seen "
                     f"{seen.get('state')} ({seen.get('message')})", interval=0.1)

    def wait_answering(self, timeout: float = 20.0) -> None:
        """Until the gateway answers an authenticated call again (after a restart)."""

        def answers() -> bool:
            try:
                r = self.http.get("/v1/jobs", params={"page_size": 1})
            except httpx.TransportError:
                return False
            assert r.status_code in (200, *TRANSIENT_HTTP), r.text
            return r.status_code == 200

        until(answers, timeout, "the gateway to answer again", interval=0.1)

    def cancel_unfinished(self) -> None:
        """Cancel every job not yet terminal (cleanup between tests); waits until they are."""
        r = self.http.get("/v1/jobs", params={"page_size": 500, "state": ["pending", "admitted", "running",
                                                                          "restarting"]})
        assert r.status_code == 200, r.text
        ids = [j["id"] for j in r.json()["jobs"]]
        for job_id in ids:
            self.http.post(f"/v1/jobs/{job_id}:cancel")
        for job_id in ids:
            until(lambda job_id=job_id: (self.try_job(job_id) or {}).get("state") in TERMINAL,  # type: ignore[misc]
                  30, f"job {job_id} cancelled")


def hold_spec(name: str, records: Path, *, hold: bool = True, gpus: int = 1) -> dict[str, Any]:
    """A one-node job whose workers record their start and (with `hold`) run until `release(records, id)`."""
    command = [sys.executable, str(PROGRAMS / "hold.py"), str(records)] + ([] if hold else ["--no-hold"])
    return {"name": name, "command": command, "resources": {"nodes": 1, "gpus_per_node": gpus}}


def release(records: Path, job_id: str) -> None:
    (records / f"release.{job_id}").touch()


@dataclass(frozen=True, order=True)
class Start:
    job_id: str
    attempt: int
    rank: int
    pid: int


def starts(records: Path, job_id: str | None = None) -> list[Start]:
    """Every worker start recorded by programs/hold.py, optionally of one job."""
    out = []
    for p in records.glob("start.*"):
        _, job, attempt, rank, pid = p.name.split(".")
        if job_id is None or job == job_id:
            out.append(Start(job, int(attempt), int(rank), int(pid)))
    return sorted(out)


def assert_ran_once(records: Path, job: dict[str, Any]) -> list[Start]:
    """The job ran exactly one attempt: attempt 1, one start per rank, no restart in its events."""
    got = starts(records, job["id"])
    world = job["spec"]["resources"]["nodes"] * max(1, job["spec"]["resources"]["gpus_per_node"])
    assert [(s.attempt, s.rank) for s in got] == [(1, r) for r in range(world)], \
        f"job {job['id']} ({job['name']}) should have started each rank once in attempt 1: {got}"
    assert job["attempt"] == 1, f"job {job['id']} is at attempt {job['attempt']}: {job['events']}"
    kinds = [e["kind"] for e in job["events"]]
    assert not {"restarting", "preempted", "preempting"} & set(kinds), f"job {job['id']} events: {kinds}"
    return got


# --- node agents -----------------------------------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Worker:
    node_id: str
    job_id: str
    attempt: int
    rank: int
    pid: int
    running: bool


class Agents:
    """ListWorkers of every node agent of the cluster, over gRPC."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._channels = {node: cluster.sync_channel(f"127.0.0.1:{cluster.procs[node].ports['grpc_port']}",
                                                     identity.node(node))
                          for node, _ in cluster.nodes}
        self._stubs = {n: agent_pb2_grpc.AgentServiceStub(c) for n, c in self._channels.items()}

    def workers(self, job_id: str | None = None) -> list[Worker]:
        out = []
        for node, stub in self._stubs.items():
            for w in stub.ListWorkers(agent_pb2.ListWorkersRequest(), timeout=5).workers:
                if job_id is None or w.job_id == job_id:
                    out.append(Worker(node, w.job_id, w.attempt, w.rank, w.pid, w.running))
        return sorted(out)

    def running(self, job_id: str) -> list[Worker]:
        return [w for w in self.workers(job_id) if w.running]

    def close(self) -> None:
        for c in self._channels.values():
            c.close()


# --- etcd ---------------------------------------------------------------------------------------------------

class Etcd:
    """The cluster's etcd members through `etcdctl` (API v3), reading only from members that run."""

    def __init__(self, members: list[EtcdProcess]) -> None:
        self.members = members

    def up(self) -> list[EtcdProcess]:
        return [m for m in self.members if m.proc is not None and m.proc.poll() is None]

    def ctl(self, *args: str, endpoints: Iterable[EtcdProcess] | None = None, timeout: float = 5.0) -> str:
        members = list(endpoints if endpoints is not None else self.up())
        eps = ",".join(m.client_url for m in members)
        tls = members[0].etcdctl_tls() if members else []  # as root: the local cluster's etcd has TLS and auth on
        r = subprocess.run(["etcdctl", f"--endpoints={eps}", *tls, "--dial-timeout=1s", "--command-timeout=2s", *args],
                           env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise EtcdctlError(f"etcdctl {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def statuses(self, members: Iterable[EtcdProcess] | None = None) -> dict[str, dict[str, Any]]:
        """endpoint → its status (member id, leader id, raft index) for every member that answers."""
        out = {}
        for m in members if members is not None else self.up():
            try:
                s = json.loads(self.ctl("endpoint", "status", "-w", "json", endpoints=[m]))[0]["Status"]
            except (EtcdctlError, subprocess.TimeoutExpired):
                continue
            out[m.endpoint] = s
        return out

    def leader(self) -> EtcdProcess | None:
        """The member every running member agrees leads, None while they do not agree (an election)."""
        st = self.statuses()
        leaders = {s["leader"] for s in st.values()}
        if len(st) < len(self.up()) or len(leaders) != 1 or 0 in leaders:
            return None
        lead = leaders.pop()
        return next((m for m in self.up() if st[m.endpoint]["header"]["member_id"] == lead), None)

    def raft_term(self) -> int:
        """The highest raft term the running members report: it grows with every etcd election."""
        return max((int(s["raftTerm"]) for s in self.statuses().values()), default=0)

    def move_leader(self, to: EtcdProcess) -> None:
        """Make `to` the raft leader (a deterministic starting point for the leader-loss test)."""
        lead = until(self.leader, 10, "an etcd leader")
        if lead is to:
            return
        target = self.statuses([to])[to.endpoint]["header"]["member_id"]
        self.ctl("move-leader", format(target, "x"), endpoints=[lead])
        until(lambda: self.leader() is to, 10, f"etcd leadership moved to {to.name}")

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]:
        """(key, value, create revision) of every key under `prefix`, from the quorum."""
        out = json.loads(self.ctl("get", "--prefix", prefix, "-w", "json"))
        return [(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
                 int(kv["create_revision"])) for kv in out.get("kvs", [])]

    def get_local(self, member: EtcdProcess, key: str) -> bytes | None:
        """`key` as `member` alone has it (a serializable read: no quorum, the member's own copy); None also
        while the member does not answer yet."""
        try:
            out = json.loads(self.ctl("get", key, "--consistency=s", "-w", "json", endpoints=[member]))
        except (EtcdctlError, subprocess.TimeoutExpired):
            return None
        kvs = out.get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def put(self, key: str, value: str) -> None:
        self.ctl("put", key, value)

    def scheduler_leader(self) -> tuple[str, int] | None:
        """(identity, epoch) of the scheduler leader: the leader key's value and create revision."""
        try:
            kvs = self.get_prefix(KEYS.leader)
        except (EtcdctlError, subprocess.TimeoutExpired):
            return None
        for key, value, create in kvs:
            if key == KEYS.leader:
                return value.decode(), create
        return None


class EtcdctlError(RuntimeError):
    pass


# --- the scheduler --------------------------------------------------------------------------------------

def new_scheduler_leader(etcd: Etcd, old_identity: str) -> tuple[str, int] | None:
    """(identity, epoch) of the scheduler leader once it is another replica than `old_identity`."""
    got = etcd.scheduler_leader()
    return got if got is not None and got[0] != old_identity else None


def leader_nodes(etcd: Etcd, cluster: LocalCluster) -> list[types_pb2.Node]:
    """The nodes as the scheduler leader (found through its key in etcd) lists them, asked directly: only the
    leader hears heartbeats, so this is the authoritative view ([] while there is no leader or it does not
    answer)."""
    leader = etcd.scheduler_leader()
    if leader is None:
        return []
    with cluster.sync_channel(leader[0], identity.SCHEDULER) as channel:
        try:
            reply = scheduler_pb2_grpc.NodeServiceStub(channel).ListNodes(scheduler_pb2.ListNodesRequest(),
                                                                           timeout=5)
        except grpc.RpcError:
            return []
    return list(reply.nodes)


def leader_ready_nodes(etcd: Etcd, cluster: LocalCluster, *, heard: bool = False) -> set[str]:
    """The nodes the scheduler leader holds ready ({} while there is no leader). With `heard`, only those it
    has also had a heartbeat from: a leader just elected holds the nodes ready it found ready (the failover
    grace) before their agents have found it."""
    return {n.node_id for n in leader_nodes(etcd, cluster)
            if n.state == types_pb2.NODE_STATE_READY and (not heard or n.HasField("last_heartbeat"))}


def leader_heartbeats(etcd: Etcd, cluster: LocalCluster) -> dict[str, float]:
    """Each node's last proof of life as the scheduler leader tells it (`last_heartbeat`, seconds), for the
    nodes it has one of ({} while there is no leader)."""
    return {n.node_id: n.last_heartbeat.ToMicroseconds() / 1e6 for n in leader_nodes(etcd, cluster)
            if n.HasField("last_heartbeat")}


# --- watching a fault ------------------------------------------------------------------------------------

@dataclass
class Observations:
    """What the observer saw, sample by sample."""

    samples: int = 0
    # job → the distinct (attempt, assignments) its allocation record had.
    placements: dict[str, set[tuple[int, tuple[tuple[str, tuple[int, ...]], ...]]]] = field(default_factory=dict)
    # job → create revision of its allocation record when first seen, and when it was first seen.
    allocated: dict[str, tuple[int, float]] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)
    workers: set[Worker] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class Observer:
    """A thread sampling, about every 0.1 s until stopped, the allocation records in etcd (GPU overlaps
    between gangs, every placement each job had) and the agents' worker listings. Agents or etcd being
    unreachable for a sample is a fault's normal effect, not a finding: that sample is skipped."""

    def __init__(self, etcd: Etcd, agents: Agents) -> None:
        self.etcd = etcd
        self.agents = agents
        self.seen = Observations()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)

    def __enter__(self) -> Observer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from trainyard_scheduler.state.codec import decode_allocation

        while not self._stop.is_set():
            now = time.monotonic()
            try:
                kvs = self.etcd.get_prefix(KEYS.allocations)
            except (EtcdctlError, subprocess.TimeoutExpired) as e:
                self.seen.errors.append(str(e))
                kvs = None
            if kvs is not None:
                owner: dict[tuple[str, int], str] = {}
                for _, value, create in kvs:
                    a = decode_allocation(value)
                    shape = tuple((x.node_id, tuple(x.gpu_indices)) for x in a.assignments)
                    self.seen.placements.setdefault(a.job_id, set()).add((a.attempt, shape))
                    self.seen.allocated.setdefault(a.job_id, (create, now))
                    for node, gpus in shape:
                        for g in gpus:
                            other = owner.setdefault((node, g), a.job_id)
                            if other != a.job_id:
                                self.seen.overlaps.append(f"{node} GPU {g}: {other} and {a.job_id}")
            try:
                self.seen.workers.update(self.agents.workers())
            except grpc.RpcError as e:
                self.seen.errors.append(f"ListWorkers: {e.code().name}")
            self.seen.samples += 1
            self._stop.wait(0.1)
