"""domain.quota_use: GPUs a team holds now, by the key its quota accounts them under, and how many borrowed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_scheduler.domain.models import Allocation, NodeAssignment
from trainyard_scheduler.domain.queues import ANY_MODEL, QuotaLimit, TeamQuota
from trainyard_scheduler.domain.quota_use import QuotaUse, quota_key, quota_use

H100, A100, L40S = "H100-80GB-HBM3", "A100-SXM4-40GB", "L40S"


def gang(team: str, *shares: tuple[str, int], borrowed: bool = False, job: str = "j") -> Allocation:
    assignments = tuple(NodeAssignment(node_id=f"n{i}", node_rank=i, gpu_indices=tuple(range(gpus)),
                                       ranks=tuple(range(gpus)), model=model) for i, (model, gpus) in enumerate(shares))
    return Allocation(job_id=job, attempt=0, assignments=assignments, master_addr="n0", master_port=29500,
                      created_at=0.0, team=team, borrowed=borrowed)


def test_keys_follow_the_quota_and_borrowed_gangs_count_whole() -> None:
    quota = TeamQuota("vision", {H100: QuotaLimit(8, None), ANY_MODEL: QuotaLimit(4, 0)})
    held = [gang("vision", (H100, 8)), gang("vision", (H100, 4), borrowed=True),
            gang("vision", (A100, 2), (L40S, 1)),  # both under "*"
            gang("nlp", (H100, 8)),  # another team's
            gang("vision", ("", 0))]  # a CPU task holds no GPU
    assert quota_use("vision", quota, held) == {ANY_MODEL: QuotaUse(3, 0), H100: QuotaUse(12, 4)}
    # Without an entry for a model (and no "*"), the model is its own key, as placement accounts it.
    assert quota_use("vision", TeamQuota("vision", {H100: QuotaLimit(8, None)}), held) == {
        A100: QuotaUse(2, 0), H100: QuotaUse(12, 4), L40S: QuotaUse(1, 0)}
    assert quota_use("vision", None, held) == {A100: QuotaUse(2, 0), H100: QuotaUse(12, 4), L40S: QuotaUse(1, 0)}
    assert quota_use("robotics", quota, held) == {}


models = st.sampled_from([H100, A100, L40S])
gangs = st.lists(st.tuples(st.sampled_from(["vision", "nlp"]), st.lists(st.tuples(models, st.integers(0, 8)),
                                                                          min_size=1, max_size=3), st.booleans()),
                 max_size=12)
quotas = st.dictionaries(st.sampled_from([H100, A100, ANY_MODEL]), st.builds(QuotaLimit, st.integers(0, 64),
                                                                            st.none()), max_size=3)


@settings(max_examples=200, deadline=None)
@given(gangs, quotas)
def test_use_adds_up_to_what_the_team_holds(drawn: list[tuple[str, list[tuple[str, int]], bool]],
                                            limits: dict[str, QuotaLimit]) -> None:
    quota = TeamQuota("vision", limits)
    held = [gang(team, *shares, borrowed=b, job=f"j{i}") for i, (team, shares, b) in enumerate(drawn)]
    use = quota_use("vision", quota, held)
    mine = [(s, b) for team, shares, b in drawn if team == "vision" for s in shares]
    assert sum(u.in_use for u in use.values()) == sum(gpus for (_, gpus), _ in mine)
    assert sum(u.borrowed for u in use.values()) == sum(gpus for (_, gpus), b in mine if b)
    assert all(0 <= u.borrowed <= u.in_use and u.in_use > 0 for u in use.values())
    for (model, gpus), _ in mine:
        if gpus:
            assert quota_key(quota, model) in use
