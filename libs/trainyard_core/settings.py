"""One typed settings object per service, built once at start-up from flags, environment and a file.

Precedence, highest first: command-line flags, environment (`<prefix><FIELD>`, the prefix being the
service's, e.g. `TRAINYARD_SCHEDULER_`), the YAML or JSON file named by `--config` (or `<prefix>CONFIG`),
then the model's defaults. Flags are derived from the model's fields (`listen_port` → `--listen-port`), so
adding a field adds its flag and its variable. Nothing else in a service reads the environment: main.py
builds the settings and passes them in.

Each settings class names its own prefix (`env_prefix`), so the documented names and the loader cannot
disagree. A variable under that prefix that names no setting stops the service with a message naming the
closest settings: a typo must not silently fall back to a default. Variables outside the prefix (those
meant for workers or the CLI, such as `TRAINYARD_CHECKPOINT_STORE` or `TRAINYARD_URL`) are never looked at,
but for the standard ones a settings class names in `standard_env` (OpenTelemetry's
`OTEL_EXPORTER_OTLP_ENDPOINT`), which rank below the file.

Maps and lists (`--labels rack=r1,switch=s3`) are repeatable flags and comma-separated in a variable. A map
whose values are a model (the scheduler's priority classes) takes `NAME=VALUE[,field=value...]` per flag,
the bare VALUE filling the model's first field; one variable holds several entries separated by `;`.
A flag or variable replaces the whole map or list from the file or the defaults.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from .errors import InvalidArgument
from .files import read_structured
from .security.identity import Principal
from .security.pki import CertFiles
from .store.etcd_options import EtcdOptions

log = logging.getLogger(__name__)


class SettingsError(InvalidArgument):
    """Settings could not be built; the message names the setting and the source."""


# The trace_exporter values that export nothing (telemetry.py says what the others do).
TRACES_OFF = frozenset({"", "none"})


class BaseSettings(BaseModel):
    """Fields common to every service."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The service's environment prefix, e.g. "TRAINYARD_SCHEDULER_"; every setting X is <prefix>X.
    env_prefix: ClassVar[str] = ""
    # Earlier prefixes still honoured for the exact names of settings, each with a warning at start-up.
    # Names under them that are no setting are left alone: they may be other programs' variables.
    legacy_env_prefixes: ClassVar[tuple[str, ...]] = ()
    # Standard variables outside the prefix that set a setting when neither the file, the service's own
    # variable nor a flag does, as (variable, setting); a later one wins over an earlier one.
    standard_env: ClassVar[tuple[tuple[str, str], ...]] = (("OTEL_EXPORTER_OTLP_ENDPOINT", "otlp_endpoint"),
                                                           ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "otlp_endpoint"))

    log_level: typing.Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: typing.Literal["json", "text"] = Field("json", description="one JSON object per line, or text")
    metrics_port: int = Field(-1, ge=-1, le=65535, description="port of the Prometheus /metrics endpoint; "
                              "-1 (the default): off; 0: a free port")
    metrics_host: str = Field("127.0.0.1", description="address the /metrics endpoint binds")
    trace_exporter: str = Field("none", description="OpenTelemetry spans: none, console (stderr, JSON), otlp (to "
                                "the collector at otlp_endpoint) or a file path to append them to (JSON lines)")
    otlp_endpoint: str = Field("", description="the OpenTelemetry collector's OTLP/gRPC receiver for "
                               "trace_exporter=otlp: http://HOST:PORT (plaintext) or https://HOST:PORT (default: "
                               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT)")
    otlp_ca_file: str = Field("", description="CA bundle (PEM) an https otlp_endpoint's certificate is checked "
                              "against (default: the system's)")
    ready_file: str = Field("", description="once serving, write the bound ports here as JSON (launchers, "
                            "tests)")
    tls_cert_file: str = Field("", description="this service's certificate (PEM) for mTLS on its gRPC server "
                               "and clients; its URI SAN names the service's trainyard:// principal")
    tls_key_file: str = Field("", description="the certificate's private key (PEM, unencrypted; keep it 0600)")
    tls_ca_file: str = Field("", description="the CA bundle (PEM) that signs every certificate of this deployment")
    insecure_plaintext: bool = Field(False, description="serve and call gRPC without TLS or authorization: "
                                     "development only, refused unless set explicitly, logged as a warning")

    @model_validator(mode="after")
    def _trace_export_valid(self) -> BaseSettings:
        # otlp_endpoint and otlp_ca_file are looked at only with trace_exporter=otlp: the standard variables may
        # be set for other programs (an OTLP/HTTP endpoint with a path, say) where this service exports nowhere.
        if self.trace_exporter not in TRACES_OFF:
            from .telemetry import trace_export_problem  # not at the top: it loads OpenTelemetry's SDK

            problem = trace_export_problem(self)
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _tls_complete(self) -> BaseSettings:
        given = [n for n in ("tls_cert_file", "tls_key_file", "tls_ca_file") if getattr(self, n)]
        if given and len(given) != 3:
            missing = sorted({"tls_cert_file", "tls_key_file", "tls_ca_file"} - set(given))
            raise ValueError(f"mTLS needs tls_cert_file, tls_key_file and tls_ca_file together; missing {missing}")
        if given and self.insecure_plaintext:
            raise ValueError("insecure_plaintext and the tls_* files exclude each other: set one or the other")
        return self

    @property
    def tls(self) -> CertFiles | None:
        """The mTLS files, or None (plaintext)."""
        if not self.tls_cert_file:
            return None
        return CertFiles(cert=Path(self.tls_cert_file), key=Path(self.tls_key_file), ca=Path(self.tls_ca_file))

    def principal(self) -> Principal | None:
        """The principal this service's certificate must name (None: any)."""
        return None


class EtcdSettings(BaseSettings):
    """The etcd client of the services that keep state there (scheduler, gateway, checkpoint-store)."""

    etcd_endpoints: str = Field("127.0.0.1:2379", description="etcd client endpoints, comma-separated host:port")
    etcd_prefix: str = Field("/trainyard", description="every key lives under this prefix")
    etcd_ca_file: str = Field("", description="CA bundle (PEM) that etcd's server certificates chain to; "
                              "setting it turns TLS to etcd on")
    etcd_cert_file: str = Field("", description="client certificate (PEM) presented to etcd (mTLS); under etcd's "
                                "--client-cert-auth its CN is the etcd user when no etcd_password is given")
    etcd_key_file: str = Field("", description="the etcd client certificate's private key (PEM, unencrypted, 0600)")
    etcd_user: str = Field("", description="etcd user to log in as with etcd_password (etcd's own auth)")
    etcd_password: SecretStr | None = Field(None, description="etcd_user's password; prefer the environment or "
                                            "the config file to a flag; never logged")
    etcd_insecure_plaintext: bool = Field(False, description="talk to etcd without TLS: development only, "
                                          "refused unless set explicitly (or insecure_plaintext), logged as a "
                                          "warning")

    @model_validator(mode="after")
    def _etcd_security_complete(self) -> EtcdSettings:
        if bool(self.etcd_cert_file) != bool(self.etcd_key_file):
            raise ValueError("etcd_cert_file and etcd_key_file go together: set both or neither")
        if self.etcd_cert_file and not self.etcd_ca_file:
            raise ValueError("etcd_cert_file needs etcd_ca_file (the CA bundle etcd's certificate is verified "
                             "against): a client certificate is only sent over TLS")
        if bool(self.etcd_user) != (self.etcd_password is not None and bool(self.etcd_password.get_secret_value())):
            raise ValueError("etcd_user and etcd_password go together: set both, or neither (a client "
                             "certificate alone logs in as its CN)")
        if self.etcd_ca_file and self.etcd_insecure_plaintext:
            raise ValueError("etcd_insecure_plaintext and etcd_ca_file exclude each other: set one or the other")
        return self

    def etcd_options(self) -> EtcdOptions:
        """How the store reaches etcd (`EtcdStore.from_options`): endpoints, TLS files, the credential."""
        def path(value: str) -> Path | None:
            return Path(value) if value else None
        return EtcdOptions(endpoints=self.etcd_endpoints, ca_file=path(self.etcd_ca_file),
                           cert_file=path(self.etcd_cert_file), key_file=path(self.etcd_key_file),
                           user=self.etcd_user, password=self.etcd_password if self.etcd_user else None)
    audit_retention_days: int = Field(30, ge=1, le=3650, description="how long audit entries are kept: in the "
                                      "history store (the scheduler's leader moves them there from etcd and prunes "
                                      "older ones), and while in etcd (<etcd_prefix>/audit/), each expires between "
                                      "this and one hour more")

    def audit_retention_s(self) -> float:
        return float(self.audit_retention_days * 86_400)


S = TypeVar("S", bound=BaseSettings)


def _origin_args(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _origin_args(non_none[0])
    return origin, args


def _map_model(annotation: Any) -> type[BaseModel] | None:
    """The value model of a `dict[str, SomeModel]` field, else None."""
    origin, args = _origin_args(annotation)
    if origin in (dict, Mapping) and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1]
    return None


def _kind(annotation: Any) -> str:
    origin, _ = _origin_args(annotation)
    if annotation is bool:
        return "bool"
    if _map_model(annotation) is not None:
        return "model_map"
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


def model_map_syntax(model: type[BaseModel]) -> str:
    """How one entry of a model-valued map is written on a command line, e.g.
    NAME=VALUE[,preemptible=BOOL][,can_preempt=BOOL]."""
    first, *rest = model.model_fields
    return f"NAME={first.upper()}" + "".join(f"[,{f}=...]" for f in rest)


def _parse_model_map(items: Sequence[str], source: str, name: str, model: type[BaseModel]) -> dict[str, Any]:
    fields = list(model.model_fields)
    out: dict[str, Any] = {}
    for item in items:
        for entry in (e.strip() for e in item.split(";") if e.strip()):
            key, sep, rest = entry.partition("=")
            if not sep or not key.strip() or not rest.strip():
                raise SettingsError(f"{source}: {name} expects {model_map_syntax(model)}, got {entry!r}")
            value: dict[str, str] = {}
            for i, part in enumerate(p.strip() for p in rest.split(",")):
                if "=" in part:
                    field, _, v = part.partition("=")
                    field = field.strip()
                    if field not in fields:
                        raise SettingsError(f"{source}: {name} entry {key.strip()!r}: unknown field {field!r}; "
                                            f"expected {model_map_syntax(model)}")
                    value[field] = v.strip()
                elif i == 0 and part:
                    value[fields[0]] = part
                else:
                    raise SettingsError(f"{source}: {name} expects {model_map_syntax(model)}, got {entry!r}")
            out[key.strip()] = value
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


def _parse(kind: str, field: Any, raw: Sequence[str], source: str, name: str) -> Any:
    if kind == "bool":
        return _parse_bool(raw[-1], source, name)
    if kind == "model_map":
        model = _map_model(field.annotation)
        assert model is not None
        return _parse_model_map(raw, source, name, model)
    if kind == "map":
        return _parse_map(raw, source, name)
    if kind == "list":
        return _parse_list(raw)
    return raw[-1]


def _closest(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6) or \
        difflib.get_close_matches(name, candidates, n=3, cutoff=0.0)
    return ", ".join(close)


def _read_file(path: str, cls: type[BaseSettings]) -> dict[str, Any]:
    try:
        data = read_structured(path, "config file")
    except InvalidArgument as e:
        raise SettingsError(e.message) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting names to values")
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    for key in values:
        if key not in cls.model_fields:
            raise SettingsError(f"config file {path}: {key!r} is no setting of this service; the closest are "
                                f"{_closest(key, list(cls.model_fields))}")
    return values


def resolve_prefix(cls: type[BaseSettings], env_prefix: str | None = None) -> str:
    """The prefix `load_settings` uses: the class's own, unless a caller names another (tests do). A caller
    still naming one of the class's earlier prefixes gets the current one."""
    if env_prefix is None or (cls.env_prefix and env_prefix in cls.legacy_env_prefixes):
        env_prefix = cls.env_prefix
    if not env_prefix:
        raise ValueError(f"{cls.__name__} names no env_prefix and none was given")
    return env_prefix


def settings_parser(cls: type[BaseSettings], *, prog: str, env_prefix: str | None = None) -> argparse.ArgumentParser:
    """The command line of a service: `--config` and one flag per setting."""
    prefix = resolve_prefix(cls, env_prefix)
    parser = argparse.ArgumentParser(
        prog=prog, description=(cls.__doc__ or "").strip().split("\n")[0], allow_abbrev=False,
        epilog=f"Every flag is also an environment variable: --listen-port is {prefix}LISTEN_PORT. Flags win "
               "over the environment, which wins over the --config file.")
    parser.add_argument("--config", help=f"YAML or JSON settings file (env {prefix}CONFIG)")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        kind = _kind(field.annotation)
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif kind == "model_map":
            model = _map_model(field.annotation)
            assert model is not None
            parser.add_argument(flag, dest=name, action="append", default=None,
                                help=f"{help_text} (repeatable: {model_map_syntax(model)}; replaces the whole "
                                     "table)".strip())
        elif kind in ("map", "list"):
            parser.add_argument(flag, dest=name, action="append", default=None,
                                help=(help_text + " (repeatable" + (", key=value" if kind == "map" else "")
                                      + ")").strip())
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    return parser


def env_names(cls: type[BaseSettings], env_prefix: str | None = None) -> dict[str, str]:
    """Every environment variable the loader reads for `cls`, mapped to its setting ("config" for the file)."""
    prefix = resolve_prefix(cls, env_prefix)
    return {prefix + "CONFIG": "config", **{prefix + name.upper(): name for name in cls.model_fields}}


def _environment(cls: type[BaseSettings], prefix: str, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """setting (or "config") → (variable, raw value), refusing unknown names under `prefix` and taking the
    exact names under a legacy prefix where the current name is not set."""
    known = env_names(cls, prefix)
    out: dict[str, tuple[str, str]] = {}
    for var, raw in env.items():
        if not var.startswith(prefix):
            continue
        if var not in known:
            raise SettingsError(f"environment variable {var} is no setting of this service (settings are "
                                f"{prefix}<SETTING>); the closest are {_closest(var, list(known))}")
        out[known[var]] = (var, raw)
    if prefix != cls.env_prefix:
        return out
    for legacy in cls.legacy_env_prefixes:
        for name in ("config", *cls.model_fields):
            old = legacy + name.upper()
            if old not in env:
                continue
            new = prefix + name.upper()
            if name in out:
                log.warning("%s is ignored: %s is set, and %s is the old name of it", old, new, old)
                continue
            log.warning("%s is an old name; use %s (the old one will stop working)", old, new)
            out[name] = (old, env[old])
    return out


def load_settings(
    cls: type[S],
    *,
    prog: str,
    env_prefix: str | None = None,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> S:
    """Build `cls` from flags, environment and an optional file. Raises SettingsError on bad input.

    `env_prefix` defaults to the class's own (`cls.env_prefix`)."""
    env = {} if env is None else env
    prefix = resolve_prefix(cls, env_prefix)
    parser = settings_parser(cls, prog=prog, env_prefix=prefix)
    args = parser.parse_args(list(argv) if argv is not None else [])
    from_env = _environment(cls, prefix, env)

    values: dict[str, Any] = {}
    standard: dict[str, str] = {}  # setting → the standard variable that set it
    for var, name in cls.standard_env:
        if env.get(var):
            values[name], standard[name] = env[var], var
    config_path = args.config or (from_env["config"][1] if "config" in from_env else "")
    if config_path:
        from_file = _read_file(config_path, cls)
        values.update(from_file)
        standard = {name: var for name, var in standard.items() if name not in from_file}

    for name, field in cls.model_fields.items():
        kind = _kind(field.annotation)
        if name in from_env or getattr(args, name) is not None:
            standard.pop(name, None)
        if name in from_env:
            var, raw = from_env[name]
            values[name] = _parse(kind, field, [raw], f"environment variable {var}", name)
        flag_value = getattr(args, name)
        if flag_value is not None:
            src = "--" + name.replace("_", "-")
            if kind in ("bool", "scalar"):
                values[name] = flag_value
            else:
                values[name] = _parse(kind, field, flag_value, src, name)

    try:
        return cls.model_validate(values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            problems.append(f"{loc}: {err['msg']}")
        problems += [f"({name} is {var}'s value)" for name, var in standard.items()]
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
