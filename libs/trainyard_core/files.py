"""Reading operator-provided YAML/JSON files (settings, policies, topology) with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .errors import InvalidArgument


def read_structured(path: str, what: str) -> Any:
    """Parse `path` as JSON (by its .json suffix) or YAML. Raises InvalidArgument naming `what` and `path`."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise InvalidArgument(f"cannot read {what} {path}: {e.strerror}") from e
    try:
        return json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidArgument(f"{what} {path} is not valid YAML/JSON: {e}") from e
