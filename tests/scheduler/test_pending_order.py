"""The queue order a cycle leaves behind (domain/pending.py), from real placement sessions."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_scheduler.domain.pending import pending_order, select
from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.policy.place import place
from trainyard_scheduler.policy.registry import build_profile

from .builders import NOW, make_job, make_node, snapshot

PROFILE = build_profile()
CONFIG = PolicyConfig()


def _order_after_cycle(nodes: list, jobs: list):  # type: ignore[no-untyped-def]
    snap = snapshot(nodes, jobs)
    result = place(snap, PROFILE, CONFIG, NOW)
    reasons = {u.job_id: u.reason for u in result.unplaced}
    return result, pending_order(snap.jobs, result.considered, [d.job_id for d in result.decisions], reasons, NOW)


def test_the_order_is_the_cycles_less_what_it_placed_with_places_per_queue_and_reasons() -> None:
    jobs = [make_job("job-a", gpus=8, created=NOW - 50),            # placed: the node has 8 GPUs
            make_job("job-b", gpus=8, created=NOW - 40),            # waits, first
            make_job("job-c", gpus=8, created=NOW - 30, priority=5),  # higher priority: before job-a and job-b
            make_job("job-d", gpus=1, created=NOW - 20, queue="other"),
            replace(make_job("job-h", gpus=1, created=NOW - 60), held_by="alice", message="held by alice")]
    result, order = _order_after_cycle([make_node("n-1", gpus=8)], jobs)
    assert result.considered[:2] == ["job-c", "job-a"]
    placed = {d.job_id for d in result.decisions}
    assert placed == {"job-c"}  # the priority job took the node
    ids = [e.job_id for e in order.entries]
    assert ids == ["job-a", "job-b", "job-d", "job-h"]
    by_id = {e.job_id: e for e in order.entries}
    assert (by_id["job-a"].position, by_id["job-b"].position, by_id["job-d"].position) == (1, 2, 1)
    assert order.lengths == {"default": 2, "other": 1}
    assert by_id["job-h"].position == 0 and by_id["job-h"].held and by_id["job-h"].reason == "held by alice"
    assert "8" in by_id["job-a"].reason and "GPU" in by_id["job-a"].reason, by_id["job-a"].reason
    assert order.as_of == NOW


def test_select_scopes_by_team_queue_and_job_and_counts_all_it_matched() -> None:
    # team-b's jobs have the higher priority: all five come before team-a's (one of them is placed).
    jobs = [make_job(f"job-{i}", gpus=8, created=NOW - 100 + i, team="team-a" if i % 2 else "team-b",
                     priority=0 if i % 2 else 5) for i in range(10)]
    _, order = _order_after_cycle([make_node("n-1", gpus=8)], jobs)
    mine, total = select(order, team="team-a", limit=3)
    assert total == 5 and len(mine) == 3 and all(e.team == "team-a" for e in mine)
    # Places count every team's jobs ahead: team-b's four waiting jobs.
    assert [e.position for e in mine] == [5, 6, 7]
    one, total = select(order, job_id="job-7", limit=100)
    assert total == 1 and one[0].job_id == "job-7"
    assert select(order, queue="nope", limit=10) == ([], 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(-3, 3), st.sampled_from(["default", "q2"]),
                          st.booleans()), min_size=1, max_size=25))
def test_every_pending_job_appears_once_placed_ones_never_and_places_run_1_to_n_per_queue(
        specs: list[tuple[int, int, str, bool]]) -> None:
    jobs = [make_job(f"job-{i:02d}", gpus=g, priority=p, queue=q, created=NOW - 100 + i) for i, (g, p, q, _) in
            enumerate(specs)]
    jobs = [replace(j, held_by="bob") if held else j for j, (*_, held) in zip(jobs, specs, strict=True)]
    result, order = _order_after_cycle([make_node("n-1", gpus=8), make_node("n-2", gpus=8)], jobs)
    placed = {d.job_id for d in result.decisions}
    ids = [e.job_id for e in order.entries]
    assert len(ids) == len(set(ids))
    assert set(ids) == {j.id for j in jobs} - placed
    for queue in ("default", "q2"):
        places = [e.position for e in order.entries if e.queue == queue and not e.held]
        assert places == list(range(1, len(places) + 1))
        assert order.lengths.get(queue, 0) == len(places)
    assert all(e.position == 0 for e in order.entries if e.held)
