"""Property tests of the placement core over random fleets and job streams, across many sessions:
no GPU in two gangs, gangs whole, quotas never exceeded except by declared borrowing, no preemption
loop, and backfill never delays the top job's reservation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_scheduler.domain.jobs import requeue, transition
from trainyard_scheduler.domain.models import Allocation, Job, JobState, Node
from trainyard_scheduler.domain.queues import PolicyConfig, QuotaLimit, TeamQuota, standing
from trainyard_scheduler.policy.place import PlacementResult, place
from trainyard_scheduler.policy.registry import build_profile

from .builders import NOW, make_job, make_node, snapshot

PROFILE = build_profile()
MODELS = ("H100", "A100")
TEAMS = ("team-a", "team-b", "team-c")


@dataclass
class World:
    """Just enough of a cluster to drive successive placement sessions: decisions become running
    gangs, preemption victims are stopped and requeued, finished gangs free their GPUs."""

    nodes: list[Node]
    config: PolicyConfig
    now: float = NOW
    jobs: dict[str, Job] = field(default_factory=dict)
    allocs: dict[str, Allocation] = field(default_factory=dict)
    preemptions: list[tuple[str, str]] = field(default_factory=list)
    results: list[PlacementResult] = field(default_factory=list)

    def session(self) -> PlacementResult:
        result = place(snapshot(self.nodes, self.jobs.values(), self.allocs.values()), PROFILE, self.config, self.now)
        self.results.append(result)
        self.check_disjoint(result)
        for p in result.preemptions:
            for v in p.victims:
                self.preemptions.append((p.preemptor, v))
                job = self.jobs[v]
                stopped = transition(job, JobState.PREEMPTED, self.now, p.reason)
                self.jobs[v] = replace(requeue(stopped, self.now, "requeued"),
                                       preempted_by=(*job.preempted_by, p.preemptor))
                del self.allocs[v]
        for d in result.decisions:
            job = self.jobs[d.job_id]
            spec = job.spec
            self.allocs[d.job_id] = Allocation(
                job_id=job.id, attempt=job.attempt, assignments=d.assignments, master_addr="x",
                master_port=d.master_port, created_at=self.now, team=job.team,
                priority=standing(spec.queue, spec.priority_class, spec.priority, self.config),
                borrowed=d.borrowed, preemptible=self.config.priority_class(spec.priority_class).preemptible,
                expected_end=self.now + spec.time_limit_s if spec.time_limit_s else None)
            self.jobs[d.job_id] = replace(job, state=JobState.RUNNING, started_at=self.now,
                                          placement=d.assignments)
        return result

    def check_disjoint(self, result: PlacementResult) -> None:
        taken: set[tuple[str, int]] = set()
        for alloc in self.allocs.values():
            for a in alloc.assignments:
                for g in a.gpu_indices:
                    assert (a.node_id, g) not in taken
                    taken.add((a.node_id, g))
        by_id = {n.node_id: n for n in self.nodes}
        victims = {v for p in result.preemptions for v in p.victims}
        for d in result.decisions:
            job = self.jobs[d.job_id]
            r = job.spec.resources
            assert len(d.assignments) == r.nodes, "gang partly placed"
            assert len({a.node_id for a in d.assignments}) == r.nodes
            for a in d.assignments:
                node = by_id[a.node_id]
                assert not node.cordoned and len(a.gpu_indices) == r.gpus_per_node
                for g in a.gpu_indices:
                    gpu = node.gpus[g]
                    assert gpu.healthy and (not r.accelerator or gpu.model == r.accelerator)
                    # A victim's GPUs are only freed when its stop is confirmed, never in the same session.
                    assert (a.node_id, g) not in taken, "GPU in two gangs"
                    taken.add((a.node_id, g))
        assert not victims & {d.job_id for d in result.decisions}

    def finish(self, job_id: str) -> None:
        del self.allocs[job_id]
        self.jobs[job_id] = transition(self.jobs[job_id], JobState.SUCCEEDED, self.now, "done")

    def check_quotas(self) -> None:
        """Guaranteed use within nominal; all use within nominal + borrow limit."""
        for team, quota in self.config.quotas.items():
            for key, limit in quota.limits.items():
                held = [a for a in self.allocs.values() if a.team == team]
                def gpus(allocs: list[Allocation], key: str = key) -> int:
                    return sum(len(x.gpu_indices) for a in allocs for x in a.assignments
                               if key == "*" or x.model == key)
                guaranteed = gpus([a for a in held if not a.borrowed])
                assert guaranteed <= limit.nominal, f"{team} {key}: {guaranteed} guaranteed > {limit.nominal}"
                assert gpus(held) <= limit.ceiling


node_st = st.tuples(st.integers(1, 8), st.sampled_from(MODELS), st.sets(st.integers(0, 7), max_size=2),
                    st.booleans(), st.integers(0, 2))
job_st = st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from(["", *MODELS]), st.integers(0, 3),
                   st.sampled_from(TEAMS), st.sampled_from(["", "low", "high"]))
quota_st = st.dictionaries(st.sampled_from(TEAMS), st.tuples(st.sampled_from(["*", *MODELS]), st.integers(0, 16),
                                                             st.one_of(st.none(), st.integers(0, 8))), max_size=3)


def _fleet(nodes: list[tuple[int, str, set[int], bool, int]]) -> list[Node]:
    return [make_node(f"n-{i}", gpus=g, model=m, unhealthy=bad, cordoned=c and i > 0, leaf=f"leaf-{lf}")
            for i, (g, m, bad, c, lf) in enumerate(nodes)]


@settings(max_examples=150, deadline=None)
@given(nodes=st.lists(node_st, min_size=1, max_size=6), jobs=st.lists(job_st, min_size=1, max_size=14),
       quotas=quota_st, finish_order=st.randoms(use_true_random=False), rounds=st.integers(2, 6))
def test_invariants_hold_across_sessions(nodes, jobs, quotas, finish_order, rounds) -> None:  # type: ignore[no-untyped-def]
    config = PolicyConfig(speed_factors={"H100": 3.0},
                          quotas={t: TeamQuota(t, {k: QuotaLimit(n, b)}) for t, (k, n, b) in quotas.items()})
    world = World(_fleet(nodes), config)
    for i, (n, g, a, p, team, cls) in enumerate(jobs):
        job = make_job(f"job-{i:02d}", nodes=n, gpus=g, accelerator=a, priority=p, team=team,
                       priority_class=cls, created=NOW + i)
        world.jobs[job.id] = job
    for _ in range(rounds):
        world.session()
        world.check_quotas()
        # Some gangs finish between sessions, in a random order.
        done = [j for j in world.allocs if finish_order.random() < 0.3]
        world.now += 10
        for job_id in done:
            world.finish(job_id)
    # No preemption loop: nobody is preempted by a job it preempted before.
    seen: set[tuple[str, str]] = set()
    for preemptor, victim in world.preemptions:
        assert (victim, preemptor) not in seen, f"{victim} and {preemptor} preempt each other"
        seen.add((preemptor, victim))


@settings(max_examples=80, deadline=None)
@given(pattern=st.lists(st.tuples(st.sampled_from(["low", "", "high"]), st.integers(0, 3)), min_size=2, max_size=6),
       rounds=st.integers(3, 10))
def test_no_preemption_loop_under_churn(pattern, rounds) -> None:  # type: ignore[no-untyped-def]
    """Jobs that each fill the single node keep coming back after preemption: whatever the mix of classes
    and priorities, no pair of jobs ever preempts each other both ways."""
    config = PolicyConfig(quotas={"team-a": TeamQuota("team-a", {"*": QuotaLimit(8)})})
    world = World([make_node("n-0")], config)
    for i, (cls, prio) in enumerate(pattern):
        team = "team-a" if i % 2 else "team-b"
        job = make_job(f"job-{i}", gpus=8, priority_class=cls, priority=prio, team=team, created=NOW + i)
        world.jobs[job.id] = job
    for _ in range(rounds):
        world.session()
        world.now += 1
    pairs = set(world.preemptions)
    assert not any((v, p) in pairs for p, v in pairs)


@settings(max_examples=60, deadline=None)
@given(smalls=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 40), st.integers(0, 60)), min_size=1,
                       max_size=25),
       running_ends=st.lists(st.integers(5, 100), min_size=1, max_size=4), slack=st.floats(0.3, 1.0))
def test_backfill_never_delays_the_reserved_start(smalls, running_ends, slack) -> None:  # type: ignore[no-untyped-def]
    """A top-priority job needing the whole fleet gets a reservation when it is first blocked; however many
    small jobs arrive and backfill (each stating a time limit and running at most that long), it starts
    no later than that reservation's start."""
    nodes = [make_node(f"n-{i}", gpus=8) for i in range(len(running_ends))]
    config = PolicyConfig(preemption=False)
    world = World(nodes, config)
    ends: dict[str, float] = {}
    for i, end in enumerate(running_ends):  # the fleet starts busy, each node until `end`
        job = make_job(f"busy-{i}", gpus=8, time_limit=end, created=NOW - 1)
        world.jobs[job.id] = job
    world.session()
    for i, end in enumerate(running_ends):
        ends[f"busy-{i}"] = NOW + end * slack
    big = make_job("big", nodes=len(nodes), gpus=8, priority=100, created=NOW)
    world.jobs[big.id] = big
    arrivals = sorted((NOW + at, f"small-{i}", g, limit) for i, (g, limit, at) in enumerate(smalls))
    first_start: float | None = None
    started: float | None = None
    while started is None:
        while arrivals and arrivals[0][0] <= world.now:
            _, job_id, g, limit = arrivals.pop(0)
            world.jobs[job_id] = make_job(job_id, gpus=g, time_limit=limit, created=world.now)
        result = world.session()
        if "big" in world.allocs:
            started = world.now
            break
        res = [r for r in result.reservations if r.job_id == "big"]
        assert res, "the top blocked job must hold a reservation"
        if first_start is None:
            first_start = res[0].start
        for d in result.decisions:  # backfilled jobs run for part of their stated limit
            limit = world.jobs[d.job_id].spec.time_limit_s
            ends[d.job_id] = world.now + limit * slack
        upcoming = [t for t in ends.values() if t > world.now] + [a[0] for a in arrivals]
        nxt = min(upcoming, default=math.inf)
        assert nxt < math.inf, "nothing left to happen, yet the big job did not start"
        world.now = nxt
        for job_id in [j for j, t in ends.items() if t <= world.now and j in world.allocs]:
            world.finish(job_id)
            del ends[job_id]
    assert first_start is not None and started <= first_start + 1e-9


@settings(max_examples=120, deadline=None)
@given(nodes=st.lists(node_st, min_size=1, max_size=6), jobs=st.lists(job_st, min_size=1, max_size=12),
       changes=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["cordon", "dead", "sick", "relabel", "regpu",
                                                                        "drop", "finish"])), max_size=8),
       rng=st.randoms(use_true_random=False))
def test_a_kept_index_decides_exactly_like_a_fresh_one(nodes, jobs, changes, rng) -> None:  # type: ignore[no-untyped-def]
    """The incremental index is a cache, not state: after any sequence of sessions and cluster changes,
    placing with the index kept from the previous session gives the same result as building it anew."""
    from trainyard_scheduler.policy.index import ClusterIndex

    world = World(_fleet(nodes), PolicyConfig(speed_factors={"H100": 3.0}))
    for i, (n, g, a, p, team, cls) in enumerate(jobs):
        job = make_job(f"job-{i:02d}", nodes=n, gpus=g, accelerator=a, priority=p, team=team,
                       priority_class=cls, created=NOW + i)
        world.jobs[job.id] = job
    index = ClusterIndex(PROFILE.gates)
    dead: set[str] = set()
    for step in range(len(changes) + 1):
        snap = snapshot(world.nodes, world.jobs.values(), world.allocs.values(), dead)
        fresh = place(snap, PROFILE, world.config, world.now)
        kept = place(snap, PROFILE, world.config, world.now, index=index)
        assert kept == fresh, f"step {step}"
        world.session()  # commit the decisions, as the reconciler would
        if step == len(changes):
            break
        target, kind = changes[step]
        i = target % len(world.nodes)
        node = world.nodes[i]
        if kind == "cordon":
            world.nodes[i] = replace(node, cordoned=not node.cordoned)
        elif kind == "dead":
            dead ^= {node.node_id}
        elif kind == "sick" and node.gpus:
            world.nodes[i] = replace(node, gpus=(replace(node.gpus[0], healthy=False), *node.gpus[1:]))
        elif kind == "relabel":
            world.nodes[i] = replace(node, labels={"switch": f"leaf-{rng.randint(0, 3)}"})
        elif kind == "regpu":
            world.nodes[i] = make_node(node.node_id, gpus=rng.randint(1, 12), model=rng.choice(MODELS))
            for job_id in [j for j, al in world.allocs.items() if node.node_id in al.node_ids]:
                world.finish(job_id)  # a re-registered node lost its workers
        elif kind == "drop" and len(world.nodes) > 1:
            gone = world.nodes.pop(i)
            for job_id in [j for j, al in world.allocs.items() if gone.node_id in al.node_ids]:
                world.finish(job_id)
        elif kind == "finish" and world.allocs:
            world.finish(rng.choice(sorted(world.allocs)))
        world.now += 5
