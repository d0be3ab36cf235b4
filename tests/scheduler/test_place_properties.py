"""Property tests of placement invariants: no GPU in two gangs, gangs whole, only healthy free GPUs used."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_scheduler.domain.models import Allocation
from trainyard_scheduler.policy.place import place
from trainyard_scheduler.domain.queues import PolicyConfig
from trainyard_scheduler.policy.registry import build_profile

from .builders import NOW, make_job, make_node, snapshot

PROFILE = build_profile()
CONFIG = PolicyConfig()

node_st = st.tuples(st.integers(1, 8), st.sampled_from(["H100", "A100"]), st.sets(st.integers(0, 7), max_size=2),
                    st.booleans())
job_st = st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from(["", "H100", "A100"]), st.integers(0, 3))


@settings(max_examples=200, deadline=None)
@given(nodes=st.lists(node_st, min_size=1, max_size=6), jobs=st.lists(job_st, min_size=1, max_size=12),
       rounds=st.integers(1, 3))
def test_no_gpu_in_two_gangs(nodes, jobs, rounds) -> None:  # type: ignore[no-untyped-def]
    fleet = [make_node(f"n-{i}", gpus=g, model=m, unhealthy=bad, cordoned=c and i > 0)
             for i, (g, m, bad, c) in enumerate(nodes)]
    pending = [make_job(f"job-{i}", nodes=n, gpus=g, accelerator=a, priority=p, created=NOW + i)
               for i, (n, g, a, p) in enumerate(jobs)]
    allocations: list[Allocation] = []
    for _ in range(rounds):  # later rounds see earlier allocations, as successive cycles do
        placed = {a.job_id for a in allocations}
        result = place(snapshot(fleet, [j for j in pending if j.id not in placed], allocations), PROFILE, CONFIG, NOW)
        for d in result.decisions:
            allocations.append(Allocation(job_id=d.job_id, attempt=0, assignments=d.assignments, master_addr="x",
                                          master_port=d.master_port, created_at=NOW))
    by_id = {n.node_id: n for n in fleet}
    taken: set[tuple[str, int]] = set()
    jobs_by_id = {j.id: j for j in pending}
    for alloc in allocations:
        job = jobs_by_id[alloc.job_id]
        r = job.spec.resources
        assert len(alloc.assignments) == r.nodes  # whole gang
        assert len({a.node_id for a in alloc.assignments}) == r.nodes  # on distinct nodes
        for a in alloc.assignments:
            node = by_id[a.node_id]
            assert not node.cordoned
            assert len(a.gpu_indices) == r.gpus_per_node
            for g in a.gpu_indices:
                gpu = node.gpus[g]
                assert gpu.healthy and (not r.accelerator or gpu.model == r.accelerator)
                assert (a.node_id, g) not in taken, "GPU in two gangs"
                taken.add((a.node_id, g))
