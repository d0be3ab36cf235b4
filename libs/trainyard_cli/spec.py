"""The job spec `trainyard submit` sends: a YAML/JSON file (`-f`), flags, or both (flags win).

The CLI checks only what it needs to merge the two; the gateway validates the result and its message
names any offending field.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .errors import UsageError


def load_spec_file(path: str) -> dict[str, Any]:
    """A spec from a YAML or JSON file ('-' reads standard input)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read spec file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise UsageError(f"spec file {path} is not valid {kind}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"spec file {path} must hold a mapping (name, command, resources, ...)")
    return data


def parse_pairs(items: Sequence[str], flag: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """KEY=VALUE items; with `environ`, a bare KEY takes its value from there (like `docker run -e`)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key:
            raise UsageError(f"{flag} expects KEY=VALUE, got {item!r}")
        if not sep:
            if environ is None or key not in environ:
                raise UsageError(f"{flag} {key}: expected KEY=VALUE"
                                 + (f", and {key} is not set in this environment" if environ is not None else ""))
            value = environ[key]
        out[key] = value
    return out


def _stringify(values: Any) -> Any:
    # YAML turns `OMP_NUM_THREADS: 4` into an int and `DEBUG: yes` into True; the API wants strings.
    if not isinstance(values, dict):
        return values
    return {k: ("true" if v is True else "false" if v is False else str(v))
            if isinstance(v, bool | int | float) else v for k, v in values.items()}


def build_spec(*, file_spec: dict[str, Any] | None, name: str | None, command: Sequence[str],
               nodes: int | None, gpus_per_node: int | None, accelerator: str | None, env: Mapping[str, str],
               labels: Mapping[str, str], working_dir: str | None, queue: str | None, priority: int | None,
               max_restarts: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = dict(file_spec or {})
    if name is not None:
        spec["name"] = name
    if command:
        spec["command"] = list(command)
    resources = spec.get("resources")
    resources = dict(resources) if isinstance(resources, dict) else ({} if resources is None else resources)
    if isinstance(resources, dict):
        for key, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("accelerator", accelerator)):
            if value is not None:
                resources[key] = value
        resources.setdefault("nodes", 1)
        resources.setdefault("gpus_per_node", 1)
    spec["resources"] = resources
    for key, flags in (("env", env), ("labels", labels)):
        merged = _stringify(spec.get(key) or {})
        if flags:
            if not isinstance(merged, dict):
                raise UsageError(f"{key} in the spec file must be a mapping")
            merged = {**merged, **flags}
        if merged or key in spec:
            spec[key] = merged
    for key, value in (("working_dir", working_dir), ("queue", queue), ("priority", priority),
                       ("max_restarts", max_restarts)):
        if value is not None:
            spec[key] = value
    if not spec.get("name"):
        raise UsageError("a job needs a name: pass --name NAME or give `name:` in the spec file")
    if not spec.get("command"):
        raise UsageError("a job needs a command: put it after `--` (trainyard submit --name N -- python "
                         "train.py) or give `command:` in the spec file")
    return spec
