"""The tests' own etcd is run as production runs it (tests/conftest.py, testing.etcd_secure): TLS only under
--client-cert-auth, auth on, the services' user logging in by its certificate's CN with a role that reads and
writes the tests' prefix only; root reaches every key. If the fixture ever went back to plaintext or to an
all-powerful user, these fail."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from trainyard_core.errors import PermissionDenied
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_check import StartupCheckFailed, check_access
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing import etcd_secure


@pytest.fixture
async def root_store(etcd_root_options: EtcdOptions) -> AsyncIterator[EtcdStore]:
    store = EtcdStore.from_options(etcd_root_options)
    try:
        yield store
    finally:
        await store.close()


async def test_the_services_user_logs_in_by_certificate_and_keeps_to_the_test_keys(
        etcd_store: EtcdStore, key_prefix: str, etcd_settings: dict[str, str]) -> None:
    assert key_prefix.startswith(etcd_secure.TEST_KEYS)
    assert etcd_settings.keys() == {"etcd_endpoints", "etcd_ca_file", "etcd_cert_file", "etcd_key_file"}
    await check_access(etcd_store, key_prefix)
    await etcd_store.put(key_prefix + "inside", b"1")
    outside = f"/elsewhere-{uuid.uuid4().hex[:8]}/key"
    with pytest.raises(PermissionDenied, match=f"etcd refused a transaction of {outside}: its user trainyard"):
        await etcd_store.put(outside, b"x")
    with pytest.raises(PermissionDenied, match=f"etcd refused a read of {outside}"):
        await etcd_store.get(outside)
    with pytest.raises(StartupCheckFailed, match="etcd_prefix /trainyard: etcd refused a read"):
        await check_access(etcd_store, "/trainyard")  # the production prefix is not the tests'
    assert etcd_store.logins == 0  # the certificate's CN, no password: no token fetched


async def test_root_reaches_every_key(root_store: EtcdStore, etcd_store: EtcdStore, key_prefix: str) -> None:
    outside = f"/elsewhere-{uuid.uuid4().hex[:8]}/key"
    await root_store.put(outside, b"root")
    try:
        got = await root_store.get(outside)
        assert got is not None and got.value == b"root"
    finally:
        assert await root_store.delete(outside)
    await etcd_store.put(key_prefix + "k", b"v")
    got = await root_store.get(key_prefix + "k")
    assert got is not None and got.value == b"v"


async def test_a_plaintext_client_is_refused(etcd_options: EtcdOptions) -> None:
    store = EtcdStore.from_options(EtcdOptions(endpoints=etcd_options.endpoints), timeout=2.0)
    try:
        with pytest.raises(StartupCheckFailed, match="closed the plaintext connection: it probably serves TLS"):
            await check_access(store, etcd_secure.TEST_KEYS)
    finally:
        await store.close()
