"""The SDK finds the gateway as the CLI does (trainyard_cli.config): the same URL and token, from the same place,
for every way of configuring them; and a client's own settings (the User-Agent naming the SDK's version, the
token, TLS verification)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from trainyard_cli import config as cli_config
from trainyard_cli.errors import UsageError
from trainyard_sdk import AsyncClient, Client, ConfigurationError, __version__
from trainyard_sdk import config as sdk_config
from trainyard_sdk.connection import USER_AGENT, Options


def _local_env(directory: Path, text: str) -> None:
    (directory / ".trainyard").mkdir(parents=True, exist_ok=True)
    (directory / ".trainyard" / "local.env").write_text(text)


FILE = "# written by make run\nexport TRAINYARD_URL='http://file:1/'\nTRAINYARD_TOKEN = \"ty_file=x\"\n"
# (given url, given token, environment, local.env text or None)
CASES = [
    (None, None, {"TRAINYARD_URL": "http://env:2", "TRAINYARD_TOKEN": "ty_env"}, FILE),
    (None, None, {}, FILE),
    (None, None, {"TRAINYARD_URL": ""}, FILE),
    (None, None, {"TRAINYARD_URL": "http://env:2"}, FILE),  # the URL from the environment, the token from the file
    ("http://given:3/", "ty_given", {"TRAINYARD_URL": "http://env:2", "TRAINYARD_TOKEN": "ty_env"}, FILE),
    (None, "ty_given", {"TRAINYARD_URL": "https://env:2"}, None),
]


@pytest.mark.parametrize(("url", "token", "environ", "file"), CASES)
def test_the_sdk_and_the_cli_resolve_alike(tmp_path: Path, url: str | None, token: str | None,
                                           environ: dict[str, str], file: str | None) -> None:
    if file is not None:
        _local_env(tmp_path, file)
    deep = tmp_path / "a" / "b"  # found in a parent directory
    deep.mkdir(parents=True)
    cli = cli_config.resolve(url_flag=url, token_flag=token, environ=environ, cwd=deep)
    sdk = sdk_config.resolve(url=url, token=token, environ=environ, cwd=deep)
    given = {"--url": "argument", "--token": "argument"}
    assert (sdk.url, sdk.token, sdk.url_source, sdk.token_source) == (
        cli.url, cli.token, given.get(cli.url_source, cli.url_source), given.get(cli.token_source, cli.token_source))


@pytest.mark.parametrize(("url", "token", "environ", "file"), [
    (None, None, {}, None),                                   # no URL anywhere
    ("http://x:1", None, {}, None),                           # no token
    ("localhost:8080", "ty_x", {}, None),                     # not http(s)
    (None, None, {}, "TRAINYARD_URL\n"),                      # a line that is not KEY=value
])
def test_the_sdk_and_the_cli_refuse_alike(tmp_path: Path, url: str | None, token: str | None,
                                          environ: dict[str, str], file: str | None) -> None:
    if file is not None:
        _local_env(tmp_path, file)
    with pytest.raises(UsageError) as cli:
        cli_config.resolve(url_flag=url, token_flag=token, environ=environ, cwd=tmp_path)
    with pytest.raises(ConfigurationError) as sdk:
        sdk_config.resolve(url=url, token=token, environ=environ, cwd=tmp_path)
    assert cli.value.message.split(":")[0] == sdk.value.message.split(":")[0]


def test_from_env_builds_either_client(tmp_path: Path) -> None:
    _local_env(tmp_path / "with", FILE)
    for cls in (Client, AsyncClient):
        client = cls.from_env(environ={}, cwd=tmp_path / "with")
        assert client.url == "http://file:1" and client.target.token == "ty_file=x"
        assert client.target.token_source.endswith(".trainyard/local.env")
        assert client.options.target.url_source.endswith(".trainyard/local.env")
    viewer = Client.from_env(environ={"TRAINYARD_URL": "http://h:1"}, cwd=tmp_path, need_token=False)
    assert viewer.target.token == ""


def test_headers_name_the_sdk_and_carry_the_token() -> None:
    options = Options(target=sdk_config.Target(url="http://h:1", token="ty_secret"))
    headers = options.httpx_kwargs()["headers"]
    assert headers["User-Agent"] == USER_AGENT and USER_AGENT.startswith(f"trainyard-sdk/{__version__} ")
    assert headers["Authorization"] == "Bearer ty_secret"
    assert "Authorization" not in Options(target=sdk_config.Target(url="http://h:1", token="")).httpx_kwargs()[
        "headers"]


def test_tls_verification_is_on_and_a_ca_bundle_is_trusted(tmp_path: Path, pki_dir: Path) -> None:
    assert sdk_config.ssl_context(verify=True, ca_bundle="") is True
    assert sdk_config.ssl_context(verify=False, ca_bundle=str(pki_dir / "ca.pem")) is False
    context = sdk_config.ssl_context(verify=True, ca_bundle=str(pki_dir / "ca.pem"))
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED
    assert context.get_ca_certs()  # the bundle's CA, loaded
    (tmp_path / "not.pem").write_text("no certificate here")
    with pytest.raises(ConfigurationError, match=r"not\.pem: cannot be read as PEM certificates"):
        sdk_config.ssl_context(verify=True, ca_bundle=str(tmp_path / "not.pem"))
    target = sdk_config.resolve(environ={"TRAINYARD_URL": "https://h:1", "TRAINYARD_TOKEN": "t",
                                         "TRAINYARD_CA_BUNDLE": str(pki_dir / "ca.pem")}, cwd=tmp_path)
    assert target.ca_bundle == str(pki_dir / "ca.pem")


def test_a_client_refuses_a_url_that_is_not_http() -> None:
    with pytest.raises(ConfigurationError, match="must start with http:// or https://"):
        Client("gateway:8080", "t")
