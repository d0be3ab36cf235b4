"""Where the gateway is, which token to use, and how to talk to it: found the way the CLI finds them.

Each of TRAINYARD_URL and TRAINYARD_TOKEN is taken, in order, from the argument given, the environment, or
`.trainyard/local.env` (searched in the current directory and then its parents; `make run` writes it), whose
lines are `KEY=value` (blank lines and `#` comments ignored, an `export ` prefix and surrounding quotes
accepted). TRAINYARD_CA_BUNDLE, found the same way, names the PEM file of the CA that signed an HTTPS
gateway's certificate (otherwise the system's and certifi's CAs are trusted); verification is on unless
`verify=False` is passed.

These are the rules of `trainyard_cli.config` (tests/sdk/test_config.py holds the two to the same answers), so
a script and the CLI on the same machine reach the same gateway with the same token. Pure but for reading the
file: the environment and the directory are passed in.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigurationError

LOCAL_ENV = Path(".trainyard") / "local.env"
URL_VAR = "TRAINYARD_URL"
TOKEN_VAR = "TRAINYARD_TOKEN"
CA_BUNDLE_VAR = "TRAINYARD_CA_BUNDLE"


@dataclass(frozen=True, slots=True)
class Target:
    """The gateway and credentials a client uses, and where each was found (for error messages: a 401 says
    which token was sent)."""

    url: str
    token: str
    url_source: str = "argument"
    token_source: str = "argument"
    ca_bundle: str = ""


def find_local_env(start: Path) -> Path | None:
    for directory in (start, *start.parents):
        candidate = directory / LOCAL_ENV
        if candidate.is_file():
            return candidate
    return None


def read_env_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror}") from exc
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"{path}:{number}: expected KEY=value, got {line[:60]!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def check_url(url: str, source: str = "argument") -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"gateway URL {url!r} (from {source}) must start with http:// or https://")
    return url.rstrip("/")


def resolve(*, url: str | None = None, token: str | None = None, ca_bundle: str | None = None,
            environ: Mapping[str, str], cwd: Path, need_token: bool = True) -> Target:
    """The gateway URL, token and CA bundle; ConfigurationError naming every place looked at when the URL (or,
    with `need_token`, the token) is missing."""
    local_path = find_local_env(cwd)
    local = read_env_file(local_path) if local_path else {}
    here = str(local_path) if local_path else ""

    def pick(given: str | None, key: str) -> tuple[str, str]:
        if given:
            return given, "argument"
        if environ.get(key):
            return environ[key], f"environment variable {key}"
        if local.get(key):
            return local[key], here
        return "", ""

    found_url, url_source = pick(url, URL_VAR)
    found_token, token_source = pick(token, TOKEN_VAR)
    found_ca, _ = pick(ca_bundle, CA_BUNDLE_VAR)
    if not found_url:
        raise ConfigurationError(f"no gateway URL: pass one, set {URL_VAR}, or start a local cluster with "
                                 f"`make run` (it writes {LOCAL_ENV})")
    checked = check_url(found_url, url_source)
    if need_token and not found_token:
        raise ConfigurationError(f"no API token: pass one or set {TOKEN_VAR} (with `make run`, {LOCAL_ENV} holds "
                                 "a development admin token)")
    return Target(url=checked, token=found_token, url_source=url_source, token_source=token_source,
                  ca_bundle=found_ca)


def ssl_context(*, verify: bool | ssl.SSLContext, ca_bundle: str) -> bool | ssl.SSLContext:
    """What httpx's `verify` takes: an SSLContext trusting `ca_bundle` when one is named, else `verify` as given
    (True: the default trust store)."""
    if isinstance(verify, ssl.SSLContext) or not verify or not ca_bundle:
        return verify
    try:
        return ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"CA bundle {ca_bundle}: cannot be read as PEM certificates: {exc}") from exc
