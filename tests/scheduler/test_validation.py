"""Job spec validation: every bad field gets a message naming it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainyard_core.errors import InvalidArgument
from trainyard_scheduler.domain.models import JobSpec, Resources
from trainyard_scheduler.domain.validation import check_fits_fleet, validate_spec

from .builders import make_node

GOOD = JobSpec(name="train-1", command=("python", "train.py"), resources=Resources(nodes=2, gpus_per_node=1))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"name": ""}, "name"),
        ({"name": "-bad"}, "name"),
        ({"name": "x" * 64}, "name"),
        ({"command": ()}, "command must not be empty"),
        ({"command": ("",)}, "command[0]"),
        ({"resources": Resources(nodes=0, gpus_per_node=1)}, "resources.nodes"),
        ({"resources": Resources(nodes=1, gpus_per_node=0)}, "resources.gpus_per_node"),
        ({"resources": Resources(nodes=-1, gpus_per_node=1)}, "resources.nodes"),
        ({"env": {"RANK": "3"}}, "'RANK' is set by Trainyard"),
        ({"env": {"TRAINYARD_JOB_ID": "x"}}, "TRAINYARD_JOB_ID"),
        ({"env": {"1BAD": "x"}}, "not a valid variable name"),
        ({"working_dir": "relative/dir"}, "working_dir"),
        ({"priority": 5000}, "priority"),
        ({"max_restarts": -1}, "max_restarts"),
    ],
)
def test_bad_specs_name_the_field(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_spec(replace(GOOD, **change))  # type: ignore[arg-type]
    assert fragment in info.value.message


def test_good_spec_passes() -> None:
    validate_spec(GOOD)


def test_more_gpus_than_any_node_is_refused() -> None:
    fleet = [make_node("n-a", gpus=4), make_node("n-b", gpus=8)]
    with pytest.raises(InvalidArgument, match="more than any node has"):
        check_fits_fleet(replace(GOOD, resources=Resources(nodes=1, gpus_per_node=9)), fleet)
    with pytest.raises(InvalidArgument, match=r"resources\.nodes=2"):
        check_fits_fleet(replace(GOOD, resources=Resources(nodes=2, gpus_per_node=8)), fleet)
    with pytest.raises(InvalidArgument, match="matches no node"):
        check_fits_fleet(replace(GOOD, resources=Resources(nodes=1, gpus_per_node=1, accelerator="B200")), fleet)
    check_fits_fleet(replace(GOOD, resources=Resources(nodes=2, gpus_per_node=4)), fleet)
