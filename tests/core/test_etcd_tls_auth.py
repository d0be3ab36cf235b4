"""etcd with TLS and its own auth, as production runs it: a member serving TLS only under --client-cert-auth,
auth on, a `trainyard` user whose role may read and write one prefix. The store works there with a password
and with a certificate alone, renews a token etcd has forgotten, reports a refusal of the role as
PermissionDenied, and the scheduler's start-up stops with exit 2 and a message naming the setting on each
wrong credential.

The module has its own etcd, started as the session's is (testing.etcd_secure), with a password user and a
one-second token TTL."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from aetcd import rpc
from cryptography import x509

from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core import service
from trainyard_core.errors import PermissionDenied, Unavailable
from trainyard_core.files import atomic_write_bytes
from trainyard_core.security import identity, pki
from trainyard_core.security.identity import InvalidPrincipal
from trainyard_core.settings import SettingsError, load_settings
from trainyard_core.store import etcd_connection as etcd_module
from trainyard_core.store.api import Put, absent
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_check import StartupCheckFailed, check_access
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.etcd_auth import enable_auth
from trainyard_core.testing.etcd_secure import SecureEtcd, settings_of, start_secure, stop_secure
from trainyard_core.testing.wait import eventually, truthy
from trainyard_gateway.app import GatewayApp
from trainyard_gateway.settings import GatewaySettings
from trainyard_scheduler.settings import SchedulerSettings

PREFIX = "/tyauth"
PASSWORD = "correct-horse-battery-staple"
TOKEN_TTL_S = 1


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    base = tmp_path_factory.mktemp("etcd-tls")
    # `nobody` is no etcd user: a store presenting its certificate gets in only with the password.
    etcd = start_secure(base, PREFIX + "/", {"trainyard": PASSWORD}, certificates_for=["nobody"],
                        extra_args=["--auth-token-ttl", str(TOKEN_TTL_S)])
    try:
        # `foreign`: a client certificate with the CN trainyard from another CA.
        etcd.users["foreign"] = pki.ensure_etcd(base / "other-pki", ["trainyard"])[1]["trainyard"]
        yield etcd
    finally:
        stop_secure(etcd)


@pytest.fixture
def prefix(key_prefix: str) -> str:
    """A fresh prefix under the one the role grants."""
    return PREFIX + key_prefix


@pytest.fixture
async def password_store(secure_etcd: SecureEtcd) -> AsyncIterator[EtcdStore]:
    store = EtcdStore.from_options(secure_etcd.options(user="trainyard", password=PASSWORD, cert="nobody"))
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def cert_store(secure_etcd: SecureEtcd) -> AsyncIterator[EtcdStore]:
    store = EtcdStore.from_options(secure_etcd.options(cert="trainyard"))
    try:
        yield store
    finally:
        await store.close()


async def _round_trip(store: EtcdStore, prefix: str) -> None:
    await check_access(store, prefix)
    rev = await store.put(prefix + "a", b"1")
    got = await store.get(prefix + "a")
    assert got is not None and got.value == b"1" and got.mod_revision == rev
    assert (await store.txn([absent(prefix + "b")], [Put(prefix + "b", b"2")])).succeeded
    assert [kv.key for kv in (await store.range(prefix)).kvs] == [prefix + "a", prefix + "b"]
    lease = await store.grant_lease(30)
    assert await store.keepalive(lease) > 0
    await store.put(prefix + "leased", b"x", lease=lease)
    await store.revoke_lease(lease)
    assert await store.get(prefix + "leased") is None
    watch = store.watch(prefix, start_revision=rev)
    batch = await asyncio.wait_for(anext(watch), 10)
    assert (batch[0].kind, batch[0].key, batch[0].value) == ("put", prefix + "a", b"1")
    await watch.aclose()
    assert await store.delete(prefix + "a")


async def test_round_trip_over_tls_with_a_password(password_store: EtcdStore, prefix: str) -> None:
    await _round_trip(password_store, prefix)
    assert password_store.logins >= 1


async def test_round_trip_over_tls_with_the_certificate_cn_as_user(cert_store: EtcdStore, prefix: str) -> None:
    await _round_trip(cert_store, prefix)
    assert cert_store.logins == 0  # no password, no token: etcd took the user from the certificate


async def _until_tokens_of_now_expire(secure_etcd: SecureEtcd) -> None:
    """Return once a token issued now has expired in etcd, so any token last used before now has too.
    Each probe spends a token of its own, issued before the first probe and unused until then: using a token
    extends its life, so probing one token would keep it alive."""
    creds = grpc.ssl_channel_credentials(secure_etcd.server.ca.read_bytes(),
                                         secure_etcd.users["nobody"].key.read_bytes(),
                                         secure_etcd.users["nobody"].cert.read_bytes())
    async with grpc.aio.secure_channel(secure_etcd.member.endpoint, creds) as channel:
        auth, kv = rpc.AuthStub(channel), rpc.KVStub(channel)
        tokens = [(await auth.Authenticate(rpc.AuthenticateRequest(name="trainyard", password=PASSWORD),
                                           timeout=5)).token for _ in range(40)]
        for token in tokens:
            try:
                await kv.Range(rpc.RangeRequest(key=(PREFIX + "/").encode()), timeout=5,
                               metadata=(("token", token),))
            except grpc.aio.AioRpcError as exc:
                assert "invalid auth token" in (exc.details() or ""), exc
                return
            await asyncio.sleep(0.2)
    raise AssertionError(f"no token expired within {len(tokens) * 0.2:g}s of a {TOKEN_TTL_S}s TTL")


async def test_a_token_etcd_has_forgotten_is_renewed_and_the_call_made(
        password_store: EtcdStore, secure_etcd: SecureEtcd, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    await password_store.put(prefix + "k", b"v")
    logins = password_store.logins
    await _until_tokens_of_now_expire(secure_etcd)
    with caplog.at_level(logging.INFO, logger="trainyard_core.store.etcd_client"):
        got = await password_store.get(prefix + "k")  # a unary call on the expired token
    assert got is not None and got.value == b"v"
    assert password_store.logins == logins + 1
    assert any(r.getMessage() == "etcd: auth token renewed" for r in caplog.records)

    # A watch opened with an expired token: etcd cancels it at creation; the store logs in and watches.
    rev = await password_store.put(prefix + "w", b"1")
    await _until_tokens_of_now_expire(secure_etcd)
    watch = password_store.watch(prefix + "w", start_revision=rev)
    batch = await asyncio.wait_for(anext(watch), 10)
    await watch.aclose()
    assert [(e.key, e.value) for e in batch] == [(prefix + "w", b"1")]
    assert password_store.logins == logins + 2


async def test_the_role_covers_the_prefix_only(cert_store: EtcdStore, prefix: str) -> None:
    outside = "/elsewhere/key"
    with pytest.raises(PermissionDenied, match="etcd refused a transaction of /elsewhere/key: its user trainyard"):
        await cert_store.put(outside, b"x")
    with pytest.raises(PermissionDenied, match="etcd refused a read of /elsewhere/key"):
        await cert_store.get(outside)
    with pytest.raises(PermissionDenied, match="etcd refused a watch of /elsewhere/"):
        await anext(cert_store.watch("/elsewhere/"))
    endpoint = cert_store.endpoint
    await cert_store.put(prefix + "still-fine", b"1")  # a refusal is no connection failure: no failover
    assert cert_store.endpoint == endpoint
    with pytest.raises(StartupCheckFailed, match="etcd_prefix /elsewhere: etcd refused a read"):
        await check_access(cert_store, "/elsewhere")


async def test_the_start_up_check_names_what_is_wrong(secure_etcd: SecureEtcd, prefix: str) -> None:
    cases = {
        "etcd_user/etcd_password: etcd at": secure_etcd.options(user="trainyard", password="wrong", cert="nobody"),
        "refused the TLS connection: it was given etcd_cert_file": secure_etcd.options(cert="foreign"),
        "etcd_ca_file": secure_etcd.options(ca=secure_etcd.users["foreign"].ca),
        "closed the plaintext connection: it probably serves TLS": EtcdOptions(endpoints=secure_etcd.member.endpoint),
    }
    for expected, options in cases.items():
        store = EtcdStore.from_options(options, timeout=2.0)
        try:
            with pytest.raises(StartupCheckFailed) as err:
                await check_access(store, prefix)
            assert expected in err.value.message, err.value.message
        finally:
            await store.close()


# --- the scheduler process --------------------------------------------------------------------------------

PY = sys.executable


def _scheduler(tmp_path: Path, pki_dir: Path, prefix: str, etcd: dict[str, str],
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({f"TRAINYARD_SCHEDULER_{k.upper()}": v for k, v in {
        "etcd_prefix": prefix.rstrip("/"), "listen_port": str(free_port()), "leader_ttl_s": "2",
        **pki.files_for(pki_dir, identity.SCHEDULER).settings(), **etcd}.items()})
    return subprocess.run([PY, "-m", "trainyard_scheduler.main"], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_scheduler_does_not_start_on_a_wrong_etcd_credential(tmp_path: Path, pki_dir: Path,
                                                                 secure_etcd: SecureEtcd, prefix: str) -> None:
    cases = [
        (settings_of(secure_etcd.options(user="trainyard", password="not-the-password", cert="nobody")),
         "etcd_user/etcd_password: etcd at", "authentication failed"),
        (settings_of(secure_etcd.options(cert="foreign")), "etcd_cert_file", "refused the TLS connection"),
        (settings_of(secure_etcd.options(ca=secure_etcd.users["foreign"].ca)), "etcd_ca_file",
         "CERTIFICATE_VERIFY_FAILED"),
        ({"etcd_endpoints": secure_etcd.member.endpoint, "etcd_insecure_plaintext": "true"},
         "closed the plaintext connection", "set etcd_ca_file"),
        ({**settings_of(secure_etcd.options()), "etcd_key_file": str(tmp_path / "missing.key")},
         f"etcd_key_file {tmp_path / 'missing.key'}: cannot read it", "No such file"),
    ]
    for settings, *expected in cases:
        done = _scheduler(tmp_path, pki_dir, prefix, settings)
        assert done.returncode == 2, (settings, done.stderr[-3000:])
        error_lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(error_lines) == 1 and all(e in error_lines[0] for e in expected), (expected, done.stderr[-3000:])
        assert "not-the-password" not in done.stderr


def test_the_scheduler_serves_with_its_etcd_role(tmp_path: Path, pki_dir: Path, secure_etcd: SecureEtcd,
                                                 prefix: str) -> None:
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({f"TRAINYARD_SCHEDULER_{k.upper()}": v for k, v in {
        "etcd_prefix": prefix.rstrip("/"), "listen_port": str(free_port()), "leader_ttl_s": "2",
        "ready_file": str(ready), **pki.files_for(pki_dir, identity.SCHEDULER).settings(),
        **settings_of(secure_etcd.options(user="trainyard", password=PASSWORD, cert="nobody"))}.items()})
    proc = subprocess.Popen([PY, "-m", "trainyard_scheduler.main"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the scheduler wrote no ready file within 60s"
            time.sleep(0.05)
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-3000:]
        assert PASSWORD not in err  # the settings are logged at start, the password as ***
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- settings ---------------------------------------------------------------------------------------------

def test_etcd_settings_go_together() -> None:
    def load(**values: str) -> SchedulerSettings:
        return load_settings(SchedulerSettings, prog="t", argv=[], env={
            f"TRAINYARD_SCHEDULER_{k.upper()}": v for k, v in values.items()})
    with pytest.raises(SettingsError, match="etcd_cert_file and etcd_key_file go together"):
        load(etcd_ca_file="/ca.pem", etcd_cert_file="/c.pem")
    with pytest.raises(SettingsError, match="etcd_cert_file needs etcd_ca_file"):
        load(etcd_cert_file="/c.pem", etcd_key_file="/c.key")
    with pytest.raises(SettingsError, match="etcd_user and etcd_password go together"):
        load(etcd_ca_file="/ca.pem", etcd_user="trainyard")
    with pytest.raises(SettingsError, match="etcd_insecure_plaintext and etcd_ca_file exclude each other"):
        load(etcd_ca_file="/ca.pem", etcd_insecure_plaintext="true")
    options = load(etcd_ca_file="/ca.pem", etcd_user="trainyard", etcd_password="s3cret").etcd_options()
    assert options.auth_mode == "password" and "s3cret" not in repr(options)


def test_plaintext_etcd_needs_a_setting_that_says_so(pki_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    tls = pki.files_for(pki_dir, identity.SCHEDULER).settings()
    problem = service.check_etcd(SchedulerSettings(**tls))  # what service.run refuses to start with (exit 2)
    assert problem.startswith("no TLS to etcd: set etcd_ca_file") and "etcd_insecure_plaintext=true" in problem
    with caplog.at_level(logging.WARNING, logger="trainyard_core.service"):
        assert service.check_etcd(SchedulerSettings(**tls, etcd_insecure_plaintext=True)) == ""
        assert service.check_etcd(SchedulerSettings(insecure_plaintext=True)) == ""
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["PLAINTEXT etcd"] * 2


# --- setting etcd up ---------------------------------------------------------------------------------------

async def test_enabling_auth_again_is_harmless_and_takes_a_new_password(secure_etcd: SecureEtcd, prefix: str) -> None:
    """`make run` enables auth on every start, against data that may have it on already."""
    enable_auth(secure_etcd.member.endpoint, secure_etcd.users["root"], PREFIX + "/", {"trainyard": "rotated-pw"})
    try:
        old = EtcdStore.from_options(secure_etcd.options(user="trainyard", password=PASSWORD, cert="nobody"))
        new = EtcdStore.from_options(secure_etcd.options(user="trainyard", password="rotated-pw", cert="nobody"))
        try:
            with pytest.raises(StartupCheckFailed, match="etcd_user/etcd_password"):
                await check_access(old, prefix)
            await check_access(new, prefix)
        finally:
            await old.close()
            await new.close()
    finally:
        enable_auth(secure_etcd.member.endpoint, secure_etcd.users["root"], PREFIX + "/", {"trainyard": PASSWORD})


def test_the_pki_issues_etcd_certificates_once(tmp_path: Path) -> None:
    server, users = pki.ensure_etcd(tmp_path, ["trainyard"])
    first = (server.cert.read_bytes(), users["trainyard"].cert.read_bytes())
    again, users_again = pki.ensure_etcd(tmp_path, ["trainyard"])
    assert (again.cert.read_bytes(), users_again["trainyard"].cert.read_bytes()) == first  # nothing re-issued
    client = x509.load_pem_x509_certificate(first[1])
    assert client.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "trainyard"
    with pytest.raises(InvalidPrincipal):  # no trainyard:// URI: it cannot call a Trainyard service
        pki.principal_of(client)
    # A new etcd host name re-issues the server's certificate, and only that one.
    pki.ensure_etcd(tmp_path, ["trainyard"], server_dns=["localhost", "etcd1"])
    san = x509.load_pem_x509_certificate(server.cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "etcd1"}
    assert users["trainyard"].cert.read_bytes() == first[1]
    with pytest.raises(ValueError, match="etcd user 'Not_A_Label'"):
        pki.ensure_etcd(tmp_path, ["Not_A_Label"])


async def test_the_gateway_and_the_checkpoint_store_check_their_etcd_credential_at_start(
        tmp_path: Path, secure_etcd: SecureEtcd, prefix: str) -> None:
    """The same check as the scheduler's (service.run exits 2 on it); the apps close what they opened."""
    wrong = settings_of(secure_etcd.options(user="trainyard", password="nope", cert="nobody"))
    good = settings_of(secure_etcd.options())
    base = {"etcd_prefix": prefix.rstrip("/")}
    gateway = GatewaySettings(**base, **wrong, http_port=0, grpc_port=0, scheduler_address=f"127.0.0.1:{free_port()}")
    with pytest.raises(StartupCheckFailed, match=r"etcd_user/etcd_password: etcd at .* refused the login"):
        await GatewayApp(gateway).start()
    storage = (tmp_path / "ckpt").as_uri()
    for etcd, ok in ((wrong, False), (good, True)):
        app = CheckpointApp(CheckpointSettings(**base, **etcd, listen_host="127.0.0.1", listen_port=0,
                                               storage_url=storage, shutdown_grace_s=1.0, gc_interval_s=0))
        if ok:
            await app.start()  # the certificate's CN, trainyard, may use the prefix
            await app.stop()
        else:
            with pytest.raises(StartupCheckFailed, match="etcd_user/etcd_password"):
                await app.start()


async def test_an_unreadable_file_is_named_before_etcd_is_called(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    options = secure_etcd.options()
    missing = EtcdOptions(endpoints=options.endpoints, ca_file=options.ca_file, cert_file=options.cert_file,
                          key_file=tmp_path / "gone.key")
    store = EtcdStore.from_options(missing)
    try:
        with pytest.raises(StartupCheckFailed, match=f"etcd_key_file {tmp_path / 'gone.key'}: cannot read it"):
            await check_access(store, PREFIX)
        assert store.logins == 0
    finally:
        await store.close()
    wrong_key = EtcdOptions(endpoints=options.endpoints, ca_file=options.ca_file, cert_file=options.cert_file,
                            key_file=secure_etcd.users["nobody"].key)
    with pytest.raises(StartupCheckFailed, match="is not the private key of etcd_cert_file"):
        await check_access(EtcdStore.from_options(wrong_key), PREFIX)


async def test_rotated_tls_files_are_taken_up_without_a_restart(secure_etcd: SecureEtcd, tmp_path: Path, prefix: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The store reconnects with its client certificate once it is rotated on disk (proved by rotating to one
    etcd does not trust, then back), and keeps its connection through a rotation half done."""
    good, foreign = secure_etcd.users["trainyard"], secure_etcd.users["foreign"]
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"

    def install(cert_from: Path, key_from: Path) -> None:
        atomic_write_bytes(cert, cert_from.read_bytes())
        atomic_write_bytes(key, key_from.read_bytes(), mode=0o600)

    install(good.cert, good.key)
    store = EtcdStore.from_options(EtcdOptions(endpoints=secure_etcd.endpoint, ca_file=secure_etcd.server.ca,
                                               cert_file=cert, key_file=key))
    try:
        await store.put(prefix + "k", b"1")
        install(foreign.cert, good.key)  # half a rotation: a certificate whose key has not arrived yet
        await asyncio.sleep(etcd_module.TLS_CHECK_EVERY_S + 0.1)
        with caplog.at_level(logging.WARNING, logger="trainyard_core.store.etcd"):
            await store.put(prefix + "k", b"2")
        assert store.tls_reloads == 0 and "not usable yet" in caplog.text, "the current connection is kept"

        install(foreign.cert, foreign.key)  # a whole set, from a CA etcd does not trust
        await asyncio.sleep(etcd_module.TLS_CHECK_EVERY_S + 0.1)
        with pytest.raises(Unavailable):
            await store.put(prefix + "k", b"3")
        assert store.tls_reloads == 1, "the next call connected with the rotated files"

        install(good.cert, good.key)  # rotated again, to a certificate etcd takes
        await asyncio.sleep(etcd_module.TLS_CHECK_EVERY_S + 0.1)
        await store.put(prefix + "k", b"4")
        got = await store.get(prefix + "k")
        assert got is not None and got.value == b"4"
    finally:
        await store.close()


async def test_the_leaders_lease_keeper_thread_logs_in_with_the_password(password_store: EtcdStore) -> None:
    """The keeper renews over its own connection (lease_thread.py), so it logs in with the password itself."""
    lease = await password_store.grant_lease(2)
    lost: list[str] = []
    keeper = password_store.lease_keeper(lease, 2, loop_alive=time.monotonic, on_lost=lost.append)
    keeper.start()
    try:
        await eventually(lambda: truthy(keeper.renewals >= 2), timeout=10, what="two renewals")
    finally:
        keeper.stop()
    assert keeper.join(5) and lost == []
