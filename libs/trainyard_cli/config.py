"""Where the gateway is and which token to use.

Each of TRAINYARD_URL, TRAINYARD_TOKEN and TRAINYARD_CA_BUNDLE is taken, in order, from the `--url`/`--token`/
`--ca-bundle` flag, the environment, or `.trainyard/local.env` (searched in the current directory and then its
parents; `make run` writes it), whose lines are `KEY=value` (blank lines and `#` comments ignored, an `export `
prefix and surrounding quotes accepted). TRAINYARD_CA_BUNDLE names the PEM file of the CA of an HTTPS gateway
whose certificate is not signed by a public CA.

These are the SDK's rules (`trainyard_sdk.config`, whose `Target`, file search and file syntax this uses;
tests/sdk/test_config.py holds the two to the same answers); what is the CLI's own is the wording: sources and
messages name the flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trainyard_sdk import ConfigurationError
from trainyard_sdk import config as sdk_config
from trainyard_sdk.config import CA_BUNDLE_VAR, LOCAL_ENV, TOKEN_VAR, URL_VAR, Target, find_local_env

from .errors import UsageError

__all__ = ["LOCAL_ENV", "Target", "find_local_env", "read_env_file", "resolve"]


def read_env_file(path: Path) -> dict[str, str]:
    try:
        return sdk_config.read_env_file(path)
    except ConfigurationError as exc:
        raise UsageError(exc.message) from None


def resolve(*, url_flag: str | None, token_flag: str | None, environ: Mapping[str, str], cwd: Path,
            need_token: bool = True, ca_bundle_flag: str | None = None) -> Target:
    """The gateway URL, token and CA bundle; UsageError naming every place looked at when the URL or the token is
    missing."""
    local_path = find_local_env(cwd)
    local = read_env_file(local_path) if local_path else {}
    here = str(local_path) if local_path else ""

    def pick(flag: str | None, flag_name: str, key: str) -> tuple[str, str]:
        if flag:
            return flag, flag_name
        if environ.get(key):
            return environ[key], f"environment variable {key}"
        if local.get(key):
            return local[key], here
        return "", ""

    url, url_source = pick(url_flag, "--url", URL_VAR)
    token, token_source = pick(token_flag, "--token", TOKEN_VAR)
    ca_bundle, _ = pick(ca_bundle_flag, "--ca-bundle", CA_BUNDLE_VAR)
    if not url:
        raise UsageError("no gateway URL: pass --url, set TRAINYARD_URL, or start a local cluster with "
                         f"`make run` (it writes {LOCAL_ENV})")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"gateway URL {url!r} (from {url_source}) must start with http:// or https://")
    if need_token and not token:
        raise UsageError("no API token: pass --token or set TRAINYARD_TOKEN (with `make run`, "
                         f"{LOCAL_ENV} holds a development admin token)")
    return Target(url=url.rstrip("/"), token=token, url_source=url_source, token_source=token_source,
                  ca_bundle=ca_bundle)
