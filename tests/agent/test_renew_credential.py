"""The checkpoint-store credential on the node (issue 12): the agent writes the credential a launch carries to
files only the workers' identity may read, gives the workers their paths, and replaces them when the scheduler
calls RenewJobCredential. A real multi-tenant agent over mTLS (test_tenancy's `host`: workers run as their
team's uid), real worker processes, credentials minted by the real job issuer.

Refusals, each from the real server: a node or tool principal (PERMISSION_DENIED, the fence untouched), a
stale leader epoch, an unknown job, another attempt, ended workers (NOT_FOUND / FAILED_PRECONDITION), and a
credential that is not one of that job and attempt (INVALID_ARGUMENT); after each the files are as before.
Needs root, like test_tenancy (CI runs as root)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import stat
import subprocess
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509

from tests.agent.agent_kit import agent_settings
from tests.agent.test_tenancy import EPOCH, ML, NODE, OPS, RESEARCH, RUN_AS, WORKER, Host, _worker_python, needs_root
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_core.security import identity, job_credentials, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.job_credentials import JobCredential, JobGrant, JobIssuer
from trainyard_core.testing import accounts
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

pytestmark = needs_root

NAMES = (job_credentials.CERT_ENV, job_credentials.KEY_ENV, job_credentials.CA_ENV)
# Prints where its credential is and whether its own uid can read it, then stays until told to end.
RENEW_WORKER = textwrap.dedent("""
    import json, os, sys, time
    names = sys.argv[1:4]
    readable = {}
    for name in names:
        try:
            with open(os.environ[name], "rb") as f:
                readable[name] = f.read().startswith(b"-----BEGIN")
        except OSError as exc:
            readable[name] = type(exc).__name__
    print(json.dumps({"env": {n: os.environ.get(n, "") for n in names}, "readable": readable,
                      "uid": os.getuid(), "key_in_environ": "PRIVATE KEY" in "".join(os.environ.values())}),
          flush=True)
    while not os.path.exists("end"):
        time.sleep(0.05)
""")


@pytest.fixture
async def host(pki_dir: Path, public_tmp: Path) -> AsyncIterator[Host]:
    """test_tenancy's multi-tenant agent on node-1 (teams ml and research), with no scheduler: the tests call it
    as the scheduler would."""
    script = public_tmp / "worker.py"
    script.write_text(WORKER)
    script.chmod(0o644)
    settings = agent_settings(public_tmp / "state", f"127.0.0.1:{free_port()}", node_id="node-1",
                              single_tenant=False, run_as=RUN_AS, workdir_root=str(public_tmp / "work"),
                              **pki.files_for(pki_dir, NODE).settings())
    app = AgentApp(settings)
    await app.start()
    node = Host(app=app, pki_dir=pki_dir, python=_worker_python(), script=script, workdir_root=public_tmp / "work")
    try:
        yield node
    finally:
        await node.app.stop(kill_workers=True)  # the one running now: a test may have restarted it


@pytest.fixture
def issuer(pki_dir: Path) -> JobIssuer:
    pki.ensure(pki_dir, [], job_issuer=True)
    cert, key = pki.job_issuer_files(pki_dir)
    return JobIssuer(cert, key, pki_dir / "ca.pem", ttl_s=3600)


@pytest.fixture
def worker_script(host: Host) -> Path:
    path = host.script.with_name("renew_worker.py")
    path.write_text(RENEW_WORKER)
    path.chmod(0o644)
    return path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _mint(pki_dir: Path, job_id: str, attempt: int, team: str = "ml") -> JobCredential:
    """A new credential at every call (the issuer's cache would hand out the same one)."""
    cert, key = pki.job_issuer_files(pki_dir)
    material = job_credentials.load_issuer(cert, key, pki_dir / "ca.pem")
    leaf, leaf_key, not_after = job_credentials.mint(material.cert, material.key, JobGrant(job_id, attempt, team),
                                                     now=_now(), ttl=dt.timedelta(hours=1))
    return JobCredential(JobGrant(job_id, attempt, team), leaf + material.cert_pem, leaf_key, material.ca_pem,
                         not_after)


def _launch_request(host: Host, script: Path, job_id: str, cred: JobCredential, *, attempt: int = 1,
                    team: str = "ml") -> agent_pb2.LaunchWorkersRequest:
    return agent_pb2.LaunchWorkersRequest(
        job_id=job_id, attempt=attempt, team=team, leader_epoch=EPOCH, env=cred.env(),
        command=[host.python, str(script), *NAMES], workers=[agent_pb2.WorkerSpec(rank=0, local_rank=0)])


def _renew_request(job_id: str, cred: JobCredential | None, *, attempt: int = 1,
                   epoch: int = EPOCH) -> agent_pb2.RenewJobCredentialRequest:
    req = agent_pb2.RenewJobCredentialRequest(job_id=job_id, attempt=attempt, leader_epoch=epoch)
    if cred is not None:
        req.credential.CopyFrom(agent_pb2.JobCredential(cert_chain=cred.cert_chain, key=cred.key, ca=cred.ca))
    return req


async def _renew(host: Host, req: agent_pb2.RenewJobCredentialRequest,
                 caller: Principal = identity.SCHEDULER) -> agent_pb2.RenewJobCredentialResponse:
    async with host.channel(caller) as ch:
        got: agent_pb2.RenewJobCredentialResponse = await agent_pb2_grpc.AgentServiceStub(ch).RenewJobCredential(
            req, timeout=10)
    return got


async def _refused(host: Host, req: agent_pb2.RenewJobCredentialRequest,
                   caller: Principal = identity.SCHEDULER) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _renew(host, req, caller)
    return info.value


def _owner_mode(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def _files(report: dict[str, object]) -> dict[str, Path]:
    env = report["env"]
    assert isinstance(env, dict)
    return {name: Path(env[name]) for name in NAMES}


def _held(files: dict[str, Path]) -> tuple[bytes, bytes, bytes]:
    return tuple(files[n].read_bytes() for n in NAMES)  # type: ignore[return-value]


def _as_uid(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return accounts.run_as(uid, gid, *argv)


@contextlib.contextmanager
def _reading(paths: list[Path], seen: list[bytes]) -> Iterator[None]:
    """A reader that keeps reading `paths` while the block runs, as a checkpoint client polls its files."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for p in paths:
                seen.append(p.read_bytes())

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture
async def launched(host: Host, worker_script: Path, issuer: JobIssuer) -> AsyncIterator[dict[str, object]]:
    """job-r attempt 1 of team ml running on the node with its first credential; its worker's report."""
    cred = issuer.credential("job-r", 1, "ml", _now())
    async with host.channel(identity.SCHEDULER) as ch:
        await agent_pb2_grpc.AgentServiceStub(ch).LaunchWorkers(_launch_request(host, worker_script, "job-r", cred),
                                                                timeout=30)
    report = await host.report("job-r")
    report["first"] = cred  # type: ignore[assignment]
    yield report


async def test_the_workers_get_files_of_their_own_and_no_key_in_their_environment(
        host: Host, launched: dict[str, object]) -> None:
    files = _files(launched)
    cred = launched["first"]
    assert isinstance(cred, JobCredential)
    job_dir = host.workdir_root / "job-r"
    assert {n: p.parent for n, p in files.items()} == {n: job_dir / ".trainyard" for n in NAMES}
    assert launched["readable"] == {n: True for n in NAMES}, "the worker's own uid reads its credential"
    assert launched["uid"] == ML.uid and launched["key_in_environ"] is False
    assert _held(files) == (cred.cert_chain, cred.key, cred.ca)
    assert _owner_mode(job_dir / ".trainyard") == (ML.uid, ML.gid, 0o700)
    for path in files.values():
        assert _owner_mode(path) == (ML.uid, ML.gid, 0o600), path
    # Another team's uid cannot list the directory or read the key.
    for argv in (("ls", str(job_dir / ".trainyard")), ("cat", str(files[job_credentials.KEY_ENV]))):
        denied = _as_uid(RESEARCH.uid, RESEARCH.gid, *argv)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, (argv, denied)


async def test_the_scheduler_renews_the_files_atomically_and_nobody_else_may(
        host: Host, launched: dict[str, object], issuer: JobIssuer, pki_dir: Path) -> None:
    files = _files(launched)
    first = launched["first"]
    assert isinstance(first, JobCredential)
    # Held open across the renewals: the first key file's inode cannot be freed and reused for a later file.
    held_open = os.open(files[job_credentials.KEY_ENV], os.O_RDONLY)
    # Twenty renewals while a reader keeps reading: each read is one whole file, the old one or a new one.
    minted = [_mint(pki_dir, "job-r", 1) for _ in range(20)]
    seen: list[bytes] = []
    with _reading([files[job_credentials.KEY_ENV], files[job_credentials.CERT_ENV]], seen):
        for cred in minted:
            got = await _renew(host, _renew_request("job-r", cred))
            assert got.workers == 1
    whole = {c.key for c in (first, *minted)} | {c.cert_chain for c in (first, *minted)}
    assert seen and set(seen) <= whole, "a reader saw a part of a file"
    last = minted[-1]
    assert _held(files) == (last.cert_chain, last.key, last.ca)
    try:
        assert os.fstat(held_open).st_ino != files[job_credentials.KEY_ENV].stat().st_ino, \
            "replaced by a rename, not rewritten in place"
        assert os.pread(held_open, 1 << 16, 0) == first.key, "the first file was never written to"
    finally:
        os.close(held_open)
    for path in files.values():
        assert _owner_mode(path) == (ML.uid, ML.gid, 0o600), path
    assert sorted(p.name for p in files[job_credentials.KEY_ENV].parent.iterdir()) == sorted(
        p.name for p in files.values()), "no temporary file is left"
    assert host.app.fence.highest == EPOCH

    # Only the scheduler: a node's or a tool's certificate is refused before anything is looked at.
    other = issuer.credential("job-r", 1, "ml", _now() + dt.timedelta(days=2))
    for caller in (identity.node("node-2"), OPS):
        err = await _refused(host, _renew_request("job-r", other, epoch=EPOCH + 100), caller)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, caller
        assert "RenewJobCredential" in (err.details() or "")
    assert host.app.fence.highest == EPOCH, "a refused epoch does not reach the fence"
    assert _held(files) == (last.cert_chain, last.key, last.ca)
    # The agent's audit records each renewal with the job and attempt, and never the credential.
    entries = [e for e in host.app.audit.entries() if e.action.endswith("/RenewJobCredential")]
    assert len(entries) == 22 and {e.target for e in entries} == {"job/job-r"}
    assert {e.result for e in entries} == {"ok", "permission_denied"}
    assert all("PRIVATE KEY" not in json.dumps(e.detail) for e in entries)


async def test_renewals_for_the_wrong_leader_job_attempt_or_credential_are_refused(
        host: Host, launched: dict[str, object], issuer: JobIssuer, pki_dir: Path) -> None:
    files = _files(launched)
    before = _held(files)
    fresh = issuer.credential("job-r", 1, "ml", _now() + dt.timedelta(hours=1))
    # Another leader's newer epoch moves the fence; the deposed one is refused from then on.
    await _renew(host, _renew_request("job-r", fresh, epoch=EPOCH + 1))
    before = _held(files)
    err = await _refused(host, _renew_request("job-r", issuer.credential("job-r", 1, "ml", _now() + dt.timedelta(
        hours=2)), epoch=EPOCH))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"stale scheduler leader: request has leader epoch {EPOCH}" in (err.details() or "")

    epoch = EPOCH + 1
    issuer_cert, issuer_key = pki.job_issuer_files(pki_dir)
    material = job_credentials.load_issuer(issuer_cert, issuer_key, pki_dir / "ca.pem")
    expired_leaf, expired_key, _ = job_credentials.mint(material.cert, material.key, JobGrant("job-r", 1, "ml"),
                                                        now=_now() - dt.timedelta(hours=2), ttl=dt.timedelta(hours=1))
    other_job = issuer.credential("job-s", 1, "ml", _now())
    other_attempt = issuer.credential("job-r", 2, "ml", _now())
    node_cert = pki.files_for(pki_dir, identity.node("node-1"))
    cases: list[tuple[agent_pb2.RenewJobCredentialRequest, grpc.StatusCode, str]] = [
        (_renew_request("job-none", issuer.credential("job-none", 1, "ml", _now()), epoch=epoch),
         grpc.StatusCode.NOT_FOUND, "job job-none has no workers on node node-1"),
        (_renew_request("job-r", other_attempt, attempt=2, epoch=epoch),
         grpc.StatusCode.FAILED_PRECONDITION, "job job-r has attempt 1 on node node-1, not attempt 2"),
        (_renew_request("job-r", other_job, epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "the credential is for job job-s attempt 1, not for job job-r attempt 1"),
        (_renew_request("job-r", other_attempt, epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "the credential is for job job-r attempt 2, not for job job-r attempt 1"),
        (_renew_request("job-r", JobCredential(fresh.grant, b"not pem", fresh.key, fresh.ca, fresh.not_after),
                        epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "cert_chain is not PEM certificates"),
        (_renew_request("job-r", JobCredential(fresh.grant, fresh.cert_chain, other_job.key, fresh.ca,
                                               fresh.not_after), epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "the credential's key is not the key of its certificate"),
        (_renew_request("job-r", JobCredential(fresh.grant, fresh.cert_chain, fresh.key, b"", fresh.not_after),
                        epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "the credential's ca is not PEM certificates"),
        (_renew_request("job-r", JobCredential(fresh.grant, expired_leaf + material.cert_pem, expired_key,
                                               material.ca_pem, fresh.not_after), epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "the credential expired at"),
        # A certificate that is no job's (the node's own), with its key.
        (_renew_request("job-r", JobCredential(fresh.grant, node_cert.cert.read_bytes(), node_cert.key.read_bytes(),
                                               fresh.ca, fresh.not_after), epoch=epoch),
         grpc.StatusCode.INVALID_ARGUMENT, "names trainyard://node/node-1, not a job"),
        (_renew_request("job-r", None, epoch=epoch), grpc.StatusCode.INVALID_ARGUMENT, "credential is required"),
        (_renew_request("job r", fresh, epoch=epoch), grpc.StatusCode.INVALID_ARGUMENT, "job_id 'job r' is invalid"),
    ]
    for req, code, message in cases:
        err = await _refused(host, req)
        assert (err.code(), message in (err.details() or "")) == (code, True), (message, err.details())
        assert "PRIVATE KEY" not in (err.details() or "")
    assert _held(files) == before, "a refused renewal changes nothing"


async def test_the_files_follow_the_attempt_through_an_agent_restart_and_go_when_it_ends(
        host: Host, launched: dict[str, object], issuer: JobIssuer) -> None:
    files = _files(launched)
    await host.app.stop()  # the worker keeps running under its shim
    host.app = AgentApp(host.app.settings)
    await host.app.start()
    cred = issuer.credential("job-r", 1, "ml", _now() + dt.timedelta(hours=1))
    assert (await _renew(host, _renew_request("job-r", cred))).workers == 1, "an adopted attempt is renewed"
    assert _held(files) == (cred.cert_chain, cred.key, cred.ca)
    assert all(_owner_mode(p) == (ML.uid, ML.gid, 0o600) for p in files.values())

    # A worker that swapped its credential directory for a link elsewhere does not get root to write there.
    job_dir = host.workdir_root / "job-r"
    elsewhere = host.workdir_root.parent / "elsewhere"
    elsewhere.mkdir()
    (job_dir / ".trainyard").rename(job_dir / "moved")
    (job_dir / ".trainyard").symlink_to(elsewhere)
    err = await _refused(host, _renew_request("job-r", issuer.credential("job-r", 1, "ml", _now() + dt.timedelta(
        hours=2))))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and ".trainyard" in (err.details() or "")
    assert list(elsewhere.iterdir()) == []
    (job_dir / ".trainyard").unlink()
    (job_dir / "moved").rename(job_dir / ".trainyard")

    # The worker ends: its files go, and a renewal is refused as too late.
    (job_dir / "end").touch()

    async def ended() -> bool:
        return not await host.running("job-r")

    await eventually(ended, timeout=30, what="the worker to end")
    assert not any(p.exists() for p in files.values())
    err = await _refused(host, _renew_request("job-r", cred))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the workers of job job-r attempt 1 on node node-1 have ended" in (err.details() or "")


async def test_a_launch_with_a_credential_of_another_attempt_or_in_part_is_refused(
        host: Host, worker_script: Path, issuer: JobIssuer) -> None:
    wrong = issuer.credential("job-w", 2, "ml", _now())
    bad = _launch_request(host, worker_script, "job-w", wrong)
    partial = _launch_request(host, worker_script, "job-p", issuer.credential("job-p", 1, "ml", _now()))
    partial.env[job_credentials.CA_ENV] = "/etc/ssl/ca.pem"
    for req, message in ((bad, "the credential is for job job-w attempt 2, not for job job-w attempt 1"),
                         (partial, "hold PEM but TRAINYARD_CHECKPOINT_CA do not")):
        async with host.channel(identity.SCHEDULER) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await agent_pb2_grpc.AgentServiceStub(ch).LaunchWorkers(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
        assert not await host.running(req.job_id)
    # A credential the job names as files of its own (no PEM) reaches the workers as it is.
    own = _launch_request(host, worker_script, "job-o", wrong)
    for name in NAMES:
        own.env[name] = f"/nonexistent/{name}"
    async with host.channel(identity.SCHEDULER) as ch:
        await agent_pb2_grpc.AgentServiceStub(ch).LaunchWorkers(own, timeout=30)
    report = await host.report("job-o")
    assert report["env"] == {name: f"/nonexistent/{name}" for name in NAMES}
    (host.workdir_root / "job-o" / "end").touch()
    leaf = x509.load_pem_x509_certificates(wrong.cert_chain)[0]
    assert leaf.not_valid_after_utc > _now()
