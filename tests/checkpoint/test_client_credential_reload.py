"""The worker's checkpoint client follows its renewed credential without a restart: the real blocking client
(`ServiceClient`, what the saver and the coordinator rank use) against the real checkpoint-store on mTLS, with
its credential in files replaced as the agent replaces them (one rename per file).

- A call that fails at the handshake because the certificate expired (after a reconnect: the store was
  restarted) reads the renewed files and succeeds on a new channel; a client whose credential came as PEM
  has nothing to read and fails, which is what the first would do without the reload.
- Before a call, a changed file is noticed (at most once per check interval) and the channel rebuilt, with no
  failure first; a key replaced before its certificate (mid-renewal) is not taken, the credential that works is
  kept, and the pair is taken once whole.
- The environment: paths are followed, PEM is not; a mismatched pair read at start settles or is refused."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.client import credentials as client_credentials
from trainyard_checkpoint.client.credentials import CredentialSource, KeyMismatch, WorkerTls
from trainyard_checkpoint.client.env import ClientSettings
from trainyard_checkpoint.client.errors import CheckpointError
from trainyard_checkpoint.client.service import ServiceClient
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.clock import ManualClock
from trainyard_core.files import atomic_write_bytes
from trainyard_core.security import identity, job_credentials, pki
from trainyard_core.security.job_credentials import JobCredential, JobGrant
from trainyard_core.testing.etcd import free_port

from .conftest import running_app

NAMES = (job_credentials.CERT_ENV, job_credentials.KEY_ENV, job_credentials.CA_ENV)


@pytest.fixture
def job_pki(pki_dir: Path) -> Path:
    pki.ensure(pki_dir, [], job_issuer=True)
    return pki_dir


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def mint(job_pki: Path, ttl_s: float, job_id: str = "job-a") -> JobCredential:
    cert, key = pki.job_issuer_files(job_pki)
    issuer = job_credentials.load_issuer(cert, key, job_pki / "ca.pem")
    leaf, leaf_key, not_after = job_credentials.mint(issuer.cert, issuer.key, JobGrant(job_id, 0, "ml"), now=_now(),
                                                     ttl=dt.timedelta(seconds=ttl_s))
    return JobCredential(JobGrant(job_id, 0, "ml"), leaf + issuer.cert_pem, leaf_key, issuer.ca_pem, not_after)


class Files:
    """The three files of a worker's credential, written as the agent writes them (CA, key, then certificate)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700)
        self.paths = {name: directory / f"{name.lower()}.pem" for name in NAMES}

    def write(self, cred: JobCredential, *, only: tuple[str, ...] = (job_credentials.CA_ENV, job_credentials.KEY_ENV,
                                                                     job_credentials.CERT_ENV)) -> None:
        content = {job_credentials.CERT_ENV: cred.cert_chain, job_credentials.KEY_ENV: cred.key,
                   job_credentials.CA_ENV: cred.ca}
        for name in only:
            atomic_write_bytes(self.paths[name], content[name], mode=0o600)

    def env(self) -> dict[str, str]:
        return {name: str(p) for name, p in self.paths.items()}

    def tls(self) -> WorkerTls:
        return WorkerTls.parse(*(str(self.paths[n]) for n in NAMES))


@contextlib.asynccontextmanager
async def store_on(port: int, storage_root: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path,
                   clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    settings = CheckpointSettings(listen_host="127.0.0.1", listen_port=port, storage_url=storage_root.as_uri(),
                                  **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), shutdown_grace_s=0.5,
                                  gc_interval_s=0, **pki.files_for(job_pki, identity.CHECKPOINT_STORE).settings())
    async with running_app(settings, clock) as app:
        yield app


async def _begin(service: ServiceClient, step: int) -> str:
    info = await asyncio.to_thread(service.begin, job_id="job-a", attempt=0, step=step, world_size=1, metadata={})
    return info.id


async def test_a_call_refused_for_an_expired_certificate_takes_the_renewed_one(
        tmp_path: Path, storage_root: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path,
        clock: ManualClock) -> None:
    port = free_port()
    files = Files(tmp_path / "cred")
    first = mint(job_pki, ttl_s=3)
    files.write(first)
    # The proactive look is off (an hour), so only the failed handshake can make it read the files again.
    following = ServiceClient(f"127.0.0.1:{port}", tls=files.tls(), timeout_s=5, retry_for_s=3, check_every_s=3600)
    fixed = ServiceClient(f"127.0.0.1:{port}", tls=WorkerTls.check(first.cert_chain, first.key, first.ca),
                          timeout_s=5, retry_for_s=3, check_every_s=0)
    try:
        async with store_on(port, storage_root, etcd_settings, key_prefix, job_pki, clock):
            await _begin(following, 1)
            await _begin(fixed, 2)
            files.write(mint(job_pki, ttl_s=3600))  # the renewal lands; the connection made with `first` stays up
            assert following.channels_built == 1
        # The first credential's lifetime has to run out (a time, not an event).
        await asyncio.sleep(max(0.0, (first.not_after - _now()).total_seconds()) + 0.1)
        # A new store process: every connection is made again, and `first` no longer gets through.
        async with store_on(port, storage_root, etcd_settings, key_prefix, job_pki, clock):
            assert await _begin(following, 3)
            assert following.channels_built == 2, "one new channel, with the renewed credential"
            with pytest.raises(CheckpointError, match="UNAVAILABLE"):
                await _begin(fixed, 4)
    finally:
        following.close()
        fixed.close()


async def test_changed_files_are_taken_before_a_call_and_a_half_renewed_pair_is_not(
        tmp_path: Path, storage_root: Path, etcd_settings: dict[str, str], key_prefix: str, job_pki: Path,
        clock: ManualClock) -> None:
    port = free_port()
    files = Files(tmp_path / "cred")
    files.write(mint(job_pki, ttl_s=3600))
    service = ServiceClient(f"127.0.0.1:{port}", tls=files.tls(), timeout_s=5, retry_for_s=3, check_every_s=0)
    try:
        async with store_on(port, storage_root, etcd_settings, key_prefix, job_pki, clock):
            await _begin(service, 1)
            # The first look reads the files once (they may have changed since they were parsed): same content.
            assert service.channels_built == 1
            second = mint(job_pki, ttl_s=3600)
            files.write(second)
            await _begin(service, 2)
            assert service.channels_built == 2, "a changed credential is taken before the call, with no failure"
            # Mid-renewal: the new key is there, its certificate not yet. The pair that works stays in use.
            third = mint(job_pki, ttl_s=3600)
            files.write(third, only=(job_credentials.KEY_ENV,))
            await _begin(service, 3)
            assert service.channels_built == 2
            files.write(third, only=(job_credentials.CERT_ENV,))
            await _begin(service, 4)
            assert service.channels_built == 3
            # The files gone (the attempt ended on the node): what works is kept.
            for p in files.paths.values():
                p.unlink()
            await _begin(service, 5)
            assert service.channels_built == 3
    finally:
        service.close()


def test_the_environment_names_files_that_are_followed_or_pem_that_is_not(
        tmp_path: Path, job_pki: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = Files(tmp_path / "cred")
    cred = mint(job_pki, ttl_s=3600)
    files.write(cred)
    base = {"TRAINYARD_CHECKPOINT_STORE": "127.0.0.1:1", "TRAINYARD_JOB_ID": "job-a"}
    by_path = ClientSettings.from_env({**base, **files.env()})
    assert by_path.tls is not None and by_path.tls.files == tuple(str(files.paths[n]) for n in NAMES)
    assert (by_path.tls.cert_chain, by_path.tls.key) == (cred.cert_chain, cred.key)
    by_pem = ClientSettings.from_env({**base, **cred.env()})
    assert by_pem.tls is not None and by_pem.tls.files is None
    assert "BEGIN" not in repr(by_path.tls), "the key is in no repr"
    # A key that is not the certificate's: read again for a moment (a renewal in progress), then refused.
    files.write(mint(job_pki, ttl_s=3600), only=(job_credentials.KEY_ENV,))
    monkeypatch.setattr(client_credentials, "SETTLE_FOR_S", 0.2)
    with pytest.raises(KeyMismatch, match="TRAINYARD_CHECKPOINT_KEY is not the key of the certificate"):
        ClientSettings.from_env({**base, **files.env()})


def test_the_files_are_looked_at_once_per_interval_and_again_at_once_after_a_half_renewed_read(
        tmp_path: Path, job_pki: Path) -> None:
    files = Files(tmp_path / "cred")
    first = mint(job_pki, ttl_s=3600)
    files.write(first)
    mono = [100.0]
    source = CredentialSource(files.tls(), check_every_s=1.0, monotonic=lambda: mono[0])
    second = mint(job_pki, ttl_s=3600)
    files.write(second)
    assert not source.refresh(), "not within the interval"
    assert source.refresh(now=True), "at once when asked (after UNAVAILABLE)"
    assert (source.current.cert_chain, source.generation) == (second.cert_chain, 1)
    third = mint(job_pki, ttl_s=3600)
    files.write(third, only=(job_credentials.KEY_ENV,))
    mono[0] += 1.0
    assert not source.refresh(), "a key beside the previous certificate is not taken"
    assert source.current.key == second.key
    files.write(third, only=(job_credentials.CERT_ENV,))
    assert source.refresh(), "the next look comes at once, not an interval later"
    assert (source.current.key, source.current.cert_chain, source.generation) == (third.key, third.cert_chain, 2)
    assert not source.refresh() and not source.refresh(now=True), "unchanged files are not read again"
    # A credential given as PEM has no files to follow.
    pem = CredentialSource(WorkerTls.check(first.cert_chain, first.key, first.ca))
    assert not pem.reloads and not pem.refresh(now=True)
