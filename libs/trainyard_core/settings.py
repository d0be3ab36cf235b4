"""One typed settings object per service, built once at start-up from flags, environment and a file.

Precedence, highest first: command-line flags, environment (`TRAINYARD_<SERVICE>_<FIELD>`), the YAML or
JSON file named by `--config` (or `TRAINYARD_<SERVICE>_CONFIG`), then the model's defaults. Flags are
derived from the model's fields (`listen_port` → `--listen-port`), so adding a field adds its flag.
Nothing else in a service reads the environment: main.py builds the settings and passes them in.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

from .errors import InvalidArgument
from .files import read_structured


class SettingsError(InvalidArgument):
    """Settings could not be built; the message names the setting and the source."""


class BaseSettings(BaseModel):
    """Fields common to every service."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_level: typing.Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: typing.Literal["json", "text"] = "json"
    # Port of the Prometheus /metrics endpoint; 0 picks a free one, -1 turns it off.
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    # OpenTelemetry: "none", "console" (spans to stderr as JSON) or a file path to append spans to.
    trace_exporter: str = "none"
    # Once serving, write {"grpc_port": ..., ...} as JSON here (used by the local cluster and tests).
    ready_file: str = ""
    # etcd client endpoints, comma-separated host:port; every key lives under etcd_prefix.
    etcd_endpoints: str = "127.0.0.1:2379"
    etcd_prefix: str = "/trainyard"


S = TypeVar("S", bound=BaseSettings)


def _origin_args(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _origin_args(non_none[0])
    return origin, args


def _kind(annotation: Any) -> str:
    origin, _ = _origin_args(annotation)
    if annotation is bool:
        return "bool"
    if origin in (dict, Mapping):
        return "map"
    if origin in (list, tuple, Sequence):
        return "list"
    return "scalar"


def _parse_map(items: Sequence[str], source: str, name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        for part in (p for p in item.split(",") if p.strip()):
            if "=" not in part:
                raise SettingsError(f"{source}: {name} expects key=value pairs, got {part!r}")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _parse_list(items: Sequence[str]) -> list[str]:
    return [p.strip() for item in items for p in item.split(",") if p.strip()]


def _parse_bool(value: str, source: str, name: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError(f"{source}: {name} must be true or false, got {value!r}")


def _read_file(path: str) -> dict[str, Any]:
    try:
        data = read_structured(path, "config file")
    except InvalidArgument as e:
        raise SettingsError(e.message) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_settings(
    cls: type[S],
    *,
    prog: str,
    env_prefix: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> S:
    """Build `cls` from flags, environment and an optional file. Raises SettingsError on bad input."""
    env = {} if env is None else env
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().split("\n")[0])
    parser.add_argument("--config", help=f"YAML or JSON settings file (env {env_prefix}CONFIG)")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        kind = _kind(field.annotation)
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif kind in ("map", "list"):
            parser.add_argument(flag, dest=name, action="append", default=None,
                                help=(help_text + " (repeatable" + (", key=value" if kind == "map" else "")
                                      + ")").strip())
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    args = parser.parse_args(list(argv) if argv is not None else [])

    values: dict[str, Any] = {}
    config_path = args.config or env.get(f"{env_prefix}CONFIG")
    if config_path:
        values.update(_read_file(config_path))

    for name, field in cls.model_fields.items():
        kind = _kind(field.annotation)
        env_name = env_prefix + name.upper()
        if env_name in env:
            raw = env[env_name]
            src = f"environment variable {env_name}"
            if kind == "bool":
                values[name] = _parse_bool(raw, src, name)
            elif kind == "map":
                values[name] = _parse_map([raw], src, name)
            elif kind == "list":
                values[name] = _parse_list([raw])
            else:
                values[name] = raw
        flag_value = getattr(args, name)
        if flag_value is not None:
            src = "--" + name.replace("_", "-")
            if kind == "map":
                values[name] = _parse_map(flag_value, src, name)
            elif kind == "list":
                values[name] = _parse_list(flag_value)
            else:
                values[name] = flag_value

    try:
        return cls.model_validate(values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            problems.append(f"{loc}: {err['msg']}")
        raise SettingsError(f"invalid {prog} settings: " + "; ".join(problems)) from None


def redacted(settings: BaseModel) -> dict[str, Any]:
    """Settings as a dict safe to log: secrets are shown as '***'."""
    out: dict[str, Any] = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        out[name] = "***" if isinstance(value, SecretStr) and value.get_secret_value() else (
            "" if isinstance(value, SecretStr) else value)
    return out


def write_ready_file(path: str, **ports: int) -> None:
    """Atomically write the bound ports, so a waiting launcher never reads half a file."""
    if not path:
        return
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(ports, f)
    os.replace(tmp, path)
