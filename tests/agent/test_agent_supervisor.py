"""Worker supervision with real processes: environment, CPU binding, logs, exits, stop, idempotency.
Previous agent lives: test_agent_workers_restart.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from tests.agent.agent_kit import PY, RecordingSink, launch, make_supervisor, read_pids, until
from trainyard_agent.model import Health, Vendor
from trainyard_agent.workers import affinity, process, records, shim
from trainyard_agent.workers.model import LaunchRequest, LogQuery
from trainyard_agent.workers.supervisor import Supervisor
from trainyard_core.errors import FailedPrecondition, InvalidArgument

ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "MASTER_ADDR",
            "SITE_DEFAULT", "OVERRIDDEN", "PYTHONUNBUFFERED", "CUDA_DEVICE_ORDER", "TRAINYARD_NODE_ID"]
PRINT_ENV = ("import json, os, sys; "
             f"print(json.dumps({{k: os.environ.get(k) for k in {ENV_KEYS!r}}})); "
             "print(json.dumps({'cwd': os.getcwd()})); "
             "print('to stderr', file=sys.stderr)")


def gone(pids: list[int]) -> bool:
    return all(process.start_time(pid) is None for pid in pids)


async def test_workers_get_their_environment_and_logs_keep_the_stream(
        supervisor: Supervisor, sink: RecordingSink) -> None:
    result = await supervisor.launch(launch(
        "job-env", [PY, "-c", PRINT_ENV], ranks=2, gpus_per_rank=2,
        env={"MASTER_ADDR": "10.0.0.1", "WORLD_SIZE": "4", "OVERRIDDEN": "job", "RANK": "99"}))
    assert len(result.pids) == 2 and not result.already_running
    await until(lambda: len(sink.by_rank("job-env")) == 2, "both workers to exit")
    assert {e.exit_code for e in sink.exits} == {0}

    lines = await supervisor.read_logs(LogQuery("job-env"))
    for rank, devices in ((0, "0,1"), (1, "2,3")):
        out = [ln for ln in lines if ln.rank == rank and ln.stream == "stdout"]
        env = json.loads(out[0].text)
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
                       "CUDA_VISIBLE_DEVICES": devices, "HIP_VISIBLE_DEVICES": None, "MASTER_ADDR": "10.0.0.1",
                       "SITE_DEFAULT": "1", "OVERRIDDEN": "job", "PYTHONUNBUFFERED": "1",
                       "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "TRAINYARD_NODE_ID": "node-a"}
        cwd = json.loads(out[1].text)["cwd"]
        assert cwd == str(supervisor.workdir_root / "job-env")
        assert [(ln.stream, ln.text, ln.attempt) for ln in lines if ln.rank == rank and ln.stream == "stderr"] \
            == [("stderr", "to stderr", 1)]
    assert (supervisor.jobs_root / "job-env" / "attempt-1" / "rank-1.log").exists()


async def test_amd_workers_also_get_rocm_device_variables(tmp_path: Path, sink: RecordingSink) -> None:
    sup = make_supervisor(tmp_path, sink, vendor=Vendor.AMD)
    try:
        await sup.launch(launch("job-amd", [PY, "-c", PRINT_ENV], gpus_per_rank=2))
        await until(lambda: sink.exits, "the worker to exit")
        env = json.loads((await sup.read_logs(LogQuery("job-amd")))[0].text)
        assert env["CUDA_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == "0,1"
    finally:
        await sup.close(kill=True)


async def test_exit_codes_and_signals_are_recorded(supervisor: Supervisor, sink: RecordingSink) -> None:
    await supervisor.launch(launch("job-fail", [PY, "-c", "import sys; sys.exit(3)"]))
    await supervisor.launch(launch("job-sig", [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]))
    await until(lambda: len(sink.exits) == 2, "both workers to exit")
    fail, sig = sink.by_rank("job-fail")[0], sink.by_rank("job-sig")[0]
    assert (fail.exit_code, fail.signal) == (3, 0)
    assert (sig.exit_code, sig.signal) == (128 + signal.SIGTERM, signal.SIGTERM)
    statuses = {s.job_id: s for s in supervisor.list_workers()}
    assert not statuses["job-fail"].running and statuses["job-fail"].exit_code == 3
    assert statuses["job-sig"].signal == signal.SIGTERM
    rec = records.load(supervisor.jobs_root / "job-fail" / "attempt-1" / records.RECORD_NAME)
    assert rec is not None and rec.workers[0].exit_code == 3


@pytest.mark.parametrize("mode,expected_signal", [("sleep", signal.SIGTERM), ("ignore", signal.SIGKILL)])
async def test_stop_kills_the_whole_process_group(supervisor: Supervisor, sink: RecordingSink, tmp_path: Path,
                                                  tree_script: Path, mode: str, expected_signal: int) -> None:
    pid_file = tmp_path / "pids"
    await supervisor.launch(launch("job-tree", [PY, str(tree_script), "2", str(pid_file), mode]))
    await until(lambda: len(read_pids(pid_file)) == 3, "worker, child and grandchild to start")
    assert supervisor.running_allocations()[0].ranks == (0,)

    stopped = await supervisor.stop("job-tree", 1, grace_s=0.5)

    assert stopped == 1
    assert gone(read_pids(pid_file)), "a process of the worker's group survived the stop"
    exit = sink.by_rank("job-tree")[0]  # recorded and reported before stop returned
    assert exit.signal == expected_signal and exit.exit_code == 128 + expected_signal
    assert supervisor.running_allocations() == []


async def test_a_worker_that_exits_leaves_no_orphans(supervisor: Supervisor, sink: RecordingSink,
                                                     tmp_path: Path, tree_script: Path) -> None:
    pid_file = tmp_path / "pids"
    await supervisor.launch(launch("job-orphans", [PY, str(tree_script), "2", str(pid_file), "exit"]))
    await until(lambda: sink.exits, "the worker to exit")
    assert sink.exits[0].exit_code == 0
    await until(lambda: len(read_pids(pid_file)) == 3 and gone(read_pids(pid_file)),
                "the worker's children to be killed", timeout=5)


async def test_stop_is_idempotent(supervisor: Supervisor, tmp_path: Path, tree_script: Path) -> None:
    assert await supervisor.stop("never-launched", 1) == 0
    pid_file = tmp_path / "pids"
    await supervisor.launch(launch("job-stop", [PY, str(tree_script), "0", str(pid_file), "sleep"], ranks=2))
    await until(lambda: len(read_pids(pid_file)) == 2, "workers to start")
    first, second = await asyncio.gather(supervisor.stop("job-stop", 1, 2.0), supervisor.stop("job-stop", 1, 2.0))
    assert sorted([first, second]) == [0, 2]
    assert gone(read_pids(pid_file))
    assert await supervisor.stop("job-stop", 1) == 0
    assert await supervisor.stop("job-stop", 0) == 0


async def test_stop_with_attempt_zero_stops_every_attempt(supervisor: Supervisor, tmp_path: Path,
                                                          tree_script: Path) -> None:
    pid_file = tmp_path / "pids"
    cmd = [PY, str(tree_script), "0", str(pid_file), "sleep"]
    await supervisor.launch(launch("job-att", cmd, attempt=1))
    await supervisor.launch(launch("job-att", cmd, attempt=2, ranks=1, gpus_per_rank=0))
    await until(lambda: len(read_pids(pid_file)) == 2, "workers to start")
    assert await supervisor.stop("job-att", 0, 2.0) == 2
    assert gone(read_pids(pid_file))


async def test_launch_is_idempotent_per_job_and_attempt(supervisor: Supervisor, sink: RecordingSink,
                                                        tmp_path: Path, tree_script: Path) -> None:
    pid_file = tmp_path / "pids"
    req = launch("job-idem", [PY, str(tree_script), "0", str(pid_file), "sleep"], ranks=2)
    first = await supervisor.launch(req)
    again = await supervisor.launch(req)
    assert again.already_running and again.pids == first.pids
    await until(lambda: len(read_pids(pid_file)) == 2, "workers to start")
    await supervisor.stop("job-idem", 1, 2.0)
    # Finished workers are not started again either: the scheduler learns their exits instead.
    after = await supervisor.launch(req)
    assert after.already_running and after.pids == first.pids
    assert len(read_pids(pid_file)) == 2
    # A later agent life knows it from the record files.
    other = make_supervisor(supervisor.jobs_root.parent, RecordingSink())
    try:
        assert (await other.launch(req)).already_running
    finally:
        await other.close()
    assert len(read_pids(pid_file)) == 2


async def test_a_launch_whose_caller_goes_away_still_completes(supervisor: Supervisor, tmp_path: Path,
                                                               tree_script: Path) -> None:
    # E.g. LaunchWorkers past its deadline: half a launch would leave shims waiting for their commit.
    pid_file = tmp_path / "pids"
    req = launch("job-gone", [PY, str(tree_script), "0", str(pid_file), "sleep"], ranks=2)
    call = asyncio.create_task(supervisor.launch(req))
    await asyncio.sleep(0)  # let the launch begin
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    again = await supervisor.launch(req)  # the scheduler's retry
    assert again.already_running and len(again.pids) == 2
    await until(lambda: len(read_pids(pid_file)) == 2, "both workers to start")
    assert await supervisor.stop("job-gone", 1, 2.0) == 2
    assert gone(read_pids(pid_file))


async def test_a_stale_scheduler_leader_is_refused(supervisor: Supervisor) -> None:
    await supervisor.launch(launch("job-e5", [PY, "-c", "pass"], epoch=5))
    with pytest.raises(FailedPrecondition, match="stale scheduler leader"):
        await supervisor.launch(launch("job-e4", [PY, "-c", "pass"], epoch=4))
    supervisor.fence.observe(7)  # e.g. from a heartbeat answer of a newer leader
    with pytest.raises(FailedPrecondition, match="epoch 6"):
        await supervisor.launch(launch("job-e6", [PY, "-c", "pass"], epoch=6))
    assert (await supervisor.launch(launch("job-e7", [PY, "-c", "pass"], epoch=7))).pids


def _ok() -> LaunchRequest:
    return launch("job-bad", [PY, "-c", "pass"])


BAD_LAUNCHES: list[tuple[str, Callable[[], LaunchRequest], str]] = [
    ("empty command", lambda: replace(_ok(), command=()), "command is empty"),
    ("path in job id", lambda: replace(_ok(), job_id="../etc"), "job_id '../etc' is invalid"),
    ("missing working dir", lambda: replace(_ok(), working_dir="/does/not/exist"),
     "working_dir /does/not/exist does not exist"),
    ("relative working dir", lambda: replace(_ok(), working_dir="rel/dir"), "must be an absolute path"),
    ("GPU not on node", lambda: launch("job-bad", [PY, "-c", "pass"], gpus_per_rank=9),
     "asks for GPU 4, but node node-a has GPUs 0-3"),
    ("duplicate ranks", lambda: replace(_ok(), workers=_ok().workers * 2), "duplicate ranks"),
    ("bad env name", lambda: replace(_ok(), env={"BAD=NAME": "x"}), "not a valid environment variable name"),
    ("missing program", lambda: replace(_ok(), command=("/no/such/program",)), "cannot start '/no/such/program'"),
]


@pytest.mark.parametrize("build,message", [(b, m) for _, b, m in BAD_LAUNCHES], ids=[i for i, _, _ in BAD_LAUNCHES])
async def test_bad_launches_are_refused_with_a_message(supervisor: Supervisor, build: Callable[[], LaunchRequest],
                                                       message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        await supervisor.launch(build())
    assert supervisor.list_workers() == []


async def test_a_gang_starts_whole_or_not_at_all(supervisor: Supervisor) -> None:
    # Rank 1's log cannot be opened (a directory holds its name), so rank 1 is not started: rank 0, started
    # already, must not run on alone.
    adir = supervisor.jobs_root / "job-half" / "attempt-1"
    (adir / "rank-1.log").mkdir(parents=True)
    with pytest.raises(FailedPrecondition, match="the worker's shim could not start it: cannot open the log"):
        await supervisor.launch(launch("job-half", [PY, "-c", "import time; time.sleep(300)"], ranks=2))
    assert supervisor.list_workers() == [] and not (adir / records.RECORD_NAME).exists()
    status = shim.read_status(records.status_path(adir, 0))
    assert status is not None and status[0] == -signal.SIGKILL, "rank 0 was not stopped"


async def test_unhealthy_or_busy_gpus_are_refused(tmp_path: Path, sink: RecordingSink, tree_script: Path) -> None:
    health = [(Health.HEALTHY, ""), (Health.UNHEALTHY, "XID 79: GPU has fallen off the bus")]
    sup = make_supervisor(tmp_path / "s", sink, health=health)
    try:
        with pytest.raises(FailedPrecondition, match="GPU 1 of node node-a is unhealthy: XID 79"):
            await sup.launch(launch("job-sick", [PY, "-c", "pass"], ranks=2, gpus_per_rank=1))
        await sup.launch(launch("job-a", [PY, str(tree_script), "0", str(tmp_path / "p"), "sleep"], gpus_per_rank=1))
        with pytest.raises(FailedPrecondition, match=r"GPU 0 .* in use by job job-a attempt 1"):
            await sup.launch(launch("job-b", [PY, "-c", "pass"], gpus_per_rank=1))
    finally:
        await sup.close(kill=True)


async def test_output_without_newlines_and_huge_lines_is_captured(supervisor: Supervisor,
                                                                  sink: RecordingSink) -> None:
    script = ("import sys; sys.stdout.write('x' * 200000); sys.stdout.flush(); "
              "sys.stderr.write('no newline at the end')")
    await supervisor.launch(launch("job-raw", [PY, "-c", script]))
    await until(lambda: sink.exits, "the worker to exit")
    lines = await supervisor.read_logs(LogQuery("job-raw"))
    out = [ln.text for ln in lines if ln.stream == "stdout"]
    assert "".join(out) == "x" * 200000 and max(map(len, out)) == 64 * 1024
    assert [ln.text for ln in lines if ln.stream == "stderr"] == ["no newline at the end"]
    # Both streams end without a newline; which tail reaches the file first is up to the scheduler.
    tail = await supervisor.read_logs(LogQuery("job-raw", tail_lines=2))
    assert len(tail) == 2 and "no newline at the end" in [ln.text for ln in tail]


async def test_follow_streams_lines_until_the_workers_exit(supervisor: Supervisor) -> None:
    script = "import time\nfor i in range(20):\n    print(f'line {i}')\n    time.sleep(0.02)\n"
    await supervisor.launch(launch("job-follow", [PY, "-c", script], ranks=2))
    seen: list[tuple[int, str]] = []

    async def follow() -> None:
        async for lines in supervisor.follow_logs(LogQuery("job-follow")):
            seen.extend((ln.rank, ln.text) for ln in lines)

    await asyncio.wait_for(follow(), timeout=20)
    for rank in (0, 1):
        assert [t for r, t in seen if r == rank] == [f"line {i}" for i in range(20)]


async def test_a_partial_last_line_is_kept_when_the_worker_is_stopped(supervisor: Supervisor, sink: RecordingSink,
                                                                      tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = ("import sys, time, pathlib; sys.stdout.write('line\\npartial, no newline'); sys.stdout.flush(); "
              f"pathlib.Path({str(ready)!r}).touch(); time.sleep(300)")
    await supervisor.launch(launch("job-partial", [PY, "-c", script]))
    await until(ready.exists, "the worker to print")
    await supervisor.stop("job-partial", 1, grace_s=5)
    assert sink.by_rank("job-partial")[0].signal == signal.SIGTERM
    lines = await supervisor.read_logs(LogQuery("job-partial"))
    assert [(ln.stream, ln.text) for ln in lines] == [("stdout", "line"), ("stdout", "partial, no newline")]


# --- CPU binding ------------------------------------------------------------------------------------------

PRINT_AFFINITY = "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"


def bound_supervisor(state_dir: Path, sink: RecordingSink, *, gpu_cpus: dict[int, list[int]] | None = None,
                     cpu_binding: bool = True, restart_policy: str = "stop") -> Supervisor:
    """`make_supervisor`'s settings plus the options it does not take."""
    healthy = [(Health.HEALTHY, "")] * 4
    return Supervisor(state_dir=state_dir, node_id="node-a", vendor=Vendor.NVIDIA, gpu_health=lambda: healthy,
                      base_env=dict(os.environ), site_env={}, stop_grace_s=5.0, log_max_bytes=1 << 20,
                      log_backups=2, exits=sink, gpu_cpus=gpu_cpus, cpu_binding=cpu_binding,
                      restart_policy=restart_policy)


async def affinity_of_worker(sup: Supervisor, sink: RecordingSink, job_id: str, gpus: int) -> list[int]:
    await sup.launch(launch(job_id, [PY, "-c", PRINT_AFFINITY], gpus_per_rank=gpus))
    await until(lambda: sink.by_rank(job_id), "the worker to exit")
    cpus: list[int] = json.loads((await sup.read_logs(LogQuery(job_id)))[0].text)
    return cpus


@pytest.mark.parametrize("gpu_cpus,cpu_binding,gpus,bound", [
    ({0: [1], 1: [1]}, True, 1, [1]),  # GPU 0's CPU exists here: the worker runs on it only
    ({0: [1], 1: [0]}, True, 2, [0, 1]),  # a worker with two GPUs gets the CPUs of both
    ({0: [4096, 4097]}, True, 1, None),  # none of GPU 0's CPUs exists on this machine: not bound
    ({0: [1]}, False, 1, None),  # binding switched off
    ({0: [1]}, True, 0, None),  # a worker without GPUs is not bound
    ({1: [1]}, True, 1, None),  # GPU 0's affinity is unknown
], ids=["one-cpu", "two-gpus", "cpus-not-here", "off", "no-gpus", "unknown"])
async def test_workers_are_bound_to_the_cpus_of_their_gpus(tmp_path: Path, sink: RecordingSink,
                                                           gpu_cpus: dict[int, list[int]], cpu_binding: bool,
                                                           gpus: int, bound: list[int] | None) -> None:
    mine = sorted(os.sched_getaffinity(0))
    if not {0, 1} <= set(mine):
        pytest.skip(f"needs CPUs 0 and 1; this process may use {mine}")
    sup = bound_supervisor(tmp_path / "state", sink, gpu_cpus=gpu_cpus, cpu_binding=cpu_binding)
    try:
        assert await affinity_of_worker(sup, sink, "job-cpus", gpus) == (bound if bound is not None else mine)
    finally:
        await sup.close(kill=True)


@pytest.mark.parametrize("gpu_cpus,message", [
    ({0: [-1]}, "CPU -1 of GPU 0 must be an integer >= 0"),
    ({-2: [0]}, "GPU index -2 must be an integer >= 0"),
    ({0: ["1"]}, "CPU '1' of GPU 0 must be an integer >= 0"),
])
def test_a_bad_gpu_cpu_map_is_refused(tmp_path: Path, gpu_cpus: dict[int, list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        bound_supervisor(tmp_path, RecordingSink(), gpu_cpus=gpu_cpus)


def test_bad_supervisor_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="restart policy 'keep' is unknown; use one of: adopt, stop"):
        bound_supervisor(tmp_path, RecordingSink(), restart_policy="keep")
    with pytest.raises(ValueError, match="log_max_bytes must be larger than 3"):
        Supervisor(state_dir=tmp_path, node_id="node-a", vendor=Vendor.NVIDIA, gpu_health=list, base_env={},
                   site_env={}, stop_grace_s=1, log_max_bytes=3, log_backups=0)


@pytest.mark.parametrize("gpus,available,cpus,reason", [
    ([0], {0, 1, 2, 3}, {0, 1}, ""),
    ([0, 1], {0, 1, 2, 3}, {0, 1, 2, 3}, ""),
    ([1], {0, 1, 3}, {3}, ""),  # a cpuset leaves out CPU 2
    ([1], {0, 1}, set(), "none of the CPUs 2-3 near GPU 1 is available to the agent (it may use 0-1)"),
    ([2], {0, 1}, set(), "the CPU affinity of GPU 2 is not known"),
    ([], {0, 1}, set(), "the worker has no GPUs"),
])
def test_binding_is_the_gpus_cpus_this_agent_may_use(gpus: list[int], available: set[int], cpus: set[int],
                                                     reason: str) -> None:
    gpu_cpus = affinity.check_gpu_cpus({0: [0, 1], 1: [2, 3]})
    assert affinity.worker_binding(gpu_cpus, gpus, frozenset(available)) == affinity.Binding(frozenset(cpus), reason)


def test_cpu_lists_are_formatted_as_ranges() -> None:
    assert affinity.format_cpus([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert affinity.format_cpus([]) == ""


async def test_workers_are_killed_when_the_agents_lease_runs_out(supervisor: Supervisor, sink: RecordingSink,
                                                                 tmp_path: Path, tree_script: Path) -> None:
    """The worker fence: the shims watch the lease the agent renews with every answer of the scheduler
    leader. No lease: no fence. A live lease: the workers run. A lease that ran out (the agent died or lost
    the leader, and the scheduler restarts the job elsewhere): every process of the worker's group dies."""
    from trainyard_agent.workers import lease

    pid_file = tmp_path / "pids"
    await supervisor.launch(launch("job-fenced", [PY, str(tree_script), "2", str(pid_file), "sleep"]))
    await until(lambda: len(read_pids(pid_file)) == 3, "worker, child and grandchild to start")
    lease.renew(supervisor.lease_path, 0.6)
    await asyncio.sleep(0.3)  # well inside the lease: nothing may happen
    assert not sink.exits and not gone(read_pids(pid_file))
    await until(lambda: sink.exits, "the worker to be killed once the lease ran out", timeout=5)
    exit = sink.by_rank("job-fenced")[0]
    assert exit.signal == signal.SIGKILL
    assert gone(read_pids(pid_file)), "a process of the worker's group survived the fence"
    logs = (await supervisor.read_logs(LogQuery("job-fenced")))
    assert any("worker fence" in line.text for line in logs)
    lease.renew(supervisor.lease_path, 0)
    assert not supervisor.lease_path.exists()
