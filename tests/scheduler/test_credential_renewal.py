"""The renewal decision (credential_renewal.plan, running_attempts): pure, over a snapshot and a time. Tables of
scenarios, then properties over generated fleets of attempts: every due node is renewed or left for a later
pass (never both, never a node that is not due), the bound holds, the most urgent go first, nothing becomes
due before the time the plan says, and a renewed node is not due again until half its new lifetime is gone.
The services themselves (leader, agent, checkpoint-store) are in test_credential_renewal_integration.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduler.builders import make_job, running
from trainyard_scheduler.credential_renewal import (
    UNKNOWN,
    Held,
    Key,
    Plan,
    RenewalSettings,
    RunningAttempt,
    due_at,
    plan,
    running_attempts,
)
from trainyard_scheduler.domain.models import WorkerExit

TTL = 3600.0
NOW = 1_800_000_000.0


def attempt(job_id: str, nodes: tuple[str, ...] = ("n-1",), *, number: int = 1, started_at: float = NOW - 600,
            team: str = "ml") -> RunningAttempt:
    return RunningAttempt(job_id, number, team, frozenset(nodes), started_at)


def renewed(p: Plan) -> dict[tuple[str, int], tuple[str, ...]]:
    return {(r.attempt.job_id, r.attempt.attempt): r.nodes for r in p.renewals}


# --- which attempts run where ------------------------------------------------------------------------------


def test_an_attempt_runs_on_the_nodes_that_launched_it_and_have_not_stopped_or_seen_every_rank_exit() -> None:
    job, alloc = running(make_job("job-a", nodes=3, gpus=2), [("n-1", [0, 1]), ("n-2", [0, 1]), ("n-3", [0, 1])])
    alloc = replace(alloc, launched=frozenset({"n-1", "n-2", "n-3"}), stopped=frozenset({"n-3"}),
                    # n-2: both its ranks (2, 3) exited; n-1: one of two.
                    exits=(WorkerExit(0, "n-1", 0, 0, NOW), WorkerExit(2, "n-2", 1, 0, NOW),
                           WorkerExit(3, "n-2", 1, 0, NOW)))
    [att] = running_attempts([alloc])
    assert (att.job_id, att.attempt, att.team, att.nodes) == ("job-a", job.attempt, job.team, frozenset({"n-1"}))
    assert att.started_at == alloc.created_at
    # Placed but launched nowhere yet (the launch carries the credential), or over everywhere: nothing to renew.
    assert running_attempts([replace(alloc, launched=frozenset())]) == []
    assert running_attempts([replace(alloc, stopped=frozenset({"n-1", "n-2", "n-3"}))]) == []


# --- the plan ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("held", "due", "next_at"), [
    # Unknown (a new leader's first pass): at once.
    (None, True, None),
    # Launched or renewed 10 minutes ago: due when half the lifetime is gone, 20 minutes from now.
    (Held(NOW + TTL - 600), False, NOW + TTL / 2 - 600),
    # Exactly half gone: due.
    (Held(NOW + TTL / 2), True, None),
    # Expired already (the leader was down): due.
    (Held(NOW - 5), True, None),
    # Due, but a delivery just failed: not before its retry time.
    (Held(NOW - 5, retry_at=NOW + 10), False, NOW + 10),
    (Held(UNKNOWN, retry_at=NOW + 10), False, NOW + 10),
    (Held(UNKNOWN, retry_at=NOW), True, None),
])
def test_a_node_is_due_when_unknown_or_past_half_its_credentials_lifetime(held: Held | None, due: bool,
                                                                           next_at: float | None) -> None:
    att = attempt("job-a")
    held_map: dict[Key, Held] = {} if held is None else {("job-a", 1, "n-1"): held}
    p = plan([att], held_map, NOW, ttl_s=TTL, limit=10)
    assert renewed(p) == ({("job-a", 1): ("n-1",)} if due else {})
    assert (p.deferred, p.next_at) == (0, next_at)


def test_only_the_due_nodes_of_a_gang_are_renewed() -> None:
    att = attempt("job-a", ("n-1", "n-2", "n-3"))
    held = {("job-a", 1, "n-1"): Held(NOW + 100), ("job-a", 1, "n-2"): Held(NOW + TTL),
            ("job-a", 1, "n-3"): Held(NOW - 1, retry_at=NOW - 1)}
    p = plan([att], held, NOW, ttl_s=TTL, limit=10)
    assert renewed(p) == {("job-a", 1): ("n-1", "n-3")}
    assert p.next_at == NOW + TTL / 2


def test_after_a_leader_change_every_running_attempt_is_due_at_once_bounded_oldest_first() -> None:
    # The new leader knows nothing it did not deliver itself this term.
    attempts = [attempt(f"job-{i}", (f"n-{i}",), started_at=NOW - 1000 + i) for i in range(10)]
    p = plan(attempts, {}, NOW, ttl_s=TTL, limit=4)
    assert [r.attempt.job_id for r in p.renewals] == ["job-0", "job-1", "job-2", "job-3"]
    assert (p.deferred, p.next_at) == (6, NOW), "the rest go in the next pass, at once"


def test_unknown_nodes_go_before_known_ones_then_the_earliest_expiry() -> None:
    attempts = [attempt("late", started_at=NOW - 10), attempt("early", started_at=NOW - 5000),
                attempt("unknown", started_at=NOW - 1)]
    held = {("late", 1, "n-1"): Held(NOW + 100), ("early", 1, "n-1"): Held(NOW + 50)}
    p = plan(attempts, held, NOW, ttl_s=TTL, limit=10)
    assert [r.attempt.job_id for r in p.renewals] == ["unknown", "early", "late"]


def test_a_gang_larger_than_the_bound_goes_alone_and_does_not_let_smaller_ones_overtake() -> None:
    big = attempt("big", tuple(f"n-{i}" for i in range(8)), started_at=NOW - 100)
    small = attempt("small", ("m-1",), started_at=NOW - 50)
    first = plan([big, small], {}, NOW, ttl_s=TTL, limit=4)
    assert renewed(first) == {("big", 1): tuple(sorted(f"n-{i}" for i in range(8)))}
    assert first.deferred == 1
    # With a smaller, more urgent attempt first, the big one waits for the next pass rather than exceed it.
    urgent = replace(small, started_at=NOW - 500)
    second = plan([big, urgent], {}, NOW, ttl_s=TTL, limit=4)
    assert renewed(second) == {("small", 1): ("m-1",)} and second.deferred == 1


def test_nothing_running_plans_nothing() -> None:
    assert plan([], {("gone", 1, "n-1"): Held(NOW)}, NOW, ttl_s=TTL, limit=4) == Plan((), 0, None)


def test_renewal_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="renewal settings out of range"):
        RenewalSettings(max_per_pass=0)


# --- properties ------------------------------------------------------------------------------------------------

nodes_st = st.frozensets(st.sampled_from([f"n-{i}" for i in range(6)]), min_size=1, max_size=4)
attempt_st = st.builds(lambda j, a, nodes, age: RunningAttempt(f"job-{j}", a, "ml", nodes, NOW - age),
                       st.integers(0, 7), st.integers(1, 3), nodes_st, st.floats(0, 10_000))
held_st = st.one_of(
    st.none(),
    st.builds(Held, st.floats(NOW - 2 * TTL, NOW + TTL), st.sampled_from([0.0, NOW - 1, NOW + 5, NOW + 400])),
    st.builds(Held, st.just(UNKNOWN), st.sampled_from([0.0, NOW + 5])))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[RunningAttempt], dict[Key, Held], int]:
    found = draw(st.lists(attempt_st, max_size=8, unique_by=lambda a: (a.job_id, a.attempt)))
    held: dict[Key, Held] = {}
    for att in found:
        for node in att.nodes:
            h = draw(held_st)
            if h is not None:
                held[(att.job_id, att.attempt, node)] = h
    return found, held, draw(st.integers(1, 10))


def _due(attempts: list[RunningAttempt], held: dict[Key, Held]) -> set[Key]:
    return {(a.job_id, a.attempt, n) for a in attempts for n in a.nodes
            if due_at(held.get((a.job_id, a.attempt, n)), TTL) <= NOW}


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_plan_renews_due_nodes_only_within_the_bound_and_says_when_to_look_again(
        scenario: tuple[list[RunningAttempt], dict[Key, Held], int]) -> None:
    attempts, held, limit = scenario
    p = plan(attempts, held, NOW, ttl_s=TTL, limit=limit)
    chosen = {(r.attempt.job_id, r.attempt.attempt, n) for r in p.renewals for n in r.nodes}
    due = _due(attempts, held)
    assert chosen <= due, "only due nodes are renewed"
    due_attempts = {(j, a) for j, a, _ in due}
    chosen_attempts = {(r.attempt.job_id, r.attempt.attempt) for r in p.renewals}
    assert len(chosen_attempts) == len(p.renewals), "one renewal per attempt"
    # A renewed attempt gets all its due nodes; the attempts left over are counted.
    for r in p.renewals:
        assert set(r.nodes) == {n for j, a, n in due if (j, a) == (r.attempt.job_id, r.attempt.attempt)}
    assert p.deferred == len(due_attempts - chosen_attempts)
    # The bound: at most `limit` deliveries, unless one attempt alone is bigger.
    deliveries = sum(len(r.nodes) for r in p.renewals)
    assert deliveries <= limit or len(p.renewals) == 1
    if due:
        assert p.renewals, "due work is never left without a renewal in the pass"
    # Nothing not due now becomes due before next_at; with work left over, the next pass is now.
    if p.deferred:
        assert p.next_at == NOW
    else:
        not_due = [due_at(held.get((a.job_id, a.attempt, n)), TTL) for a in attempts for n in a.nodes
                   if (a.job_id, a.attempt, n) not in due]
        assert p.next_at == (min(not_due) if not_due else None)
        assert p.next_at is None or p.next_at > NOW


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_what_is_left_over_is_no_more_urgent_than_what_was_taken_and_renewed_nodes_wait_half_a_lifetime(
        scenario: tuple[list[RunningAttempt], dict[Key, Held], int]) -> None:
    attempts, held, limit = scenario
    p = plan(attempts, held, NOW, ttl_s=TTL, limit=limit)
    by_key = {(a.job_id, a.attempt): a for a in attempts}

    def urgency(job_id: str, number: int) -> tuple[float, float]:
        a = by_key[(job_id, number)]
        known = [held.get((job_id, number, n), Held()).not_after for n in a.nodes
                 if due_at(held.get((job_id, number, n)), TTL) <= NOW]
        return (min(known), a.started_at)

    taken = [urgency(r.attempt.job_id, r.attempt.attempt) for r in p.renewals]
    assert taken == sorted(taken), "the most urgent first"
    left = {(j, a) for j, a, _ in _due(attempts, held)} - {(r.attempt.job_id, r.attempt.attempt) for r in p.renewals}
    for job_id, number in left:
        assert urgency(job_id, number) >= taken[-1]
    # Deliver what was planned; the same nodes are then not due until half the new lifetime has gone.
    after = dict(held)
    for r in p.renewals:
        for n in r.nodes:
            after[(r.attempt.job_id, r.attempt.attempt, n)] = Held(NOW + TTL)
    again = plan(attempts, after, NOW, ttl_s=TTL, limit=limit)
    assert not {(r.attempt.job_id, r.attempt.attempt, n) for r in again.renewals for n in r.nodes} & \
        {(r.attempt.job_id, r.attempt.attempt, n) for r in p.renewals for n in r.nodes}
    later = plan(attempts, after, NOW + TTL / 2, ttl_s=TTL, limit=10**9)
    for r in p.renewals:
        assert (r.attempt.job_id, r.attempt.attempt) in renewed(later)
