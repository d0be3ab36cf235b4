"""Per-job worker credentials against the real checkpoint-store on mTLS (real etcd, real gRPC, the real
authorization interceptor and job binding): a job's credential reaches only its own job's checkpoints and
only for its own attempt; the gateway and tools see only their team's jobs; certificates the job issuer may
not vouch for, and expired ones, are refused; the real client saves and loads with a minted credential."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import stat
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from cryptography import x509

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.clock import ManualClock
from trainyard_core.rpc.server import CHANNEL_OPTIONS
from trainyard_core.security import identity, job_credentials, pki
from trainyard_core.security.job_credentials import JobCredential, JobGrant, JobIssuer
from trainyard_core.security.tls import ClientTls, target_name_option
from trainyard_core.testing import accounts

from .checkpoint_support import Client, dcp_like_files, location_dir, rpc_error, write_shards
from .conftest import running_app
from .scripts.gang import Zygote, job_env, run_gang, zygote_fixture  # noqa: F401 - the zygote fixture

TEAM_HEADER = "x-trainyard-team"


@pytest.fixture
def job_pki(pki_dir: Path) -> Path:
    pki.ensure(pki_dir, [], job_issuer=True)
    return pki_dir


@pytest.fixture
def issuer(job_pki: Path) -> JobIssuer:
    cert, key = pki.job_issuer_files(job_pki)
    return JobIssuer(cert, key, job_pki / "ca.pem", ttl_s=3600)


@pytest.fixture
async def tls_app(storage_root: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path,
                  clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    settings = CheckpointSettings(listen_host="127.0.0.1", listen_port=0, storage_url=storage_root.as_uri(),
                                  **etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                                  shutdown_grace_s=1.0, gc_interval_s=0, tool_teams=["ops:ml", "ops:research"],
                                  **pki.files_for(job_pki, identity.CHECKPOINT_STORE).settings())
    async with running_app(settings, clock) as app:
        yield app


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _pem_channel(app: CheckpointApp, chain: bytes, key: bytes, ca: bytes) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
    return grpc.aio.secure_channel(f"127.0.0.1:{app.grpc_port}", creds,
                                   options=[*CHANNEL_OPTIONS, target_name_option(identity.CHECKPOINT_STORE)])


@contextlib.asynccontextmanager
async def as_job(app: CheckpointApp, cred: JobCredential) -> AsyncIterator[Client]:
    channel = _pem_channel(app, cred.cert_chain, cred.key, cred.ca)
    try:
        yield Client(pb_grpc.CheckpointServiceStub(channel))
    finally:
        await channel.close()


class _TeamHeader(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, team: str) -> None:
        self._team = team

    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), (TEAM_HEADER, self._team)]
        return await continuation(details._replace(metadata=metadata), request)


@contextlib.asynccontextmanager
async def as_service(app: CheckpointApp, directory: Path, principal: identity.Principal,
                     team: str = "") -> AsyncIterator[Client]:
    """A gateway, tool or scheduler channel, naming `team` in every call's metadata when given."""
    tls = ClientTls(pki.files_for(directory, principal))
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{app.grpc_port}", tls.credentials(),
        options=[*CHANNEL_OPTIONS, target_name_option(identity.CHECKPOINT_STORE)],
        interceptors=[_TeamHeader(team)] if team else None)
    try:
        yield Client(pb_grpc.CheckpointServiceStub(channel))
    finally:
        await channel.close()


async def _save(client: Client, job_id: str, step: int, attempt: int = 0) -> pb.Checkpoint:
    ckpt = await client.begin(job_id, step, world_size=1, attempt=attempt)
    return await client.commit(ckpt.id, write_shards(ckpt, dcp_like_files(1, step)))


async def test_a_job_credential_reaches_only_its_own_jobs_checkpoints(tls_app: CheckpointApp,
                                                                       issuer: JobIssuer) -> None:
    a = issuer.credential("job-a", 0, "ml", _now())
    b = issuer.credential("job-b", 0, "ml", _now())
    async with as_job(tls_app, a) as job_a, as_job(tls_app, b) as job_b:
        theirs = await _save(job_b, "job-b", 1)
        writing = await job_b.begin("job-b", 2, world_size=1)
        mine = await _save(job_a, "job-a", 1)
        assert (await job_a.latest("job-a")).id == mine.id

        refusals = {
            "get": job_a.get(theirs.id),
            "latest": job_a.latest("job-b"),
            "list": job_a.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id="job-b")),
            "begin": job_a.begin("job-b", 3, world_size=1),
            "commit": job_a.commit(writing.id, write_shards(writing, dcp_like_files(1, 2))),
            "abort": job_a.abort(writing.id),
            "lease": job_a.acquire(theirs.id),
            "damaged": job_a.stub.ReportDamaged(pb.ReportDamagedRequest(checkpoint_id=theirs.id)),
        }
        for what, call in refusals.items():
            err = await rpc_error(call)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (what, err.details())
            assert "trainyard://job/job-a" in err.details() and "job-b" in err.details(), (what, err.details())

        # Deleting is not a worker's call at all, for any job.
        for ckpt in (theirs, mine):
            err = await rpc_error(job_a.delete(ckpt.id))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
            assert "trainyard://job/job-a may not call" in err.details()
        # Nothing of job B changed.
        assert (await job_b.get(writing.id)).state == pb.CHECKPOINT_STATE_WRITING
        assert (await job_b.latest("job-b")).id == theirs.id


async def test_a_stale_attempts_credential_cannot_commit_after_the_next_attempt_began(
        tls_app: CheckpointApp, issuer: JobIssuer) -> None:
    first = issuer.credential("job-s", 1, "ml", _now())
    second = issuer.credential("job-s", 2, "ml", _now())
    async with as_job(tls_app, first) as old, as_job(tls_app, second) as new:
        err = await rpc_error(old.begin("job-s", 1, world_size=1, attempt=2))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "attempt 1's" in err.details(), err.details()

        pending = await old.begin("job-s", 1, world_size=1, attempt=1)
        shards = write_shards(pending, dcp_like_files(1, 1))
        begun = await new.begin("job-s", 2, world_size=1, attempt=2)
        # The attempt fence: attempt 2 has begun a checkpoint, so attempt 1's may not be committed any more.
        err = await rpc_error(old.commit(pending.id, shards))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        # And attempt 1's credential may not touch what attempt 2 began.
        for call in (old.commit(begun.id, write_shards(begun, dcp_like_files(1, 2))), old.abort(begun.id)):
            err = await rpc_error(call)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
            assert "attempt 2 began it" in err.details(), err.details()
        # The current attempt's credential commits.
        done = await new.commit(begun.id, write_shards(begun, dcp_like_files(1, 2)))
        assert done.state == pb.CHECKPOINT_STATE_COMMITTED
        # Reads stay open to every attempt of the job (a restarted attempt resumes from them).
        assert (await old.latest("job-s")).id == begun.id


async def test_the_gateway_and_tools_see_only_their_teams_jobs(tls_app: CheckpointApp, issuer: JobIssuer,
                                                               job_pki: Path) -> None:
    async with as_job(tls_app, issuer.credential("job-ml", 0, "ml", _now())) as worker:
        saved = await _save(worker, "job-ml", 1)
    for principal in (identity.GATEWAY, identity.tool("ops")):
        async with as_service(tls_app, job_pki, principal, team="ml") as ours:
            assert (await ours.latest("job-ml")).id == saved.id
            assert (await ours.get(saved.id)).step == 1
            await ours.tag(saved.id, "best")
        async with as_service(tls_app, job_pki, principal, team="research") as other:
            for call in (other.get(saved.id), other.latest("job-ml"), other.delete(saved.id),
                         other.tag(saved.id, "mine"), other.set_retention("job-ml", keep_last=1),
                         other.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id="job-ml"))):
                err = await rpc_error(call)
                assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
        # Malformed or missing ids get the servicer's own INVALID_ARGUMENT, before anything is looked up.
        async with as_service(tls_app, job_pki, principal, team="ml") as ours:
            err = await rpc_error(ours.stub.ListCheckpoints(pb.ListCheckpointsRequest()))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == "job_id is required"
            err = await rpc_error(ours.get("not-a-checkpoint"))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a checkpoint id" in err.details()
        async with as_service(tls_app, job_pki, principal, team="research") as other:
            # The same answer as for a checkpoint that does not exist at all.
            absent = await rpc_error(other.get("ckpt-00000000000000000000"))
            assert (await rpc_error(other.get(saved.id))).details() == \
                absent.details().replace("ckpt-00000000000000000000", saved.id)
        async with as_service(tls_app, job_pki, principal) as unnamed:
            err = await rpc_error(unnamed.get(saved.id))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and TEAM_HEADER in err.details()
        async with as_service(tls_app, job_pki, principal, team="Not_A_Team") as bad:
            err = await rpc_error(bad.get(saved.id))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a team" in err.details()
    # A tool acts only for the teams tool_teams binds it to (the gateway is trusted with its users' teams).
    async with as_service(tls_app, job_pki, identity.tool("ops"), team="vision") as unbound:
        err = await rpc_error(unbound.latest("job-ml"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
        assert "may not act for team 'vision'; its teams: ml, research" in err.details()
    # The scheduler acts on any job, without a team.
    async with as_service(tls_app, job_pki, identity.SCHEDULER) as scheduler:
        assert (await scheduler.get(saved.id)).tags == ["best"]
    # A node is no checkpoint caller at all.
    async with as_service(tls_app, job_pki, identity.node("node-1"), team="ml") as node:
        err = await rpc_error(node.get(saved.id))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_the_team_recorded_is_the_first_credentials_and_cannot_change(tls_app: CheckpointApp,
                                                                            issuer: JobIssuer) -> None:
    async with as_job(tls_app, issuer.credential("job-t", 0, "ml", _now())) as worker:
        await _save(worker, "job-t", 1)
    async with as_job(tls_app, issuer.credential("job-t", 1, "research", _now())) as moved:
        err = await rpc_error(moved.latest("job-t"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "recorded for team ml" in err.details() and "team research" in err.details(), err.details()


async def test_certificates_the_job_issuer_may_not_vouch_for_are_refused(tls_app: CheckpointApp,
                                                                         job_pki: Path) -> None:
    ca_cert, ca_key = pki._load_ca(job_pki)
    issuer_cert_path, issuer_key_path = pki.job_issuer_files(job_pki)
    issuer = job_credentials.load_issuer(issuer_cert_path, issuer_key_path, job_pki / "ca.pem")
    ca_pem = (job_pki / "ca.pem").read_bytes()
    # The job issuer's key minting a scheduler certificate (the scheduler's issuer must not make service
    # identities).
    forged_cert, forged_key = pki.issue(issuer.cert, issuer.key, identity.SCHEDULER)
    channel = _pem_channel(tls_app, forged_cert + issuer.cert_pem, forged_key, ca_pem)
    try:
        err = await rpc_error(Client(pb_grpc.CheckpointServiceStub(channel)).get("ckpt-00000000000000000000"))
    finally:
        await channel.close()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert "a job issuer signs job certificates only" in err.details()
    # A job certificate signed by the CA directly, not by a job issuer.
    direct_cert, direct_key, _ = job_credentials.mint(ca_cert, ca_key, JobGrant("job-a", 0, "ml"), now=_now(),
                                                      ttl=dt.timedelta(hours=1))
    channel = _pem_channel(tls_app, direct_cert, direct_key, ca_pem)
    try:
        err = await rpc_error(Client(pb_grpc.CheckpointServiceStub(channel)).latest("job-a"))
    finally:
        await channel.close()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert "must be signed by a job issuer" in err.details()


async def test_an_expired_job_certificate_does_not_get_through_the_handshake(tls_app: CheckpointApp,
                                                                              job_pki: Path) -> None:
    cert_path, key_path = pki.job_issuer_files(job_pki)
    issuer = job_credentials.load_issuer(cert_path, key_path, job_pki / "ca.pem")
    past = _now() - dt.timedelta(hours=2)
    cert, key, not_after = job_credentials.mint(issuer.cert, issuer.key, JobGrant("job-a", 0, "ml"), now=past,
                                                ttl=dt.timedelta(hours=1))
    assert not_after < _now()
    channel = _pem_channel(tls_app, cert + issuer.cert_pem, key, issuer.ca_pem)
    try:
        err = await rpc_error(Client(pb_grpc.CheckpointServiceStub(channel)).latest("job-a"))
    finally:
        await channel.close()
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()


async def test_the_real_client_saves_and_loads_with_a_minted_credential(
        tls_app: CheckpointApp, issuer: JobIssuer, job_pki: Path, tmp_path: Path, zygote: Zygote) -> None:
    cred = issuer.credential("job-e2e", 0, "ml", _now())
    env = job_env(f"127.0.0.1:{tls_app.grpc_port}", "job-e2e")
    del env["TRAINYARD_CHECKPOINT_PLAINTEXT"]
    env.update(cred.env())
    saved = await run_gang(zygote, ["save", "1", "2"], world_size=2, env=env, out=tmp_path / "save")
    assert [r["step"] for r in saved[0]["saved"]] == [1, 2]
    loaded = await run_gang(zygote, ["load"], world_size=1, env=env, out=tmp_path / "load")
    assert loaded[0]["step"] == 2 and loaded[0]["mismatches"] == [], loaded
    async with as_service(tls_app, job_pki, identity.tool("ops"), team="ml") as ops:
        assert (await ops.latest("job-e2e")).step == 2
    # Without a credential and without saying plaintext, the client does not start.
    del env[job_credentials.CERT_ENV], env[job_credentials.KEY_ENV], env[job_credentials.CA_ENV]
    with pytest.raises(AssertionError, match="no checkpoint-store credential"):
        await run_gang(zygote, ["load"], world_size=1, env=env, out=tmp_path / "none")


def test_minted_certificates_name_the_job_attempt_and_team(issuer: JobIssuer) -> None:
    now = _now()
    cred = issuer.credential("job-x", 3, "ml", now)
    leaf, chained_issuer = x509.load_pem_x509_certificates(cred.cert_chain)
    assert pki.principal_of(leaf) == identity.job("job-x")
    assert job_credentials.grant_of(leaf, identity.job("job-x")) == JobGrant("job-x", 3, "ml")
    assert pki.is_job_issuer_name(leaf.issuer) and pki.is_job_issuer_name(chained_issuer.subject)
    assert leaf.not_valid_before_utc <= now - dt.timedelta(seconds=59)
    assert leaf.not_valid_after_utc == cred.not_after
    assert abs((cred.not_after - now) - dt.timedelta(hours=1)) < dt.timedelta(seconds=1)
    assert "BEGIN" not in repr(cred), "the key must not appear in a repr"
    # One credential per attempt, shared by its nodes; another attempt gets its own.
    assert issuer.credential("job-x", 3, "ml", now) is cred
    assert issuer.credential("job-x", 4, "ml", now) is not cred
    # Past half its lifetime, the next launch of the attempt gets a fresh one.
    assert issuer.credential("job-x", 3, "ml", now + dt.timedelta(minutes=31)) is not cred



# Teams apart on a POSIX storage: the store hands each checkpoint directory to its job's team (`run_as`, the
# agents' mapping), and workers write their shards as their team's uid, umask 077, as the agent runs them.
ML, RESEARCH = (2001, 2001), (2002, 2002)
RUN_AS = {"ml": "2001:2001", "research": "2002:2002"}



@pytest.fixture
async def teams_app(public_tmp: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path,
                    clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    if os.geteuid() != 0:
        pytest.fail("teams apart on the storage need root (the store hands directories to other uids); "
                    "make test runs as root")
    settings = CheckpointSettings(listen_host="127.0.0.1", listen_port=0,
                                  storage_url=(public_tmp / "checkpoints").as_uri(), run_as=RUN_AS,
                                  **etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                                  shutdown_grace_s=1.0, gc_interval_s=0, tool_teams=["ops:ml"],
                                  **pki.files_for(job_pki, identity.CHECKPOINT_STORE).settings())
    async with running_app(settings, clock) as app:
        yield app


def _as_uid(user: tuple[int, int], *argv: str) -> subprocess.CompletedProcess[str]:
    return accounts.run_as(user[0], user[1], *argv)


async def test_workers_save_as_their_teams_uid_and_other_teams_cannot_read(
        teams_app: CheckpointApp, issuer: JobIssuer, job_pki: Path, public_tmp: Path, zygote: Zygote) -> None:
    cred = issuer.credential("job-ml", 0, "ml", _now())
    env = job_env(f"127.0.0.1:{teams_app.grpc_port}", "job-ml")
    del env["TRAINYARD_CHECKPOINT_PLAINTEXT"]
    env.update(cred.env(), HOME=str(public_tmp))
    out = public_tmp / "out"
    for sub in (out, out / "save", out / "load"):  # where each rank writes its report, as the team's uid
        sub.mkdir()
        os.chown(sub, *ML)
    saved = await run_gang(zygote, ["save", "1", "2"], world_size=2, env=env, out=out / "save", user=ML)
    assert [r["step"] for r in saved[0]["saved"]] == [1, 2]
    loaded = await run_gang(zygote, ["load"], world_size=1, env=env, out=out / "load", user=ML)
    assert loaded[0]["step"] == 2 and loaded[0]["mismatches"] == [], loaded

    async with as_service(teams_app, job_pki, identity.tool("ops"), team="ml") as ops:
        latest = await ops.latest("job-ml")
    directory = location_dir(latest.location)
    root = directory.parent.parent
    for path, owner, mode in ((root, (0, 0), 0o711), (directory.parent, (0, 0), 0o711), (directory, ML, 0o700)):
        st = os.lstat(path)
        assert ((st.st_uid, st.st_gid), stat.S_IMODE(st.st_mode)) == (owner, mode), path
    shards = [p for p in directory.iterdir() if p.name.endswith(".distcp")]
    assert shards and all((p.stat().st_uid, stat.S_IMODE(p.stat().st_mode)) == (ML[0], 0o600) for p in shards)

    # Another team's uid lists nothing and reads nothing of it; the team's own uid does.
    for argv in (("ls", str(root)), ("ls", str(directory)), ("cat", str(shards[0]))):
        denied = _as_uid(RESEARCH, *argv)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, (argv, denied)
    assert _as_uid(ML, "wc", "-c", str(shards[0])).stdout.split()[0] == str(shards[0].stat().st_size)

    # A job of a team the store has no identity for cannot begin: its workers could not write, nor be apart.
    stranger = issuer.credential("job-vision", 0, "vision", _now())
    async with as_job(teams_app, stranger) as job:
        err = await rpc_error(job.begin("job-vision", 1, world_size=1))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert "team 'vision' has no Unix identity" in err.details() and "run_as" in err.details()
