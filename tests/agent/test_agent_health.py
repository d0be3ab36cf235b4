"""Health policy, the health book and fault injection."""

from __future__ import annotations

import pytest

from trainyard_agent.health import policy
from trainyard_agent.health.book import HealthBook
from trainyard_agent.health.faults import FaultInjector
from trainyard_agent.model import Health
from trainyard_agent.nvml.adapter import NvmlAdapter
from trainyard_agent.nvml.fake import FakeNvml
from trainyard_core.errors import FailedPrecondition, InvalidArgument


def book_of(profile: str = "h100x8") -> tuple[FakeNvml, HealthBook]:
    fake = FakeNvml(profile)
    adapter = NvmlAdapter(fake)
    adapter.open()
    return fake, HealthBook(adapter.inventory().accelerators)


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_leave_the_gpu_healthy(xid: int) -> None:
    verdict = policy.for_xid(xid)
    assert verdict.health is Health.HEALTHY and verdict.action is policy.Action.IGNORE


@pytest.mark.parametrize("xid,health", [(79, Health.UNHEALTHY), (48, Health.UNHEALTHY), (74, Health.UNHEALTHY),
                                        (63, Health.DEGRADED), (92, Health.DEGRADED), (12345, Health.DEGRADED)])
def test_hardware_xids(xid: int, health: Health) -> None:
    verdict = policy.for_xid(xid)
    assert verdict.health is health and verdict.reason.startswith(f"XID {xid}: ")


def test_worst_health_wins_and_changes_are_versioned() -> None:
    _, book = book_of()
    assert book.report(3, Health.DEGRADED, "hot")
    v = book.version
    assert book.report(3, Health.UNHEALTHY, "XID 79")
    assert not book.report(3, Health.DEGRADED, "later, milder")
    assert book.get(3).health is Health.UNHEALTHY and book.get(3).health_reason == "XID 79"
    assert [g.index for g in book.changed_since(0)] == [3]
    assert [g.index for g in book.changed_since(v)] == [3]
    assert book.changed_since(book.version) == []


def test_injected_faults_on_simulated_gpus() -> None:
    fake, book = book_of()
    faults = FaultInjector(fake, book)
    gpu = faults.inject(3, "xid", xid=79)
    assert gpu.health is Health.UNHEALTHY and "fallen off the bus" in gpu.health_reason
    assert faults.inject(1, "xid", xid=13).health is Health.HEALTHY
    assert faults.inject(2, "ecc", count=2).health is Health.DEGRADED
    assert faults.inject(2, "ecc", count=policy.ECC_UNHEALTHY_AT).health is Health.UNHEALTHY
    assert faults.inject(4, "thermal").health is Health.DEGRADED
    assert faults.inject(5, "fall_off_bus").health is Health.UNHEALTHY
    assert fake.pending_xids == [(3, 79), (1, 13), (5, 79)]


@pytest.mark.parametrize("index,kind,message", [(8, "xid", "gpu_index 8 does not exist"),
                                                (0, "meteor", "unknown fault kind 'meteor'"),
                                                (0, "xid", "needs a positive xid")])
def test_bad_fault_requests(index: int, kind: str, message: str) -> None:
    fake, book = book_of()
    with pytest.raises(InvalidArgument, match=message):
        FaultInjector(fake, book).inject(index, kind)


def test_fault_injection_is_refused_on_real_hardware() -> None:
    _, book = book_of()
    with pytest.raises(FailedPrecondition, match="only available on simulated GPUs"):
        FaultInjector(None, book).inject(0, "xid", xid=79)


async def test_the_monitor_notices_a_gpu_that_stops_answering() -> None:
    from trainyard_agent.health.monitor import GpuMonitor

    fake = FakeNvml("l40sx4")
    adapter = NvmlAdapter(fake)
    adapter.open()
    book = HealthBook(adapter.inventory().accelerators)
    monitor = GpuMonitor(adapter, book, node_id="node-m", interval_s=1.0)
    await monitor.poll_once()
    assert len(monitor.latest) == 4 and book.version == 0
    fake.fall_off_bus(2)  # the hardware fails; nobody injects anything through the agent
    fake.set_temperature(0, 95)
    await monitor.poll_once()
    assert book.get(2).health is Health.UNHEALTHY and "GpuIsLost" in book.get(2).health_reason
    assert book.get(0).health is Health.DEGRADED and "thermal" in book.get(0).health_reason
    assert [m.index for m in monitor.latest] == [0, 1, 3]
