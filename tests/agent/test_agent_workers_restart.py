"""Workers across agent lives: a restarted agent adopts or stops the workers of its previous life, per its
restart policy, and nothing is left behind. Supervisor-level tests end a life with `close()` (what a killed
agent leaves is the same: shims, workers, record files); the last tests kill a real `trainyard-agent`
process with SIGKILL and start another on the same state directory, against the real scheduler."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import pytest

from tests.agent.agent_kit import PY, RecordingSink, Scheduler, launch, read_pids, seconds, until
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.model import Health, RunningAllocation, Vendor
from trainyard_agent.workers import logs, process, records, shim, spawn
from trainyard_agent.workers.model import EXIT_UNKNOWN, LogQuery
from trainyard_agent.workers.supervisor import Supervisor
from trainyard_core.errors import FailedPrecondition, NotFound

# A worker that prints "step <n>" and then waits for the file <dir>/go-<n>, for each of <steps> steps, then
# prints "done" and exits with <code>. It gives up after two minutes, so a failed test leaves nothing
# running for long; the tests' own deadlines are much shorter.
STEPPER = textwrap.dedent("""
    import pathlib, sys, time
    folder, steps, code = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for n in range(steps):
        print(f"step {n}", flush=True)
        deadline = time.monotonic() + 120
        while not (folder / f"go-{n}").exists():
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.01)
    print("done", flush=True)
    sys.exit(code)
""")


@pytest.fixture
def stepper(tmp_path: Path) -> Path:
    path = tmp_path / "stepper.py"
    path.write_text(STEPPER)
    return path


def life(state_dir: Path, sink: RecordingSink, policy: str, grace: float = 1.0) -> Supervisor:
    """One agent life's supervisor on `state_dir`."""
    healthy = [(Health.HEALTHY, "")] * 4
    return Supervisor(state_dir=state_dir, node_id="node-a", vendor=Vendor.NVIDIA, gpu_health=lambda: healthy,
                      base_env=dict(os.environ), site_env={}, stop_grace_s=grace, log_max_bytes=1 << 20,
                      log_backups=2, exits=sink, restart_policy=policy)


def texts(state_dir: Path, job_id: str, rank: int) -> list[str]:
    """The rank's log lines, read from the files (no agent needed)."""
    try:
        lines = logs.read_logs(state_dir / "jobs", LogQuery(job_id), max_bytes=1 << 20)
    except NotFound:  # before the first launch wrote anything
        return []
    return [ln.text for ln in lines if ln.rank == rank]


def worker_records(state_dir: Path) -> list[records.WorkerRecord]:
    found = [records.load(p) for p in records.find_all(state_dir / "jobs")]
    return [w for rec in found if rec is not None for w in rec.workers]


def leftovers(state_dir: Path) -> list[str]:
    """Processes of recorded workers (their groups) and shims that are still alive."""
    groups = process.live_groups()
    left = []
    for w in worker_records(state_dir):
        if w.pgid in groups:
            left.append(f"process group {w.pgid} of rank {w.rank}")
        if process.is_running(w.shim_pid, w.shim_start_time):
            left.append(f"shim {w.shim_pid} of rank {w.rank}")
    return left


def kill_leftovers(state_dir: Path) -> None:
    """Cleanup after a failed test: nothing it started may outlive it."""
    for w in worker_records(state_dir):
        process.signal_group(w.pgid, signal.SIGKILL)
        process.kill_process(w.shim_pid, w.shim_start_time, signal.SIGKILL)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    yield path
    kill_leftovers(path)


# --- adopt ----------------------------------------------------------------------------------------------


async def test_adopted_workers_run_on_log_and_report_their_real_exit(state: Path, tmp_path: Path,
                                                                    stepper: Path) -> None:
    first = life(state, RecordingSink(), "adopt")
    await first.launch(launch("job-adopt", [PY, str(stepper), str(tmp_path), "2", "3"], ranks=2))
    await until(lambda: texts(state, "job-adopt", 0) == texts(state, "job-adopt", 1) == ["step 0"], "step 0")
    pids = [w.pid for w in first.list_workers()]
    await first.close()  # the agent goes away; the workers keep running under their shims

    (tmp_path / "go-0").touch()
    await until(lambda: texts(state, "job-adopt", 0) == texts(state, "job-adopt", 1) == ["step 0", "step 1"],
                "the workers to log while no agent runs")

    sink = RecordingSink()
    second = life(state, sink, "adopt")
    try:
        assert await second.recover() == []
        assert [(s.rank, s.pid, s.running) for s in second.list_workers()] == [(0, pids[0], True), (1, pids[1], True)]
        assert second.running_allocations() == [RunningAllocation("job-adopt", 1, (0, 1))]

        (tmp_path / "go-1").touch()
        await until(lambda: len(sink.exits) == 2, "the adopted workers' exits")
        assert sorted((e.rank, e.exit_code, e.signal) for e in sink.exits) == [(0, 3, 0), (1, 3, 0)]
        assert second.running_allocations() == []
        assert [(w.exit_code, w.signal) for w in worker_records(state)] == [(3, 0), (3, 0)]
        lines = await second.read_logs(LogQuery("job-adopt"))
        assert [(ln.rank, ln.text) for ln in lines] == [(r, t) for r in (0, 1) for t in ("step 0", "step 1", "done")]
        await until(lambda: not leftovers(state), "the workers and their shims to be gone")
    finally:
        await second.close(kill=True)


async def test_adopted_workers_can_be_stopped(state: Path, tree_script: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    first = life(state, RecordingSink(), "adopt")
    await first.launch(launch("job-tree", [PY, str(tree_script), "2", str(pid_file), "ignore"]))
    await until(lambda: len(read_pids(pid_file)) == 3, "the worker's tree to start")
    await first.close()
    sink = RecordingSink()
    second = life(state, sink, "adopt", grace=0.5)
    try:
        await second.recover()
        assert await second.stop("job-tree", 1) == 1
        assert all(process.start_time(p) is None for p in read_pids(pid_file)), "a process of the tree survived"
        assert [(e.exit_code, e.signal) for e in sink.exits] == [(128 + signal.SIGKILL, signal.SIGKILL)]
        assert not leftovers(state)
    finally:
        await second.close(kill=True)


async def test_exits_while_no_agent_watched_are_reported_with_their_real_status(state: Path, tmp_path: Path,
                                                                               stepper: Path) -> None:
    first = life(state, RecordingSink(), "adopt")
    await first.launch(launch("job-code", [PY, str(stepper), str(tmp_path), "1", "5"]))
    await first.launch(launch("job-killed", [PY, "-c", "import time; time.sleep(300)"], gpus_per_rank=1))
    await until(lambda: texts(state, "job-code", 0) == ["step 0"], "the first worker to start")
    killed_pid = {s.job_id: s.pid for s in first.list_workers()}["job-killed"]
    await first.close()

    (tmp_path / "go-0").touch()
    os.kill(killed_pid, signal.SIGKILL)
    await until(lambda: not leftovers(state), "both workers to end while no agent runs")

    sink = RecordingSink()
    second = life(state, sink, "adopt")
    try:
        exits = {e.job_id: e for e in await second.recover()}
        assert (exits["job-code"].exit_code, exits["job-code"].signal) == (5, 0)
        assert (exits["job-killed"].exit_code, exits["job-killed"].signal) == (128 + signal.SIGKILL, signal.SIGKILL)
        assert all(e.exited_at > 0 for e in exits.values())
        assert sorted(sink.exits, key=lambda e: e.job_id) == sorted(exits.values(), key=lambda e: e.job_id)
        second.mark_reported(exits["job-code"])
    finally:
        await second.close()
    # Unacknowledged exits are reported again by the next life; acknowledged ones are not.
    third = life(state, RecordingSink(), "adopt")
    try:
        assert [e.job_id for e in await third.recover()] == ["job-killed"]
    finally:
        await third.close()


async def test_workers_ended_by_the_agents_shutdown_are_reported_as_such_in_this_life_and_the_next(
        state: Path) -> None:
    """close(kill=True) (kill_workers_on_stop) ends the workers: their exits say the agent's shutdown did it
    (the scheduler restarts such jobs as after a lost node), and so does the record a later life reports an
    unacknowledged one from. A worker that ended by itself before is not marked."""
    sink = RecordingSink()
    first = life(state, sink, "adopt", grace=0.5)
    await first.launch(launch("job-done", [PY, "-c", "pass"]))
    await until(lambda: sink.by_rank("job-done"), "the first worker to end by itself")
    await first.launch(launch("job-long", [PY, "-c", "import time; time.sleep(300)"], gpus_per_rank=1))
    await first.close(kill=True)
    (done,), (killed,) = sink.by_rank("job-done").values(), sink.by_rank("job-long").values()
    assert not done.agent_shutdown and (done.exit_code, done.signal) == (0, 0)
    assert killed.agent_shutdown and killed.signal == signal.SIGTERM
    assert not leftovers(state)
    second = life(state, RecordingSink(), "adopt")
    try:
        again = {e.job_id: e for e in await second.recover()}
        assert again["job-long"].agent_shutdown and not again["job-done"].agent_shutdown
    finally:
        await second.close()


# --- stop -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,expected_signal", [("sleep", signal.SIGTERM), ("ignore", signal.SIGKILL)])
async def test_the_stop_policy_stops_the_previous_lifes_workers(state: Path, tmp_path: Path, tree_script: Path,
                                                                mode: str, expected_signal: int) -> None:
    pid_file = tmp_path / "pids"
    first = life(state, RecordingSink(), "stop")
    await first.launch(launch("job-stop", [PY, str(tree_script), "1", str(pid_file), mode]))
    await until(lambda: len(read_pids(pid_file)) == 2, "the worker and its child to start")
    await first.close()
    assert all(process.start_time(p) is not None for p in read_pids(pid_file))

    sink = RecordingSink()
    second = life(state, sink, "stop", grace=0.5)
    try:
        submitted = await second.recover()
        assert all(process.start_time(p) is None for p in read_pids(pid_file)), "a worker of the previous life survived"
        assert [(e.job_id, e.exit_code, e.signal) for e in submitted] == [
            ("job-stop", 128 + expected_signal, expected_signal)]
        assert sink.exits == submitted
        assert [(s.job_id, s.running) for s in second.list_workers()] == [("job-stop", False)]
        await until(lambda: not leftovers(state), "the shim to be gone")
    finally:
        await second.close()


# --- what a shim could not record ---------------------------------------------------------------------


async def test_a_worker_whose_shim_was_killed_is_stopped_and_its_status_unknown(state: Path, tmp_path: Path) -> None:
    first = life(state, RecordingSink(), "adopt")
    sleeper = [PY, "-c", "import time; print('up', flush=True); time.sleep(300)"]
    await first.launch(launch("job-orphan", sleeper))
    await first.launch(launch("job-lost", sleeper, gpus_per_rank=1))
    await until(lambda: texts(state, "job-orphan", 0) == texts(state, "job-lost", 0) == ["up"], "workers to start")
    await first.close()
    by_job = {rec.job_id: rec.workers[0] for rec in map(records.load, records.find_all(state / "jobs")) if rec}
    # job-orphan: only its shim dies; the worker runs on with nobody reading its output. job-lost: both die.
    for job, w in by_job.items():
        assert process.kill_process(w.shim_pid, w.shim_start_time, signal.SIGKILL)
        if job == "job-lost":
            os.kill(w.pid, signal.SIGKILL)
    await until(lambda: not any(process.is_running(w.shim_pid, w.shim_start_time) for w in by_job.values()),
                "the shims to die")

    second = life(state, RecordingSink(), "adopt")
    try:
        exits = {e.job_id: (e.exit_code, e.signal) for e in await second.recover()}
        assert exits == {"job-orphan": (128 + signal.SIGTERM, signal.SIGTERM), "job-lost": (EXIT_UNKNOWN, 0)}
        assert not leftovers(state)
        lost = await second.read_logs(LogQuery("job-lost"))
        assert [(ln.stream, ln.text) for ln in lost] == [
            ("stdout", "up"), ("agent", "[exit status unknown: its shim ended without recording it; reported as "
                                        "exit code -1]")]
    finally:
        await second.close()


async def test_records_without_shims_or_with_a_reused_pid(state: Path, tmp_path: Path) -> None:
    """Records of an agent without shims: a live worker is stopped (its output went to that agent), a gone
    one is unknown. A shim pid now held by another process (here: this test's) is not taken for the shim."""
    live = await asyncio.create_subprocess_exec(PY, "-c", "import time; time.sleep(300)", start_new_session=True)
    gone = await asyncio.create_subprocess_exec(PY, "-c", "pass", start_new_session=True)
    await gone.wait()
    try:
        await until(lambda: process.start_time(live.pid) is not None, "the live worker to start")
        entries = {
            "job-legacy-live": dict(pid=live.pid, start_time=process.start_time(live.pid)),
            "job-legacy-gone": dict(pid=gone.pid, start_time=1),
            "job-reused": dict(pid=gone.pid, start_time=1, shim_pid=os.getpid(), shim_start_time=1),
        }
        for job_id, fields in entries.items():
            adir = state / "jobs" / job_id / "attempt-1"
            adir.mkdir(parents=True)
            w = {"rank": 0, "local_rank": 0, "gpu_indices": [], "pgid": fields["pid"], **fields}
            (adir / records.RECORD_NAME).write_text(json.dumps(
                {"job_id": job_id, "attempt": 1, "node_id": "node-a", "created_at": 1.0, "workers": [w]}))

        second = life(state, RecordingSink(), "adopt")
        try:
            exits = {e.job_id: (e.exit_code, e.signal) for e in await second.recover()}
        finally:
            await second.close()
        assert exits == {"job-legacy-live": (128 + signal.SIGTERM, signal.SIGTERM),
                         "job-legacy-gone": (EXIT_UNKNOWN, 0), "job-reused": (EXIT_UNKNOWN, 0)}
        assert await asyncio.wait_for(live.wait(), timeout=10) == -signal.SIGTERM
    finally:
        if live.returncode is None:
            live.kill()
            await live.wait()


async def test_a_launch_that_is_never_committed_kills_its_worker(tmp_path: Path) -> None:
    # As when the agent dies between starting the shims and saving the record: the shim's stdin ends.
    status, log_path = tmp_path / "rank-0.exit.json", tmp_path / "rank-0.log"
    spec = shim.Spec(command=[PY, "-c", "import time; print('up', flush=True); time.sleep(300)"],
                     env=dict(os.environ), cwd=str(tmp_path), cpus=[], log_path=str(log_path), max_bytes=1 << 20,
                     backups=1, status_path=str(status), drain_timeout_s=5.0)
    started = await spawn.start_worker(spec, err_path=tmp_path / "rank-0.shim.err")
    await until(lambda: log_path.exists() and b"up" in log_path.read_bytes(), "the worker to start")
    spawn.release(started)
    await asyncio.wait_for(process.wait_for_exit(started.shim), timeout=10)
    assert process.start_time(started.pid) is None
    result = shim.read_status(status)
    assert result is not None and result[0] == -signal.SIGKILL
    stored = [logs.parse_record(raw) for raw in log_path.read_bytes().splitlines()]
    assert [(stream, seq, text.decode()) for stream, seq, _, text in stored] == [
        ("stdout", 1, "up"), ("agent", 2, "[the launch did not complete (another worker could not start, or the agent "
                                      "went away); this worker is killed]")]


async def test_a_shim_refuses_a_bad_spec(tmp_path: Path) -> None:
    spec = shim.Spec(command=[PY], env={}, cwd="", cpus=[], log_path=str(tmp_path / "log"), max_bytes=1 << 20,
                     backups=1, status_path=str(tmp_path / "status"), drain_timeout_s=1.0)
    with pytest.raises(FailedPrecondition, match="bad shim spec: cwd must be a non-empty string"):
        await spawn.start_worker(spec, err_path=tmp_path / "err")


# --- a real agent process, killed with SIGKILL ---------------------------------------------------------



@dataclass
class AgentProcess:
    proc: asyncio.subprocess.Process
    port: int

    async def workers(self) -> list[agent_pb2.WorkerStatus]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            got = await agent_pb2_grpc.AgentServiceStub(channel).ListWorkers(agent_pb2.ListWorkersRequest(),
                                                                             timeout=10)
        return list(got.workers)

    async def log_texts(self, job_id: str) -> list[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            got = await agent_pb2_grpc.AgentServiceStub(channel).GetWorkerLogs(
                agent_pb2.GetWorkerLogsRequest(job_id=job_id), timeout=10)
        return [ln.text for ln in got.lines]


@pytest.fixture
async def agents(tmp_path: Path, scheduler: Scheduler, state: Path) -> AsyncIterator[list[AgentProcess]]:
    """Agent processes a test starts with `start_agent`; whatever still runs at the end is killed."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        if agent.proc.returncode is None:
            agent.proc.kill()
            await agent.proc.wait()


async def start_agent(tmp_path: Path, scheduler: Scheduler, agents: list[AgentProcess], policy: str) -> AgentProcess:
    life_no = len(agents) + 1
    ready = tmp_path / f"ready-{life_no}.json"
    err = os.open(tmp_path / f"agent-{life_no}.err", os.O_WRONLY | os.O_CREAT)
    try:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "trainyard_agent.main", "--worker-restart-policy", policy, "--gpu-profile", "a100x4",
            "--node-id", "node-main", "--insecure-plaintext", "--single-tenant",
            "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready), "--scheduler-address",
            scheduler.address, "--stop-grace-s", "2", "--heartbeat-interval-s", "0.2", stderr=err)
    finally:
        os.close(err)
    agent = AgentProcess(proc, 0)
    agents.append(agent)
    await until(lambda: ready.exists() or proc.returncode is not None, "the agent's ready file", timeout=60)
    assert proc.returncode is None, (tmp_path / f"agent-{life_no}.err").read_text()[-2000:]
    agent.port = json.loads(ready.read_text())["grpc_port"]
    return agent


async def kill(agent: AgentProcess) -> None:
    agent.proc.send_signal(signal.SIGKILL)
    assert await agent.proc.wait() == -signal.SIGKILL


# The scheduler must not give up on the node while its agent restarts (the interpreter takes a while).
PATIENT_SCHEDULER = [{"node_timeout_s": 60.0, "worker_fence_s": 70.0}]


@pytest.mark.parametrize("scheduler_options", PATIENT_SCHEDULER)
async def test_a_restarted_agent_adopts_the_worker_its_killed_life_started(
        tmp_path: Path, state: Path, scheduler: Scheduler, agents: list[AgentProcess], stepper: Path) -> None:
    first = await start_agent(tmp_path, scheduler, agents, "adopt")
    job_id = await scheduler.submit([PY, str(stepper), str(tmp_path), "1", "3"])
    await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    [worker] = await first.workers()
    await until(lambda: texts(state, job_id, 0) == ["step 0"], "the worker to start")
    node = await scheduler.node("node-main")
    assert node is not None

    await kill(first)
    assert process.start_time(worker.pid) is not None, "the worker died with its agent"

    second = await start_agent(tmp_path, scheduler, agents, "adopt")
    assert [(w.job_id, w.pid, w.running) for w in await second.workers()] == [(job_id, worker.pid, True)]
    await scheduler.registered("node-main", after=seconds(node.registered_at))
    assert (await scheduler.job(job_id)).state == types_pb2.JOB_STATE_RUNNING

    (tmp_path / "go-0").touch()
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_FAILED)
    assert [(e.node_id, e.rank, e.exit_code, e.signal) for e in job.exits] == [("node-main", 0, 3, 0)]
    assert await second.log_texts(job_id) == ["step 0", "done"]
    await until(lambda: not leftovers(state), "the worker and its shim to be gone")


@pytest.mark.parametrize("scheduler_options", PATIENT_SCHEDULER)
async def test_a_restarted_agent_with_the_stop_policy_stops_the_worker_of_its_killed_life(
        tmp_path: Path, state: Path, scheduler: Scheduler, agents: list[AgentProcess], tree_script: Path) -> None:
    pid_file = tmp_path / "pids"
    first = await start_agent(tmp_path, scheduler, agents, "stop")
    job_id = await scheduler.submit([PY, str(tree_script), "1", str(pid_file), "sleep"])
    await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    await until(lambda: len(read_pids(pid_file)) == 2, "the worker and its child to start")

    await kill(first)
    assert all(process.start_time(p) is not None for p in read_pids(pid_file)), "the worker died with its agent"

    second = await start_agent(tmp_path, scheduler, agents, "stop")
    # Stopped before the agent served anything (it is ready only then).
    assert all(process.start_time(p) is None for p in read_pids(pid_file)), "a worker of the killed life survived"
    assert [(w.job_id, w.running, w.signal) for w in await second.workers()] == [(job_id, False, signal.SIGTERM)]
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_FAILED)
    assert [(e.node_id, e.rank, e.exit_code, e.signal) for e in job.exits] == [
        ("node-main", 0, 128 + signal.SIGTERM, signal.SIGTERM)]
    await until(lambda: not leftovers(state), "the shim to be gone")


def test_the_shim_is_a_small_program() -> None:
    # One runs per worker: it must not pull in the agent (grpc, asyncio, pydantic) on start-up.
    loaded = subprocess.run(
        [PY, "-c", "import sys, trainyard_agent.workers.shim; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in loaded if m.split(".")[0] in ("grpc", "asyncio", "pydantic", "trainyard_core")]
