"""The chaos harness's own pure parts, without a cluster: the plan is a function of its inputs, and the
checker reports what it must (a checker that never fires would let every chaos run pass)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from trainyard.common.v1 import types_pb2
from trainyard_checkpoint import checksum
from trainyard_checkpoint.domain.checkpoint import MANIFEST_NAME, Checkpoint, CheckpointState, Shard
from trainyard_scheduler.domain.models import Allocation, NodeAssignment

from . import procs
from .invariants import Checker, Snapshot, storage_problems
from .schedule import FAULT_WEIGHTS, NETWORK_KINDS, make_plan
from .slow_links import SLOW, SlowLinks, SlowWindow


def test_a_seed_gives_the_same_plan_and_another_seed_another() -> None:
    assert make_plan(7, 100) == make_plan(7, 100)
    assert make_plan(7, 100).faults != make_plan(8, 100).faults
    only = make_plan(7, 100, kinds=frozenset({"xid", "etcd_member_kill"}))
    assert only.faults and {f.kind for f in only.faults} <= {"xid", "etcd_member_kill"}
    assert all(0 < f.at < 100 for f in make_plan(7, 100).faults)
    with pytest.raises(ValueError, match="unknown fault kind"):
        make_plan(7, 100, kinds=frozenset({"meteor"}))
    assert set(FAULT_WEIGHTS) == {f.kind for f in make_plan(3, 2000).faults}


def test_network_faults_are_drawn_within_their_bounds_and_on_both_sides_of_the_deadlines() -> None:
    faults = make_plan(11, 20_000).faults
    by_kind: dict[str, list[Any]] = {}
    for f in faults:
        by_kind.setdefault(f.kind, []).append(f)
    assert set(by_kind) >= NETWORK_KINDS | {"freeze_agent", "freeze_scheduler", "freeze_etcd_member"}
    # Latency: the round trip (both ways, delay + jitter each) stays below a second.
    assert all(2 * (f.amount + f.jitter_ms) < 1000 and 50 <= f.amount <= 300 for f in by_kind["latency"])
    assert all(5 <= f.amount <= 30 for f in by_kind["packet_loss"])
    for kind, deadline in (("partition_agent_leader", 2.5), ("isolate_node", 2.5), ("freeze_agent", 2.5),
                           ("freeze_scheduler", 3.0), ("partition_leader_etcd", 3.0), ("freeze_etcd_member", 2.0)):
        downs = [f.down_s for f in by_kind[kind]]
        assert min(downs) < deadline < max(downs), (kind, min(downs), max(downs))
    assert {f.scope for f in by_kind["freeze_scheduler"]} == {"leader", "standby"}
    assert {f.scope for f in by_kind["partition_gateway_scheduler"]} == {"leader", "all"}
    assert "delay=" in by_kind["latency"][0].describe() and "loss=" in by_kind["packet_loss"][0].describe()
    without = make_plan(11, 2000, kinds=frozenset(FAULT_WEIGHTS) - NETWORK_KINDS)
    assert without.faults and not {f.kind for f in without.faults} & NETWORK_KINDS


def _slow_links(found: list[tuple[str, str, str]]) -> SlowLinks:
    return SlowLinks(cast(Any, None), cast(Any, None), cast(Any, None),
                     lambda inv, key, detail: found.append((inv, key, detail)), lambda what: None)


def _stopped(job: str, node: str, reason: str, attempt: int = 1) -> Allocation:
    return replace(_alloc(job, node, (0,), attempt), stop_reason=reason)


def test_a_slow_node_lost_while_its_only_fault_is_latency_is_a_violation_and_nothing_else_is() -> None:
    found: list[tuple[str, str, str]] = []
    links = _slow_links(found)
    window = SlowWindow(1, "n1", "latency 200 ms", baseline=frozenset({("job-old", 1)}))
    links._open["n1"] = window
    before = links.windows()
    links.check_allocations([_stopped("job-old", "n1", "node n1 lost contact"),        # before the window
                             _stopped("job-b", "n2", "node n2 lost contact"),          # another node
                             _stopped("job-c", "n1", "exit code 3 (rank 0 on n1)")], 7, before)
    links.check_states({"n1": types_pb2.NODE_STATE_READY, "n2": types_pb2.NODE_STATE_NOT_READY}, before)
    links.check_states({"n1": types_pb2.NODE_STATE_CORDONED}, before)
    assert found == []
    links.check_allocations([_stopped("job-d", "n1", "node n1 lost contact", attempt=2)], 8, before)
    links.check_states({"n1": types_pb2.NODE_STATE_NOT_READY}, before)
    assert [(inv, key) for inv, key, _ in found] == [(SLOW, "n1/job-d/2"), (SLOW, "n1/view/1")]
    assert "latency 200 ms" in found[0][2]
    # A read that began in a window that closed (or was replaced) before it ended counts for nothing.
    found.clear()
    links.close("n1")
    links.check_allocations([_stopped("job-e", "n1", "node n1 lost contact")], 9, before)
    links.check_states({"n1": types_pb2.NODE_STATE_NOT_READY}, before)
    assert found == []


def _checker() -> Checker:
    return Checker(cast(Any, None), cast(Any, None), "run")


def _alloc(job: str, node: str, gpus: tuple[int, ...], attempt: int = 1) -> Allocation:
    return Allocation(job_id=job, attempt=attempt, master_addr="127.0.0.1", master_port=1, created_at=0.0,
                      assignments=(NodeAssignment(node_id=node, node_rank=0, gpu_indices=gpus,
                                                  ranks=tuple(range(len(gpus)))),))


def test_a_gpu_in_two_allocations_is_a_violation() -> None:
    c = _checker()
    owners = c._gpu_owners([_alloc("job-a", "n1", (0, 1)), _alloc("job-b", "n1", (2,)), _alloc("job-c", "n2", (1,))],
                           revision=5)
    assert not c.violations and owners[("n1", 2)] == ("job-b", 1)
    c._gpu_owners([_alloc("job-a", "n1", (0, 1)), _alloc("job-b", "n1", (1,))], revision=6)
    [v] = c.violations.values()
    assert v.invariant.startswith("(a)") and "GPU 1 of n1" in v.detail


def _ckpt(state: CheckpointState, ckpt_id: str = "ckpt-1", shards: tuple[Shard, ...] = ()) -> Checkpoint:
    return Checkpoint(id=ckpt_id, job_id="job-a", attempt=1, step=4, world_size=1, location="file:///nowhere",
                      state=state, created_at=0.0, shards=shards)


def _snap(*ckpts: Checkpoint, latest: dict[str, str] | None = None) -> Snapshot:
    return Snapshot(revision=1, jobs={}, allocations={}, checkpoints={c.id: c for c in ckpts}, latest=latest or {})


@pytest.mark.parametrize(("after", "violated"), [
    (CheckpointState.COMMITTED, False), (CheckpointState.DELETED, False), (CheckpointState.DAMAGED, False),
    (CheckpointState.ABORTED, True), (CheckpointState.WRITING, True), (None, True)])
def test_a_committed_checkpoint_may_only_stay_or_be_deleted_or_damaged(after: CheckpointState | None,
                                                                        violated: bool) -> None:
    c = _checker()
    c._check_checkpoints(_snap(_ckpt(CheckpointState.COMMITTED)))
    c._check_checkpoints(_snap(_ckpt(after)) if after else _snap())
    assert bool(c.violations) is violated


def test_a_committed_checkpoint_with_another_shard_list_and_a_bad_latest_pointer_are_violations() -> None:
    c = _checker()
    c._check_checkpoints(_snap(_ckpt(CheckpointState.COMMITTED)))
    c._check_checkpoints(_snap(_ckpt(CheckpointState.COMMITTED, shards=(Shard(0, "x", 1, "xxh3:0"),))))
    c._check_checkpoints(_snap(_ckpt(CheckpointState.DELETED, "ckpt-2"), latest={"job-a": "ckpt-2"}))
    assert sorted(v.invariant for v in c.violations.values()) == [
        "(c) latest pointer names a committed checkpoint", "(c) no committed checkpoint lost"]


def test_storage_problems_reads_the_shards_and_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "shard-0").write_bytes(b"weights" * 1000)
    (tmp_path / MANIFEST_NAME).write_text("{}")
    good = str(checksum.of_file(tmp_path / "shard-0"))
    ckpt = Checkpoint(id="c", job_id="j", attempt=1, step=1, world_size=1, location=tmp_path.as_uri(),
                      state=CheckpointState.COMMITTED, created_at=0.0, shards=(Shard(0, "shard-0", 7000, good),))
    assert storage_problems(ckpt) == []
    (tmp_path / "shard-0").write_bytes(b"Weights" * 1000)
    assert "differs" in storage_problems(ckpt)[0]
    (tmp_path / MANIFEST_NAME).unlink()
    (tmp_path / "shard-0").unlink()
    assert len(storage_problems(ckpt)) == 2


def test_workers_are_found_by_their_marker_and_are_dead_once_killed() -> None:
    env = {**os.environ, "CHAOS_RUN_ID": "test-run", "TRAINYARD_JOB_ID": "job-x", "TRAINYARD_ATTEMPT": "2",
           "RANK": "1", "TRAINYARD_NODE_ID": "n1", "CUDA_VISIBLE_DEVICES": "3"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        found: list[procs.WorkerProc] = []
        while not found and time.monotonic() < deadline:
            found = procs.workers("CHAOS_RUN_ID", "test-run")
        [w] = found
        assert (w.pid, w.job_id, w.attempt, w.rank, w.node_id, w.gpus) == (p.pid, "job-x", 2, 1, "n1", (3,))
        assert procs.alive(w.pid, w.start_time) and not procs.alive(w.pid, w.start_time + 1)
        assert procs.kill(w.pid, w.start_time, group=True)
        p.wait()
        assert not procs.alive(w.pid, w.start_time) and procs.workers("CHAOS_RUN_ID", "test-run") == []
    finally:
        p.kill()
        p.wait()
