"""The simulator and the FIFO baseline: invariants on small random traces, the checks that make the
invariants trustworthy (a broken place function is caught), and the mixed-GPU policy beating
type-unaware gang FIFO on a 3-model trace (average JCT; a behaviour check, not a timing)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainyard_scheduler.domain.models import JobState
from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.domain.snapshot import ClusterSnapshot
from trainyard_scheduler.policy.api import ModelInfo, Profile
from trainyard_scheduler.policy.place import Decision, PlacementResult, place
from trainyard_scheduler.policy.plugins.accelerators import AcceleratorRequest
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.settings import DEFAULT_SPEED_FACTORS
from trainyard_scheduler.sim import (
    FleetShape,
    SimResult,
    SimulationError,
    Simulator,
    gang_fifo,
    make_fleet,
    synthetic_trace,
    trace_job,
)
from trainyard_scheduler.sim.fleet import A100, H100, MI300X, MODELS, domain_sizes
from trainyard_scheduler.sim.simulator import PlaceFn, Timer
from trainyard_scheduler.sim.trace import TraceJob

PROFILE = build_profile()
CONFIG = PolicyConfig(speed_factors=dict(DEFAULT_SPEED_FACTORS))
# 48 nodes x 8 GPUs: 4-node leaves, 4 leaves per spine, 2 zones; models in blocks of 2 leaves (8 nodes).
SHAPE = FleetShape(nodes=48, nodes_per_leaf=4, leaves_per_spine=4, zones=2, block_leaves=2)
SMALL_SIZES = ((1, 0.3), (2, 0.1), (4, 0.15), (8, 0.25), (16, 0.1), (32, 0.06), (64, 0.04))


def small_trace(jobs: int, seed: int, load: float = 0.8) -> list[TraceJob]:
    return synthetic_trace(jobs, seed, shape=SHAPE, sizes=SMALL_SIZES, load=load, median_runtime_s=900.0)


class NoOverlap:
    """Observer: at every cycle, no GPU is in two allocations, and no decision takes a GPU that a running
    gang or an earlier decision of the same cycle holds (checked independently of the simulator's own
    assertion)."""

    def __init__(self) -> None:
        self.cycles = 0

    def __call__(self, snap: ClusterSnapshot, result: PlacementResult, now: float) -> None:
        self.cycles += 1
        held: set[tuple[str, int]] = set()
        for alloc in snap.allocations.values():
            for a in alloc.assignments:
                for g in a.gpu_indices:
                    assert (a.node_id, g) not in held
                    held.add((a.node_id, g))
        for d in result.decisions:
            for a in d.assignments:
                for g in a.gpu_indices:
                    assert (a.node_id, g) not in held, f"{d.job_id} got GPU {g} of {a.node_id}, which is taken"
                    held.add((a.node_id, g))


def simulate(trace: list[TraceJob], place_fn: PlaceFn = place, config: PolicyConfig = CONFIG,
             observer: NoOverlap | None = None, cycle_s: float = 30.0) -> SimResult:
    nodes = make_fleet(SHAPE.nodes, SHAPE.gpus_per_node, shape=SHAPE)
    return Simulator(nodes, PROFILE, config, place_fn=place_fn, cycle_s=cycle_s, observer=observer).run(trace)


# --- the fleet and the trace -------------------------------------------------------------------------------

def test_fleet_has_three_models_two_vendors_and_three_tiers() -> None:
    nodes = make_fleet(10_000, 8)
    assert len(nodes) == 10_000 and sum(len(n.gpus) for n in nodes) == 80_000
    by_model: dict[str, int] = {}
    for n in nodes:
        assert len({g.model for g in n.gpus}) == 1
        by_model[n.gpus[0].model] = by_model.get(n.gpus[0].model, 0) + 1
    assert set(by_model) == {H100, A100, MI300X}
    assert {g.vendor for n in nodes for g in n.gpus} == {"nvidia", "amd"}
    # Named as agents report them, so the scheduler's default speed factors apply.
    assert set(by_model) <= set(DEFAULT_SPEED_FACTORS)
    assert by_model[H100] / 10_000 == pytest.approx(0.4, abs=0.02)
    assert by_model[MI300X] / 10_000 == pytest.approx(0.2, abs=0.02)
    # Whole leaves share one model; zones, spines and leaves nest.
    leaf_models: dict[str, set[str]] = {}
    for n in nodes:
        leaf_models.setdefault(n.labels["switch"], set()).add(n.gpus[0].model)
    assert all(len(m) == 1 for m in leaf_models.values())
    assert {n.labels["zone"] for n in nodes} == {"zone-0", "zone-1"}
    sizes = domain_sizes(nodes)
    assert (sizes[""].leaf, sizes[""].spine) == (32, 512)
    assert sizes[MI300X].spine >= 128  # a 128-node gang of every model fits in one spine


def test_trace_is_deterministic_and_heavy_tailed() -> None:
    a, b = synthetic_trace(2_000, 5), synthetic_trace(2_000, 5)
    assert a == b and a != synthetic_trace(2_000, 6)
    sizes = [t.gpus for t in a]
    assert sum(1 for s in sizes if s <= 8) / len(sizes) > 0.6
    assert max(sizes) == 1024 and any(64 <= s < 1024 for s in sizes)
    assert all(s <= 8 or t.spec.resources.gpus_per_node == 8 for s, t in zip(sizes, a, strict=True))
    assert all(x.submit < y.submit for x, y in itertools.pairwise(a))
    # Time limits over-estimate the run time on the slowest model the job accepts: 1.2-3x.
    accepts = AcceleratorRequest()
    infos = [ModelInfo(m.model, m.vendor, m.memory_mb, m.compute_capability) for m in MODELS.values()]
    for t in a:
        job = t.job()
        slowest = min(t.speed(i.model) for i in infos if accepts.filter(job, i) is None)
        runtime = t.work / (t.gpus * slowest)
        assert 1.2 * runtime - 1e-6 <= t.spec.time_limit_s <= 3.0 * runtime + 60.0


# --- invariants ----------------------------------------------------------------------------------------------

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), jobs=st.integers(20, 80), fifo=st.booleans())
def test_random_traces_keep_the_invariants(seed: int, jobs: int, fifo: bool) -> None:
    trace = small_trace(jobs, seed, load=1.2)
    watch = NoOverlap()
    result = simulate(trace, gang_fifo() if fifo else place, observer=watch)
    assert watch.cycles > 0
    # A finite trace ends: every job started and reached a terminal state.
    for rec in result.jobs.values():
        assert rec.first_start is not None and rec.end is not None, rec.job_id
        assert rec.state in (JobState.SUCCEEDED, JobState.FAILED)
        assert rec.first_start >= rec.submit and rec.end > rec.first_start
    assert sum(1 for r in result.jobs.values() if r.state is JobState.SUCCEEDED) == len(trace) - len(result.failed())
    # Sample allocation never exceeds the fleet.
    assert all(0.0 <= c.allocation <= 1.0 for c in result.cycles)


def test_fifo_baseline_starts_jobs_strictly_in_submission_order() -> None:
    trace = small_trace(150, 11, load=1.1)
    result = simulate(trace, gang_fifo())
    starts = [result.jobs[t.job_id].first_start for t in trace]
    assert all(s is not None for s in starts)
    assert starts == sorted(starts)  # type: ignore[type-var]
    assert result.preemptions() == 0
    # ... and it really does block: some job waited behind a bigger one although it would have fit.
    assert any(result.jobs[t.job_id].wait > 0 for t in trace if t.gpus == 1)


def test_simulation_is_deterministic() -> None:
    trace = small_trace(60, 3)
    a, b = simulate(trace), simulate(trace)
    assert {k: (r.first_start, r.end, r.models) for k, r in a.jobs.items()} == \
        {k: (r.first_start, r.end, r.models) for k, r in b.jobs.items()}


def _overlapping_place(snapshot: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
                       port_range: tuple[int, int] = (29500, 29999), timer: Timer | None = None) -> PlacementResult:
    """A broken policy: every gang of the cycle gets the first gang's GPUs."""
    result = place(snapshot, profile, config, now, port_range, timer)
    return PlacementResult(decisions=[replace(d, assignments=result.decisions[0].assignments)
                                      for d in result.decisions])


def _partial_place(snapshot: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
                   port_range: tuple[int, int] = (29500, 29999), timer: Timer | None = None) -> PlacementResult:
    """A broken policy: drops the last node of every multi-node gang."""
    result = place(snapshot, profile, config, now, port_range, timer)
    return PlacementResult(decisions=[Decision(d.job_id, d.assignments[:-1] if len(d.assignments) > 1
                                               else d.assignments, d.master_port, d.model) for d in result.decisions])


@pytest.mark.parametrize(("broken", "message"), [(_overlapping_place, "already in a running gang"),
                                                 (_partial_place, "placed on")])
def test_the_simulator_catches_a_broken_policy(broken: PlaceFn, message: str) -> None:
    trace = [trace_job("a", 0.0, nodes=2, gpus_per_node=4), trace_job("b", 0.0, nodes=2, gpus_per_node=4)]
    with pytest.raises(SimulationError, match=message):
        simulate(trace, broken)


def test_a_refused_model_is_caught() -> None:
    def wrong_model(snapshot: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
                    port_range: tuple[int, int] = (29500, 29999), timer: Timer | None = None) -> PlacementResult:
        # Ignores the job's exact request: places it as if it asked for any model.
        relaxed = {k: replace(j, spec=replace(j.spec, resources=replace(j.spec.resources, accelerator="")))
                   for k, j in snapshot.jobs.items()}
        return place(replace(snapshot, jobs=relaxed), profile, config, now, port_range, timer)

    with pytest.raises(SimulationError, match="refuses"):
        simulate([trace_job("a", 0.0, gpus_per_node=8, accelerator=A100)], wrong_model)


# --- what the simulator models ----------------------------------------------------------------------------

def test_preempted_job_loses_work_since_its_checkpoint_and_resumes() -> None:
    one_node = FleetShape(nodes_per_leaf=1, leaves_per_spine=1, zones=1, block_leaves=1, mix=((H100, 1.0),))
    nodes = make_fleet(1, 8, shape=one_node)
    low = trace_job("low", 0.0, gpus_per_node=8, work=8 * 3000.0, speeds={H100: 1.0}, priority_class="low",
                    checkpoint_s=600.0, time_limit_s=10_000.0)
    high = trace_job("high", 1000.0, gpus_per_node=8, work=8 * 500.0, speeds={H100: 1.0}, priority_class="high",
                     time_limit_s=1_000.0)
    result = Simulator(nodes, PROFILE, CONFIG, cycle_s=10.0).run([low, high])
    lo, hi = result.jobs["low"], result.jobs["high"]
    assert lo.preemptions == 1 and hi.preemptions == 0
    assert hi.first_start is not None and hi.first_start == pytest.approx(1010.0)  # the cycle after the preemption
    # 'low' ran 1000 s, saved at 600 s: 400 s lost, 2400 s left after 'high' (500 s) finishes.
    assert lo.starts[1] == pytest.approx(hi.first_start + 500.0, abs=10.0)
    assert lo.end == pytest.approx(lo.starts[1] + 2400.0)
    assert lo.state is JobState.SUCCEEDED


def test_a_job_past_its_time_limit_is_killed() -> None:
    trace = [trace_job("slow", 0.0, gpus_per_node=8, work=8 * 3600.0, speeds={H100: 1.0, A100: 1.0, MI300X: 1.0},
                       time_limit_s=1800.0)]
    result = simulate(trace)
    rec = result.jobs["slow"]
    assert rec.state is JobState.FAILED and rec.end == pytest.approx(1800.0)


def test_mixed_gang_runs_at_its_slowest_model() -> None:
    # FIFO fills nodes in id order: a 24-node gang on an empty fleet takes the first 3 blocks (8 nodes each),
    # which hold more than one model.
    trace = [trace_job("wide", 0.0, nodes=24, gpus_per_node=8, work=192 * 1000.0,
                       speeds={H100: 3.0, A100: 1.0, MI300X: 2.0})]
    result = simulate(trace, gang_fifo())
    rec = result.jobs["wide"]
    assert rec.models == ["mixed"] and rec.end == pytest.approx(1000.0)  # A100 speed, 1.0
    ours = simulate(trace).jobs["wide"]
    assert ours.models != ["mixed"]


# --- the policy against the baseline ----------------------------------------------------------------------

def test_mixed_gpu_policy_beats_type_unaware_fifo_on_average_jct() -> None:
    trace = small_trace(300, 21, load=0.75)
    ours, fifo = simulate(trace), simulate(trace, gang_fifo())
    assert len(ours.finished()) == len(fifo.finished()) == len(trace)
    assert ours.average_jct() < 0.8 * fifo.average_jct()
    # It packs gangs closer, too.
    assert ours.mean_tiers_over_optimal() < fifo.mean_tiers_over_optimal()


@pytest.mark.parametrize(("exempt_s", "at_most"), [(0.0, None), (300.0, 6)])
def test_a_gang_preempted_again_and_again_still_progresses(exempt_s: float, at_most: int | None) -> None:
    """A long low-class job and a stream of short normal ones on one node. Without an exemption the low job
    is preempted by every arrival, each time before its first checkpoint (18 times); with the exemption
    doubling after each preemption it gets to checkpoint and is preempted a few times only."""
    one_node = FleetShape(nodes_per_leaf=1, leaves_per_spine=1, zones=1, block_leaves=1, mix=((H100, 1.0),))
    nodes = make_fleet(1, 8, shape=one_node)
    low = trace_job("low", 0.0, gpus_per_node=8, work=8 * 3600.0, speeds={H100: 1.0}, priority_class="low",
                    checkpoint_s=1800.0, time_limit_s=50_000.0)
    normals = [trace_job(f"n-{i:02d}", 600.0 * (i + 1), gpus_per_node=8, work=8 * 300.0, speeds={H100: 1.0},
                         time_limit_s=600.0) for i in range(18)]
    config = replace(CONFIG, preempt_exempt_s=exempt_s)
    result = Simulator(nodes, PROFILE, config, cycle_s=10.0).run([low, *normals])
    preempted = result.jobs["low"].preemptions
    if at_most is None:
        assert preempted >= 18
    else:
        assert preempted <= at_most and result.jobs["low"].state is JobState.SUCCEEDED
    assert all(result.jobs[n.job_id].state is JobState.SUCCEEDED for n in normals)
