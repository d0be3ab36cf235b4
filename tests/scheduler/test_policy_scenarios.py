"""Scenario tables for the placement core: type choice, topology packing, fragmentation, quotas and
borrowing, reclaim, backfill with reservations, preemption victims, queues and fair share."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from trainyard_scheduler.domain.models import Job, Node
from trainyard_scheduler.domain.queues import FairShareUsage, PolicyConfig, QueueConfig, QuotaLimit, TeamQuota
from trainyard_scheduler.policy.place import PlacementResult, place
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.policy.topology import ISLAND, LEAF, NODE, SPINE

from .builders import NOW, fleet, make_job, make_node, running, snapshot

PROFILE = build_profile()
SPEEDS = {"H100": 3.0, "A100": 1.0, "MI300X": 2.5, "A100-40": 1.0}
CONFIG = PolicyConfig(speed_factors=SPEEDS)


def run(nodes: list[Node], jobs: list[Job], allocs: tuple = (), config: PolicyConfig = CONFIG,  # type: ignore[type-arg]
        now: float = NOW, dead: tuple[str, ...] = ()) -> PlacementResult:
    running_jobs = [j for j, _ in allocs]
    return place(snapshot(nodes, [*jobs, *running_jobs], [a for _, a in allocs], dead), PROFILE, config, now)


def placed(result: PlacementResult, job_id: str) -> list[str] | None:
    for d in result.decisions:
        if d.job_id == job_id:
            return [a.node_id for a in d.assignments]
    return None


def mixed_fleet() -> list[Node]:
    return [make_node("h-0", model="H100"), make_node("a-0", model="A100", cc="8.0"),
            make_node("a40-0", model="A100-40", memory_mb=40_960, cc="8.0"),
            make_node("m-0", model="MI300X", vendor="amd", memory_mb=196_592, cc="9.4")]


# --- heterogeneous accelerators -----------------------------------------------------------------------

@pytest.mark.parametrize(("name", "job", "busy", "expect"), [
    ("any-of picks the fastest model", make_job(gpus=8, accelerators=["A100", "H100"]), [], "h-0"),
    ("any-of falls back when the fastest is full", make_job(gpus=8, accelerators=["A100", "H100"]), ["h-0"], "a-0"),
    ("no request: fastest model in the fleet", make_job(gpus=8), [], "h-0"),
    ("class: memory excludes the 40 GB part", make_job(gpus=8, min_memory_gb=60),
     ["h-0", "m-0", "a-0"], None),
    ("class: memory admits the 80 GB part", make_job(gpus=8, min_memory_gb=60), ["h-0", "m-0"], "a-0"),
    ("class: vendor", make_job(gpus=8, vendor="amd"), [], "m-0"),
    ("class: compute capability excludes Ampere", make_job(gpus=8, min_cc="9.0"), ["h-0", "m-0"], None),
    ("job's own speed hint wins over the config", make_job(gpus=8, accelerators=["A100", "H100"],
                                                           speed_hints={"A100": 5.0}), [], "a-0"),
    ("exact model", make_job(gpus=8, accelerator="A100-40"), [], "a40-0"),
])
def test_type_choice(name: str, job: Job, busy: list[str], expect: str | None) -> None:
    nodes = mixed_fleet()
    allocs = [running(make_job(f"busy-{n}", gpus=8, priority=100, priority_class="critical"), [(n, range(8))],
                      preemptible=False) for n in busy]
    result = run(nodes, [job], tuple(allocs))
    got = placed(result, job.id)
    assert got == ([expect] if expect else None), name
    if expect is None:
        assert result.unplaced and result.unplaced[0].job_id == job.id


def test_gang_never_mixes_models_unless_allowed() -> None:
    nodes = [make_node("h-0", model="H100"), make_node("a-0", model="A100")]
    assert placed(run(nodes, [make_job(nodes=2, gpus=8)]), "job-1") is None
    result = run(nodes, [make_job(nodes=2, gpus=8, allow_mixed=True)])
    (d,) = result.decisions
    assert {a.model for a in d.assignments} == {"H100", "A100"} and d.model == "mixed"


def test_cpu_task_goes_to_cpu_only_nodes_and_counts_cpus() -> None:
    nodes = [make_node("g-0"), make_node("c-0", gpus=0, cpus=16), make_node("c-1", gpus=0, cpus=4)]
    result = run(nodes, [make_job("prep", gpus=0, cpus=8), make_job("prep2", gpus=0, cpus=8, created=NOW + 1),
                         make_job("prep3", gpus=0, cpus=8, created=NOW + 2)])
    assert placed(result, "prep") == ["c-0"] and placed(result, "prep2") == ["c-0"]
    assert placed(result, "prep3") is None  # c-0 is full, c-1 has 4 CPUs, GPU nodes never take CPU tasks
    (d, _) = result.decisions
    assert d.assignments[0].gpu_indices == () and d.assignments[0].cpus == 8


# --- topology ----------------------------------------------------------------------------------------

def test_gang_goes_to_the_leaf_it_fits_best() -> None:
    nodes = fleet(leaves=2, per_leaf=4)  # n-0a-0..3, n-0b-0..3
    busy = running(make_job("busy", nodes=2, gpus=8, priority_class="critical"),
                   [("n-0a-0", range(8)), ("n-0a-1", range(8))], preemptible=False)
    result = run(nodes, [make_job(nodes=2, gpus=8)], (busy,))
    assert placed(result, "job-1") == ["n-0a-2", "n-0a-3"]  # the fuller leaf: leaf-0b stays whole
    assert result.decisions[0].tier == LEAF


def test_gang_spans_the_fewest_leaves_under_one_spine() -> None:
    nodes = fleet(spines=2, leaves=2, per_leaf=4)
    result = run(nodes, [make_job(nodes=6, gpus=8)])
    got = placed(result, "job-1")
    assert got is not None
    assert len({n.split("-")[1][0] for n in got}) == 1  # one spine
    assert len({n.rsplit("-", 1)[0] for n in got}) == 2  # two leaves
    assert result.decisions[0].tier == SPINE


def test_required_tier_waits_instead_of_spreading() -> None:
    nodes = fleet(spines=1, leaves=2, per_leaf=4)
    result = run(nodes, [make_job(nodes=6, gpus=8, tier="leaf", required=True)])
    assert result.decisions == []
    assert "within one leaf" in result.unplaced[0].reason


@pytest.mark.parametrize(("waited", "expect_placed"), [(10.0, False), (700.0, True)])
def test_preferred_tier_waits_up_to_wait_s(waited: float, expect_placed: bool) -> None:
    nodes = fleet(spines=1, leaves=2, per_leaf=4)
    job = make_job(nodes=6, gpus=8, tier="leaf", wait_s=600, created=NOW - waited)
    assert (placed(run(nodes, [job]), job.id) is not None) is expect_placed


def test_node_ranks_follow_leaves_and_gpus_follow_islands() -> None:
    nodes = [make_node("n-z", leaf="l1", islands=[0, 0, 0, 0, 1, 1, 1, 1]),
             make_node("n-a", leaf="l2"), make_node("n-m", leaf="l1")]
    busy = running(make_job("busy", gpus=2, priority_class="critical"), [("n-z", (0, 1))], preemptible=False)
    result = run(nodes, [make_job(nodes=2, gpus=4, tier="leaf", required=True)], (busy,))
    (d,) = result.decisions
    assert [a.node_id for a in d.assignments] == ["n-m", "n-z"]  # leaf l1, ranks in node order
    # On n-z GPUs 0-1 are taken; the 4-GPU share goes whole into island 1, not across islands.
    assert d.assignments[1].gpu_indices == (4, 5, 6, 7)
    assert [a.ranks for a in d.assignments] == [(0, 1, 2, 3), (4, 5, 6, 7)]


# --- fragmentation ---------------------------------------------------------------------------------------

def test_small_jobs_fill_one_node_and_keep_whole_nodes_for_gangs() -> None:
    nodes = fleet(leaves=2, per_leaf=2)
    smalls = [make_job(f"s-{i}", gpus=1, created=NOW + i) for i in range(8)]
    result = run(nodes, smalls)
    assert len({placed(result, j.id)[0] for j in smalls}) == 1  # type: ignore[index]
    allocs = [running(j, [(placed(result, j.id)[0], d.assignments[0].gpu_indices)])  # type: ignore[index]
              for j, d in zip(smalls, result.decisions, strict=True)]
    big = run(nodes, [make_job("big", nodes=2, gpus=8)], tuple(allocs))
    assert big.decisions and big.decisions[0].tier == LEAF


def test_single_node_share_prefers_the_partly_used_node() -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    busy = running(make_job("busy", gpus=4), [("n-b", range(4))])
    assert placed(run(nodes, [make_job(gpus=4)], (busy,)), "job-1") == ["n-b"]


# --- quotas, borrowing, reclaim ------------------------------------------------------------------------------

def quota_config(*quotas: TeamQuota) -> PolicyConfig:
    return replace(CONFIG, quotas={q.team: q for q in quotas})


@pytest.mark.parametrize(("name", "limits", "held", "expect"), [
    ("within nominal: guaranteed", {"H100": QuotaLimit(16)}, 0, "guaranteed"),
    ("above nominal: borrowed", {"H100": QuotaLimit(8, 8)}, 8, "borrowed"),
    ("past nominal + borrow limit: waits", {"H100": QuotaLimit(8, 4)}, 8, "refused"),
    ("'*' counts every model", {"*": QuotaLimit(8, 0)}, 8, "refused"),
    ("no limit for the model: borrowed", {"A100": QuotaLimit(64)}, 0, "borrowed"),
])
def test_quota_admission(name: str, limits: dict[str, QuotaLimit], held: int, expect: str) -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    allocs = []
    if held:
        allocs.append(running(make_job("mine", gpus=held, priority_class="critical"), [("n-a", range(held))],
                              preemptible=False))
    config = quota_config(TeamQuota("team-a", limits))
    result = run(nodes, [make_job(gpus=8, accelerator="H100")], tuple(allocs), config=config)
    if expect == "refused":
        assert result.decisions == [], name
        assert "quota" in result.unplaced[0].reason
    else:
        (d,) = result.decisions
        assert d.borrowed is (expect == "borrowed"), name


def test_team_without_quota_borrows_and_is_reclaimed_by_an_owner_even_at_higher_priority() -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    config = quota_config(TeamQuota("team-a", {"H100": QuotaLimit(8)}))
    borrower = [running(make_job(f"b-{i}", gpus=8, team="team-b", priority=50), [(n, range(8))], borrowed=True,
                        config=config) for i, n in enumerate(["n-a", "n-b"])]
    result = run(nodes, [make_job("owner", gpus=8, team="team-a")], tuple(borrower), config=config)
    (p,) = result.preemptions
    assert p.preemptor == "owner" and len(p.victims) == 1 and "reclaim" in p.reason


def test_borrowing_team_cannot_reclaim_from_another_borrower_at_equal_standing() -> None:
    nodes = [make_node("n-a")]
    config = quota_config(TeamQuota("team-a", {"H100": QuotaLimit(0)}))
    borrower = running(make_job("b-0", gpus=8, team="team-b"), [("n-a", range(8))], borrowed=True, config=config)
    result = run(nodes, [make_job("wants", gpus=8, team="team-a")], (borrower,), config=config)
    assert result.preemptions == [] and result.decisions == []


def test_guaranteed_work_of_another_team_is_never_preempted_by_priority() -> None:
    nodes = [make_node("n-a")]
    config = quota_config(TeamQuota("team-b", {"H100": QuotaLimit(8)}))
    owner = running(make_job("b-0", gpus=8, team="team-b"), [("n-a", range(8))], borrowed=False, config=config)
    result = run(nodes, [make_job("vip", gpus=8, team="team-a", priority_class="high")], (owner,), config=config)
    assert result.preemptions == []


# --- backfill with reservations ----------------------------------------------------------------------

def _two_nodes_one_busy(end: float | None) -> tuple[list[Node], tuple]:  # type: ignore[type-arg]
    nodes = [make_node("n-0"), make_node("n-1")]
    busy = running(make_job("busy", gpus=8, priority_class="critical"), [("n-0", range(8))], expected_end=end,
                   preemptible=False)
    return nodes, (busy,)


@pytest.mark.parametrize(("name", "small", "expect_placed"), [
    ("ends before the reservation: backfilled", make_job("small", gpus=1, time_limit=50, created=NOW + 1), True),
    ("would run past the reservation: waits", make_job("small", gpus=1, time_limit=500, created=NOW + 1), False),
    ("no time limit: never backfills", make_job("small", gpus=1, created=NOW + 1), False),
])
def test_backfill_respects_the_reservation(name: str, small: Job, expect_placed: bool) -> None:
    nodes, allocs = _two_nodes_one_busy(end=NOW + 100)
    big = make_job("big", nodes=2, gpus=8, priority=10)
    result = run(nodes, [big, small], allocs)
    (res,) = result.reservations
    assert res.job_id == "big" and res.start == NOW + 100 and set(res.nodes) == {"n-0", "n-1"}
    assert (placed(result, "small") is not None) is expect_placed, name


def test_unknown_end_reserves_forever_but_leaves_other_gpus_to_backfill() -> None:
    nodes = [make_node(f"n-{i}") for i in range(4)]
    allocs = (running(make_job("r-0", gpus=8), [("n-0", range(8))]),
              running(make_job("r-1", gpus=4), [("n-1", range(4))]))
    big = make_job("big", nodes=3, gpus=8, priority=10, priority_class="low")  # low: may not preempt
    small = make_job("small", gpus=1, time_limit=30, created=NOW + 1)
    result = run(nodes, [big, small], allocs)
    (res,) = result.reservations
    assert math.isinf(res.start) and {"n-2", "n-3"} <= set(res.nodes)
    assert placed(result, "small") == ["n-1"]  # not on the held nodes: their start is unknown


def test_only_the_top_blocked_jobs_hold_reservations() -> None:
    nodes, allocs = _two_nodes_one_busy(end=NOW + 100)
    jobs = [make_job("big", nodes=2, gpus=8, priority=10), make_job("big2", nodes=2, gpus=8, priority=5)]
    result = run(nodes, jobs, allocs)
    assert [r.job_id for r in result.reservations] == ["big"]
    deeper = run(nodes, jobs, allocs, config=replace(CONFIG, reservation_depth=2))
    assert [r.job_id for r in deeper.reservations] == ["big"]  # big2 would need big's nodes: nothing left


# --- preemption ------------------------------------------------------------------------------------------

def test_victim_is_the_lowest_standing_gang_that_frees_room() -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    allocs = (running(make_job("low", gpus=8, priority=1), [("n-a", range(8))]),
              running(make_job("mid", gpus=8, priority=5), [("n-b", range(8))]))
    result = run(nodes, [make_job("vip", gpus=8, priority=10)], allocs)
    (p,) = result.preemptions
    assert p.victims == ("low",) and "higher standing" in p.reason


def test_among_equals_the_victim_loses_the_least_work_since_its_checkpoint() -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    fresh_job, fresh = running(make_job("fresh-ckpt", gpus=8), [("n-a", range(8))], started=NOW - 3600)
    stale_job, stale = running(make_job("stale-ckpt", gpus=8), [("n-b", range(8))], started=NOW - 3600)
    fresh_job = replace(fresh_job, last_checkpoint_at=NOW - 60)
    stale_job = replace(stale_job, last_checkpoint_at=NOW - 3000)
    result = run(nodes, [make_job("vip", gpus=8, priority=10)], ((fresh_job, fresh), (stale_job, stale)))
    assert result.preemptions[0].victims == ("fresh-ckpt",)


def test_preemption_is_topology_aware() -> None:
    """Two nodes must come free inside one leaf: the victims are the two on leaf-0a, although the cheapest
    single gang is elsewhere."""
    nodes = fleet(leaves=2, per_leaf=2)
    allocs = (running(make_job("a0", gpus=8, priority=2), [("n-0a-0", range(8))]),
              running(make_job("a1", gpus=8, priority=2), [("n-0a-1", range(8))]),
              running(make_job("b0", gpus=8, priority=1), [("n-0b-0", range(8))]),
              running(make_job("b1", gpus=8, priority=9, priority_class="critical"), [("n-0b-1", range(8))],
                      preemptible=False))
    result = run(nodes, [make_job("vip", nodes=2, gpus=8, priority=20, priority_class="high", tier="leaf",
                                  required=True)], allocs)
    (p,) = result.preemptions
    assert set(p.victims) == {"a0", "a1"}


def test_only_the_victims_needed_are_stopped() -> None:
    nodes = [make_node("n-a")]
    allocs = tuple(running(make_job(f"v{i}", gpus=2, priority=i), [("n-a", (2 * i, 2 * i + 1))]) for i in range(4))
    result = run(nodes, [make_job("vip", gpus=2, priority=10)], allocs)
    assert result.preemptions[0].victims == ("v0",)


@pytest.mark.parametrize(("name", "victim", "preemptor"), [
    ("equal standing in the same team", make_job("v", gpus=8, priority=5), make_job("p", gpus=8, priority=5)),
    ("higher standing victim", make_job("v", gpus=8, priority=9), make_job("p", gpus=8, priority=5)),
    ("the victim once preempted the preemptor", make_job("v", gpus=8, priority=1),
     make_job("p", gpus=8, priority=5, preempted_by=["v"])),
    ("class low may not preempt", make_job("v", gpus=8, priority=-5, priority_class="low"),
     make_job("p", gpus=8, priority=5, priority_class="low")),
    ("class critical is never preempted", make_job("v", gpus=8, priority_class="critical"),
     make_job("p", gpus=8, priority=5, priority_class="critical")),
])
def test_no_preemption(name: str, victim: Job, preemptor: Job) -> None:
    cls = CONFIG.priority_class(victim.spec.priority_class)
    alloc = running(victim, [("n-a", range(8))], preemptible=cls.preemptible)
    result = run([make_node("n-a")], [preemptor], (alloc,))
    assert result.preemptions == [], name


def test_a_preemptor_waiting_for_its_victims_does_not_preempt_again() -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    stopping = running(make_job("v0", gpus=8), [("n-a", range(8))], stop_reason="preempted by vip",
                       preempted_by="vip")
    other = running(make_job("v1", gpus=8), [("n-b", range(8))])
    result = run(nodes, [make_job("vip", gpus=8, priority=10)], (stopping, other))
    assert result.preemptions == []
    assert result.reservations and result.reservations[0].start == NOW  # held for it, starting now


# --- queues, order, fair share -----------------------------------------------------------------------

def test_standing_orders_queue_tier_then_class_then_priority() -> None:
    config = replace(CONFIG, queues={"default": QueueConfig("default"), "prod": QueueConfig("prod", tier=10)})
    jobs = [make_job("prio-99", gpus=8, priority=99, created=NOW),
            make_job("class-high", gpus=8, priority_class="high", created=NOW + 1),
            make_job("queue-prod", gpus=8, queue="prod", priority_class="low", created=NOW + 2)]
    result = run([make_node("n-a")], jobs, config=replace(config, preemption=False))
    assert [d.job_id for d in result.decisions] == ["queue-prod"]
    two = run([make_node("n-a"), make_node("n-b")], jobs, config=replace(config, preemption=False))
    assert [d.job_id for d in two.decisions] == ["queue-prod", "class-high"]


def test_queue_partition_and_cap() -> None:
    nodes = [make_node("n-a", labels={"pool": "debug"}), make_node("n-b")]
    config = replace(CONFIG, queues={"default": QueueConfig("default"),
                                     "debug": QueueConfig("debug", node_labels={"pool": "debug"}, max_gpus=4)})
    jobs = [make_job("d-1", gpus=2, queue="debug"), make_job("d-2", gpus=2, queue="debug", created=NOW + 1),
            make_job("d-3", gpus=2, queue="debug", created=NOW + 2)]
    result = run(nodes, jobs, config=config)
    assert placed(result, "d-1") == ["n-a"] and placed(result, "d-2") == ["n-a"]
    assert placed(result, "d-3") is None and "4 GPUs" in result.unplaced[0].reason


def test_fair_share_serves_the_team_with_less_usage_first() -> None:
    usage = FairShareUsage(at=NOW, by_team={"team-a": {"H100": 1e6}})
    config = replace(CONFIG, usage=usage)
    jobs = [make_job("a-job", gpus=8, team="team-a", created=NOW), make_job("b-job", gpus=8, team="team-b",
                                                                              created=NOW + 5)]
    result = run([make_node("n-a")], jobs, config=config)
    assert [d.job_id for d in result.decisions] == ["b-job"]
    # Without history, submission order decides.
    assert [d.job_id for d in run([make_node("n-a")], jobs).decisions] == ["a-job"]


def test_fair_share_alternates_teams_within_one_session() -> None:
    jobs = [make_job(f"a-{i}", gpus=8, team="team-a", created=NOW + i) for i in range(3)]
    jobs += [make_job(f"b-{i}", gpus=8, team="team-b", created=NOW + 10 + i) for i in range(3)]
    result = run([make_node(f"n-{i}") for i in range(4)], jobs)
    assert sorted(d.job_id for d in result.decisions) == ["a-0", "a-1", "b-0", "b-1"]


def test_single_node_tier_is_island_when_one_island_holds_the_share() -> None:
    node = make_node("n-a", islands=[0, 0, 0, 0, 1, 1, 1, 1])
    assert run([node], [make_job(gpus=4)]).decisions[0].tier == ISLAND
    assert run([node], [make_job(gpus=8)]).decisions[0].tier == NODE


def test_the_quota_ceiling_bounds_borrowed_plus_guaranteed() -> None:
    """Regression (found by the property test): a team holding 4 borrowed GPUs under nominal 1 + borrow 3
    took a 5th as 'guaranteed', since its guaranteed count was still 0."""
    config = quota_config(TeamQuota("team-a", {"*": QuotaLimit(1, 3)}))
    held = running(make_job("big", gpus=4), [("n-a", range(4))], borrowed=True, config=config)
    result = run([make_node("n-a")], [make_job("one-more", gpus=1)], (held,), config=config)
    assert result.decisions == [] and "would exceed its * quota" in result.unplaced[0].reason


@pytest.mark.parametrize(("ran_s", "times_preempted", "expect"), [
    (100, 0, False),   # younger than the exemption
    (400, 0, True),
    (400, 1, False),   # preempted once before: 600 s
    (700, 1, True),
    (1000, 2, False),  # twice: 1200 s
])
def test_young_gangs_are_exempt_with_backoff(ran_s: float, times_preempted: int, expect: bool) -> None:
    config = replace(CONFIG, preempt_exempt_s=300)
    victim = make_job("v", gpus=8, preempted_by=[f"p{i}" for i in range(times_preempted)])
    alloc = running(victim, [("n-a", range(8))], started=NOW - ran_s)
    result = run([make_node("n-a")], [make_job("vip", gpus=8, priority=10)], (alloc,), config=config)
    assert bool(result.preemptions) is expect


def test_the_victim_preempted_least_often_goes_first() -> None:
    nodes = [make_node("n-a"), make_node("n-b")]
    often = running(make_job("often", gpus=8, preempted_by=["x", "y"]), [("n-a", range(8))])
    never = running(make_job("never", gpus=8), [("n-b", range(8))])
    result = run(nodes, [make_job("vip", gpus=8, priority=10)], (often, never))
    assert result.preemptions[0].victims == ("never",)
