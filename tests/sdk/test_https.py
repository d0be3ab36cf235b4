"""The SDK against an HTTPS gateway (its http_tls_* settings, a certificate of the development CA), with both
clients: trusted through `ca_bundle` (or TRAINYARD_CA_BUNDLE), refused with a message that says how to trust it
otherwise, and never downgraded to plain HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.gateway.support import RunningGateway, running_gateway
from trainyard_core.security import identity, pki
from trainyard_core.testing.etcd import free_port
from trainyard_sdk import ConnectionFailed

from .support import Sdk


@pytest.fixture
async def https_gateway(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> AsyncIterator[RunningGateway]:
    files = pki.files_for(pki_dir, identity.GATEWAY)
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", http_tls_cert_file=str(files.cert),
                               http_tls_key_file=str(files.key)) as gw:
        yield gw


async def test_https_with_the_gateways_ca(sdk: Sdk, https_gateway: RunningGateway, pki_dir: Path,
                                          tmp_path: Path) -> None:
    url = f"https://localhost:{https_gateway.app.http_port}"
    api = sdk(url, https_gateway.admin_token, ca_bundle=str(pki_dir / "ca.pem"))
    tokens = await api(lambda c: c.list_tokens())
    assert [t.team for t in tokens] == ["admin"]

    with pytest.raises(ConnectionFailed, match=r"certificate is not trusted .* pass ca_bundle= or "
                                               r"set TRAINYARD_CA_BUNDLE") as untrusted:
        await sdk(url, https_gateway.admin_token, retry=None)(lambda c: c.list_tokens())
    assert not untrusted.value.refused
    with pytest.raises(ConnectionFailed):  # the same port without TLS
        await sdk(f"http://localhost:{https_gateway.app.http_port}", https_gateway.admin_token, retry=None)(
            lambda c: c.list_tokens())

    environ = {"TRAINYARD_URL": url, "TRAINYARD_TOKEN": https_gateway.admin_token,
               "TRAINYARD_CA_BUNDLE": str(pki_dir / "ca.pem")}
    from_env = sdk.from_env(environ=environ, cwd=tmp_path)
    assert [t.team for t in await from_env(lambda c: c.list_tokens())] == ["admin"]
