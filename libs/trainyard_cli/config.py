"""Where the gateway is and which token to use.

Each of TRAINYARD_URL and TRAINYARD_TOKEN is taken, in order, from the `--url`/`--token` flag, the
environment, or `.trainyard/local.env` (searched in the current directory and then its parents; `make
run` writes it), whose lines are `KEY=value` (blank lines and `#` comments ignored, an `export ` prefix
and surrounding quotes accepted).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

LOCAL_ENV = Path(".trainyard") / "local.env"


@dataclass(frozen=True)
class Target:
    url: str
    token: str
    url_source: str
    token_source: str


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
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{path}:{number}: expected KEY=value, got {line[:60]!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def resolve(*, url_flag: str | None, token_flag: str | None, environ: Mapping[str, str], cwd: Path,
            need_token: bool = True) -> Target:
    """The gateway URL and token; UsageError naming every place looked at when one is missing."""
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

    url, url_source = pick(url_flag, "--url", "TRAINYARD_URL")
    token, token_source = pick(token_flag, "--token", "TRAINYARD_TOKEN")
    if not url:
        raise UsageError("no gateway URL: pass --url, set TRAINYARD_URL, or start a local cluster with "
                         f"`make run` (it writes {LOCAL_ENV})")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"gateway URL {url!r} (from {url_source}) must start with http:// or https://")
    if need_token and not token:
        raise UsageError("no API token: pass --token or set TRAINYARD_TOKEN (with `make run`, "
                         f"{LOCAL_ENV} holds a development admin token)")
    return Target(url=url.rstrip("/"), token=token, url_source=url_source, token_source=token_source)
