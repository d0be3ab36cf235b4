"""Tenants apart on the hosts (issue 12): each team's workers run as the Unix identity the agent's `run_as`
maps the team to, and the kernel keeps two teams' jobs on one node apart. A real agent over mTLS (the
`pki_dir` fixture) is sent launches as the scheduler; the workers are real processes that try to reach
the other team's files, logs, environment and processes and say what the kernel answered.

Starting workers as other uids needs root (CI runs these as root): only the tests that do are skipped,
with that reason, otherwise. The worker script is standard-library Python in a 0755 temporary directory,
run by a Python the workers' uids can execute (checked, not assumed: the repository may sit where other
users cannot reach)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.agent.agent_kit import Scheduler, agent_settings
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.model import Vendor
from trainyard_agent.settings import AgentSettings
from trainyard_agent.tenancy import Identity, Tenancy, TenancyError, prepare_workdir_root
from trainyard_agent.workers.env import worker_env
from trainyard_agent.workers.model import WorkerSpec
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.tls import ClientTls
from trainyard_core.settings import SettingsError, load_settings
from trainyard_core.testing import accounts
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

ML, RESEARCH = Identity(2001, 2001), Identity(2002, 2002)
RUN_AS = {"ml": str(ML), "research": str(RESEARCH)}
NODE = identity.node("node-1")
OPS = identity.tool("ops")
EPOCH = 5

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only a root agent starts workers as other uids "
                                                          "(run_as refuses to start otherwise)")

# "victim" writes a file in its working directory, prints what it is and stays; "probe" tries to reach the
# victim (PROBE: its pid, working directory, log and attempt directory) and its own shim, and prints what
# the kernel said. Reaching its own working directory and environ are the controls that the probes work.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time

    def attempt(action):
        try:
            action()
            return "allowed"
        except OSError as exc:
            return type(exc).__name__

    def read(path):
        with open(path, "rb") as f:
            f.read()

    mask = os.umask(0)
    os.umask(mask)
    me = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "egid": os.getegid(),
          "groups": os.getgroups(), "umask": mask, "cwd": os.getcwd(), "home": os.environ.get("HOME"),
          "stdin": os.readlink("/proc/self/fd/0"),
          "no_new_privs": [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("NoNewPrivs:")][0]}
    if sys.argv[1] == "victim":
        with open("secret.txt", "w") as f:
            f.write("research only")
        print(json.dumps(me), flush=True)
        time.sleep(600)
    else:
        other = json.loads(os.environ["PROBE"])
        shim = os.getppid()
        me["probes"] = {
            "own_workdir": attempt(lambda: os.listdir(".")),
            "own_environ": attempt(lambda: read(f"/proc/{os.getpid()}/environ")),
            "other_workdir": attempt(lambda: os.listdir(other["workdir"])),
            "other_file": attempt(lambda: read(os.path.join(other["workdir"], "secret.txt"))),
            "other_log": attempt(lambda: read(other["log"])),
            "other_attempt_dir": attempt(lambda: os.listdir(other["attempt_dir"])),
            "other_environ": attempt(lambda: read(f"/proc/{other['pid']}/environ")),
            "other_signal": attempt(lambda: os.kill(other["pid"], signal.SIGKILL)),
            "own_status": attempt(lambda: open(other["own_status"], "w").close()),
            "own_log": attempt(lambda: open(other["own_log"], "a").close()),
            "shim_control_pipe": attempt(lambda: open(f"/proc/{shim}/fd/0", "wb").close()),
            "shim_signal": attempt(lambda: os.kill(shim, signal.SIGKILL)),
            "lease": attempt(lambda: open(other["lease"], "a").close()),
        }
        print(json.dumps(me), flush=True)
""")


def _runs_as(python: str, who: Identity) -> bool:
    try:
        done = accounts.run_as(who.uid, who.gid, python, "-c", "pass", cwd="/", timeout=60)
    except OSError:
        return False
    return done.returncode == 0


def _worker_python() -> str:
    for python in (sys.executable, "/usr/bin/python3"):
        if all(_runs_as(python, who) for who in (ML, RESEARCH)):
            return python
    pytest.fail(f"no Python that uids {ML.uid} and {RESEARCH.uid} may execute ({sys.executable} and "
                "/usr/bin/python3 tried): the worker script cannot run")


@dataclass
class Host:
    """A multi-tenant agent on node-1 and what its tests need to talk to it and to run workers."""

    app: AgentApp
    pki_dir: Path
    python: str
    script: Path
    workdir_root: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.grpc_port}"

    def channel(self, caller: Principal) -> grpc.aio.Channel:
        return secure_channel(self.address, ClientTls(pki.files_for(self.pki_dir, caller)), NODE)

    async def launch(self, job_id: str, team: str, mode: str, env: dict[str, str] | None = None,
                     working_dir: str = "") -> int:
        request = agent_pb2.LaunchWorkersRequest(
            job_id=job_id, attempt=1, team=team, leader_epoch=EPOCH, env=env or {}, working_dir=working_dir,
            command=[self.python, str(self.script), mode],
            workers=[agent_pb2.WorkerSpec(rank=0, local_rank=0)])
        async with self.channel(identity.SCHEDULER) as ch:
            got: agent_pb2.LaunchWorkersResponse = await agent_pb2_grpc.AgentServiceStub(ch).LaunchWorkers(
                request, timeout=30)
        return int(got.pids[0])

    async def report(self, job_id: str) -> dict[str, object]:
        """The JSON line the job's worker printed, read through GetWorkerLogs as a tool."""
        async def printed() -> dict[str, object] | None:
            async with self.channel(OPS) as ch:
                got: agent_pb2.GetWorkerLogsResponse = await agent_pb2_grpc.AgentServiceStub(ch).GetWorkerLogs(
                    agent_pb2.GetWorkerLogsRequest(job_id=job_id), timeout=10)
            lines = [ln.text for ln in got.lines if ln.stream == "stdout"]
            return json.loads(lines[0]) if lines else None

        report = await eventually(printed, timeout=60, what=f"{job_id}'s worker to report")
        assert isinstance(report, dict)
        return report

    async def running(self, job_id: str) -> bool:
        async with self.channel(OPS) as ch:
            got: agent_pb2.ListWorkersResponse = await agent_pb2_grpc.AgentServiceStub(ch).ListWorkers(
                agent_pb2.ListWorkersRequest(), timeout=10)
        return any(w.running for w in got.workers if w.job_id == job_id)



@pytest.fixture
async def host(pki_dir: Path, public_tmp: Path) -> AsyncIterator[Host]:
    script = public_tmp / "worker.py"
    script.write_text(WORKER)
    script.chmod(0o644)
    workdir_root = public_tmp / "work"
    # No scheduler is needed: the agent serves while its reporter retries in the background.
    settings = agent_settings(public_tmp / "state", f"127.0.0.1:{free_port()}", node_id="node-1",
                              single_tenant=False, run_as=RUN_AS, workdir_root=str(workdir_root),
                              **pki.files_for(pki_dir, NODE).settings())
    app = AgentApp(settings)
    await app.start()
    host = Host(app=app, pki_dir=pki_dir, python=_worker_python(), script=script, workdir_root=workdir_root)
    try:
        yield host
    finally:
        await host.app.stop(kill_workers=True)  # the one running now: a test may have restarted it


def _uid_of(pid: int) -> int | None:
    """The real uid of a live process; None once it is gone (a zombie counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return None if fields["State"].strip().startswith("Z") else int(fields["Uid"].split()[0])


def _environ_of(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def _owner_mode(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@needs_root
async def test_two_teams_jobs_on_one_node(host: Host) -> None:
    assert host.app.supervisor is not None
    jobs_root = host.app.supervisor.jobs_root
    b_pid = await host.launch("job-b", "research", "victim", env={"RESEARCH_TOKEN": "s3cr3t-research"})
    victim = await host.report("job-b")
    b_workdir = host.workdir_root / "job-b"
    a_attempt, b_attempt = jobs_root / "job-a" / "attempt-1", jobs_root / "job-b" / "attempt-1"
    probe = {"pid": b_pid, "workdir": str(b_workdir), "log": str(b_attempt / "rank-0.log"),
             "attempt_dir": str(b_attempt), "own_status": str(a_attempt / "rank-0.exit.json"),
             "own_log": str(a_attempt / "rank-0.log"), "lease": str(host.app.supervisor.lease_path)}
    await host.launch("job-a", "ml", "probe", env={"PROBE": json.dumps(probe)})
    prober = await host.report("job-a")

    # Each worker runs as its team's uid and gid, with no supplementary groups, umask 077, stdin /dev/null,
    # HOME its own working directory, and no_new_privs set.
    for report, who, job in ((victim, RESEARCH, "job-b"), (prober, ML, "job-a")):
        workdir = str(host.workdir_root / job)
        assert (report["uid"], report["euid"], report["gid"], report["egid"]) == (who.uid, who.uid, who.gid, who.gid)
        assert report["groups"] == [] and report["umask"] == 0o077
        assert report["cwd"] == report["home"] == workdir and report["stdin"] == "/dev/null"
        assert report["no_new_privs"] == "1", "no set-uid program on the host gives a worker more than its uid"
        assert _owner_mode(Path(workdir)) == (who.uid, who.gid, 0o700)
    assert _owner_mode(b_workdir / "secret.txt") == (RESEARCH.uid, RESEARCH.gid, 0o600)
    # Only the agent passes through the root of the working directories; logs and status are its own.
    assert _owner_mode(host.workdir_root) == (0, 0, 0o711)
    for private in (Path(host.app.settings.state_dir), jobs_root, b_attempt):
        assert _owner_mode(private)[::2] == (0, 0o700), private
    assert _owner_mode(b_attempt / "rank-0.log")[::2] == (0, 0o600)

    # The controls: the probe reaches what is its own, and the victim's environ holds its secret (root reads it).
    probes = prober["probes"]
    assert isinstance(probes, dict)
    assert probes.pop("own_workdir") == probes.pop("own_environ") == "allowed"
    assert b"RESEARCH_TOKEN=s3cr3t-research" in _environ_of(b_pid)
    # Nothing of team research, of its own shim or of the agent: the kernel refuses every one.
    assert probes == {name: "PermissionError" for name in (
        "other_workdir", "other_file", "other_log", "other_attempt_dir", "other_environ", "other_signal",
        "own_status", "own_log", "shim_control_pipe", "shim_signal", "lease")}

    # team ml's worker exited 0 with its status recorded by its shim (0600, the agent's); team research's
    # worker survived the SIGKILL it was sent.
    async def probe_done() -> bool:
        return not await host.running("job-a")

    await eventually(probe_done, timeout=30, what="the probe worker to exit")
    assert _owner_mode(a_attempt / "rank-0.exit.json")[::2] == (0, 0o600)
    assert json.loads((a_attempt / "rank-0.exit.json").read_text())["returncode"] == 0
    assert await host.running("job-b")

    # The agent keeps the right to stop another uid's worker.
    async with host.channel(identity.SCHEDULER) as ch:
        stopped: agent_pb2.StopWorkersResponse = await agent_pb2_grpc.AgentServiceStub(ch).StopWorkers(
            agent_pb2.StopWorkersRequest(job_id="job-b", attempt=1, leader_epoch=EPOCH, grace_period_ms=2000),
            timeout=30)
    assert stopped.stopped == 1 and not await host.running("job-b")


@needs_root
async def test_a_launch_for_a_team_without_identity_is_refused(host: Host) -> None:
    for team, expected in (("physics", "team 'physics' has no Unix identity on this node: add it to the agent's "
                                       "run_as"),
                           ("", "the launch names no team")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await host.launch(f"job-{team or 'none'}", team, "victim")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert expected in (info.value.details() or "")
        assert not await host.running(f"job-{team or 'none'}")
        assert not (host.workdir_root / f"job-{team or 'none'}").exists()


@needs_root
async def test_a_restarted_agent_adopts_and_stops_another_uids_worker(host: Host) -> None:
    pid = await host.launch("job-r", "research", "victim")
    assert (await host.report("job-r"))["uid"] == RESEARCH.uid
    await host.app.stop()  # workers keep running under their shims
    host.app = AgentApp(host.app.settings)
    await host.app.start()

    async def adopted() -> bool:
        return await host.running("job-r")

    await eventually(adopted, timeout=30, what="the new agent to report the worker as running")
    assert _uid_of(pid) == RESEARCH.uid
    async with host.channel(identity.SCHEDULER) as ch:
        stopped: agent_pb2.StopWorkersResponse = await agent_pb2_grpc.AgentServiceStub(ch).StopWorkers(
            agent_pb2.StopWorkersRequest(job_id="job-r", attempt=1, leader_epoch=EPOCH, grace_period_ms=2000),
            timeout=30)
    assert stopped.stopped == 1 and not await host.running("job-r")
    assert _uid_of(pid) is None


@needs_root
async def test_a_working_dir_the_teams_uid_may_not_enter_is_refused(host: Host, public_tmp: Path) -> None:
    # The kernel decides, as the worker's uid: the agent (root) could enter it, and did before.
    theirs = public_tmp / "research-data"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, RESEARCH.uid, RESEARCH.gid)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await host.launch("job-w", "ml", "victim", working_dir=str(theirs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"in {theirs}: uid {ML.uid} may not enter the working directory" in (info.value.details() or "")
    assert not await host.running("job-w")


@needs_root
async def test_the_scheduler_fails_a_job_its_node_refuses_for_want_of_an_identity(
        tmp_path: Path, scheduler: Scheduler, public_tmp: Path) -> None:
    # The kit's scheduler submits for team agent-tests, which this agent has no identity for.
    app = AgentApp(agent_settings(tmp_path / "state", scheduler.address, single_tenant=False, run_as=RUN_AS,
                                  workdir_root=str(public_tmp / "work")))
    await app.start()
    try:
        await scheduler.registered("node-a")
        job_id = await scheduler.submit([sys.executable, "-c", "pass"], gpus=1)
        job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_FAILED, timeout=30)
        assert "launch refused by node-a: team 'agent-tests' has no Unix identity" in job.message
        assert app.supervisor is not None and app.supervisor.list_workers() == []
    finally:
        await app.stop(kill_workers=True)


# --- refusing to start ----------------------------------------------------------------------------------------


def load_settings_of(env: dict[str, str]) -> AgentSettings:
    return load_settings(AgentSettings, prog="trainyard-agent", argv=[], env=env)


async def test_without_a_mapping_the_agent_refuses_to_start_unless_single_tenant(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    app = AgentApp(agent_settings(tmp_path / "state", f"127.0.0.1:{free_port()}", single_tenant=False))
    with pytest.raises(TenancyError, match=r"no run_as mapping: .* set single_tenant=true"):
        await app.start()
    assert app.server is None and app.supervisor is None

    caplog.set_level(logging.INFO)
    app = AgentApp(agent_settings(tmp_path / "state", f"127.0.0.1:{free_port()}", single_tenant=True))
    await app.start()
    try:
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "single_tenant" in r.getMessage()]
        assert len(warned) == 1 and warned[0].name == "trainyard_agent.app"
    finally:
        await app.stop(kill_workers=True)


async def test_the_daemon_without_a_mapping_exits_with_code_2_and_says_what_to_set(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainyard_agent.main", "--gpu-profile", "cpu", "--insecure-plaintext",
        "--state-dir", str(tmp_path / "state"), "--log-format", "text", stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 2
    text = err.decode()
    assert "error: no run_as mapping" in text and "--run-as ml=2001:2001" in text and "single_tenant=true" in text


def test_run_as_needs_a_root_agent() -> None:
    with pytest.raises(TenancyError, match=r"run_as needs the agent to run as root \(it runs as uid 1234\)"):
        Tenancy.decide(RUN_AS, single_tenant=False, euid=1234)
    assert Tenancy.decide(RUN_AS, single_tenant=False, euid=0).identities == {"ml": ML, "research": RESEARCH}
    with pytest.raises(TenancyError, match="exclude each other"):
        Tenancy.decide(RUN_AS, single_tenant=True, euid=0)


@pytest.mark.parametrize(("run_as", "message"), [
    ("ml=0:0", "team 'ml': uid 0 is root"),
    ("ml=root", "team 'ml': uid 0 is root"),
    ("ml=2001:0", "team 'ml': gid 0 is root"),
    ("ml=999:999", "uid 999 is a system account: workers run as ids from 1000 up"),
    ("ml=65534:65534", "uid 65534 is nobody/nogroup"),
    ("ml=2001", "gives a uid without a gid: write uid:gid"),
    ("ml=no-such-user-here", "no user named 'no-such-user-here' on this host"),
    ("ml=2001:no-such-group-here", "no group named 'no-such-group-here' on this host"),
    ("ml=2001:2001,research=2001:2002", "teams 'ml' and 'research' both run as uid 2001"),
    ("ML=2001:2001", "'ML' is not a team name"),
])
def test_identities_that_cannot_be_a_workers_are_refused(run_as: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings_of({"TRAINYARD_AGENT_RUN_AS": run_as})


def test_the_site_file_maps_teams_and_run_as_wins(tmp_path: Path) -> None:
    site = tmp_path / "run-as"
    site.write_text("# team uid:gid\nml 2001:2001\nresearch   2002:2002  # the lab\n\n")
    settings = load_settings_of({"TRAINYARD_AGENT_RUN_AS_FILE": str(site), "TRAINYARD_AGENT_RUN_AS": "ml=2003:2003"})
    assert settings.run_as == {"ml": "2003:2003", "research": "2002:2002"}
    site.write_text("ml 2001:2001\nresearch\n")
    with pytest.raises(SettingsError, match=f"{site} line 2: expected 'team uid:gid'"):
        load_settings_of({"TRAINYARD_AGENT_RUN_AS_FILE": str(site)})
    with pytest.raises(SettingsError, match="cannot read run_as_file"):
        load_settings_of({"TRAINYARD_AGENT_RUN_AS_FILE": str(tmp_path / "missing")})
    with pytest.raises(SettingsError, match="exclude each other"):
        load_settings_of({"TRAINYARD_AGENT_RUN_AS": "ml=2001:2001", "TRAINYARD_AGENT_SINGLE_TENANT": "true"})


def test_a_workdir_root_other_users_cannot_reach_is_refused(tmp_path: Path, public_tmp: Path) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    with pytest.raises(TenancyError, match=f"{hidden} is mode 0700, which other users may not pass through"):
        prepare_workdir_root(hidden / "work", shared=True)
    prepare_workdir_root(hidden / "work", shared=False)  # one user: no one else needs to pass
    prepare_workdir_root(public_tmp / "work", shared=True)
    assert stat.S_IMODE(os.stat(public_tmp / "work").st_mode) == 0o711


def test_a_worker_of_another_uid_gets_no_variables_naming_the_agents_user() -> None:
    agent = {"PATH": "/usr/bin", "HOME": "/root", "USER": "root", "LOGNAME": "root", "XDG_RUNTIME_DIR": "/run/user/0"}

    def env(home: str, job: dict[str, str]) -> dict[str, str]:
        return worker_env(base=agent, site_defaults={}, request_env=job, worker=WorkerSpec(0, 0, ()),
                          vendor=Vendor.NVIDIA, node_id="node-1", home=home)

    separated = env("/work/job-a", {})
    assert separated["HOME"] == "/work/job-a" and separated["PATH"] == "/usr/bin"
    assert not {"USER", "LOGNAME", "XDG_RUNTIME_DIR"} & set(separated)
    assert env("/work/job-a", {"HOME": "/data/ml"})["HOME"] == "/data/ml"  # the job's own wins
    assert env("", {})["HOME"] == "/root" and env("", {})["USER"] == "root"  # single tenant: as before
