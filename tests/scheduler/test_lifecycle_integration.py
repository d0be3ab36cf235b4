"""Placement policy and job lifecycle against a real etcd, real scheduler replicas and real node agents
(simulated GPUs): preemption with a checkpoint signal and requeue, restart policy with backoff, time
limits, the two-gangs-on-too-few-nodes deadlock, and a leader SIGKILLed while jobs are being placed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core import gc_tuning
from trainyard_core.ids import new_id
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.etcd_secure import as_env
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.models import Job, JobSpec, JobState, PreemptionPolicy, Resources
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .test_scheduler_integration import sched_settings

PY = sys.executable


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str) -> AsyncIterator[SchedulerApp]:
    # No preemption exemption: the preemption test preempts a gang seconds after it started.
    app = SchedulerApp(sched_settings(etcd_settings, key_prefix.rstrip("/")).model_copy(
        update={"preempt_exempt_s": 0.0}))
    await app.start()
    await eventually(lambda: truthy(app.leadership.is_leader), what="first replica leads")
    yield app
    await app.stop()


async def start_agents(leader: SchedulerApp, tmp_path: Path, count: int) -> list[AgentApp]:
    agents = []
    for i in range(count):
        app = AgentApp(AgentSettings(node_id=f"node-{i}", gpu_profile="a100x4",
                                     scheduler_address=f"127.0.0.1:{leader.grpc_port}",
                                     state_dir=str(tmp_path / f"agent-{i}"), heartbeat_interval_s=0.2,
                                     stop_grace_s=1.0, labels={"switch": "leaf-1"}, single_tenant=True))
        await app.start()
        agents.append(app)

    async def registered() -> bool:
        return len(await Repository(leader.store, leader.keys).nodes.list()) == count
    await eventually(registered, what=f"{count} nodes registered")
    return agents


def job(command: list[str], *, nodes: int = 1, gpus: int = 4, priority: int = 0, **spec_fields: object) -> Job:
    now = time.time()
    spec = JobSpec(name="it", command=tuple(command), resources=Resources(nodes=nodes, gpus_per_node=gpus),
                   priority=priority)
    spec = replace(spec, **spec_fields)  # type: ignore[arg-type]
    return Job(id=new_id("job"), spec=spec, state=JobState.PENDING, team="team-a", user="u", created_at=now,
               updated_at=now, queued_at=now)


async def submit(repo: Repository, j: Job) -> str:
    await repo.create_job(j)
    return j.id


async def wait_for(repo: Repository, job_id: str, state: JobState, timeout: float = 30) -> Job:
    async def probe() -> Job | None:
        found = await repo.get_job(job_id)
        return found[0] if found and found[0].state is state else None
    return await eventually(probe, timeout=timeout, what=f"{job_id} {state.value}")


async def test_preemption_signals_the_victim_requeues_it_and_runs_the_preemptor(
        leader: SchedulerApp, tmp_path: Path) -> None:
    agents = await start_agents(leader, tmp_path, 1)
    repo = Repository(leader.store, leader.keys)
    marks = tmp_path / "marks"
    marks.mkdir()
    # The victim saves "a checkpoint" on SIGUSR1 and exits; its next attempt finishes at once.
    victim_code = (
        "import os, signal, sys, time\n"
        f"marks = {str(marks)!r}\n"
        "if os.environ['TRAINYARD_ATTEMPT'] != '1': sys.exit(0)\n"
        "def save(*_):\n"
        "    open(os.path.join(marks, 'ckpt-' + os.environ['RANK']), 'w').close(); sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, save)\n"
        "open(os.path.join(marks, 'up-' + os.environ['RANK']), 'w').close()\n"
        "time.sleep(600)\n")
    try:
        low = await submit(repo, job([PY, "-c", victim_code], priority=0,
                                     preemption=PreemptionPolicy(signal="SIGUSR1", grace_s=20)))
        await wait_for(repo, low, JobState.RUNNING)
        await eventually(lambda: truthy(len(list(marks.glob("up-*"))) == 4), what="victim ranks up")
        high = await submit(repo, job([PY, "-c", "pass"], priority=10))
        done = await wait_for(repo, high, JobState.SUCCEEDED)
        assert done.attempt == 1
        # Every rank of the victim got the checkpoint signal (not SIGTERM) before being stopped.
        assert sorted(p.name for p in marks.glob("ckpt-*")) == [f"ckpt-{r}" for r in range(4)]
        requeued = await wait_for(repo, low, JobState.SUCCEEDED)
        assert requeued.attempt == 2 and requeued.preempted_by == (high,)
        kinds = [e.kind for e in requeued.events]
        assert kinds.index("preempted") < kinds.index("pending") < kinds.index("succeeded")
        assert (done.started_at or 0) >= max(e.at for e in requeued.events if e.kind == "preempted")
    finally:
        for a in agents:
            await a.stop(kill_workers=True)


async def test_restart_policy_retries_with_backoff_then_fails_with_the_reason(
        leader: SchedulerApp, tmp_path: Path) -> None:
    agents = await start_agents(leader, tmp_path, 1)
    repo = Repository(leader.store, leader.keys)
    try:
        crash = await submit(repo, job([PY, "-c", "raise SystemExit(3)"], gpus=1, max_restarts=2,
                                       restart_backoff_s=0.2))
        failed = await wait_for(repo, crash, JobState.FAILED)
        assert failed.attempt == 3 and failed.restarts == 2 and failed.exit_code == 3
        assert "restart budget of 2 used up" in failed.message
        assert [e.kind for e in failed.events].count("restarting") == 2
        # The second restart waited twice as long as the first (exponential backoff).
        restarts = [e.at for e in failed.events if e.kind == "restarting"]
        requeues = [e.at for e in failed.events if e.kind == "pending"]
        assert requeues[0] - restarts[0] >= 0.2 and requeues[1] - restarts[1] >= 0.4

        flaky_code = "import os; raise SystemExit(os.environ['TRAINYARD_ATTEMPT'] == '1')"
        flaky = await submit(repo, job([PY, "-c", flaky_code], gpus=1, max_restarts=1, restart_backoff_s=0.1))
        ok = await wait_for(repo, flaky, JobState.SUCCEEDED)
        assert ok.attempt == 2 and ok.restarts == 1
    finally:
        for a in agents:
            await a.stop(kill_workers=True)


async def test_time_limit_stops_the_job(leader: SchedulerApp, tmp_path: Path) -> None:
    agents = await start_agents(leader, tmp_path, 1)
    repo = Repository(leader.store, leader.keys)
    try:
        slow = await submit(repo, job([PY, "-c", "import time; time.sleep(600)"], gpus=1, time_limit_s=1.0,
                                      max_restarts=3))
        failed = await wait_for(repo, slow, JobState.FAILED)
        assert "time limit of 1s exceeded" in failed.message and failed.restarts == 0
    finally:
        for a in agents:
            await a.stop(kill_workers=True)


async def test_two_gangs_bigger_than_half_the_fleet_both_finish(leader: SchedulerApp, tmp_path: Path) -> None:
    """The classic gang deadlock: 3 nodes, two gangs of 2 nodes each. Placed whole, one runs, then the
    other; neither ever holds part of the fleet while waiting for the rest."""
    agents = await start_agents(leader, tmp_path, 3)
    repo = Repository(leader.store, leader.keys)
    code = "import time; time.sleep(1)"
    try:
        first = await submit(repo, job([PY, "-c", code], nodes=2))
        second = await submit(repo, job([PY, "-c", code], nodes=2))
        a = await wait_for(repo, first, JobState.SUCCEEDED)
        b = await wait_for(repo, second, JobState.SUCCEEDED)
        runs = sorted([(a.started_at or 0, a.finished_at or 0), (b.started_at or 0, b.finished_at or 0)])
        assert runs[1][0] >= runs[0][1] - 0.5  # one after the other (started_at is set once all ranks run)
        assert all(len(j.placement) == 2 for j in (a, b))
    finally:
        for ag in agents:
            await ag.stop(kill_workers=True)


def _scheduler_proc(etcd: dict[str, str], prefix: str, port: int, workdir: Path,
                    name: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({**as_env(etcd, "TRAINYARD_SCHEDULER_"), "TRAINYARD_SCHEDULER_ETCD_PREFIX": prefix,
                "TRAINYARD_SCHEDULER_LISTEN_PORT": str(port), "TRAINYARD_SCHEDULER_LEADER_TTL_S": "2",
                "TRAINYARD_SCHEDULER_RECONCILE_INTERVAL_S": "0.2", "TRAINYARD_SCHEDULER_HEARTBEAT_INTERVAL_MS": "200",
                "TRAINYARD_SCHEDULER_NODE_TIMEOUT_S": "3", "TRAINYARD_SCHEDULER_STOP_GRACE_S": "1",
                "TRAINYARD_SCHEDULER_READY_FILE": str(workdir / f"{name}.ready"),
                "TRAINYARD_SCHEDULER_INSECURE_PLAINTEXT": "true"})
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen([PY, "-m", "trainyard_scheduler.main"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


async def test_leader_sigkilled_while_placing_standby_finishes_without_double_placement(
        etcd_settings: dict[str, str], etcd_options: EtcdOptions, key_prefix: str, tmp_path: Path) -> None:
    """Two scheduler processes; jobs keep arriving; the leader is SIGKILLed (no resignation: its lease has
    to expire). The standby takes over and every job runs exactly once, never two on one GPU."""
    prefix = key_prefix.rstrip("/")
    ports = [free_port(), free_port()]
    procs = [_scheduler_proc(etcd_settings, prefix, p, tmp_path, f"sched-{i}") for i, p in enumerate(ports)]
    store = EtcdStore.from_options(etcd_options)
    repo = Repository(store, Keys(prefix))
    log_dir = tmp_path / "runs"
    log_dir.mkdir()
    agent = AgentApp(AgentSettings(node_id="node-0", gpu_profile="a100x4", state_dir=str(tmp_path / "agent"),
                                   scheduler_address=",".join(f"127.0.0.1:{p}" for p in ports), stop_grace_s=1.0,
                                   reconnect_initial_s=0.05, reconnect_max_s=0.3, single_tenant=True))
    # Each worker records which GPU it held and when; overlaps would mean a GPU in two gangs.
    code = ("import os, time, json, sys\n"
            "t0 = time.time(); time.sleep(0.3)\n"
            f"open(os.path.join({str(log_dir)!r}, os.environ['TRAINYARD_JOB_ID'] + '-' + os.environ['RANK']), 'w')"
            ".write(json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], t0, time.time()]))\n")
    try:
        await eventually(lambda: truthy(all((tmp_path / f"sched-{i}.ready").exists() for i in range(2))),
                         timeout=60, what="both schedulers up")
        for i in range(2):  # the collector tuned, the start-up heap frozen, before the ready file
            lines = (tmp_path / f"sched-{i}.log").read_text().splitlines()
            [tuned] = [line for line in map(json.loads, (t for t in lines if t.startswith("{")))
                       if line["msg"] == "garbage collector tuned"]
            assert tuned["gc_thresholds"] == list(gc_tuning.THRESHOLDS) and tuned["gc_frozen_objects"] > 10_000
        await agent.start()
        await eventually(lambda: truthy(agent.reporter is not None and agent.reporter.connected), timeout=20,
                         what="agent connected to the leader")
        leader_key = await store.get(Keys(prefix).leader)
        assert leader_key is not None
        ids = [await submit(repo, job([PY, "-c", code], gpus=1)) for _ in range(6)]
        await wait_for(repo, ids[0], JobState.SUCCEEDED)
        # Kill whichever process leads (its identity is in the leader key).
        leading = next(i for i, p in enumerate(ports) if str(p) in leader_key.value.decode())
        os.killpg(procs[leading].pid, signal.SIGKILL)
        procs[leading].wait()
        ids += [await submit(repo, job([PY, "-c", code], gpus=1)) for _ in range(6)]
        done = [await wait_for(repo, i, JobState.SUCCEEDED, timeout=60) for i in ids]
        assert all(j.attempt == 1 for j in done), [(j.id, j.attempt) for j in done]
        spans: dict[str, list[tuple[float, float]]] = {}
        for f in log_dir.iterdir():
            gpu, start, end = json.loads(f.read_text())
            spans.setdefault(gpu, []).append((start, end))
        assert sum(len(v) for v in spans.values()) == len(ids)  # each job ran once
        for gpu, runs in spans.items():
            runs.sort()
            assert all(b[0] >= a[1] for a, b in itertools.pairwise(runs)), f"GPU {gpu} in two gangs"
    finally:
        await agent.stop(kill_workers=True)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        await store.close()
