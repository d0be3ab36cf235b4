"""The site's topology file (setting `topology_file`): where each node sits in the network, as labels.

One YAML or JSON file can serve a whole site (generated from the inventory system and installed on every
host), or one node:

    labels:                 # for every node reading this file (optional)
      site: dc1
    nodes:                  # per node id (optional); these win over `labels`
      gpu-node-01: {rack: r12, switch: leaf-3, spine: s1}
      gpu-node-02: {rack: r12, switch: leaf-3, spine: s1}

The scheduler places gangs by these labels (NVLink island, then leaf `switch`, then `spine`), so a wrong
file means slow jobs: it is validated as a whole at start-up. A file with a `nodes` table that does not
list this node is an error (a new host whose place the file does not know yet); labels the agent's own
settings give win over the file.
"""

from __future__ import annotations

import re
from typing import Any

from trainyard_core.errors import InvalidArgument
from trainyard_core.files import read_structured
from trainyard_core.ids import is_valid_id

LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
MAX_VALUE = 63


def check_labels(labels: Any, where: str) -> dict[str, str]:
    if not isinstance(labels, dict):
        raise ValueError(f"{where} must be a mapping of label names to values")
    out: dict[str, str] = {}
    for key, value in labels.items():
        key = str(key)
        if not LABEL_KEY_RE.match(key):
            raise ValueError(f"{where}: label key {key!r} must be 1-63 letters, digits, '.', '_', '/' or '-', "
                             "starting and ending with a letter or digit")
        if isinstance(value, (dict, list)) or value is None:
            raise ValueError(f"{where}.{key} must be a single value (a string or a number)")
        text = str(value)
        if not text or len(text) > MAX_VALUE or any(not ch.isprintable() or ch.isspace() for ch in text):
            raise ValueError(f"{where}.{key}: {text!r} must be 1-{MAX_VALUE} characters without spaces")
        out[key] = text
    return out


def labels_for(path: str, node_id: str) -> dict[str, str]:
    """This node's labels from the topology file at `path`. Raises ValueError naming the file and the entry."""
    try:
        data = read_structured(path, "topology file")
    except InvalidArgument as e:
        raise ValueError(e.message) from e
    if not isinstance(data, dict):
        raise ValueError(f"topology file {path} must hold a mapping with `labels` and/or `nodes`")
    unknown = sorted(set(data) - {"labels", "nodes"})
    if unknown:
        raise ValueError(f"topology file {path}: unknown key(s) {', '.join(map(str, unknown))}; "
                         "expected `labels` and/or `nodes`")
    common = check_labels(data.get("labels") or {}, f"topology file {path}: labels")
    nodes = data.get("nodes")
    if nodes is None:
        return common
    if not isinstance(nodes, dict):
        raise ValueError(f"topology file {path}: nodes must map node ids to their labels")
    per_node: dict[str, dict[str, str]] = {}
    for name, labels in nodes.items():
        if not is_valid_id(str(name)):
            raise ValueError(f"topology file {path}: nodes.{name} is not a valid node id")
        per_node[str(name)] = check_labels(labels or {}, f"topology file {path}: nodes.{name}")
    if node_id not in per_node:
        raise ValueError(f"topology file {path} does not list node {node_id!r} under `nodes` (it lists "
                         f"{len(per_node)} nodes); add it, or start the agent with the right --node-id")
    return {**common, **per_node[node_id]}
