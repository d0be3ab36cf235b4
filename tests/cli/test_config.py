"""Where the CLI finds the gateway URL and token: flags, then the environment, then .trainyard/local.env
in the current directory or a parent."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_cli.config import find_local_env, read_env_file, resolve
from trainyard_cli.errors import UsageError
from trainyard_sdk import config as sdk_config


def _local_env(directory: Path, text: str) -> Path:
    (directory / ".trainyard").mkdir(parents=True, exist_ok=True)
    path = directory / ".trainyard" / "local.env"
    path.write_text(text)
    return path


def test_flags_beat_environment_beat_local_env(tmp_path: Path) -> None:
    _local_env(tmp_path, "TRAINYARD_URL=http://file:1\nTRAINYARD_TOKEN=ty_file\n")
    env = {"TRAINYARD_URL": "http://env:2", "TRAINYARD_TOKEN": "ty_env"}
    t = resolve(url_flag="http://flag:3/", token_flag="ty_flag", environ=env, cwd=tmp_path)
    assert (t.url, t.token, t.url_source, t.token_source) == ("http://flag:3", "ty_flag", "--url", "--token")
    t = resolve(url_flag=None, token_flag=None, environ=env, cwd=tmp_path)
    assert (t.url, t.token) == ("http://env:2", "ty_env")
    assert t.token_source == "environment variable TRAINYARD_TOKEN"
    t = resolve(url_flag=None, token_flag=None, environ={"TRAINYARD_URL": ""}, cwd=tmp_path)
    assert (t.url, t.token) == ("http://file:1", "ty_file")
    assert t.token_source.endswith(".trainyard/local.env")
    # Per key: the URL from the environment, the token from the file.
    t = resolve(url_flag=None, token_flag=None, environ={"TRAINYARD_URL": "http://env:2"}, cwd=tmp_path)
    assert (t.url, t.token) == ("http://env:2", "ty_file")


def test_local_env_is_found_in_a_parent_directory(tmp_path: Path) -> None:
    path = _local_env(tmp_path, "TRAINYARD_URL=http://parent:1\nTRAINYARD_TOKEN=ty_parent\n")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    assert find_local_env(deep) == path
    assert resolve(url_flag=None, token_flag=None, environ={}, cwd=deep).url == "http://parent:1"


def test_env_file_syntax(tmp_path: Path) -> None:
    path = _local_env(tmp_path, "# written by make run\n\nexport TRAINYARD_URL='http://q:1'\n"
                                "TRAINYARD_TOKEN = \"ty_x=y\"\nOTHER=1\n")
    assert read_env_file(path) == {"TRAINYARD_URL": "http://q:1", "TRAINYARD_TOKEN": "ty_x=y", "OTHER": "1"}
    bad = _local_env(tmp_path / "bad", "TRAINYARD_URL\n")
    with pytest.raises(UsageError, match=r"local\.env:1: expected KEY=value"):
        read_env_file(bad)


def test_missing_configuration_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no gateway URL: pass --url, set TRAINYARD_URL"):
        resolve(url_flag=None, token_flag=None, environ={}, cwd=tmp_path)
    with pytest.raises(UsageError, match="no API token"):
        resolve(url_flag="http://x:1", token_flag=None, environ={}, cwd=tmp_path)
    with pytest.raises(UsageError, match="must start with http"):
        resolve(url_flag="localhost:8080", token_flag="ty_x", environ={}, cwd=tmp_path)


@pytest.mark.parametrize(("flag", "environ", "file"), [
    ("/flag/ca.pem", {"TRAINYARD_CA_BUNDLE": "/env/ca.pem"}, "TRAINYARD_CA_BUNDLE=/file/ca.pem\n"),
    (None, {"TRAINYARD_CA_BUNDLE": "/env/ca.pem"}, "TRAINYARD_CA_BUNDLE=/file/ca.pem\n"),
    (None, {}, "TRAINYARD_CA_BUNDLE=/file/ca.pem\n"),
    (None, {}, ""),
])
def test_the_ca_bundle_is_found_as_the_sdk_finds_it(tmp_path: Path, flag: str | None, environ: dict[str, str],
                                                    file: str) -> None:
    _local_env(tmp_path, "TRAINYARD_URL=https://file:1\nTRAINYARD_TOKEN=ty_file\n" + file)
    cli = resolve(url_flag=None, token_flag=None, ca_bundle_flag=flag, environ=environ, cwd=tmp_path)
    sdk = sdk_config.resolve(ca_bundle=flag, environ=environ, cwd=tmp_path)
    assert cli.ca_bundle == sdk.ca_bundle == (flag or environ.get("TRAINYARD_CA_BUNDLE") or file[20:].strip())
