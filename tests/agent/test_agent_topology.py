"""Topology arithmetic (islands, NVLinks per pair, CPU masks, PCIe levels) as tables, and the site's
topology file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_agent.nvml import api
from trainyard_agent.nvml.profiles import common_ancestor
from trainyard_agent.nvml.topology import (
    cpus_from_mask,
    mask_from_cpus,
    nvlink_islands,
    nvlinks_between,
    parse_bus_id,
)
from trainyard_agent.site_topology import labels_for

G = [(0, bus, 0) for bus in (0x10, 0x20, 0x30, 0x40)]
SW1, SW2 = (0, 0xC0, 0), (0, 0xC1, 0)


@pytest.mark.parametrize("remotes,islands", [
    # no links at all
    ([[], [], [], []], [-1, -1, -1, -1]),
    # every GPU to the same switch: one island
    ([[SW1, SW1], [SW1, SW1], [SW1], [SW1]], [0, 0, 0, 0]),
    # two boards: GPUs 0-1 on one switch, 2-3 on another
    ([[SW1], [SW1], [SW2], [SW2]], [0, 0, 1, 1]),
    # direct pairs (0-1, 2-3) and no link between them; island ids follow the lowest GPU index
    ([[G[1]], [G[0]], [G[3]], [G[2]]], [0, 0, 1, 1]),
    # a chain 0-1-2 joins all three; GPU 3 alone
    ([[G[1]], [G[0], G[2]], [G[1]], []], [0, 0, 0, -1]),
    # a link seen from one side only still joins (a GPU may be lost while the other reports its link)
    ([[], [], [G[0]], []], [0, -1, 0, -1]),
])
def test_islands(remotes: list[list[tuple[int, int, int]]], islands: list[int]) -> None:
    assert nvlink_islands(G, remotes) == islands


def test_nvlinks_between_pairs() -> None:
    # GPU 0: 2 links to SW1, 1 to SW2, 2 direct to GPU 1; GPU 1: 1 to SW1, 2 to SW2, 2 direct to GPU 0.
    remotes = [[SW1, SW1, SW2, G[1], G[1]], [SW1, SW2, SW2, G[0], G[0]], [], []]
    assert nvlinks_between(G, remotes, 0, 1) == 2 + 1 + 1
    assert nvlinks_between(G, remotes, 0, 2) == 0


@pytest.mark.parametrize("cpus,words", [((), 1), ((0, 1, 63), 1), ((0, 64, 65, 127, 128), 3), (tuple(range(200)), 4)])
def test_cpu_masks_round_trip(cpus: tuple[int, ...], words: int) -> None:
    assert cpus_from_mask(mask_from_cpus(cpus, words)) == cpus


def test_cpus_beyond_the_mask_are_dropped() -> None:
    assert cpus_from_mask(mask_from_cpus([1, 70], 1)) == (1,)


@pytest.mark.parametrize("bus_id,key", [("00000000:18:00.0", (0, 0x18, 0)), ("0000:DB:1F.3", (0, 0xDB, 0x1F))])
def test_bus_ids(bus_id: str, key: tuple[int, int, int]) -> None:
    assert parse_bus_id(bus_id) == key


def test_a_bad_bus_id_is_named() -> None:
    with pytest.raises(ValueError, match="not a PCI bus id: 'gpu0'"):
        parse_bus_id("gpu0")


@pytest.mark.parametrize("a,b,level", [
    (("s0", "hb0", "sw0"), ("s0", "hb0", "sw0"), api.NVML_TOPOLOGY_SINGLE),
    (("s0", "hb0", "sw0", "leaf0"), ("s0", "hb0", "sw0", "leaf1"), api.NVML_TOPOLOGY_MULTIPLE),
    (("s0", "hb0", "rp1"), ("s0", "hb0", "rp2"), api.NVML_TOPOLOGY_HOSTBRIDGE),
    (("s0", "hb0", "sw0"), ("s0", "hb1", "sw1"), api.NVML_TOPOLOGY_NODE),
    (("s0", "hb0", "sw0"), ("s1", "hb1", "sw1"), api.NVML_TOPOLOGY_SYSTEM),
])
def test_pcie_levels_of_the_simulated_layouts(a: tuple[str, ...], b: tuple[str, ...], level: int) -> None:
    assert common_ancestor(a, b) == level == common_ancestor(b, a)
    assert api.TOPOLOGY_LEVEL_NAMES[level] in ("PIX", "PXB", "PHB", "NODE", "SYS")


# --- the site's topology file -------------------------------------------------------------------------------


def test_site_file_labels_for_a_node(tmp_path: Path) -> None:
    f = tmp_path / "topology.yaml"
    f.write_text("labels: {site: dc1, spine: s0}\n"
                 "nodes:\n  gpu-node-01: {rack: r12, switch: leaf-3, spine: s1}\n  gpu-node-02: {rack: 7}\n")
    assert labels_for(str(f), "gpu-node-01") == {"site": "dc1", "spine": "s1", "rack": "r12", "switch": "leaf-3"}
    assert labels_for(str(f), "gpu-node-02") == {"site": "dc1", "spine": "s0", "rack": "7"}


def test_a_single_node_file_needs_no_nodes_table(tmp_path: Path) -> None:
    f = tmp_path / "topology.json"
    f.write_text('{"labels": {"rack": "r1", "switch": "leaf-1"}}')
    assert labels_for(str(f), "anything-goes") == {"rack": "r1", "switch": "leaf-1"}


@pytest.mark.parametrize("text,message", [
    ("nodes:\n  gpu-node-01: {rack: r1}\n", "does not list node 'node-a' under `nodes` (it lists 1 nodes)"),
    ("racks: {}\n", "unknown key(s) racks; expected `labels` and/or `nodes`"),
    ("- rack\n", "must hold a mapping with `labels` and/or `nodes`"),
    ("labels: {rack: [1, 2]}\n", "labels.rack must be a single value"),
    ("labels: {rack: 'r 1'}\n", "labels.rack: 'r 1' must be 1-63 characters without spaces"),
    ("labels: {-rack: r1}\n", "label key '-rack' must be 1-63 letters"),
    ("nodes: {Node_A: {rack: r1}}\n", "nodes.Node_A is not a valid node id"),
    ("nodes: [node-a]\n", "nodes must map node ids to their labels"),
    ("labels: {rack: r1\n", "is not valid YAML/JSON"),
])
def test_bad_site_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "topology.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as info:
        labels_for(str(f), "node-a")
    assert message in str(info.value) and str(f) in str(info.value)


def test_a_missing_site_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read topology file .*nope\.yaml: No such file"):
        labels_for(str(tmp_path / "nope.yaml"), "node-a")
