"""The agent's ring buffer of GPU polls and health events (gpu_history.py): retention, averaging down to a point
budget, health transitions and XIDs as events, validation; and GetGpuMetrics through a real channel to an
AgentApp on simulated GPUs, whose values follow the fake NVML's."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.gpu_history import MAX_FRAMES, GpuHistory, GpuPoint, downsample
from trainyard_agent.health.policy import Verdict
from trainyard_agent.model import Accelerator, AcceleratorMetrics, Action, Health, Vendor
from trainyard_core.clock import ManualClock
from trainyard_core.errors import InvalidArgument
from trainyard_core.testing.wait import eventually


def _gpu(index: int, health: Health = Health.HEALTHY, reason: str = "") -> Accelerator:
    return Accelerator(index=index, uuid=f"GPU-{index}", vendor=Vendor.NVIDIA, model="H100-80GB-HBM3", name="H100",
                       memory_mb=81_559, pci_bus_id=f"0000:{index:02x}:00.0", capability="9.0", health=health,
                       health_reason=reason)


def _metrics(index: int, util: int, mem: int = 1000) -> AcceleratorMetrics:
    return AcceleratorMetrics(index=index, utilization_percent=util, memory_used_mb=mem, temperature_c=40 + util // 10,
                              power_w=100 + util, sm_clock_mhz=1980)


def test_a_window_holds_the_polls_inside_it_per_gpu_oldest_first() -> None:
    clock = ManualClock(1_000.0)
    history = GpuHistory(clock, interval_s=1.0)
    gpus = [_gpu(0), _gpu(1)]
    for second in range(10):
        history.record([_metrics(0, second * 10), _metrics(1, 5)], gpus)
        clock.advance(1.0)
    # now = 1010 s; the last 4 s hold the polls of 1006..1009.
    w = history.window(4, 0)
    assert [p.utilization_percent for p in w.gpus[0]] == [60.0, 70.0, 80.0, 90.0]
    assert [p.time_ms for p in w.gpus[1]] == [1_006_000, 1_007_000, 1_008_000, 1_009_000]
    assert (w.now_ms, w.retained_since_ms, w.interval_s) == (1_010_000, 1_000_000, 1.0)
    latest = history.window(0, 0)
    assert {i: [p.utilization_percent for p in pts] for i, pts in latest.gpus.items()} == {0: [90.0], 1: [5.0]}


def test_points_are_averaged_down_to_the_budget_by_slices_of_the_window() -> None:
    points = [GpuPoint(t * 1000, float(t), 0.0, 0.0, 0.0, 0.0) for t in range(10)]
    # Ten polls over [0, 10 s) in 2 slices of 5 s: the mean of 0..4 and of 5..9, stamped with their last poll.
    assert [(p.time_ms, p.utilization_percent) for p in downsample(points, 0, 10_000, 2)] == [(4000, 2.0),
                                                                                              (9000, 7.0)]
    assert downsample(points, 0, 10_000, 0) == points
    assert downsample(points, 0, 10_000, 20) == points
    # A gap leaves its slices out rather than inventing points.
    sparse = [points[0], points[9]]
    assert [p.time_ms for p in downsample(sparse, 0, 10_000, 1)] == [9000]


def test_retention_is_bounded_by_time_and_by_frames() -> None:
    clock = ManualClock()
    history = GpuHistory(clock, interval_s=1.0, retention_s=5)
    for _ in range(20):
        history.record([_metrics(0, 1)], [_gpu(0)])
        clock.advance(1.0)
    assert len(history.window(86_400, 0).gpus[0]) == 5
    fast = GpuHistory(clock, interval_s=0.001, retention_s=3600)
    for _ in range(MAX_FRAMES + 10):
        fast.record([_metrics(0, 1)], [_gpu(0)])
    assert len(fast.window(86_400, 0).gpus[0]) == MAX_FRAMES


def test_health_changes_and_xids_become_events() -> None:
    clock = ManualClock(2_000.0)
    history = GpuHistory(clock, interval_s=1.0)
    history.record([_metrics(0, 1), _metrics(1, 1)], [_gpu(0), _gpu(1, Health.DEGRADED, "hot")])
    history.record([_metrics(0, 1), _metrics(1, 1)], [_gpu(0), _gpu(1, Health.DEGRADED, "hot")])
    clock.advance(1.0)
    history.xid(0, 13, Verdict(Health.HEALTHY, "XID 13: graphics engine exception", Action.IGNORE))
    history.xid(0, 79, Verdict(Health.UNHEALTHY, "XID 79: GPU has fallen off the bus", Action.DRAIN_NODE))
    history.record([_metrics(1, 1)], [_gpu(0, Health.UNHEALTHY, "XID 79: GPU has fallen off the bus"),
                                      _gpu(1, Health.DEGRADED, "hot")])
    events = [(e.time_ms, e.gpu, e.kind, e.xid, e.health, e.reason) for e in history.window(60, 0).events]
    assert events == [
        # A GPU first seen unhealthy is an event; one first seen healthy is not; an unchanged state is not.
        (2_000_000, 1, "health", 0, Health.DEGRADED, "hot"),
        (2_001_000, 0, "xid", 13, Health.HEALTHY, "XID 13: graphics engine exception"),
        (2_001_000, 0, "xid", 79, Health.UNHEALTHY, "XID 79: GPU has fallen off the bus"),
        (2_001_000, 0, "health", 0, Health.UNHEALTHY, "XID 79: GPU has fallen off the bus"),
    ]


@pytest.mark.parametrize(("window_s", "points", "field"), [(-1, 0, "window_s"), (86_401, 0, "window_s"),
                                                           (60, -1, "max_points"), (60, 10_001, "max_points")])
def test_out_of_range_requests_are_refused_naming_the_field(window_s: int, points: int, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        GpuHistory(ManualClock(), interval_s=1.0).window(window_s, points)


async def test_get_gpu_metrics_follows_the_fake_nvml(agent: AgentApp,
                                                     agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    assert agent.fake is not None
    agent.fake.set_load(2, 87, 30_000)

    async def loaded() -> agent_pb2.GetGpuMetricsResponse | None:
        reply = await agent_stub.GetGpuMetrics(agent_pb2.GetGpuMetricsRequest(window_s=0))
        gpu2 = [s for s in reply.gpus if s.gpu_index == 2]
        return reply if gpu2 and gpu2[0].samples[-1].utilization_percent == 87 else None

    reply = await eventually(loaded, timeout=10, what="GPU 2 at 87% in the agent's history")
    assert [s.gpu_index for s in reply.gpus] == list(range(8))
    gpu2 = reply.gpus[2].samples[-1]
    assert gpu2.memory_used_mb == 30_000 and gpu2.time_unix_ms <= reply.now_unix_ms
    assert reply.interval_ms == round(agent.settings.heartbeat_interval_s * 1000)
    assert 0 < reply.retained_since_unix_ms <= reply.now_unix_ms

    await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=5, kind="xid", xid=79))

    async def flagged() -> list[agent_pb2.GpuHealthEvent] | None:
        events = (await agent_stub.GetGpuMetrics(agent_pb2.GetGpuMetricsRequest(window_s=60))).events
        return list(events) if any(e.kind == "health" and e.gpu_index == 5 for e in events) else None

    events = await eventually(flagged, timeout=10, what="GPU 5's XID and health change in the history")
    assert [(e.kind, e.xid, e.health) for e in events if e.gpu_index == 5] == [
        ("xid", 79, types_pb2.GPU_HEALTH_UNHEALTHY), ("health", 0, types_pb2.GPU_HEALTH_UNHEALTHY)]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent_stub.GetGpuMetrics(agent_pb2.GetGpuMetricsRequest(window_s=-5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "window_s" in (err.value.details() or "")
