"""Shared fixtures: a real etcd per test session (free ports, data on tmpfs) run as production runs it — TLS
only, client certificates required, auth on, the services' user limited to the tests' prefix —, a clean
prefix per test; and logging as the services have it in production: INFO, through the JSON formatter, for
the whole run."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest

from trainyard_core import logs
from trainyard_core.security import identity, pki
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing import etcd as etcd_proc
from trainyard_core.testing import etcd_secure
from trainyard_core.testing.etcd_secure import SecureEtcd
from trainyard_core.testing.hang_report import Watchdog

# A teardown still running after this long prints every asyncio task's stack (testing/hang_report.py), so a
# stop that never returns says in the CI log which await it is stuck on.
TEARDOWN_REPORT_AFTER_S = 120.0


class ReservedExtraKey(AssertionError):
    """A log call's `extra` named a LogRecord attribute: production renames the field, a test fails."""


class FormatEveryRecord(logging.Handler):
    """The root handler of every test run. The default root level (WARNING) made info() return before
    building a record, so a log call that raises (an `extra` key such as `created`) never ran in a test
    and answered 503 in the cluster. This formats each record as a service does and keeps nothing:
    pytest's own capture shows a failed test's records. A record that cannot be formatted raises at the
    log call, and so does one whose `extra` needed the production guard's rename."""

    def emit(self, record: logging.LogRecord) -> None:
        renamed = getattr(record, logs.RENAMED_EXTRA_ATTR, ())
        if renamed:
            raise ReservedExtraKey(f"log call {record.pathname}:{record.lineno} ({record.getMessage()!r}) passes "
                                   f"extra keys {list(renamed)} that name LogRecord attributes; rename them")
        self.format(record)


def pytest_configure(config: pytest.Config) -> None:
    # Before collection, so even import-time log lines go through it; caplog.set_level still works
    # (pytest restores the root level to INFO after each test).
    logs.setup_logging("tests", level="INFO", fmt="json", handler=FormatEveryRecord())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    watchdog = Watchdog(TEARDOWN_REPORT_AFTER_S, f"{item.nodeid}: teardown still running after "
                                                 f"{TEARDOWN_REPORT_AFTER_S:g}s").start()
    try:
        return (yield)
    finally:
        watchdog.cancel()


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """The session's etcd: TLS with --client-cert-auth and auth on; the services' user `trainyard` logs in by
    its certificate's CN (no password, so no token to check per call) and may read and write TEST_KEYS only."""
    etcd = etcd_secure.start_secure(tmp_path_factory.mktemp("session-etcd"), etcd_secure.TEST_KEYS,
                                   {etcd_secure.SERVICE_USER: None})
    try:
        yield etcd
    finally:
        etcd_secure.stop_secure(etcd)


@pytest.fixture(scope="session")
def etcd_server(secure_etcd: SecureEtcd) -> etcd_proc.EtcdProcess:
    """The session's etcd member (`etcdctl_tls()` gives etcdctl its root certificate)."""
    return secure_etcd.member


@pytest.fixture(scope="session")
def etcd_options(secure_etcd: SecureEtcd) -> EtcdOptions:
    """How a test and its services reach the session's etcd: as the services' etcd user, whose role reads and
    writes the test prefixes only (`key_prefix`)."""
    return secure_etcd.options()


@pytest.fixture(scope="session")
def etcd_root_options(secure_etcd: SecureEtcd) -> EtcdOptions:
    """The session's etcd as `root` (every key): for what is no service's business, as etcdctl is."""
    return secure_etcd.root_options()


@pytest.fixture
def etcd_settings(etcd_options: EtcdOptions) -> dict[str, str]:
    """The services' etcd settings (etcd_endpoints and the TLS and credential fields) for `etcd_options`;
    a service's settings take them as `**etcd_settings`, its flags as `etcd_secure.as_flags`."""
    return etcd_secure.settings_of(etcd_options)


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test uses, so tests sharing the session's etcd never see each other's keys; under
    the one the services' etcd role may read and write."""
    return etcd_secure.fresh_prefix()


@pytest.fixture
async def etcd_store(etcd_options: EtcdOptions) -> AsyncIterator[EtcdStore]:
    store = EtcdStore.from_options(etcd_options)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def pki_dir(tmp_path: Path) -> Path:
    """A development PKI (trainyard_core.security.pki) with a certificate for each principal the TLS tests use:
    the services, nodes node-1 and node-2, and the tool `ops`."""
    directory = tmp_path / "pki"
    pki.ensure(directory, [identity.SCHEDULER, identity.GATEWAY, identity.CHECKPOINT_STORE, identity.node("node-1"),
                           identity.node("node-2"), identity.tool("ops")])
    return directory


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory every uid may pass through (pytest's tmp_path is root's, 0700): for tests that run workers as
    a team's uid; what keeps teams apart below it is the modes of what the services make there."""
    path = Path(tempfile.mkdtemp(prefix="trainyard-public-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
