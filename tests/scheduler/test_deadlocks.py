"""Gang deadlock and starvation, through the simulator on small fleets.

1. Two gangs that each need two thirds of the fleet, submitted together. A scheduler that places workers
   one by one can give each gang part of the fleet and leave both waiting for ever. Fleet: 75 nodes x 2
   GPUs = 150 GPUs; each gang is 50 nodes x 2 GPUs = 100 GPUs, so one fits at a time and a 50/50 split
   (75 + 75 GPUs) would deadlock both. Both must complete, one after the other, and no snapshot ever
   holds a gang with fewer GPUs than it asked for.
2. A big job in a stream of small ones that keeps the fleet busy for as long as it lasts. With the
   reservation (the default, reservation_depth=1) it starts by the time the time limits of the gangs
   running when it became the top blocked job allow, while small jobs keep starting meanwhile
   (backfill). With reservation_depth=0 the same trace starves it until the stream ends: the contrast
   shows the first assertion can fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.domain.snapshot import ClusterSnapshot
from trainyard_scheduler.policy.place import PlacementResult, place
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.sim import FleetShape, SimResult, Simulator, gang_fifo, make_fleet, trace_job
from trainyard_scheduler.sim.fleet import H100
from trainyard_scheduler.sim.simulator import PlaceFn
from trainyard_scheduler.sim.trace import TraceJob

PROFILE = build_profile()
CONFIG = PolicyConfig(speed_factors={H100: 1.0})
ONE_MODEL = ((H100, 1.0),)


@dataclass
class Watch:
    """Every cycle's snapshot and result, reduced to what the assertions need."""

    gang_gpus: list[dict[str, int]] = field(default_factory=list)
    first_reservation: tuple[float, float, float] | None = None  # (at, start, max expected end then)
    watched: str = ""

    def __call__(self, snap: ClusterSnapshot, result: PlacementResult, now: float) -> None:
        self.gang_gpus.append({a.job_id: a.gpus for a in snap.allocations.values()})
        if self.first_reservation is None and any(r.job_id == self.watched for r in result.reservations):
            res = next(r for r in result.reservations if r.job_id == self.watched)
            ends = [a.expected_end for a in snap.allocations.values() if a.expected_end is not None]
            ends += [now + snap.jobs[d.job_id].spec.time_limit_s for d in result.decisions]
            self.first_reservation = (now, res.start, max(ends))


# --- 1. two gangs of two thirds ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["ours", "fifo"])
def test_two_gangs_of_two_thirds_run_one_after_the_other(policy: str) -> None:
    shape = FleetShape(nodes_per_leaf=25, leaves_per_spine=3, zones=1, block_leaves=3, island_size=2, mix=ONE_MODEL)
    nodes = make_fleet(75, 2, shape=shape)
    assert sum(len(n.gpus) for n in nodes) == 150
    gangs = [trace_job(name, 0.0, nodes=50, gpus_per_node=2, work=100 * 3600.0, speeds={H100: 1.0},
                       time_limit_s=2 * 3600.0) for name in ("gang-a", "gang-b")]
    watch = Watch()
    place_fn: PlaceFn = place if policy == "ours" else gang_fifo()
    result = Simulator(nodes, PROFILE, CONFIG, place_fn=place_fn, cycle_s=10.0, observer=watch).run(gangs)

    a, b = (result.jobs[g.job_id] for g in gangs)
    assert a.state.value == b.state.value == "succeeded"
    first, second = sorted((a, b), key=lambda r: r.first_start or 0.0)
    assert first.first_start == 0.0 and first.end == pytest.approx(3600.0)
    assert second.first_start is not None and first.end is not None
    assert first.end <= second.first_start <= first.end + 10.0  # the next cycle after the first ends
    assert result.preemptions() == 0
    # Never both placed, never one partly placed.
    for held in watch.gang_gpus:
        assert len(held) <= 1 and all(gpus == 100 for gpus in held.values())


# --- 2. a big job among a stream of small ones ----------------------------------------------------------

SMALL_EVERY_S = 60.0
STREAM_END_S = 20_000.0
BIG_AT_S = 3_000.0


def stream_with_big_job(seed: int = 3) -> list[TraceJob]:
    """16 nodes x 8 GPUs. One-node jobs (8 GPUs) every minute, each running 10-30 minutes (time limit 1.5x
    that): 1.25x what the fleet serves, so the queue never empties while the stream lasts. The big job
    wants 8 nodes (half the fleet) for 30 minutes."""
    rng = random.Random(seed)
    jobs = []
    t, i = 0.0, 0
    while t < STREAM_END_S:
        runtime = rng.uniform(600.0, 1800.0)
        jobs.append(trace_job(f"s-{i:04d}", t, nodes=1, gpus_per_node=8, work=8 * runtime, speeds={H100: 1.0},
                              time_limit_s=round(1.5 * runtime)))
        t += SMALL_EVERY_S
        i += 1
    jobs.append(trace_job("big", BIG_AT_S + 1.0, nodes=8, gpus_per_node=8, work=64 * 1800.0, speeds={H100: 1.0},
                          time_limit_s=3600.0))
    return sorted(jobs, key=lambda j: j.submit)


def with_limit(job_id: str) -> float:
    return next(j.spec.time_limit_s for j in stream_with_big_job() if j.job_id == job_id)


def run_stream(config: PolicyConfig) -> tuple[SimResult, Watch]:
    shape = FleetShape(nodes_per_leaf=16, leaves_per_spine=1, zones=1, block_leaves=1, mix=ONE_MODEL)
    watch = Watch(watched="big")
    sim = Simulator(make_fleet(16, 8, shape=shape), PROFILE, config, cycle_s=10.0, observer=watch)
    return sim.run(stream_with_big_job()), watch


def test_big_job_starts_within_the_reservation_bound_while_small_jobs_flow() -> None:
    result, watch = run_stream(CONFIG)
    big = result.jobs["big"]
    assert watch.first_reservation is not None, "the big job never became the top blocked job"
    blocked_at, reserved_start, max_end = watch.first_reservation
    assert reserved_start <= max_end
    assert big.first_start is not None
    # No later than the running gangs' time limits allow (plus the wait for the next cycle).
    assert big.first_start <= reserved_start + 10.0
    assert big.first_start < STREAM_END_S / 2  # long before the stream dries up
    # Small jobs kept starting while the big one waited, among them jobs submitted after it that jumped
    # ahead: backfill, allowed only to jobs whose time limit ends before the reserved start.
    during = [r for r in result.jobs.values() if r.job_id != "big" and r.first_start is not None
              and blocked_at <= r.first_start < big.first_start]
    backfilled = [r for r in during if r.submit > big.submit]
    assert len(during) >= 2 and backfilled
    assert all(r.first_start + with_limit(r.job_id) <= reserved_start + 1e-6
               for r in backfilled if r.first_start is not None)
    # The queue never emptied meanwhile, and the fleet stayed mostly busy while it drained for the big job.
    assert all(c.pending > 0 for c in result.cycles if blocked_at <= c.at < big.first_start)
    assert result.mean_allocation(since=blocked_at, until=big.first_start) > 0.75


def test_without_reservations_the_big_job_starves_until_the_stream_ends() -> None:
    with_res, _ = run_stream(CONFIG)
    without, _ = run_stream(replace(CONFIG, reservation_depth=0))
    starved = without.jobs["big"]
    assert starved.first_start is not None
    assert starved.first_start > STREAM_END_S  # only once the small jobs stop coming
    served = with_res.jobs["big"].first_start
    assert served is not None and starved.first_start > 4 * served
