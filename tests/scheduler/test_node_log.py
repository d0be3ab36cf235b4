"""The leader logs a node that stops being alive (WARNING, with its silence) and one that comes back (INFO), each
line carrying the node's id, as the JSON formatter writes it; a node first registered is not "back", an
unchanged live set logs nothing, and a mass loss is summed up after MAX_LINES lines."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.scheduler.builders import make_node, snapshot
from trainyard_core.logs import JsonFormatter
from trainyard_scheduler import node_log
from trainyard_scheduler.node_log import NodeTransitions


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter("scheduler"))
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def lines() -> Iterator[list[dict[str, object]]]:
    handler = _Lines()
    logger = logging.getLogger(node_log.__name__)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_lost_node_and_its_return_are_logged_with_its_id(lines: list[dict[str, object]]) -> None:
    nodes = [make_node(f"n{i}") for i in range(3)]
    watch = NodeTransitions()
    first = snapshot(nodes)
    assert watch.observe(first) == ([], [])  # the baseline
    assert watch.observe(first) == ([], [])  # the same live set object: nothing to compare
    assert lines == []

    lost = replace(snapshot(nodes, dead=["n1"]), silence={"n1": 3.456})
    assert watch.observe(lost) == (["n1"], [])
    assert [(x["level"], x["msg"], x["node_id"], x["silent_s"]) for x in lines] == [
        ("warning", "node lost: no proof of life from its agent", "n1", 3.46)]

    lines.clear()
    assert watch.observe(snapshot(nodes)) == ([], ["n1"])
    assert [(x["level"], x["msg"], x["node_id"]) for x in lines] == [("info", "node alive again", "n1")]

    # A node registered since the last change is not back from anything.
    lines.clear()
    assert watch.observe(snapshot([*nodes, make_node("n9")])) == ([], [])
    assert lines == []


def test_a_mass_loss_names_the_first_nodes_and_counts_the_rest(lines: list[dict[str, object]]) -> None:
    nodes = [make_node(f"n{i:03d}") for i in range(node_log.MAX_LINES + 7)]
    watch = NodeTransitions()
    watch.observe(snapshot(nodes))
    lost, back = watch.observe(snapshot(nodes, dead=[n.node_id for n in nodes]))
    assert len(lost) == len(nodes) and back == []
    named = [x for x in lines if "node_id" in x]
    assert [x["node_id"] for x in named] == [f"n{i:03d}" for i in range(node_log.MAX_LINES)]
    assert [x["msg"] for x in lines if "node_id" not in x] == ["7 more nodes lost"]
