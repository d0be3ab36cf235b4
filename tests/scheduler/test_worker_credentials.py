"""The scheduler mints each attempt's checkpoint-store credential and hands it to the workers through the
launch, with a real agent over mTLS: every rank of the attempt gets the same certificate for its job,
attempt and team, in files the agent wrote (their paths in the environment, the key in none); the key is in
no etcd value and in no log record."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.scheduler.test_scheduler_tls import OPS, agent_settings, sched_settings
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, job_credentials, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.settings import SettingsError
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.worker_credentials import WorkerCredentials

ENV_NAMES = (job_credentials.CERT_ENV, job_credentials.KEY_ENV, job_credentials.CA_ENV,
             job_credentials.PLAINTEXT_ENV, "TRAINYARD_CHECKPOINT_STORE", "TRAINYARD_JOB_ID", "TRAINYARD_ATTEMPT")
# Each rank writes the credential variables it was started with, and what the files they name hold.
DUMP = ("import json, os, sys; env = {k: os.environ.get(k, '') for k in sys.argv[2:]}; "
        "files = {k: open(env[k]).read() for k in sys.argv[2:5] if env[k]}; "
        "json.dump({'env': env, 'files': files, 'environ': ''.join(os.environ.values())}, "
        "open(sys.argv[1] + '/rank' + os.environ['RANK'] + '.json', 'w'))")


def _issuer_settings(pki_dir: Path) -> dict[str, str]:
    cert, key = pki.job_issuer_files(pki_dir)
    return {"job_issuer_cert_file": str(cert), "job_issuer_key_file": str(key)}


@pytest.fixture
def job_pki(pki_dir: Path) -> Path:
    pki.ensure(pki_dir, [], job_issuer=True)
    return pki_dir


@pytest.fixture
async def minting_leader(etcd_settings: dict[str, str], key_prefix: str,
                         job_pki: Path) -> AsyncIterator[SchedulerApp]:
    base = sched_settings(etcd_settings, key_prefix.rstrip("/"), pki.files_for(job_pki, identity.SCHEDULER))
    settings = SchedulerSettings.model_validate({**base.model_dump(), **_issuer_settings(job_pki),
                                                 "checkpoint_store_address": "127.0.0.1:1"})
    app = SchedulerApp(settings)
    await app.start()

    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, what="the scheduler to lead")
    yield app
    await app.stop()


async def test_every_rank_of_an_attempt_gets_its_credential_which_is_never_stored_or_logged(
        minting_leader: SchedulerApp, tmp_path: Path, job_pki: Path, etcd_options: EtcdOptions, key_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "env"
    out.mkdir()
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{minting_leader.grpc_port}",
                                    pki.files_for(job_pki, identity.node("node-1"))))
    await agent.start()
    try:
        async with secure_channel(f"127.0.0.1:{minting_leader.grpc_port}", ClientTls(pki.files_for(job_pki, OPS)),
                                  identity.SCHEDULER) as ch:
            jobs = scheduler_pb2_grpc.JobServiceStub(ch)
            nodes = scheduler_pb2_grpc.NodeServiceStub(ch)

            async def registered() -> bool:
                return len((await nodes.ListNodes(scheduler_pb2.ListNodesRequest())).nodes) == 1

            await eventually(registered, what="node-1 registered")
            sub = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
                spec=types_pb2.JobSpec(name="creds", command=[sys.executable, "-c", DUMP, str(out), *ENV_NAMES],
                                       resources=types_pb2.Resources(nodes=1, gpus_per_node=2)),
                team="team-a", user="ann"))

            async def succeeded() -> types_pb2.Job | None:
                job = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=sub.job.id, team="team-a"))).job
                return job if job.state == types_pb2.JOB_STATE_SUCCEEDED else None

            job = await eventually(succeeded, timeout=30, what="the job to succeed")
    finally:
        await agent.stop(kill_workers=True)

    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0]["files"] == seen[1]["files"], "one credential per attempt, the same for every rank"
    # The environment names the files; the key is in no worker's environment.
    paths = {name: Path(seen[0]["env"][name]) for name in job_credentials.CREDENTIAL_ENVS}
    assert {p.parent for p in paths.values()} == {Path(agent.settings.workdir_root) / job.id / ".trainyard"}
    assert all("PRIVATE KEY" not in s["environ"] for s in seen)
    env = {**seen[0]["env"], **seen[0]["files"]}
    assert env[job_credentials.PLAINTEXT_ENV] == ""
    leaf, issuer = x509.load_pem_x509_certificates(env[job_credentials.CERT_ENV].encode())
    principal = pki.principal_of(leaf)
    assert principal == identity.job(job.id)
    assert job_credentials.grant_of(leaf, principal) == job_credentials.JobGrant(job.id, job.attempt, "team-a")
    assert str(job.attempt) == env["TRAINYARD_ATTEMPT"]
    assert issuer.subject == leaf.issuer and pki.is_job_issuer_name(issuer.subject)
    key = serialization.load_pem_private_key(env[job_credentials.KEY_ENV].encode(), password=None)
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(serialization.Encoding.DER, spki) == \
        leaf.public_key().public_bytes(serialization.Encoding.DER, spki)
    assert env[job_credentials.CA_ENV] == (job_pki / "ca.pem").read_text()

    # Built at launch, never stored: no etcd value holds the key or the certificate.
    key_body = env[job_credentials.KEY_ENV].splitlines()[1]
    cert_body = env[job_credentials.CERT_ENV].splitlines()[1]
    store = EtcdStore.from_options(etcd_options)
    try:
        kvs = (await store.range(key_prefix)).kvs
    finally:
        await store.close()
    assert any(kv.key.endswith(f"/jobs/{job.id}") for kv in kvs), "the job record is where the test looks"
    for kv in kvs:
        assert key_body.encode() not in kv.value and cert_body.encode() not in kv.value, kv.key
    # ... and never logged, by the scheduler or the agent.
    assert caplog.records, "the services log at INFO and above"
    for record in caplog.records:
        text = f"{record.getMessage()} {record.__dict__}"
        assert "PRIVATE KEY" not in text and key_body not in text and cert_body not in text, record.getMessage()


def test_the_job_issuer_settings_go_together_and_need_the_ca(job_pki: Path) -> None:
    tls = pki.files_for(job_pki, identity.SCHEDULER).settings()
    cert, _ = pki.job_issuer_files(job_pki)
    with pytest.raises(ValueError, match="job_issuer_cert_file and job_issuer_key_file go together"):
        SchedulerSettings.model_validate({**tls, "job_issuer_cert_file": str(cert)})
    with pytest.raises(ValueError, match="needs the mTLS files"):
        SchedulerSettings.model_validate({"insecure_plaintext": True, **_issuer_settings(job_pki)})
    with pytest.raises(ValueError, match="job_credential_ttl_s"):
        SchedulerSettings.model_validate({**tls, "job_credential_ttl_s": 10})


def test_an_unusable_job_issuer_stops_the_start_naming_the_file(job_pki: Path) -> None:
    tls = pki.files_for(job_pki, identity.SCHEDULER)
    # The scheduler's own certificate is no CA, let alone a job issuer.
    wrong = SchedulerSettings.model_validate({**tls.settings(), "job_issuer_cert_file": str(tls.cert),
                                              "job_issuer_key_file": str(tls.key)})
    with pytest.raises(SettingsError, match=f"{tls.cert} is not a CA certificate"):
        WorkerCredentials.from_settings(wrong)
    cert, _ = pki.job_issuer_files(job_pki)
    mismatched = SchedulerSettings.model_validate({**tls.settings(), "job_issuer_cert_file": str(cert),
                                                   "job_issuer_key_file": str(tls.key)})
    with pytest.raises(SettingsError, match="is not the private key of"):
        WorkerCredentials.from_settings(mismatched)


def test_without_an_issuer_workers_get_no_credential_and_plaintext_only_when_the_scheduler_is(
        job_pki: Path) -> None:
    store = {"checkpoint_store_address": "10.0.0.5:50053"}
    tls = SchedulerSettings.model_validate({**pki.files_for(job_pki, identity.SCHEDULER).settings(), **store})
    assert WorkerCredentials.from_settings(tls).env("job-a", 0, "ml") == {}
    plain = SchedulerSettings.model_validate({"insecure_plaintext": True, **store})
    assert WorkerCredentials.from_settings(plain).env("job-a", 0, "ml") == {job_credentials.PLAINTEXT_ENV: "1"}
    # No checkpoint-store at all: nothing to reach, nothing minted.
    minting = SchedulerSettings.model_validate({**pki.files_for(job_pki, identity.SCHEDULER).settings(),
                                                **_issuer_settings(job_pki)})
    assert WorkerCredentials.from_settings(minting).env("job-a", 0, "ml") == {}
