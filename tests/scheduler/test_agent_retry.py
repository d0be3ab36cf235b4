"""An agent call that does not reach its agent is tried again after a backoff, not on the very next cycle.

Before, a launch to an agent that was gone failed at once (gRPC fails fast while a channel reconnects), the
failure woke the next cycle, and that cycle launched again: the loop ran hot for as long as the node counted
as alive (seen in CI: 251 launches in 20 s, and the stopped node was not lost within those 20 s). The real
`Reconciler.run` over a store in memory, with an agent port that refuses until the test lets it through.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from trainyard_core.clock import SystemClock
from trainyard_core.errors import Unavailable
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.launch import NodeLaunch
from trainyard_scheduler.liveness import NodeLiveness
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.reconcile import AGENT_RETRY_MAX_S, AGENT_RETRY_MIN_S, Reconciler, ReconcileSettings
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job, make_node


class GoneAgent:
    """Refuses every launch as unreachable until `back` is set; notes when each launch was asked."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.back = False
        self.launched: list[str] = []

    async def launch(self, node: Any, launch: NodeLaunch, epoch: int) -> None:
        self.asked.append(time.monotonic())
        if not self.back:
            raise Unavailable(f"agent {node.node_id} is unavailable: connection refused")
        self.launched.append(launch.job_id)

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        return None


async def test_a_launch_to_an_unreachable_agent_backs_off_then_goes_through(key_prefix: str) -> None:
    keys = Keys(key_prefix.rstrip("/"))
    store = MemoryStore()
    repo = Repository(store, keys)
    node = make_node("node-1", gpus=8)
    await repo.nodes.modify(node.node_id, lambda _: node)
    await repo.create_job(make_job("job-a", gpus=1))
    mirror = PrefixMirror(store, keys.prefix + "/")
    await mirror.start()
    liveness = NodeLiveness(SystemClock(), timeout_s=3600.0)  # the node stays alive: only the backoff paces
    liveness.seen(node.node_id)
    agent = GoneAgent()
    reconciler = Reconciler(repo=repo, mirror=mirror, liveness=liveness, agents=agent, profile=build_profile(),
                            clock=SystemClock(), epoch=lambda: 0, settings=ReconcileSettings(interval_s=0.01))
    stop = asyncio.Event()
    loop = asyncio.create_task(reconciler.run(stop))
    try:
        await eventually(lambda: truthy(len(agent.asked) >= 4), timeout=20, what="four tries of the launch")
        cycles = reconciler.cycles
        await eventually(lambda: truthy(reconciler.cycles > cycles + 20), what="cycles between the tries")
        # Each try waits at least its backoff after the one before: 0.2 s, 0.4 s, 0.8 s ... (cycles ran
        # every 10 ms meanwhile, and none of them launched).
        gaps = [b - a for a, b in zip(agent.asked, agent.asked[1:], strict=False)]
        for i, gap in enumerate(gaps):
            assert gap >= min(AGENT_RETRY_MIN_S * 2 ** i, AGENT_RETRY_MAX_S) - 0.01, (i, gaps)
        agent.back = True
        await eventually(lambda: truthy(agent.launched == ["job-a"]), timeout=AGENT_RETRY_MAX_S + 10,
                         what="the launch once the agent is back")
        found = await repo.get_allocation("job-a")
        assert found is not None and "node-1" in found[0].launched
    finally:
        stop.set()
        mirror.changed.set()
        await loop
        await mirror.stop()
