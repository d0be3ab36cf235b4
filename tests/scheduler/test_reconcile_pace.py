"""The reconcile loop rests after a cycle in proportion to the pending jobs its placement looked at.

Under a burst of submits over a backlog every new job woke a cycle, and every cycle walked the whole queue:
the walks took the leader's event loop from the API taking the submits. The real `Reconciler.run` over a
store in memory, with jobs that cannot be placed (their gang is larger than any node), so every cycle looks at
all of them.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from trainyard_core.clock import SystemClock
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.liveness import NodeLiveness
from trainyard_scheduler.pace import MIN_PAUSE_S, PACE_S_PER_PENDING_JOB, cycle_pause_s
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.reconcile import Reconciler, ReconcileSettings
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job, make_node


class NoAgent:
    async def launch(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("nothing here can be placed, so nothing is launched")

    async def stop(self, *args: object, **kwargs: object) -> None:
        return None


def test_the_pause_grows_with_the_walk_and_stops_at_the_cap() -> None:
    assert cycle_pause_s(2_000, PACE_S_PER_PENDING_JOB, 1.0) == pytest.approx(0.1)
    assert cycle_pause_s(20, PACE_S_PER_PENDING_JOB, 1.0) == pytest.approx(MIN_PAUSE_S)
    assert cycle_pause_s(100_000, PACE_S_PER_PENDING_JOB, 1.0) == 1.0
    assert cycle_pause_s(0, PACE_S_PER_PENDING_JOB, 1.0) == 0.0
    assert cycle_pause_s(5_000, 0.0, 1.0) == 0.0  # pacing off


def test_the_setting_is_the_pace_in_microseconds_and_refuses_a_negative_one() -> None:
    assert SchedulerSettings.model_fields["reconcile_pace_us_per_pending_job"].default == PACE_S_PER_PENDING_JOB * 1e6
    with pytest.raises(ValidationError, match="reconcile_pace_us_per_pending_job"):
        SchedulerSettings(reconcile_pace_us_per_pending_job=-1)


class Loop:
    """A reconciler running over a store in memory; `stop()` ends it."""

    def __init__(self, key_prefix: str, settings: ReconcileSettings, *, node_timeout_s: float = 3600.0) -> None:
        self.keys = Keys(key_prefix.rstrip("/"))
        self.store = MemoryStore()
        self.repo = Repository(self.store, self.keys)
        self.liveness = NodeLiveness(SystemClock(), timeout_s=node_timeout_s)
        self.settings = settings
        self.stopping = asyncio.Event()

    async def start(self, jobs: int) -> Reconciler:
        node = make_node("node-1", gpus=1)
        await self.repo.nodes.modify(node.node_id, lambda _: node)
        for i in range(jobs):
            await self.repo.create_job(make_job(f"job-{i:03d}", gpus=2))  # larger than the node: never placed
        self.mirror = PrefixMirror(self.store, self.keys.prefix + "/")
        await self.mirror.start()
        self.liveness.seen(node.node_id)
        self.reconciler = Reconciler(repo=self.repo, mirror=self.mirror, liveness=self.liveness, agents=NoAgent(),
                                     profile=build_profile(), clock=SystemClock(), epoch=lambda: 0,
                                     settings=self.settings)
        self.task = asyncio.create_task(self.reconciler.run(self.stopping))
        return self.reconciler

    async def stop(self) -> None:
        self.stopping.set()
        self.mirror.changed.set()
        await asyncio.wait_for(self.task, 5)
        await self.mirror.stop()


async def test_a_cycle_over_a_backlog_rests_and_the_changes_meanwhile_wait_for_the_next(key_prefix: str) -> None:
    loop = Loop(key_prefix, ReconcileSettings(interval_s=30.0, pace_s_per_pending_job=0.125))
    r = await loop.start(jobs=40)
    try:
        await eventually(lambda: truthy(r.cycles >= 1 and r.last_pause_s > 0), what="the first cycle's rest")
        assert r.last_considered == 40
        assert r.last_pause_s == pytest.approx(5.0)  # 40 jobs x 125 ms
        cycles = r.cycles
        await loop.repo.create_job(make_job("job-late", gpus=2))
        late = loop.keys.job("job-late")
        await eventually(lambda: truthy(late in loop.mirror.items), what="the late job in the mirror")
        # A window for a loop that would cycle on the change (it takes a few turns of the event loop to wake):
        # none may start one while the rest lasts. (Checked at once, the change's wake-up is still set and no
        # cycle could have begun yet, whether the loop rests or not.)
        await asyncio.sleep(0.5)
        assert r.cycles == cycles and r.last_considered == 40, "a change during the rest started a cycle"
        assert loop.mirror.changed.is_set(), "the change is left for the cycle after the rest"
        await eventually(lambda: truthy(r.last_considered == 41), timeout=20,
                         what="the cycle after the rest, with the job created during it")
    finally:
        await loop.stop()


async def test_a_short_queue_is_not_paced(key_prefix: str) -> None:
    loop = Loop(key_prefix, ReconcileSettings(interval_s=30.0))  # the default pace
    r = await loop.start(jobs=5)
    try:
        await eventually(lambda: truthy(r.cycles >= 1 and r.last_considered == 5), what="the first cycle")
        assert r.last_pause_s == 0.0
        cycles = r.cycles
        await loop.repo.create_job(make_job("job-late", gpus=2))
        await eventually(lambda: truthy(r.cycles > cycles and r.last_considered == 6),
                         what="a cycle on the change")
    finally:
        await loop.stop()


async def test_the_rest_ends_at_a_nodes_deadline(key_prefix: str) -> None:
    # 40 jobs at 1 s each would rest the 30 s interval; the node is lost if silent for 2 s, and that deadline
    # is acted on when it comes, not after the rest.
    loop = Loop(key_prefix, ReconcileSettings(interval_s=30.0, pace_s_per_pending_job=1.0), node_timeout_s=2.0)
    r = await loop.start(jobs=40)
    try:
        await eventually(lambda: truthy(r.cycles >= 1 and r.last_pause_s > 0), what="the first cycle's rest")
        assert r.last_pause_s <= 2.0 + 0.05
        await eventually(lambda: truthy(r.cycles >= 2), timeout=10, what="a cycle at the node's deadline")
    finally:
        await loop.stop()


async def test_stop_ends_a_rest_at_once(key_prefix: str) -> None:
    loop = Loop(key_prefix, ReconcileSettings(interval_s=60.0, pace_s_per_pending_job=10.0))
    r = await loop.start(jobs=40)
    await eventually(lambda: truthy(r.cycles >= 1 and r.last_pause_s == 60.0), what="a rest of the whole interval")
    await loop.stop()  # within 5 s, not 60
    assert loop.task.done()
