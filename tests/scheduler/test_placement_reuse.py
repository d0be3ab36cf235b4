"""A session reuses the verdict of a waiting job for the later jobs of its shape while nothing changed
(policy/place.py, `reuse_verdicts`): the result must be exactly the one of looking at every job."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_scheduler.domain.queues import PolicyConfig, QuotaLimit, TeamQuota
from trainyard_scheduler.policy.place import place

from .builders import NOW, make_job, make_node, snapshot
from .test_policy_properties import MODELS, PROFILE, TEAMS, World, _fleet, node_st, quota_st

# Few shapes, many jobs of each: the case the reuse is for (a burst of like submits), mixed with every path
# a waiting job can take (no fit, quota refusal, preemption, reservation, backfill, topology wait).
shape_st = st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from(["", *MODELS]), st.integers(0, 2),
                     st.sampled_from(TEAMS), st.sampled_from(["", "low", "high"]), st.sampled_from([0, 30, 600]),
                     st.sampled_from(["", "leaf"]))


@settings(max_examples=1000, deadline=None)
@given(nodes=st.lists(node_st, min_size=2, max_size=6), shapes=st.lists(shape_st, min_size=1, max_size=4),
       picks=st.lists(st.integers(0, 3), min_size=1, max_size=24), quotas=quota_st,
       depth=st.integers(1, 3), finish=st.randoms(use_true_random=False), rounds=st.integers(1, 4))
def test_reusing_verdicts_decides_exactly_like_looking_at_every_job(  # type: ignore[no-untyped-def]
        nodes, shapes, picks, quotas, depth, finish, rounds) -> None:
    config = PolicyConfig(speed_factors={"H100": 3.0}, reservation_depth=depth,
                          quotas={t: TeamQuota(t, {k: QuotaLimit(n, b)}) for t, (k, n, b) in quotas.items()})
    world = World(_fleet(nodes), config)
    for i, pick in enumerate(picks):
        n, g, a, p, team, cls, limit, tier = shapes[pick % len(shapes)]
        job = make_job(f"job-{i:02d}", nodes=n, gpus=g, accelerator=a, priority=p, team=team,
                       priority_class=cls, created=NOW + i, time_limit=float(limit), tier=tier, wait_s=5.0)
        world.jobs[job.id] = job
    for step in range(rounds):
        snap = snapshot(world.nodes, world.jobs.values(), world.allocs.values())
        looked = place(snap, PROFILE, world.config, world.now, reuse_verdicts=False)
        reused = place(snap, PROFILE, world.config, world.now)
        assert reused == looked, f"round {step}"
        world.session()
        world.now += 10
        for job_id in [j for j in world.allocs if finish.random() < 0.4]:
            world.finish(job_id)


def test_a_burst_of_like_jobs_on_a_full_fleet_is_looked_at_once() -> None:
    """A thousand one-GPU jobs of one team waiting on a full node: one consideration, the same reason for all."""
    node = make_node("n-0", gpus=8, model="H100")
    running = [make_job(f"run-{i}", gpus=1) for i in range(8)]
    world = World([node], PolicyConfig())
    for job in running:
        world.jobs[job.id] = job
    world.session()
    assert len(world.allocs) == 8
    for i in range(1000):
        job = make_job(f"wait-{i:04d}", gpus=1, created=NOW + 100 + i)
        world.jobs[job.id] = job
    snap = snapshot(world.nodes, world.jobs.values(), world.allocs.values())
    calls = 0
    from trainyard_scheduler.policy import place as place_module

    original = place_module._Session._consider

    def counting(self, job):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return original(self, job)

    place_module._Session._consider = counting  # type: ignore[method-assign]
    try:
        reused = place(snap, PROFILE, world.config, world.now)
        looked_calls, calls = calls, 0
        looked = place(snap, PROFILE, world.config, world.now, reuse_verdicts=False)
    finally:
        place_module._Session._consider = original  # type: ignore[method-assign]
    assert reused == looked
    assert len(reused.unplaced) == 1000 and len({u.reason for u in reused.unplaced}) == 1
    assert calls == 1000
    # The first waiting job is looked at, and the next while its reservation attempts still change the
    # session (reservation_depth + max_reservation_misses of them at most); every later one reuses.
    limit = world.config.reservation_depth + world.config.max_reservation_misses + 1
    assert looked_calls <= limit


@settings(max_examples=200, deadline=None)
@given(jobs=st.lists(st.tuples(st.sampled_from(TEAMS), st.integers(0, 3), st.sampled_from(["", "low", "high"]),
                               st.integers(0, 50)), min_size=1, max_size=12),
       held=st.dictionaries(st.sampled_from(TEAMS), st.integers(0, 8), max_size=3))
def test_a_teams_keys_at_once_are_each_jobs_key(jobs, held) -> None:  # type: ignore[no-untyped-def]
    """QueueOrder.keys (the session's sort, the team's share worked out once) equals key per job."""
    from trainyard_scheduler.policy.api import Ledger
    from trainyard_scheduler.policy.plugins.fairshare import FairShare, Fifo

    config = PolicyConfig(quotas={"team-b": TeamQuota("team-b", {"*": QuotaLimit(4, None)}, weight=2.0)})
    ledger = Ledger(capacity={"H100": 16, "A100": 8})
    for team, gpus in held.items():
        ledger.charge(team, "default", "H100", "H100", gpus, False)
    made = [make_job(f"job-{i}", team=t, priority=p, priority_class=c, created=NOW + s)
            for i, (t, p, c, s) in enumerate(jobs)]
    for order in (FairShare(), Fifo()):
        assert order.keys(made, ledger, config) == [order.key(j, ledger, config) for j in made]
