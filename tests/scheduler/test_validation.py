"""Job spec validation: every bad field gets a message naming it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainyard_core.errors import FailedPrecondition, InvalidArgument
from trainyard_scheduler.domain.models import (
    CheckpointPolicy,
    Gpu,
    JobSpec,
    Node,
    PreemptionPolicy,
    Resources,
    TopologyRequest,
)
from trainyard_scheduler.domain.queues import DEFAULT_CLASSES
from trainyard_scheduler.domain.validation import (
    FleetFit,
    check_fits_fleet,
    check_priority_class,
    check_queue,
    validate_spec,
)

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
        ({"resources": Resources(nodes=1, gpus_per_node=65)}, "resources.gpus_per_node"),
        ({"resources": Resources(nodes=1, gpus_per_node=-1)}, "resources.gpus_per_node"),
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
    with pytest.raises(FailedPrecondition, match="more than any node has"):
        check_fits_fleet(replace(GOOD, resources=Resources(nodes=1, gpus_per_node=9)), fleet)
    with pytest.raises(FailedPrecondition, match=r"resources\.nodes=2"):
        check_fits_fleet(replace(GOOD, resources=Resources(nodes=2, gpus_per_node=8)), fleet)
    with pytest.raises(FailedPrecondition, match="matches no node"):
        check_fits_fleet(replace(GOOD, resources=Resources(nodes=1, gpus_per_node=1, accelerator="B200")), fleet)
    check_fits_fleet(replace(GOOD, resources=Resources(nodes=2, gpus_per_node=4)), fleet)


def res(**kw: object) -> Resources:
    return Resources(**{"nodes": 1, "gpus_per_node": 1, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"resources": res(accelerator="H100", accelerators=("A100",))}, "not both"),
        ({"resources": res(accelerators=tuple(f"m{i}" for i in range(17)))}, "at most 16"),
        ({"resources": res(accelerators=("x" * 65,))}, "resources.accelerators"),
        ({"resources": res(accelerators=("",))}, "resources.accelerators"),
        ({"resources": res(accelerators=("A100", "A100"))}, "'A100' twice"),
        ({"resources": res(min_memory_gb=-1)}, "resources.min_memory_gb"),
        ({"resources": res(min_memory_gb=4097)}, "resources.min_memory_gb"),
        ({"resources": res(min_compute_capability="9")}, "resources.min_compute_capability"),
        ({"resources": res(min_compute_capability="sm_90")}, "resources.min_compute_capability"),
        ({"resources": res(vendor="v" * 33)}, "resources.vendor"),
        ({"resources": res(cpus_per_node=-1)}, "resources.cpus_per_node"),
        ({"resources": res(cpus_per_node=4097)}, "resources.cpus_per_node"),
        ({"resources": res(speed_hints={"H100": 0.0})}, "resources.speed_hints['H100']"),
        ({"resources": res(speed_hints={"H100": 1001.0})}, "resources.speed_hints['H100']"),
        ({"resources": res(speed_hints={"H100": float("nan")})}, "resources.speed_hints['H100']"),
        ({"resources": res(speed_hints={f"m{i}": 1.0 for i in range(33)})}, "at most 32"),
        ({"resources": res(gpus_per_node=0, accelerator="H100")}, "CPU task"),
        ({"resources": res(gpus_per_node=0, min_memory_gb=40, vendor="nvidia")},
         "remove resources.min_memory_gb, resources.vendor"),
        ({"priority_class": "no such!"}, "priority_class"),
        ({"priority_class": "x" * 64}, "priority_class"),
        ({"topology": TopologyRequest(tier="island")}, "topology.tier"),
        ({"topology": TopologyRequest(tier="cluster")}, "topology.tier"),
        ({"topology": TopologyRequest(required=True)}, "topology.required needs topology.tier"),
        ({"topology": TopologyRequest(wait_s=60)}, "topology.wait_s needs topology.tier"),
        ({"topology": TopologyRequest(tier="leaf", wait_s=7 * 86400 + 1)}, "topology.wait_s"),
        ({"topology": TopologyRequest(tier="leaf", wait_s=-1)}, "topology.wait_s"),
        ({"topology": TopologyRequest(tier="leaf", required=True, wait_s=60)}, "only when topology.required"),
        ({"preemption": PreemptionPolicy(signal="SIGKILL")}, "preemption.signal"),
        ({"preemption": PreemptionPolicy(signal="")}, "preemption.signal"),
        ({"preemption": PreemptionPolicy(grace_s=3601)}, "preemption.grace_s"),
        ({"preemption": PreemptionPolicy(grace_s=float("inf"))}, "preemption.grace_s"),
        ({"restart_backoff_s": -1.0}, "restart_backoff_s"),
        ({"restart_backoff_s": 3601.0}, "restart_backoff_s"),
        ({"time_limit_s": 365 * 86400 + 1.0}, "time_limit_s"),
        ({"time_limit_s": -5.0}, "time_limit_s"),
        ({"checkpoint": CheckpointPolicy(keep_last=-1)}, "checkpoint.keep_last"),
        ({"checkpoint": CheckpointPolicy(every_steps=-1)}, "checkpoint.every_steps"),
        ({"checkpoint": CheckpointPolicy(interval_s=float("nan"))}, "checkpoint.interval_s"),
    ],
)
def test_bad_policy_fields_name_the_field(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_spec(replace(GOOD, **change))  # type: ignore[arg-type]
    assert fragment in info.value.message


@pytest.mark.parametrize(
    "change",
    [
        {"resources": res(gpus_per_node=0)},
        {"resources": res(gpus_per_node=0, cpus_per_node=16, allow_mixed=True)},
        {"resources": res(accelerators=("H100", "A100"), allow_mixed=True, speed_hints={"H100": 2.5})},
        {"resources": res(min_memory_gb=80, min_compute_capability="9.0", vendor="nvidia", cpus_per_node=32)},
        {"priority_class": "high", "queue": "batch"},
        {"topology": TopologyRequest(tier="leaf", required=True)},
        {"topology": TopologyRequest(tier="zone", wait_s=600)},
        {"topology": TopologyRequest(tier="node")},
        {"preemption": PreemptionPolicy(signal="SIGUSR1", grace_s=60)},
        {"restart_backoff_s": 0.0, "time_limit_s": 3600.0},
        {"checkpoint": CheckpointPolicy(every_steps=500, interval_s=1800, keep_last=3)},
    ],
)
def test_good_policy_fields_pass(change: dict[str, object]) -> None:
    validate_spec(replace(GOOD, **change))  # type: ignore[arg-type]


def test_priority_class_must_be_known() -> None:
    known = [c.name for c in DEFAULT_CLASSES]
    check_priority_class(GOOD, known)  # "" is the default class
    check_priority_class(replace(GOOD, priority_class="critical"), known)
    with pytest.raises(FailedPrecondition, match="priority_class 'urgent' is not defined; classes: critical, high, "
                                              "low, normal"):
        check_priority_class(replace(GOOD, priority_class="urgent"), known)


def test_queue_must_exist() -> None:
    check_queue(GOOD, [])  # "default" always exists
    check_queue(replace(GOOD, queue="batch"), ["default", "batch"])
    with pytest.raises(FailedPrecondition, match="queue 'nope' does not exist; queues: batch, default"):
        check_queue(replace(GOOD, queue="nope"), ["batch"])


def gpu_node(node_id: str, *, gpus: int, model: str, vendor: str = "nvidia", memory_mb: int = 80_000,
             cc: str = "9.0", cpus: int = 64) -> Node:
    node = make_node(node_id, gpus=gpus, model=model)
    return replace(node, cpus=cpus, gpus=tuple(Gpu(index=g.index, uuid=g.uuid, vendor=vendor, model=model,
                                                     memory_mb=memory_mb, compute_capability=cc)
                                                 for g in node.gpus))


def cpu_node(node_id: str, cpus: int = 32) -> Node:
    return replace(make_node(node_id, gpus=0), cpus=cpus)


MIXED = [gpu_node("h-1", gpus=8, model="H100"), gpu_node("h-2", gpus=8, model="H100"),
         gpu_node("a-1", gpus=8, model="A100", memory_mb=40_000, cc="8.0"),
         gpu_node("m-1", gpus=8, model="MI300X", vendor="amd", memory_mb=192_000, cc="")]


@pytest.mark.parametrize(
    ("resources", "fragment"),
    [
        (res(accelerators=("B200", "GB200")), "no GPU in the fleet matches accelerators=B200,GB200"),
        (res(vendor="intel"), "no GPU in the fleet matches vendor=intel"),
        (res(min_memory_gb=200), "min_memory_gb=200"),
        (res(min_compute_capability="10.0"), "min_compute_capability=10.0"),
        (res(min_memory_gb=100, vendor="nvidia"), "no GPU in the fleet matches"),
        (res(gpus_per_node=9, accelerators=("H100", "A100")), "more than any node has (the largest has 8"),
        (res(nodes=3, gpus_per_node=8, accelerators=("H100", "A100")), "a gang uses one model unless"),
        (res(nodes=4, gpus_per_node=8, min_compute_capability="8.0", allow_mixed=True), "resources.nodes=4"),
        (res(nodes=2, gpus_per_node=8, vendor="amd"), "resources.nodes=2 is more than the 1 node(s)"),
        (res(gpus_per_node=1, cpus_per_node=65), "resources.cpus_per_node=65"),
        (res(gpus_per_node=0), "none of the fleet's 4 node(s) is one"),
    ],
)
def test_fleet_check_for_new_request_forms(resources: Resources, fragment: str) -> None:
    with pytest.raises(FailedPrecondition) as info:
        check_fits_fleet(replace(GOOD, resources=resources), MIXED)
    assert fragment in info.value.message


@pytest.mark.parametrize(
    "resources",
    [
        res(nodes=3, gpus_per_node=8, accelerators=("H100", "A100"), allow_mixed=True),
        res(nodes=2, gpus_per_node=8, accelerators=("H100", "A100")),
        res(nodes=3, gpus_per_node=8, min_compute_capability="8.0", allow_mixed=True),
        res(nodes=2, gpus_per_node=4, min_memory_gb=80, vendor="NVIDIA"),
        res(nodes=1, gpus_per_node=8, vendor="amd", min_memory_gb=192),
        res(nodes=1, gpus_per_node=8, min_memory_gb=40),  # 40 GB = 40 000 MB
        res(nodes=2, gpus_per_node=2, cpus_per_node=64),
    ],
)
def test_fleet_check_accepts_what_could_run(resources: Resources) -> None:
    check_fits_fleet(replace(GOOD, resources=resources), MIXED)


def test_cpu_tasks_need_cpu_only_nodes() -> None:
    fleet = [gpu_node("h-1", gpus=8, model="H100"), cpu_node("c-1", cpus=32), cpu_node("c-2", cpus=8)]
    check_fits_fleet(replace(GOOD, resources=res(nodes=2, gpus_per_node=0)), fleet)
    check_fits_fleet(replace(GOOD, resources=res(nodes=1, gpus_per_node=0, cpus_per_node=32)), fleet)
    with pytest.raises(FailedPrecondition, match=r"resources\.nodes=3 is more than the 2 CPU-only node"):
        check_fits_fleet(replace(GOOD, resources=res(nodes=3, gpus_per_node=0)), fleet)
    with pytest.raises(FailedPrecondition, match=r"the 1 CPU-only node\(s\) with 16 or more CPUs"):
        check_fits_fleet(replace(GOOD, resources=res(nodes=2, gpus_per_node=0, cpus_per_node=16)), fleet)
    with pytest.raises(FailedPrecondition, match=r"use resources\.gpus_per_node=0 for a CPU task"):
        check_fits_fleet(GOOD, [cpu_node("c-1")])


@pytest.mark.parametrize("resources", [
    Resources(nodes=1, gpus_per_node=8), Resources(nodes=3, gpus_per_node=8), Resources(nodes=1, gpus_per_node=9),
    Resources(nodes=1, gpus_per_node=1, accelerator="B200"), Resources(nodes=2, gpus_per_node=4, cpus_per_node=65),
    Resources(nodes=2, gpus_per_node=4, speed_hints={"H100": 2.0}), Resources(nodes=1, gpus_per_node=0)])
def test_a_remembered_fleet_check_says_what_the_check_says(resources: Resources) -> None:
    fleet = (make_node("n-1"), make_node("n-2"), make_node("n-3", gpus=4))
    spec = replace(GOOD, resources=resources)
    fit = FleetFit()
    try:
        check_fits_fleet(spec, fleet)
        expected = None
    except FailedPrecondition as exc:
        expected = exc.message
    for _ in range(2):  # the first answer computed, the second remembered
        if expected is None:
            fit.check(spec, fleet)
        else:
            with pytest.raises(FailedPrecondition) as got:
                fit.check(spec, fleet)
            assert got.value.message == expected


def test_a_remembered_fleet_check_is_asked_again_for_a_changed_fleet() -> None:
    spec = replace(GOOD, resources=Resources(nodes=3, gpus_per_node=8))
    fit = FleetFit()
    with pytest.raises(FailedPrecondition):
        fit.check(spec, (make_node("n-1"), make_node("n-2")))
    fit.check(spec, (make_node("n-1"), make_node("n-2"), make_node("n-3")))  # a node registered: it fits now
    growing = [make_node("n-1")]
    with pytest.raises(FailedPrecondition):
        fit.check(spec, growing)
    growing += [make_node("n-2"), make_node("n-3")]  # a list may change under the same object: checked again
    fit.check(spec, growing)
