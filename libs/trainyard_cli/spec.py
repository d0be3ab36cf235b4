"""The job spec `trainyard submit` sends: a YAML/JSON file (`-f`), flags, or both (flags win).

The CLI checks only what it needs to merge the two (and turns durations like `1h30m` into seconds); the
gateway validates the result and its message names any offending field.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
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


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# Spec fields (dotted paths) that take seconds; in a spec file they may also be written like "1h30m".
DURATION_FIELDS = ("time_limit_s", "restart_backoff_s", "topology.wait_s", "preemption.grace_s",
                   "checkpoint.interval_s")


def parse_duration(text: str) -> float:
    """Seconds from '90', '90.5', '45s', '10m', '1h30m', '2d' or '1.5h'. ValueError when it is none of those."""
    value = text.strip().lower()
    try:
        return float(value)
    except ValueError:
        pass
    if not value or _DURATION_PART.sub("", value):
        raise ValueError(f"expected seconds or a duration like 90s, 10m, 1h30m or 2d, got {text!r}")
    return float(sum(float(n) * _UNIT_S[unit] for n, unit in _DURATION_PART.findall(value)))


def when(text: str, now: datetime | None = None) -> str:
    """An RFC 3339 time from a duration back from now ('1h': an hour ago) or from a time (UTC when it names no
    zone), for the --since/--until options; argparse's error when it is neither."""
    try:
        seconds = parse_duration(text)
    except ValueError:
        try:
            at = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a duration like 1h or 2d, or a time like "
                                             f"2026-01-31T12:00:00Z, got {text!r}") from None
        return (at if at.tzinfo else at.replace(tzinfo=UTC)).isoformat()
    return ((now or datetime.now(UTC)) - timedelta(seconds=seconds)).isoformat()


def parse_limits(items: Sequence[str]) -> dict[str, dict[str, int]]:
    """`--limit MODEL=NOMINAL[:BORROW]` items → quota limits; '*' as MODEL stands for every model."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        model, sep, amounts = item.rpartition("=")
        nominal, _, borrow = amounts.partition(":")
        try:
            if not sep or not model:
                raise ValueError
            limit = {"nominal": int(nominal)}
            if borrow:
                limit["borrow_limit"] = int(borrow)
        except ValueError:
            raise UsageError(f"--limit expects MODEL=NOMINAL or MODEL=NOMINAL:BORROW_LIMIT (e.g. H100-80GB-HBM3=64:32 "
                             f"or '*=8'), got {item!r}") from None
        out[model] = limit
    return out


def parse_speed_hints(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        model, sep, factor = item.rpartition("=")
        try:
            if not sep or not model:
                raise ValueError
            out[model] = float(factor)
        except ValueError:
            raise UsageError(f"--speed-hint expects MODEL=FACTOR (e.g. H100-80GB-HBM3=2.5), got {item!r}") from None
    return out


def _set_path(spec: dict[str, Any], path: str, value: Any) -> None:
    """spec['a']['b'] = value for 'a.b', keeping what the spec file has beside it."""
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        child = node.get(key)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise UsageError(f"{key} in the spec file must be a mapping")
        else:
            child = dict(child)
        node[key] = child
        node = child
    node[leaf] = value


def _durations(spec: dict[str, Any]) -> None:
    for path in DURATION_FIELDS:
        *parents, leaf = path.split(".")
        node: Any = spec
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str):
            try:
                node[leaf] = parse_duration(node[leaf])
            except ValueError as exc:
                raise UsageError(f"{path} in the spec file: {exc}") from None


def _stringify(values: Any) -> Any:
    # YAML turns `OMP_NUM_THREADS: 4` into an int and `DEBUG: yes` into True; the API wants strings.
    if not isinstance(values, dict):
        return values
    return {k: ("true" if v is True else "false" if v is False else str(v))
            if isinstance(v, bool | int | float) else v for k, v in values.items()}


def build_spec(*, file_spec: dict[str, Any] | None, name: str | None, command: Sequence[str],
               nodes: int | None, gpus_per_node: int | None, accelerator: str | None, env: Mapping[str, str],
               labels: Mapping[str, str], working_dir: str | None, queue: str | None, priority: int | None,
               max_restarts: int | None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`overrides`: more flags as dotted spec paths ('resources.vendor', 'topology.tier', 'time_limit_s');
    None values are flags not given."""
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
    for path, value in (overrides or {}).items():
        if value is not None:
            _set_path(spec, path, value)
    _durations(spec)
    if not spec.get("name"):
        raise UsageError("a job needs a name: pass --name NAME or give `name:` in the spec file")
    if not spec.get("command"):
        raise UsageError("a job needs a command: put it after `--` (trainyard submit --name N -- python "
                         "train.py) or give `command:` in the spec file")
    return spec
