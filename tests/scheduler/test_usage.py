"""Usage and cost add up (issue 15): a scripted day of jobs with known durations, restarts and preemptions,
played on a manual clock through the scheduler's own records (allocations, `end_attempt`, `usage_of`), then
summed over windows. Amounts are exact (integer GPU-microseconds, fractional costs), so the checks are
equalities: a boundary splits an allocation exactly, groups add up to the total, jobs to their team."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_core import contract as c
from trainyard_core.clock import ManualClock
from trainyard_core.errors import InvalidArgument
from trainyard_scheduler.archive import usage_of
from trainyard_scheduler.domain.jobs import end_attempt, requeue
from trainyard_scheduler.domain.models import Allocation, Job, JobState
from trainyard_scheduler.domain.usage import (
    US_PER_HOUR,
    Amount,
    Interval,
    Pricing,
    UsageReport,
    Window,
    summarize,
    to_us,
)
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.usage_report import interval_of, live_interval

from .builders import make_job, running

H = 3600.0
T0 = 1_700_000_000.0
PRICING = Pricing.of({"H100": 2.5, "A100": "1.25"}, "USD")


@dataclass
class Script:
    """A small cluster's day on a manual clock: jobs placed, ended (done, failed or preempted) and restarted
    as the scheduler records them."""

    clock: ManualClock = field(default_factory=lambda: ManualClock(T0))
    jobs: dict[str, Job] = field(default_factory=dict)
    allocs: dict[str, Allocation] = field(default_factory=dict)

    def at(self, hours: float) -> Script:
        self.clock.advance(T0 + hours * H - self.clock.now())
        return self

    def place(self, job_id: str, *, team: str, user: str, project: str = "", shares: list[tuple[str, int]],
              model: str = "H100", models: list[str] | None = None, cpus: int = 0, queue: str = "default") -> None:
        job = self.jobs.get(job_id)
        if job is None:
            job = make_job(job_id, team=team, queue=queue)
            job = replace(job, user=user, spec=replace(job.spec, labels={"project": project} if project else {}))
        job, alloc = running(job, [(node, range(n)) for node, n in shares], started=self.clock.now(), model=model)
        if models is not None:  # a mixed gang: one model per node
            alloc = replace(alloc, assignments=tuple(replace(a, model=m) for a, m in zip(alloc.assignments, models,
                                                                                        strict=True)))
        alloc = replace(alloc, assignments=tuple(replace(a, cpus=cpus // len(shares)) for a in alloc.assignments))
        self.jobs[job_id], self.allocs[job_id] = job, alloc

    def end(self, job_id: str, outcome: JobState, *, preempted_by: str = "") -> None:
        alloc = replace(self.allocs.pop(job_id), preempted_by=preempted_by)
        job = end_attempt(replace(self.jobs[job_id], state=outcome), alloc, self.clock.now())
        if outcome in (JobState.RESTARTING, JobState.PREEMPTED):
            job = requeue(job, self.clock.now(), "again")
        self.jobs[job_id] = job

    def intervals(self) -> list[Interval]:
        """What a report is made of: the finished attempts (as their usage records) and the live allocations."""
        done = [interval_of(r) for job in self.jobs.values() for r in usage_of(job)]
        return done + [live_interval(a, self.jobs[a.job_id]) for a in self.allocs.values()]

    def report(self, start_h: float, end_h: float, group_by: str = "team", pricing: Pricing = PRICING) -> UsageReport:
        return summarize(self.intervals(), Window(T0 + start_h * H, T0 + end_h * H), group_by, pricing,
                         self.clock.now())


def day() -> Script:
    """Six hours, ending with one gang still running:

    job-a  vision/alice p1  8 x H100, 64 CPUs  0h-2h (fails), restarted 2.5h-5h (succeeds)   36 GPU-h
    job-b  vision/bob   p2  4 x A100           1h-3h (preempted by job-c2), again 4h-now(6h)  16 GPU-h
    job-c  nlp/carol        2 nodes x 8 H100    0.5h-4.5h                                     64 GPU-h
    job-d  nlp/dave         2 x L40S (no price) 2h-3h                                          2 GPU-h
    job-e  nlp/carol        CPU only, 32 CPUs   1h-2h                                          0 GPU-h
    job-f  vision/alice p1  4 H100 + 4 A100     3h-4h (a mixed gang: "A100+H100", no price)    8 GPU-h
    """
    s = Script()
    s.at(0).place("job-a", team="vision", user="alice", project="p1", shares=[("n1", 8)], cpus=64)
    s.at(0.5).place("job-c", team="nlp", user="carol", shares=[("n2", 8), ("n3", 8)])
    s.at(1).place("job-b", team="vision", user="bob", project="p2", shares=[("n4", 4)], model="A100")
    s.place("job-e", team="nlp", user="carol", shares=[("n5", 0)], model="", cpus=32, queue="cpu")
    s.at(2).end("job-a", JobState.RESTARTING)
    s.end("job-e", JobState.SUCCEEDED)
    s.place("job-d", team="nlp", user="dave", shares=[("n5", 2)], model="L40S")
    s.at(2.5).place("job-a", team="vision", user="alice", project="p1", shares=[("n1", 8)], cpus=64)
    s.at(3).end("job-b", JobState.PREEMPTED, preempted_by="job-c2")
    s.end("job-d", JobState.SUCCEEDED)
    s.place("job-f", team="vision", user="alice", project="p1", shares=[("n6", 4), ("n7", 4)],
            models=["H100", "A100"])
    s.at(4).place("job-b", team="vision", user="bob", project="p2", shares=[("n4", 4)], model="A100")
    s.end("job-f", JobState.SUCCEEDED)
    s.at(4.5).end("job-c", JobState.SUCCEEDED)
    s.at(5).end("job-a", JobState.SUCCEEDED)
    s.at(6)
    return s


def hours(n: float) -> int:
    return round(n * US_PER_HOUR)


def by_group(report: UsageReport) -> dict[str, Amount]:
    return {r.group: r.amount for r in report.rows}


def test_the_scripted_day_as_recorded() -> None:
    s = day()
    assert [(a.attempt, a.outcome) for a in s.jobs["job-a"].attempts] == [(1, "restarting"), (2, "succeeded")]
    assert [(a.attempt, a.outcome) for a in s.jobs["job-b"].attempts] == [(1, "preempted")]
    assert list(s.allocs) == ["job-b"] and s.allocs["job-b"].attempt == 2
    assert s.jobs["job-f"].attempts[0].model == "A100+H100"


def test_the_whole_day_by_team_with_cost_and_what_has_no_price() -> None:
    r = day().report(0, 6)
    assert [row.group for row in r.rows] == ["nlp", "vision"]  # the largest first
    nlp, vision = by_group(r)["nlp"], by_group(r)["vision"]
    assert vision == Amount(gpu_us=hours(36 + 16 + 8), cpu_us=hours(64 * 4.5), unpriced_gpu_us=hours(8),
                            cost=Fraction(36) * Fraction(5, 2) + 16 * Fraction(5, 4))
    assert nlp == Amount(gpu_us=hours(64 + 2), cpu_us=hours(32), unpriced_gpu_us=hours(2), cost=Fraction(160))
    assert (r.total.gpu_hours, r.total.cpu_hours, r.total.cost_value, r.total.unpriced_gpu_hours) == \
        (126.0, 320.0, 270.0, 10.0)
    assert r.unpriced_models == ("A100+H100", "L40S") and r.currency == "USD"


def test_every_grouping_of_the_day() -> None:
    s = day()
    gpu_h = {g: {row.group: row.amount.gpu_hours for row in s.report(0, 6, g).rows} for g in c.USAGE_GROUPS}
    assert gpu_h["job"] == {"job-a": 36.0, "job-b": 16.0, "job-c": 64.0, "job-d": 2.0, "job-f": 8.0,
                            "job-e": 0.0}
    assert gpu_h["user"] == {"alice": 44.0, "bob": 16.0, "carol": 64.0, "dave": 2.0}
    assert gpu_h["project"] == {"p1": 44.0, "p2": 16.0, "": 66.0}
    assert gpu_h["model"] == {"H100": 100.0, "A100": 16.0, "A100+H100": 8.0, "L40S": 2.0, "": 0.0}
    assert gpu_h["queue"] == {"default": 126.0, "cpu": 0.0}
    assert by_group(s.report(0, 6, "queue"))["cpu"].cpu_us == hours(32)


def test_a_boundary_splits_an_allocation_exactly() -> None:
    s = day()
    # job-c ran 0.5h-4.5h on 16 GPUs: 2.5 h before 3h, 1.5 h after.
    before, after = by_group(s.report(0, 3, "job"))["job-c"], by_group(s.report(3, 6, "job"))["job-c"]
    assert (before.gpu_hours, after.gpu_hours) == (40.0, 24.0)
    assert before + after == by_group(s.report(0, 6, "job"))["job-c"]
    # A boundary no float holds exactly (a third of a second past 1h 23m 17s) splits it exactly too.
    cut = 1 + 23 / 60 + (17 + 1 / 3) / 3600
    for group_by in c.USAGE_GROUPS:
        whole, first, second = s.report(0, 6, group_by), s.report(0, cut, group_by), s.report(cut, 6, group_by)
        assert first.total + second.total == whole.total, group_by
        for group, amount in by_group(whole).items():
            assert by_group(first).get(group, Amount()) + by_group(second).get(group, Amount()) == amount


def test_a_running_allocation_counts_up_to_now_and_no_further() -> None:
    s = day()
    # job-b's second attempt runs since 4h; now is 6h.
    assert by_group(s.report(5, 8, "job")) == {"job-b": Amount(gpu_us=hours(4), cost=Fraction(5))}
    assert s.report(6, 9).rows == ()
    s.at(7)
    assert by_group(s.report(5, 8, "job"))["job-b"].gpu_hours == 8.0  # an hour later, 4 GPU-hours more


WINDOWS = [(0, 6), (0, 3), (3, 6), (0.25, 0.75), (1.5, 4.75), (4.9, 5.1), (-5, 30), (5.5, 6), (6, 9), (2, 2)]


@pytest.mark.parametrize(("start", "end"), WINDOWS)
def test_groups_add_up_to_the_total_and_jobs_to_their_team(start: float, end: float) -> None:
    s = day()
    for group_by in c.USAGE_GROUPS:
        r = s.report(start, end, group_by)
        assert sum((row.amount for row in r.rows), Amount()) == r.total, group_by
        assert r.total == s.report(start, end, "team").total
    for team in ("vision", "nlp"):
        jobs = [i for i in s.intervals() if i.team == team]
        window = Window(T0 + start * H, T0 + end * H)
        per_job = summarize(jobs, window, "job", PRICING, s.clock.now())
        team_total = by_group(s.report(start, end, "team")).get(team, Amount())
        assert sum((row.amount for row in per_job.rows), Amount()) == team_total, team


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1, max_value=7, allow_nan=False), min_size=2, max_size=6, unique=True))
def test_adjacent_windows_add_up_to_the_window_over_both(cuts: list[float]) -> None:
    s = day()
    cuts.sort()
    parts = [s.report(a, b, "job") for a, b in itertools.pairwise(cuts)]
    whole = s.report(cuts[0], cuts[-1], "job")
    assert sum((p.total for p in parts), Amount()) == whole.total
    for group, amount in by_group(whole).items():
        assert sum((by_group(p).get(group, Amount()) for p in parts), Amount()) == amount


def test_a_window_with_nothing_in_it_and_an_allocation_from_a_clock_ahead_of_ours() -> None:
    s = day()
    assert s.report(-10, -1).rows == () and s.report(-10, -1).total == Amount()
    ahead = replace(live_interval(s.allocs["job-b"], s.jobs["job-b"]), started_at=s.clock.now() + 5)
    r = summarize([ahead], Window(T0, T0 + 10 * H), "team", PRICING, s.clock.now())
    assert r.rows == ()  # placed "after now" by a leader whose clock runs ahead: nothing yet, never negative


def test_prices_are_the_numbers_written_and_a_model_without_one_is_named() -> None:
    one = Interval(job_id="job-x", attempt=1, team="t", user="u", project="", queue="q", model="H100", gpus=3,
                   cpus=0, started_at=T0, ended_at=T0 + H / 3)
    r = summarize([one], Window(T0, T0 + H), "team", Pricing.of({"H100": 0.1}, "EUR"), T0 + H)
    assert r.total.cost == Fraction(1, 10) and r.currency == "EUR" and r.unpriced_models == ()
    free = summarize([one], Window(T0, T0 + H), "team", Pricing.of({"H100": 0}), T0 + H)
    assert free.total.cost == 0 and free.unpriced_models == ()  # priced at zero is not unpriced
    none = summarize([one], Window(T0, T0 + H), "team", Pricing(), T0 + H)
    assert none.total.unpriced_gpu_us == to_us(H) and none.unpriced_models == ("H100",)


@pytest.mark.parametrize(("prices", "currency", "message"), [
    ({"H100": -1.0}, "USD", "prices must be >= 0"),
    ({"": 1.0}, "USD", "non-empty model names"),
    ({"H100": float("nan")}, "USD", "not a price"),
    ({"H100": float("inf")}, "USD", "not a price"),
    ({}, "usd", "ISO 4217"),
    ({}, "EURO", "ISO 4217"),
])
def test_bad_prices_and_currencies_are_refused_by_the_settings(prices: dict[str, float], currency: str,
                                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Pricing.of(prices, currency)
    with pytest.raises(ValueError, match=message):
        SchedulerSettings(usage_prices=prices, usage_currency=currency)


def test_settings_give_the_pricing() -> None:
    s = SchedulerSettings(usage_prices={"H100-80GB-HBM3": 2.49}, usage_currency="EUR")
    assert s.pricing() == Pricing("EUR", {"H100-80GB-HBM3": Fraction(249, 100)})
    assert SchedulerSettings().pricing() == Pricing("USD", {})


def test_a_window_that_ends_before_it_starts_and_an_unknown_grouping_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"ends .* before it starts"):
        Window(T0, T0 - 1)
    with pytest.raises(InvalidArgument, match="group_by must be one of team, project, user, model, queue, job"):
        summarize([], Window(T0, T0), "account", PRICING, T0)
    assert summarize([], Window(T0, T0), "", PRICING, T0).group_by == "team"
