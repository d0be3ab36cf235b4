"""The leader renews running attempts' checkpoint-store credentials, with the real services over mTLS: the
scheduler (real etcd), a node agent running real worker processes, and the checkpoint-store.

- A job whose credential lives 6 seconds (given to the scheduler through its constructor: the settings allow
  no less than 600 s) saves a checkpoint after its first credential has expired, with the client it opened
  before (which follows the renewed files) and with a new one (a new TLS handshake: only a renewed certificate
  gets through), and succeeds.
- After a leader change the new leader renews every running attempt at once, as it cannot know when its
  predecessor last did: the credential on the node changes long before half its hour is gone.
Both check that the renewals are audited, counted, and never logged with the key."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from tests.scheduler.test_scheduler_tls import OPS, agent_settings, sched_settings
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.workers.model import LogQuery
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.audit import AuditFilter, AuditLog
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, job_credentials, pki
from trainyard_core.security.job_credentials import JobIssuer
from trainyard_core.security.tls import ClientTls
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.wait import eventually
from trainyard_scheduler import metrics
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.credential_renewal import RenewalSettings
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.worker_credentials import WorkerCredentials

RENEW = "/trainyard.agent.v1.AgentService/RenewJobCredential"
SHORT_TTL_S = 6

# Opens its client with the credential it starts with, outlives that credential, then saves twice.
TRAINER = textwrap.dedent("""
    import datetime as dt, json, logging, os, sys, time
    import torch
    from cryptography import x509
    from trainyard_checkpoint.client import CheckpointClient

    def leaf(path):
        with open(path, "rb") as f:
            return x509.load_pem_x509_certificates(f.read())[0]

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cert_path = os.environ["TRAINYARD_CHECKPOINT_CERT"]
    first = leaf(cert_path)
    client = CheckpointClient.from_env()
    state = {"w": torch.arange(8, dtype=torch.float32)}
    resumed = client.load_latest(state)  # a first call, made with the first credential
    # The training outlives its first credential. 1.5 s more: renewals (every 3 s) land about when the previous
    # credential expires, so the saves come between two of them (a read during one: test_client_credential_reload).
    while dt.datetime.now(dt.UTC) <= first.not_valid_after_utc + dt.timedelta(seconds=1.5):
        time.sleep(0.1)
    saved_at = dt.datetime.now(dt.UTC)
    saved = client.save(state, 1)
    with CheckpointClient.from_env() as fresh:  # a new connection, made after the first credential expired
        fresh_saved = fresh.save(state, 2)
    report = {"resumed": resumed, "first_serial": first.serial_number,
              "first_not_after": first.not_valid_after_utc.isoformat(), "saved_at": saved_at.isoformat(),
              "saved": [saved.step, saved.state], "fresh_saved": [fresh_saved.step, fresh_saved.state],
              "serial_now": leaf(cert_path).serial_number, "channels": client.service().channels_built,
              "env": {k: os.environ.get(k, "") for k in sys.argv[2:]},
              "key_in_environ": "PRIVATE KEY" in "".join(os.environ.values())}
    client.close()
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
""")
# Says where its credential is, then waits to be told to end.
WAITER = textwrap.dedent("""
    import os, sys, time
    out = sys.argv[1]
    with open(os.path.join(out, "cert-path.tmp"), "w") as f:
        f.write(os.environ["TRAINYARD_CHECKPOINT_CERT"])
    os.rename(os.path.join(out, "cert-path.tmp"), os.path.join(out, "cert-path"))
    while not os.path.exists(os.path.join(out, "end")):
        time.sleep(0.05)
""")
NAMES = [job_credentials.CERT_ENV, job_credentials.KEY_ENV, job_credentials.CA_ENV]


@pytest.fixture
def job_pki(pki_dir: Path) -> Path:
    pki.ensure(pki_dir, [], job_issuer=True)
    return pki_dir


def _scheduler_settings(etcd_settings: dict[str, str], key_prefix: str, job_pki: Path,
                        store_address: str) -> SchedulerSettings:
    base = sched_settings(etcd_settings, key_prefix.rstrip("/"), pki.files_for(job_pki, identity.SCHEDULER))
    cert, key = pki.job_issuer_files(job_pki)
    return SchedulerSettings.model_validate({**base.model_dump(), "job_issuer_cert_file": str(cert),
                                             "job_issuer_key_file": str(key),
                                             "checkpoint_store_address": store_address})


@pytest.fixture
async def store(tmp_path: Path, etcd_settings: dict[str, str], key_prefix: str,
                job_pki: Path) -> AsyncIterator[CheckpointApp]:
    (tmp_path / "ckpt").mkdir()
    app = CheckpointApp(CheckpointSettings.model_validate(dict(
        listen_host="127.0.0.1", listen_port=0, storage_url=(tmp_path / "ckpt").as_uri(), **etcd_settings,
        etcd_prefix=key_prefix.rstrip("/"), shutdown_grace_s=1.0, gc_interval_s=0,
        **pki.files_for(job_pki, identity.CHECKPOINT_STORE).settings())))
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def _leads(app: SchedulerApp) -> None:
    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, timeout=20, what="the scheduler to lead")


async def _submit(port: int, job_pki: Path, name: str, command: list[str]) -> str:
    async with secure_channel(f"127.0.0.1:{port}", ClientTls(pki.files_for(job_pki, OPS)), identity.SCHEDULER) as ch:
        nodes = scheduler_pb2_grpc.NodeServiceStub(ch)

        async def registered() -> bool:
            return len((await nodes.ListNodes(scheduler_pb2.ListNodesRequest())).nodes) == 1

        await eventually(registered, timeout=20, what="node-1 registered")
        sub = await scheduler_pb2_grpc.JobServiceStub(ch).SubmitJob(scheduler_pb2.SubmitJobRequest(
            spec=types_pb2.JobSpec(name=name, command=command,
                                   resources=types_pb2.Resources(nodes=1, gpus_per_node=1)),
            team="team-a", user="ann"))
    return str(sub.job.id)


async def _finished(port: int, job_pki: Path, job_id: str, timeout: float) -> types_pb2.Job:
    async with secure_channel(f"127.0.0.1:{port}", ClientTls(pki.files_for(job_pki, OPS)), identity.SCHEDULER) as ch:
        jobs = scheduler_pb2_grpc.JobServiceStub(ch)

        async def done() -> types_pb2.Job | None:
            job = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id, team="team-a"))).job
            return job if job.state in (types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED) else None

        job: types_pb2.Job = await eventually(done, timeout=timeout, what="the job to end")
        return job


async def _logs(agent: AgentApp, job_id: str) -> str:
    assert agent.supervisor is not None
    return "\n".join(line.text for line in await agent.supervisor.read_logs(LogQuery(job_id=job_id)))[-3000:]


def _no_key_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert caplog.records
    for record in caplog.records:
        text = f"{record.getMessage()} {record.__dict__}"
        assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text, record.getMessage()


def _ok_renewals() -> float:
    return float(metrics.CREDENTIAL_RENEWALS.labels("ok")._value.get())


async def _renewal_entries(etcd_store: EtcdStore, key_prefix: str, job_id: str) -> list[object]:
    log = AuditLog(etcd_store, key_prefix.rstrip("/"))
    return list((await log.query(AuditFilter(action=RENEW, target=f"job/{job_id}"))).entries)


async def test_a_job_saves_after_its_first_credential_expired_because_the_leader_renewed_it(
        tmp_path: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path, store: CheckpointApp,
        etcd_store: EtcdStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    settings = _scheduler_settings(etcd_settings, key_prefix, job_pki, f"127.0.0.1:{store.grpc_port}")
    cert, key = pki.job_issuer_files(job_pki)
    short = WorkerCredentials(JobIssuer(cert, key, job_pki / "ca.pem", ttl_s=SHORT_TTL_S), plaintext=False)
    leader = SchedulerApp(settings, worker_credentials=short, renewal=RenewalSettings(interval_s=0.5))
    await leader.start()
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{leader.grpc_port}",
                                    pki.files_for(job_pki, identity.node("node-1"))))
    script, out = tmp_path / "trainer.py", tmp_path / "report.json"
    script.write_text(TRAINER)
    before = _ok_renewals()
    try:
        await _leads(leader)
        await agent.start()
        job_id = await _submit(leader.grpc_port, job_pki, "renewed", [sys.executable, str(script), str(out), *NAMES])
        job = await _finished(leader.grpc_port, job_pki, job_id, timeout=90)
        logs = await _logs(agent, job_id)
        assert job.state == types_pb2.JOB_STATE_SUCCEEDED, f"{job.message}\n{logs}"
    finally:
        await agent.stop(kill_workers=True)
        await leader.stop()
    report = json.loads(out.read_text())
    assert report["saved_at"] > report["first_not_after"], "the saves came after the first credential expired"
    assert report["saved"] == [1, "COMMITTED"] and report["fresh_saved"] == [2, "COMMITTED"]
    assert report["serial_now"] != report["first_serial"], "the files hold a renewed credential"
    assert report["channels"] >= 2, f"the long-lived client built a channel with the renewed credential\n{logs}"
    # The workers got files, under the job's own directory, and no key.
    workdir = Path(agent.settings.workdir_root) / job_id / ".trainyard"
    assert {Path(v).parent for v in report["env"].values()} == {workdir}
    assert report["key_in_environ"] is False
    # Renewed more than once (every 3 s for some 10 s), each recorded on the scheduler's side, counted, and
    # logged without the key.
    assert _ok_renewals() - before >= 2
    entries = await _renewal_entries(etcd_store, key_prefix, job_id)
    assert len(entries) >= 2
    assert all(e.principal == "trainyard://scheduler" and e.detail["callee"] == "node/node-1"  # type: ignore[attr-defined]
               for e in entries)
    _no_key_logged(caplog)


async def test_a_new_leader_renews_every_running_attempt_at_once(
        tmp_path: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path, store: CheckpointApp,
        etcd_store: EtcdStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    # The production default: an hour, renewed at half.
    settings = _scheduler_settings(etcd_settings, key_prefix, job_pki, f"127.0.0.1:{store.grpc_port}")
    assert settings.job_credential_ttl_s == 3600
    first, second = SchedulerApp(settings), SchedulerApp(settings)
    await first.start()
    await _leads(first)
    await second.start()
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{first.grpc_port},127.0.0.1:{second.grpc_port}",
                                    pki.files_for(job_pki, identity.node("node-1"))))
    script, out = tmp_path / "waiter.py", tmp_path / "out"
    script.write_text(WAITER)
    out.mkdir()
    stopped_first = False
    try:
        async def first_pass() -> bool:
            return first.renewer is not None and first.renewer.passes >= 1

        await eventually(first_pass, timeout=10, what="the first leader's first renewal pass")
        await agent.start()
        job_id = await _submit(first.grpc_port, job_pki, "waits", [sys.executable, str(script), str(out)])

        async def cert_path() -> Path | None:
            return Path((out / "cert-path").read_text()) if (out / "cert-path").exists() else None

        path = await eventually(cert_path, timeout=30, what="the worker to start")
        launched = x509.load_pem_x509_certificates(path.read_bytes())[0]
        assert first.renewer is not None and first.renewer.renewed == 0, "nothing is due within the first half hour"

        await first.stop()
        stopped_first = True
        await _leads(second)

        async def renewed() -> bool:
            return second.renewer is not None and second.renewer.renewed >= 1

        await eventually(renewed, timeout=20, what="the new leader to renew the running attempt")
        fresh = x509.load_pem_x509_certificates(path.read_bytes())[0]
        assert fresh.serial_number != launched.serial_number
        assert fresh.not_valid_after_utc >= launched.not_valid_after_utc
        assert second.renewer is not None and second.renewer.renewed == 1, "once: then it knows what the node holds"
        (out / "end").touch()
        job = await _finished(second.grpc_port, job_pki, job_id, timeout=30)
        assert job.state == types_pb2.JOB_STATE_SUCCEEDED, job.message
    finally:
        await agent.stop(kill_workers=True)
        await second.stop()
        if not stopped_first:
            await first.stop()
    [entry] = await _renewal_entries(etcd_store, key_prefix, job_id)
    assert entry.result == "ok"  # type: ignore[attr-defined]
    _no_key_logged(caplog)
