"""The health book (findings, worst wins, persistence), the monitor (polls and the event thread) and fault
injection, against the fake NVML through the real adapter."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agent.agent_kit import until
from trainyard_agent.health.book import HealthBook
from trainyard_agent.health.faults import FaultInjector
from trainyard_agent.health.monitor import GpuMonitor
from trainyard_agent.health.policy import Verdict, default_policy
from trainyard_agent.model import Action, Health, HealthCounters
from trainyard_agent.nvml.adapter import NvmlAdapter
from trainyard_agent.nvml.fake import FakeNvml
from trainyard_core.errors import FailedPrecondition, InvalidArgument

POLICY = default_policy()
XID79 = POLICY.xid(79)
HOT = Verdict(Health.DEGRADED, "hot", Action.IGNORE)


def book_of(profile: str = "h100x8", store: Path | None = None, boot_id: str = "boot-1") -> tuple[FakeNvml, HealthBook]:
    fake = FakeNvml(profile, seed="node-a")
    adapter = NvmlAdapter(fake)
    adapter.open()
    return fake, HealthBook(adapter.inventory().accelerators, store=store, boot_id=boot_id)


# --- the book ----------------------------------------------------------------------------------------------


def test_worst_finding_wins_and_changes_are_versioned() -> None:
    _, book = book_of()
    assert book.set_finding(3, "thermal", HOT)
    v = book.version
    assert book.add_event(3, XID79)
    gpu = book.get(3)
    assert (gpu.health, gpu.health_action, gpu.wire_action) == (Health.UNHEALTHY, Action.REBOOT_HOST, "reboot_host")
    assert gpu.health_reason == "XID 79: GPU has fallen off the bus; hot"
    assert [g.index for g in book.changed_since(0)] == [3] and [g.index for g in book.changed_since(v)] == [3]
    assert book.changed_since(book.version) == []
    # the same finding again changes nothing and publishes nothing
    assert not book.set_finding(3, "thermal", HOT) and not book.add_event(3, XID79)
    # a live finding goes away by itself; the XID stays
    assert book.set_finding(3, "thermal", None)
    assert book.get(3).health_reason == "XID 79: GPU has fallen off the bus"


def test_a_milder_xid_does_not_replace_a_worse_one() -> None:
    _, book = book_of()
    book.add_event(0, POLICY.xid(48))
    assert not book.add_event(0, POLICY.xid(94)) and not book.add_event(0, POLICY.xid(74))
    assert book.add_event(0, XID79)
    assert book.get(0).health_reason == "XID 79: GPU has fallen off the bus"
    assert not book.add_event(1, POLICY.xid(13))  # an application XID is no finding at all
    assert book.get(1).health is Health.HEALTHY and book.version == 2


def test_healthy_gpus_ask_for_nothing_on_the_wire() -> None:
    _, book = book_of()
    book.set_finding(2, "thermal", HOT)
    assert (book.get(2).health, book.get(2).wire_action) == (Health.DEGRADED, "none")
    assert book.get(0).wire_action == "none"


def test_marking_healthy_clears_findings_and_acknowledges_counters() -> None:
    _, book = book_of()
    counts = HealthCounters(ecc_volatile_uncorrected=12)
    book.add_event(4, POLICY.xid(48))
    book.set_finding(4, "ecc", POLICY.counters(counts)["ecc"])
    assert book.mark_healthy(4, counts)
    assert book.get(4).health is Health.HEALTHY and book.baseline(4) == counts
    # the errors already seen no longer count; new ones do
    assert POLICY.counters(counts.since(book.baseline(4)))["ecc"] is None
    more = HealthCounters(ecc_volatile_uncorrected=13)
    assert POLICY.counters(more.since(book.baseline(4)))["ecc"] is not None
    # a GPU reset restarts the volatile counters: every error after it is new, none is hidden by the baseline
    after_reset = HealthCounters(ecc_volatile_uncorrected=2)
    assert after_reset.since(book.baseline(4)).ecc_volatile_uncorrected == 2
    assert book.mark_unhealthy(4, "marked unhealthy by alice: flaky")
    assert (book.get(4).health, book.get(4).health_action) == (Health.UNHEALTHY, Action.RESET_GPU)


def test_sticky_findings_survive_an_agent_restart(tmp_path: Path) -> None:
    store = tmp_path / "gpu-health.json"
    _, book = book_of(store=store)
    book.add_event(1, POLICY.xid(48))
    book.add_event(2, XID79)
    book.mark_unhealthy(3, "marked unhealthy by bob: fan noise")
    book.mark_healthy(5, HealthCounters(ecc_volatile_uncorrected=3))
    book.set_finding(6, "thermal", HOT)  # live: found again by the next poll, not saved

    _, again = book_of(store=store)  # same host, same boot
    assert [g.health for g in again.all()] == [Health.HEALTHY, Health.UNHEALTHY, Health.UNHEALTHY,
                                               Health.UNHEALTHY] + [Health.HEALTHY] * 4
    assert again.get(3).health_reason == "marked unhealthy by bob: fan noise"
    assert again.baseline(5) == HealthCounters(ecc_volatile_uncorrected=3)

    _, rebooted = book_of(store=store, boot_id="boot-2")
    # the reboot XID 79 asked for has happened; the others still need an operator
    assert [g.index for g in rebooted.all() if g.health is Health.UNHEALTHY] == [1, 3]
    assert rebooted.baseline(5) == HealthCounters()  # the driver's counters restart with the host

    _, other_gpus = book_of("a100x8", store=store)  # different GPUs (UUIDs): nothing applies
    assert all(g.health is Health.HEALTHY for g in other_gpus.all())


def test_a_damaged_store_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "gpu-health.json"
    store.write_text("{not json")
    _, book = book_of(store=store)
    assert all(g.health is Health.HEALTHY for g in book.all())
    assert "ignoring unreadable saved GPU health" in caplog.text
    book.add_event(0, XID79)
    assert json.loads(store.read_text())["gpus"][book.get(0).uuid]["findings"]["xid"]["action"] == "reboot_host"


# --- the monitor -------------------------------------------------------------------------------------------


@dataclass
class Watched:
    fake: FakeNvml
    book: HealthBook
    monitor: GpuMonitor


@pytest.fixture
async def watched() -> AsyncIterator[Watched]:
    fake = FakeNvml("a100x8", seed="node-m")
    adapter = NvmlAdapter(fake)
    adapter.open()
    book = HealthBook(adapter.inventory().accelerators)
    # A long interval: only events and explicit polls move anything during a test.
    monitor = GpuMonitor(adapter, book, POLICY, node_id="node-m", interval_s=60.0, counters_interval_s=60.0)
    monitor.start()
    try:
        yield Watched(fake, book, monitor)
    finally:
        await monitor.stop()
        adapter.close()


async def test_the_monitor_notices_a_gpu_that_stops_answering(watched: Watched) -> None:
    fake, book, monitor = watched.fake, watched.book, watched.monitor
    await monitor.poll_once()
    assert len(monitor.latest) == 8 and book.version == 0
    fake.fall_off_bus(2)  # the hardware fails; nobody injects anything through the agent
    fake.set_temperature(0, 95)
    await monitor.poll_once(counters=False)
    assert book.get(2).health is Health.UNHEALTHY and "GpuIsLost" in book.get(2).health_reason
    assert book.get(2).health_action is Action.REBOOT_HOST
    assert book.get(0).health is Health.DEGRADED and "thermal slowdown at 95 °C" in book.get(0).health_reason
    assert "clocks throttled by hw_slowdown, hw_thermal" in book.get(0).health_reason
    assert [m.index for m in monitor.latest] == [0, 1, 3, 4, 5, 6, 7]
    fake.set_temperature(0, 70)
    await monitor.poll_once(counters=False)
    assert book.get(0).health is Health.HEALTHY  # a thermal finding follows the hardware


async def test_xids_arrive_through_the_event_thread(watched: Watched) -> None:
    fake, book, monitor = watched.fake, watched.book, watched.monitor
    fake.inject_xid(5, 13)  # an application error: seen, logged, nothing changes
    fake.inject_xid(3, 79)
    await until(lambda: monitor.xids_seen.get(3) == 1 and monitor.xids_seen.get(5) == 1, "both XIDs delivered")
    assert book.get(3).health is Health.UNHEALTHY and book.get(3).health_action is Action.REBOOT_HOST
    assert book.get(5).health is Health.HEALTHY
    assert [g.index for g in book.changed_since(0)] == [3]


async def test_a_memory_event_reads_the_counters_at_once(watched: Watched) -> None:
    fake, book, monitor = watched.fake, watched.book, watched.monitor
    await monitor.poll_once()
    fake.add_ecc_errors(6, 11)  # posts a double-bit ECC event; the periodic counter read is a minute away
    await until(lambda: book.get(6).health is Health.UNHEALTHY, "the event-triggered counter read")
    assert book.get(6).health_reason == "11 uncorrectable ECC errors (limit 10)"
    assert book.get(6).health_action is Action.RESET_GPU
    assert monitor.counters[6].ecc_volatile_uncorrected == 11
    fake.set_memory_repair(1, failure=True)
    await until(lambda: book.get(1).health_action is Action.DRAIN_NODE, "the row-remap failure")


async def test_injected_faults_on_simulated_gpus(watched: Watched) -> None:
    faults = FaultInjector(watched.fake, watched.book, watched.monitor)
    gpu = await faults.inject(3, "xid", xid=79)
    assert gpu.health is Health.UNHEALTHY and "fallen off the bus" in gpu.health_reason
    assert (await faults.inject(1, "xid", xid=13)).health is Health.HEALTHY
    ecc = await faults.inject(2, "ecc", count=2)
    assert (ecc.health, ecc.health_action, ecc.health_reason) == (Health.DEGRADED, Action.RESTART_JOB,
                                                                  "2 uncorrectable ECC error(s)")
    assert (await faults.inject(2, "ecc", count=8)).health is Health.UNHEALTHY
    hot = await faults.inject(4, "thermal", temperature_c=93)
    assert hot.health is Health.DEGRADED and "thermal slowdown at 93 °C" in hot.health_reason
    assert (await faults.inject(6, "thermal")).health is Health.DEGRADED  # default: above the slowdown point
    lost = await faults.inject(5, "fall_off_bus")
    assert lost.health is Health.UNHEALTHY and lost.health_action is Action.REBOOT_HOST
    assert "XID 79" in lost.health_reason and "GpuIsLost" in lost.health_reason
    assert watched.fake.gpus[3].xids == [79] and watched.fake.gpus[5].lost


@pytest.mark.parametrize("index,kind,kw,message", [
    (8, "xid", {"xid": 79}, "gpu_index 8 does not exist"),
    (0, "meteor", {}, "unknown fault kind 'meteor'"),
    (0, "xid", {}, "needs an xid between 1 and 999"),
    (0, "thermal", {"temperature_c": 400}, "temperature_c must be between 1 and 150"),
    (0, "ecc", {"count": -1}, "count must be between 0 and"),
])
async def test_bad_fault_requests(watched: Watched, index: int, kind: str, kw: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        await FaultInjector(watched.fake, watched.book, watched.monitor).inject(index, kind, **kw)


async def test_fault_injection_is_refused_on_real_hardware(watched: Watched) -> None:
    with pytest.raises(FailedPrecondition, match="only available on simulated GPUs"):
        await FaultInjector(None, watched.book, watched.monitor).inject(0, "xid", xid=79)
